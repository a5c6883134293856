"""End to end through ``launch.py`` as a user starts it: clients, scripts/generate.py, bad input, shutdown.

One TP=1 cluster (``--max-total-tokens 4096``) serves the whole module; the last test stops it with SIGINT and
checks that nothing is left behind. Separate short-lived clusters cover a killed worker and refused models.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from loom_helpers import (
    PROMPTS,
    REPO,
    decode_step_seconds,
    launch_cluster,
    max_overlap,
    pid_alive,
    ready_pids,
    run_concurrently,
)
from loom_helpers import until_eos as cut

from ipc.client import LoomError
from ipc.messages import ErrorOut, GenerateReq, SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 49152
GREEDY = {"temperature": 0.0}
FRANCE = PROMPTS[0]
SHM = Path("/dev/shm")


def _shm() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    return _shm()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shm_before, model_path):
    with launch_cluster(tmp_path_factory.mktemp("e2e"), "--max-total-tokens", "4096") as h:
        yield h


@pytest.fixture
def client(cluster):
    with cluster.client(timeout_s=120) as c:
        yield c


@pytest.fixture
def still_ok(client, reference):
    """Check that a normal request (after a bad one) is still answered correctly."""

    def check(n: int = 3) -> None:
        out = client.generate(text="The quick brown fox", sampling_params={"max_new_tokens": n, **GREEDY})
        assert out["output_ids"] == reference["raw_fox"]["greedy"][:n]
        assert out["meta_info"]["finish_reason"]["type"] == "length"

    return check


# ----------------------------------------------------------------------------- start-up


def test_ready_line_names_endpoint_and_processes(cluster):
    log = cluster.log()
    assert f"Loom ready: clients connect to {cluster.endpoint} (tp_size=1)" in log
    assert set(cluster.children) == {"gpu_worker[0]", "scheduler_proc", "tokenizer_proc"}
    assert ready_pids(log) == cluster.children
    assert cluster.front_path.exists() and cluster.socket_dir.is_dir()
    assert cluster.socket_dir.name.startswith("loom-")


def test_health(client):
    h = client.health()
    assert h["message"] == "ok" and h["running"] == 0


def test_second_launcher_refuses_a_live_endpoint(cluster):
    p = subprocess.run(
        [sys.executable, "launch.py", "--zmq-endpoint", cluster.endpoint],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "in use by a running server" in p.stderr + p.stdout
    assert cluster.front_path.exists()  # the live socket was not unlinked


# ----------------------------------------------------------------------------- correctness through the cluster


def test_greedy_matches_transformers_staggered(cluster, reference):
    """All prompts (text and chat, tokenized by the server) stream concurrently, arriving ~2 steps apart."""
    n = 16
    gap = 2 * decode_step_seconds(cluster.endpoint)
    jobs = [
        (gap * i, {**p.request_kwargs(), "sampling_params": {"max_new_tokens": n, **GREEDY}})
        for i, p in enumerate(PROMPTS)
    ]
    timed = run_concurrently(cluster.endpoint, jobs)
    for p, t in zip(PROMPTS, timed, strict=True):
        ref = reference[p.name]
        assert t.result["output_ids"] == cut(ref["greedy"], n), p.name
        meta = t.result["meta_info"]
        assert meta["prompt_tokens"] == len(ref["input_ids"]), p.name
        assert meta["completion_tokens"] == len(t.result["output_ids"])
        assert meta["finish_reason"]["type"] == ("stop" if t.result["output_ids"][-1] == 2 else "length")
        assert t.chunks == len(t.result["output_ids"])  # one streamed chunk per token
    assert max_overlap([(t.first, t.done) for t in timed]) >= 3  # they really shared decode steps


def test_chat_answer_text(client, reference):
    out = client.generate(messages=FRANCE.messages, sampling_params={"max_new_tokens": 32, **GREEDY})
    assert out["text"] == "The capital of France is Paris."
    assert out["output_ids"] == reference[FRANCE.name]["greedy"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


def test_input_ids_request(client, reference):
    ids = reference["raw_code"]["input_ids"]
    out = client.generate(input_ids=ids, sampling_params={"max_new_tokens": 6, **GREEDY})
    assert out["output_ids"] == reference["raw_code"]["greedy"][:6]
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_streaming_is_cumulative_and_matches_non_streaming(client, text_codec):
    sp = {"max_new_tokens": 10, **GREEDY}
    chunks = list(client.generate(text="Once upon a time", sampling_params=sp, stream=True, rid="s1"))
    whole = client.generate(text="Once upon a time", sampling_params=sp, rid="s2")
    assert len(chunks) == 10
    for i, c in enumerate(chunks):
        assert len(c["output_ids"]) == i + 1
        assert c["meta_info"]["id"] == "s1"
        assert (c["meta_info"]["finish_reason"] is None) == (i < 9)
    for prev, cur in zip(chunks, chunks[1:], strict=False):  # cumulative: each chunk extends the previous one
        assert cur["output_ids"][:-1] == prev["output_ids"]
        assert cur["text"].startswith(prev["text"])
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["text"] == whole["text"] == text_codec.decode(whole["output_ids"])
    assert whole["meta_info"]["id"] == "s2"


def test_stop_string_is_cut_from_text(client):
    out = client.generate(messages=FRANCE.messages, sampling_params={"max_new_tokens": 32, "stop": " Paris", **GREEDY})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " Paris"}
    assert out["text"] == "The capital of France is"


def test_stop_token_ids_and_ignore_eos(client, reference):
    ref = reference[FRANCE.name]["greedy"]  # "The capital of France is Paris." + EOS
    sp = {"max_new_tokens": 32, "stop_token_ids": [ref[2]], **GREEDY}
    out = client.generate(messages=FRANCE.messages, sampling_params=sp)
    assert out["output_ids"] == ref[:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[2]}
    out = client.generate(
        messages=FRANCE.messages, sampling_params={"max_new_tokens": 10, "ignore_eos": True, **GREEDY}
    )
    assert out["output_ids"][: len(ref)] == ref and len(out["output_ids"]) == 10
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_seeded_sampling_is_reproducible_whatever_the_batch(cluster, client):
    sp = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}
    alone = client.generate(text="My favourite colour is", sampling_params=sp)["output_ids"]
    noise = {"max_new_tokens": 20, "temperature": 1.3, "ignore_eos": True}  # still running when the seeded one joins
    jobs = [
        (0.0, {"text": "Tell me a joke.", "sampling_params": noise}),
        (0.0, {"text": "Hi", "sampling_params": noise}),
    ]
    jobs += [(0.3, {"text": "My favourite colour is", "sampling_params": sp})]
    timed = run_concurrently(cluster.endpoint, jobs)
    assert timed[2].result["output_ids"] == alone
    other_seed = client.generate(text="My favourite colour is", sampling_params={**sp, "seed": 99})["output_ids"]
    assert len(other_seed) == 8  # (a different seed may or may not differ; it must simply work)


# ----------------------------------------------------------------------------- scripts/generate.py


def run_script(cluster, *args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "generate.py"), "--endpoint", cluster.endpoint, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_generate_script_json(cluster, reference):
    p = run_script(cluster, "--messages-json", json.dumps(FRANCE.messages), "--max-new-tokens", "32", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["text"] == "The capital of France is Paris."
    assert out["output_ids"] == reference[FRANCE.name]["greedy"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_generate_script_stream_prints_the_same_text(cluster, client):
    p = run_script(cluster, "--text", "The quick brown fox", "--max-new-tokens", "8", "--stream")
    assert p.returncode == 0, p.stderr
    expected = client.generate(text="The quick brown fox", sampling_params={"max_new_tokens": 8, **GREEDY})["text"]
    assert p.stdout == expected + "\n"


def test_generate_script_reports_server_errors(cluster):
    p = run_script(cluster, "--text", "hello", "--temperature", "-1")
    assert p.returncode == 1
    assert "error (bad_request)" in p.stderr and "temperature=-1.0" in p.stderr
    p = run_script(cluster, "--messages-json", "[not json")
    assert p.returncode == 2 and "not valid JSON" in p.stderr


# ----------------------------------------------------------------------------- bad input


BAD_REQUESTS = {
    "empty_text": ({"text": ""}, "the prompt is empty"),
    "empty_ids": ({"input_ids": []}, "the prompt is empty"),
    "empty_messages": ({"messages": []}, "messages is empty"),
    "two_prompts": ({"text": "a", "input_ids": [1]}, "exactly one of text, input_ids, messages"),
    "no_prompt": ({}, "exactly one of text, input_ids, messages"),
    "id_over_vocab": ({"input_ids": [1, VOCAB]}, f"input_ids[1]={VOCAB} is outside the vocabulary"),
    "id_huge": ({"input_ids": [10**12]}, "is outside the vocabulary"),
    "id_negative": ({"input_ids": [5, -1, 7]}, "input_ids[1]=-1 is outside the vocabulary"),
    "temperature_negative": ({"sampling_params": {"temperature": -1}}, "temperature=-1"),
    "temperature_absurd": ({"sampling_params": {"temperature": 1e30}}, "temperature=1e+30"),
    "temperature_nan": ({"sampling_params": {"temperature": float("nan")}}, "temperature=nan"),
    "top_p_zero": ({"sampling_params": {"top_p": 0}}, "top_p=0"),
    "top_p_over_one": ({"sampling_params": {"top_p": 1.01}}, "top_p=1.01"),
    "top_k_zero": ({"sampling_params": {"top_k": 0}}, "top_k=0"),
    "top_k_over_vocab": ({"sampling_params": {"top_k": VOCAB + 1}}, f"top_k={VOCAB + 1}"),
    "max_new_tokens_zero": ({"sampling_params": {"max_new_tokens": 0}}, "max_new_tokens=0"),
    "max_new_tokens_negative": ({"sampling_params": {"max_new_tokens": -5}}, "max_new_tokens=-5"),
    "seed_negative": ({"sampling_params": {"seed": -3}}, "seed=-3"),
    "stop_token_outside_vocab": ({"sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    "empty_stop_string": ({"sampling_params": {"stop": ""}}, "sampling_params.stop"),
    # the model allows 8192 positions but the KV pool (4096 tokens) caps the context
    "prompt_over_kv_context": (
        {"input_ids": [5] * 4090, "sampling_params": {"max_new_tokens": 10}},
        "context length 4096",
    ),
    "prompt_over_model_context": ({"input_ids": [5] * 9000}, "exceeds the context length"),
    "max_new_over_context": ({"text": "hi", "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens=5000"),
    "rid_too_long": ({"rid": "x" * 300}, "rid must be"),
    "unknown_lora": ({"lora_path": "nope"}, "LoRA is not enabled"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_refused_and_server_keeps_serving(client, case, still_ok):
    kw, needle = BAD_REQUESTS[case]
    kw = {"text": "Hello"} | kw if not ({"text", "input_ids", "messages"} & set(kw)) and case != "no_prompt" else kw
    kw.setdefault("sampling_params", {})
    kw["sampling_params"] = {"max_new_tokens": 4, **kw["sampling_params"]}
    if case == "no_prompt":
        kw.pop("text", None)
    kw.setdefault("rid", f"bad-{case}")
    with pytest.raises(LoomError) as e:
        client.generate(**kw)
    assert needle in e.value.message, e.value.message
    assert e.value.kind == "bad_request"
    assert e.value.rid == kw["rid"]
    still_ok()


def test_unknown_sampling_field_is_refused_by_the_client(client, still_ok):
    with pytest.raises(LoomError, match="unknown field `temprature`") as e:
        client.generate(text="hi", sampling_params={"temprature": 0.5})
    assert e.value.kind == "bad_request"
    still_ok()


def _frame(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": "GenerateReq", "text": "hi", "rid": "raw", **fields})


VALID = msgspec.msgpack.Encoder().encode(
    GenerateReq(text="hello", rid="raw", sampling_params=SamplingParams(max_new_tokens=2))
)
# the rid the front door can still read from a refused frame (and echoes in its error)
RAW_FRAME_RIDS = {
    "unknown_field": "raw",
    "unknown_sampling_field": "raw",
    "wrong_type": "raw",
    "wrong_tag_server_msg": "x",
    "unknown_tag": "x",
}
RAW_FRAMES = {
    "unknown_field": (_frame(bogus=1), "unknown field `bogus`"),
    "unknown_sampling_field": (_frame(sampling_params={"temprature": 0.5}), "unknown field `temprature`"),
    "wrong_type": (_frame(input_ids="abc", text=None), "input_ids"),
    "wrong_tag_server_msg": (msgspec.msgpack.encode({"type": "GenerateOut", "rid": "x"}), "GenerateOut"),
    "unknown_tag": (msgspec.msgpack.encode({"type": "Explode", "rid": "x"}), "Explode"),
    "no_tag": (msgspec.msgpack.encode({"text": "hi"}), "type"),
    "garbled": (b"\xc1\xc1\xc1\xc1garbage", "malformed frame"),
    "garbled_random": (bytes(range(7, 64, 3)), "invalid message"),
    "truncated": (VALID[: len(VALID) // 2], "truncated"),
    "truncated_by_one": (VALID[:-1], "truncated"),
    "empty": (b"", "malformed frame (0 bytes)"),
}


@pytest.mark.parametrize("case", sorted(RAW_FRAMES))
def test_bad_frame_gets_error_out_and_server_keeps_serving(client, case, still_ok):
    frame, needle = RAW_FRAMES[case]
    client.send_raw(frame)
    reply = client.recv()
    assert isinstance(reply, ErrorOut), reply
    assert reply.kind == "bad_request" and reply.rid == RAW_FRAME_RIDS.get(case, "")
    assert needle in reply.message, reply.message
    still_ok()


def test_multipart_message_is_refused(client, still_ok):
    client.sock.send_multipart([b"one", b"two"])
    reply = client.recv()
    assert isinstance(reply, ErrorOut) and "expected one frame per message, got 2" in reply.message
    still_ok()


def test_duplicate_running_rid_is_refused(client):
    stream = client.generate(
        text="Count to ten:", sampling_params={"max_new_tokens": 20, "ignore_eos": True}, stream=True, rid="dup"
    )
    next(stream)
    with pytest.raises(LoomError, match="request id 'dup' is already running"):
        client.generate(text="hi", rid="dup")
    rest = list(stream)
    assert len(rest[-1]["output_ids"]) == 20


# ----------------------------------------------------------------------------- clients that go away

_DISCONNECTING_CLIENT = """
import sys, time
from ipc.client import LoomClient
c = LoomClient(sys.argv[1], timeout_s=60)
it = c.generate(text="Write a very long story about a dragon.", stream=True,
                sampling_params={"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True})
next(it)
print("streaming", flush=True)
time.sleep(120)
"""


def wait_idle(client, timeout_s=15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.health()["running"] == 0:
            return deadline - time.monotonic()
        time.sleep(0.2)
    raise AssertionError(f"server still has requests running after {timeout_s} s: {client.health()}")


def test_client_killed_mid_stream_does_not_hurt_others(cluster, client, reference, still_ok):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    victim = subprocess.Popen(
        [sys.executable, "-c", _DISCONNECTING_CLIENT, cluster.endpoint], stdout=subprocess.PIPE, text=True, env=env
    )
    wait_idle(client)
    try:
        assert victim.stdout.readline().strip() == "streaming"
        assert client.health()["running"] == 1
        # another client is served correctly while the doomed stream runs
        out = client.generate(
            input_ids=reference["raw_fox"]["input_ids"], sampling_params={"max_new_tokens": 5, **GREEDY}
        )
        assert out["output_ids"] == reference["raw_fox"]["greedy"][:5]
    finally:
        victim.kill()
        victim.wait()
    wait_idle(client)  # its 2000-token request was aborted, not left to run for minutes
    still_ok()


def test_closing_a_stream_early_aborts_it(client, still_ok):
    stream = client.generate(
        text="Tell me a long story.", sampling_params={"max_new_tokens": 2000, "ignore_eos": True}, stream=True
    )
    next(stream)
    next(stream)
    stream.close()
    wait_idle(client)
    still_ok()


def test_explicit_abort(client, still_ok):
    stream = client.generate(
        text="Tell me a long story.",
        sampling_params={"max_new_tokens": 2000, "ignore_eos": True},
        stream=True,
        rid="ab",
    )
    next(stream)
    client.abort("ab")
    last = list(stream)[-1]  # the stream ends with a final chunk whose finish reason is "abort"
    assert last["meta_info"]["id"] == "ab"
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    assert "aborted by client" in last["meta_info"]["finish_reason"]["message"]
    assert len(last["output_ids"]) < 2000
    wait_idle(client)
    still_ok()


# ----------------------------------------------------------------------------- shutdown (keep last in module)


def _open_shm_paths() -> set[str]:
    """/dev/shm entries some live process has open or mapped."""
    held = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    held.add(os.path.basename(target.split(" (deleted)")[0]))
            for line in (d / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(os.path.basename(line.split("/dev/shm/", 1)[1].split(" (deleted)")[0]))
        except OSError:
            continue
    return held


def test_sigint_stops_everything_and_cleans_up(cluster, shm_before):
    pids = dict(cluster.children)
    assert len(pids) == 3 and all(pid_alive(p) for p in pids.values())
    t0 = time.monotonic()
    code = cluster.stop(signal.SIGINT, timeout_s=30)
    assert code == 0, cluster.log()
    assert time.monotonic() - t0 < 20
    for name, pid in pids.items():
        assert not pid_alive(pid), f"{name} (pid {pid}) survived the launcher"
    assert not cluster.front_path.exists(), "front socket file left behind"
    assert not cluster.socket_dir.exists(), f"socket dir {cluster.socket_dir} left behind"
    new = _shm() - shm_before - _open_shm_paths()  # entries of other (live) processes are not ours
    assert not new, f"new /dev/shm entries: {sorted(new)}"
    log = cluster.log()
    assert "SIGINT received; shutting down" in log and "launch INFO stopped" in log
    assert "Traceback" not in log, log


# ----------------------------------------------------------------------------- separate clusters


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"model_type": "gpt2"}, "model_type='gpt2' is not supported"), ({"hidden_act": "gelu"}, "hidden_act='gelu'")],
)
def test_launcher_refuses_unsupported_model(tmp_path, model_path, change, needle):
    model = tmp_path / "model"
    model.mkdir()
    for f in model_path.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    cfg = json.loads((model_path / "config.json").read_text()) | change
    (model / "config.json").write_text(json.dumps(cfg))
    endpoint = f"ipc://{tmp_path}/front.sock"
    p = subprocess.run(
        [sys.executable, "launch.py", "--model-path", str(model), "--zmq-endpoint", endpoint],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    assert not (tmp_path / "front.sock").exists()
