"""In-process checks of client, launcher, model-source and front-door usability fixes (no cluster starts)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from loom_helpers import ListSink

import launch
from ipc import model_source
from ipc.client import AsyncLoomClient, LoomClient, LoomError
from ipc.codec import Codec
from ipc.config import ServerArgs, make_endpoints
from ipc.messages import ChatMessage, ClientMsg, ErrorOut, GenerateOut, GenerateReq, MetaInfo, ServerMsg
from ipc.model_source import ModelSourceError, resolve_model_path
from tokenizer_proc.front_door import FrontDoor

REPO = Path(__file__).resolve().parent.parent
CLIENT_CODEC = Codec(ClientMsg)
SERVER_CODEC = Codec(ServerMsg)


def _final(rid: str, text: str = "ok") -> GenerateOut:
    return GenerateOut(rid, text, [1], MetaInfo(rid, 1, 1), True)


# ---------------------------------------------------------------- AsyncLoomClient
def test_async_client_refuses_a_rid_already_in_flight(tmp_path):
    """A second generate with the same rid fails at once; the first still gets its reply."""
    endpoint = f"ipc://{tmp_path}/front.sock"

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        try:
            async with AsyncLoomClient(endpoint, timeout_s=5) as c:
                first = asyncio.ensure_future(c.generate("a", rid="same"))
                ident, frame = await asyncio.wait_for(router.recv_multipart(), 5)
                assert CLIENT_CODEC.decode(frame).rid == "same"
                with pytest.raises(LoomError) as e:
                    await c.generate("b", rid="same")
                assert e.value.kind == "bad_request" and "already running" in e.value.message
                assert not await router.poll(200)  # the duplicate sent nothing (not even an abort)
                await router.send_multipart([ident, SERVER_CODEC.encode(_final("same", "first"))])
                assert (await asyncio.wait_for(first, 5))["text"] == "first"
                # the rid is free again once the first finished
                second = asyncio.ensure_future(c.generate("c", rid="same"))
                ident, frame = await asyncio.wait_for(router.recv_multipart(), 5)
                await router.send_multipart([ident, SERVER_CODEC.encode(_final("same", "again"))])
                assert (await asyncio.wait_for(second, 5))["text"] == "again"
            assert c.sock.closed  # __aexit__ closed it
        finally:
            router.close()
            ctx.term()

    asyncio.run(scenario())


def test_timeout_message_shows_fractional_seconds(tmp_path):
    with LoomClient(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.01) as c:
        with pytest.raises(LoomError, match=r"no reply from the server in 0\.01 s") as e:
            c.generate("hi")
    assert e.value.kind == "timeout"


@pytest.mark.parametrize("endpoint", ["foo://bar", "", "tcp://nohost"])
def test_bad_endpoint_is_a_loom_error_naming_it(endpoint):
    with pytest.raises(LoomError, match=rf"cannot use endpoint {endpoint!r}: .*expected tcp://HOST:PORT") as e:
        LoomClient(endpoint)
    assert e.value.kind == "bad_request"
    with pytest.raises(LoomError, match="cannot use endpoint") as e:
        AsyncLoomClient(endpoint)
    assert e.value.kind == "bad_request"


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("tcp://127.0.0.1:99999", "TCP port 99999 is outside 1-65535"),
        ("tcp://127.0.0.1:0", "TCP port 0 is outside 1-65535"),
        ("inproc://loom", "inproc:// reaches only sockets inside this process"),
    ],
)
def test_endpoint_zmq_takes_but_no_server_can_have_is_refused(endpoint, why):
    """ZeroMQ accepts these, and the client used to wait 2.5 s on them as if the server were down."""
    t = time.monotonic()
    with pytest.raises(LoomError, match=rf"cannot use endpoint {endpoint!r}: {why}") as e:
        LoomClient(endpoint)
    assert e.value.kind == "bad_request" and time.monotonic() - t < 1.0
    with pytest.raises(LoomError, match=why):
        AsyncLoomClient(endpoint)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--zmq-endpoint", "tcp://127.0.0.1:99999"], "--zmq-endpoint tcp://127.0.0.1:99999: TCP port 99999"),
        (["--zmq-endpoint", "inproc://loom"], "--zmq-endpoint inproc://loom: inproc:// reaches only sockets inside"),
        (["--http-port", "70000"], "--http-port 70000: must be 1-65535"),
        (["--http-port", "-1"], "--http-port -1: must be 1-65535"),
    ],
)
def test_launch_refuses_an_address_no_client_could_reach_before_loading_anything(flags, why, caplog):
    """ZeroMQ bound tcp port 99999 as 34463 while the cluster announced 99999; --http-port 70000 loaded the model,
    then the front door died with a traceback. Both now exit 2 with one line, before any process starts."""
    import launch

    t = time.monotonic()
    assert launch.main(flags) == 2
    assert why in caplog.text and time.monotonic() - t < 5.0


@pytest.mark.parametrize("endpoint", [5555, None])
def test_an_endpoint_that_is_not_a_string_is_a_loom_error(endpoint):
    """It used to escape as AttributeError ('int' object has no attribute 'partition')."""
    for client in (LoomClient, AsyncLoomClient):
        with pytest.raises(LoomError, match="an endpoint is a string") as e:
            client(endpoint)
        assert e.value.kind == "bad_request"


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({"sampling_params": {"top_k": "x"}}, "$.sampling_params.top_k"),
        ({"messages": [{"role": 1, "content": "x"}], "text": None}, "$.messages[0].role"),
        ({"return_logprob": "yes"}, "$.return_logprob"),
    ],
)
def test_client_side_type_errors_name_the_full_path(kwargs, path, tmp_path):
    """The client checked sampling params alone (``$.top_k``) and left return_logprob to the server."""
    with LoomClient(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.01) as c:
        with pytest.raises(LoomError, match=re.escape(f"at `{path}`")) as e:
            c.generate(**{"text": "hi", **kwargs})
    assert e.value.kind == "bad_request"


# ---------------------------------------------------------------- model source / launcher
def test_non_gguf_file_is_refused_before_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "x.gguf"
    bad.write_text("hello\n")
    called = []
    monkeypatch.setattr(model_source, "convert_gguf", lambda *a: called.append(a))
    with pytest.raises(ModelSourceError, match=r"is not a valid GGUF file: it starts with b'hell'"):
        resolve_model_path(str(bad))
    assert not called


def test_gguf_conversion_failure_is_a_model_source_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "y.gguf"
    bad.write_bytes(b"GGUF\x03\x00")

    def boom(*_a: object) -> None:
        raise ValueError("truncated header")

    monkeypatch.setattr(model_source, "convert_gguf", boom)
    with pytest.raises(ModelSourceError, match=r"y\.gguf is not a valid GGUF file: truncated header"):
        resolve_model_path(str(bad))


def test_launch_with_a_non_gguf_prints_one_error_line_and_exits_2(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("hello\n")
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--model-path", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "launch ERROR" in lines[0] and "not a valid GGUF file" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_describe_exit_names_the_signal():
    assert launch.describe_exit(1) == "1"
    assert launch.describe_exit(0) == "0"
    assert launch.describe_exit(-signal.SIGBUS) == f"-{int(signal.SIGBUS)} (SIGBUS)"
    assert launch.describe_exit(-9) == "-9 (SIGKILL)"
    assert launch.describe_exit(-999) == "-999 (signal 999)"


# ---------------------------------------------------------------- front door


@pytest.fixture(scope="module")
def front_door(model_path):
    args = ServerArgs(model_path=str(model_path), endpoints=make_endpoints())
    sent: list[object] = []
    door = FrontDoor(args, sent.append)
    door.sent = sent  # type: ignore[attr-defined]
    yield door
    shutil.rmtree(args.endpoints.socket_dir, ignore_errors=True)


def _run(door: FrontDoor, req: GenerateReq) -> object:
    sink = ListSink()
    door.sent.clear()  # type: ignore[attr-defined]
    asyncio.run(door.generate(req, sink))
    return sink.msgs[0] if sink.msgs else None


def test_longest_token_is_known(front_door):
    assert 10 <= front_door.codec.max_token_chars <= 1000  # SmolLM2: 81 (a run of spaces)


def test_huge_text_is_refused_before_tokenizing(front_door, monkeypatch):
    def no_encode(_text: str) -> list[int]:
        raise AssertionError("tokenized a prompt that can never fit")

    monkeypatch.setattr(front_door.codec, "encode", no_encode)
    n = 8 * 1024 * 1024
    out = _run(front_door, GenerateReq(text="a" * n))
    assert isinstance(out, ErrorOut) and out.kind == "bad_request"
    assert f"text is {n} characters" in out.message
    assert str(front_door.context_len) in out.message and str(front_door.codec.max_token_chars) in out.message
    out = _run(front_door, GenerateReq(messages=[ChatMessage("user", "a" * n)]))
    assert isinstance(out, ErrorOut) and "characters" in out.message
    out = _run(front_door, GenerateReq(messages=[ChatMessage("user", "")] * (front_door.context_len + 1)))
    assert isinstance(out, ErrorOut) and "entries" in out.message
    assert not front_door.sent  # type: ignore[attr-defined]


def test_text_within_the_char_bound_still_runs(front_door):
    out = _run(front_door, GenerateReq(text="Hello there"))
    assert out is None and len(front_door.sent) == 1  # type: ignore[attr-defined]
    front_door.pending.clear()
    front_door.by_client.clear()


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (GenerateReq(messages=[ChatMessage("wizard", "hi")]), "messages[0].role='wizard' must be one of"),
        (GenerateReq(text="hi", lora_path=""), "lora_path must be a non-empty adapter name"),
    ],
)
def test_front_door_refuses_bad_roles_and_empty_lora(front_door, req, needle):
    out = _run(front_door, req)
    assert isinstance(out, ErrorOut) and out.kind == "bad_request" and needle in out.message


# ---------------------------------------------------------------- scripts/generate.py
def _load_generate():
    import importlib.util

    spec = importlib.util.spec_from_file_location("loom_generate_script", REPO / "scripts" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeServer:
    """A ROUTER on a thread that records each GenerateReq and answers it with two stream chunks."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.reqs: list[GenerateReq] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if not self.sock.poll(10_000):
            return
        ident, frame = self.sock.recv_multipart()
        req = CLIENT_CODEC.decode(frame)
        self.reqs.append(req)
        rid = req.rid
        self.sock.send_multipart([ident, SERVER_CODEC.encode(GenerateOut(rid, "Par", [1], MetaInfo(rid, 1, 1), False))])
        self.sock.send_multipart([ident, SERVER_CODEC.encode(_final(rid, "Paris"))])

    def close(self) -> None:
        self.thread.join(15)
        self.sock.close()
        self.ctx.term()


def test_generate_script_sends_stop_flags_and_input_ids(tmp_path, capsys):
    gen = _load_generate()
    endpoint = f"ipc://{tmp_path}/front.sock"
    srv = FakeServer(endpoint)
    try:
        argv = ["--endpoint", endpoint, "--input-ids", "[1, 2, 3]", "--stop", ".", "--stop", "\n"]
        argv += ["--stop-token-ids", "2", "7", "--ignore-eos", "--stream", "--json", "--timeout", "10"]
        assert gen.main(argv) == 0
    finally:
        srv.close()
    req = srv.reqs[0]
    assert req.input_ids == [1, 2, 3] and req.text is None and req.stream
    sp = req.sampling_params
    assert sp.stop == [".", "\n"] and sp.stop_token_ids == [2, 7] and sp.ignore_eos
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(ln)["text"] for ln in lines] == ["Par", "Paris"]  # one JSON line per chunk


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--messages-json", '{"role": "user"}'], "--messages-json must be a JSON list of {role, content} objects"),
        (["--messages-json", "[1, 2]"], "--messages-json must be a JSON list of {role, content} objects"),
        (["--messages-json", "not json"], "--messages-json must be a JSON list"),
        (["--input-ids", '["a"]'], "--input-ids must be a JSON list of ints"),
        (["--text", "hi", "--endpoint", "foo://bar"], "--endpoint 'foo://bar' is not usable"),
    ],
)
def test_generate_script_flag_errors_exit_2(argv, needle, capsys):
    assert _load_generate().main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_generate_script_input_ids_excludes_text(capsys):
    with pytest.raises(SystemExit) as e:
        _load_generate().main(["--text", "hi", "--input-ids", "[1]"])
    assert e.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize("quant", ["auto", "none"])
def test_launch_refuses_a_tp_size_above_the_kv_heads_before_starting(tmp_path, quant):
    """SmolLM2 has 3 KV heads: --tp-size 4 is one error line and exit 2, nothing started (was a traceback under
    auto, and under none a slow start-up failure of every rank)."""
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--tp-size", "4", "--quantization", quant,
         "--zmq-endpoint", f"ipc://{tmp_path}/front.sock"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--tp-size 4" in lines[0] and "3 KV heads" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "gpu_worker" not in r.stderr


def test_a_worker_start_up_failure_stops_the_cluster_promptly_with_one_clear_reason(tmp_path):
    """A KV cache that cannot be allocated (larger than any address space): the worker names the setting and
    the size, the launcher exits non-zero, and nothing waits for its kill timeout (the front door used to sit in
    its scheduler sync until SIGKILLed 10 s later, and the worker's exit printed a second, chained traceback)."""
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--max-total-tokens", "1000000000000", "--quantization", "none",
         "--zmq-endpoint", f"ipc://{tmp_path}/front.sock"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "the KV cache for 1000000000000 tokens needs" in out and "lower --max-total-tokens" in out, out[-3000:]
    assert "did not stop" not in out and "During handling of the above exception" not in out, out[-3000:]
    assert not list(tmp_path.glob("*.sock"))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_kv_cache_larger_than_the_memory_left_is_refused_at_start_up(tmp_path, tp):
    """The CPU KV cache is taken page by page as tokens are written (huge_pages.zeros), so a pool that fits the
    address space but not the memory would only fail mid-serving, under the OOM killer: the workers refuse it at
    start-up, naming the memory available. At TP=2 every rank's own share fits (2 and 1 of the 3 KV heads: 0.87 and
    0.43 of the memory) but the host holds both (1.3 of it): that is what is checked."""
    from gpu_worker.kv_cache import host_memory_available

    avail = host_memory_available()
    if avail is None:
        pytest.skip("no /proc/meminfo here")
    tokens = int(avail * 1.3) // 23_040  # bf16: 30 layers x (K, V) x 3 KV heads x 64 dims x 2 bytes a token
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--max-total-tokens", str(tokens), "--quantization", "none",
         "--dtype", "bfloat16", "--tp-size", str(tp), "--zmq-endpoint", f"ipc://{tmp_path}/front.sock"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert f"the KV cache for {tokens} tokens needs" in out and "lower --max-total-tokens" in out, out[-3000:]
    assert "GiB of memory available" in out and ("with the other TP ranks on this host" in out) == (tp > 1), out[-3000:]
    assert "Loom ready" not in out and not list(tmp_path.glob("*.sock"))


def test_relative_paths_are_relative_to_where_launch_py_runs(tmp_path, model_path):
    """The children run in the repository folder; every path a user gives (model, adapters, adapter root, and
    adapter paths loaded at run time) still means the folder launch.py was started in."""
    from loom_helpers import launch_cluster
    from lora_helpers import real_adapters

    work = tmp_path / "work"
    (work / "ads").mkdir(parents=True)
    (work / "m").symlink_to(model_path)
    shutil.copytree(real_adapters()["r8-all"], work / "ads" / "a")
    flags = ["--model-path", "m", "--enable-lora", "--lora-root", "ads", "--lora-paths", "a=ads/a"]
    with launch_cluster(tmp_path / "cluster", *flags, cwd=work) as h:
        with LoomClient(h.endpoint) as c:
            sp = {"temperature": 0, "max_new_tokens": 4}
            first = c.generate("The capital of France is", sampling_params=sp, lora_path="a")["text"]
            c.load_lora_adapter("b", "ads/a")  # relative at run time: the same folder (raises if refused)
            assert c.generate("The capital of France is", sampling_params=sp, lora_path="b")["text"] == first


def test_sync_client_reusing_an_aborted_streams_rid_gets_its_own_reply(tmp_path):
    """LoomClient: an aborted stream's late replies are dropped, and a request reusing its rid waits for the
    aborted one's final reply instead of being handed it (or refused as "already running")."""
    import time

    from loom_helpers import launch_cluster

    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with launch_cluster(tmp_path) as h, LoomClient(h.endpoint) as c:
        want = c.generate("The capital of France is", sampling_params=sp)
        for gap_s in (0.0, 0.0, 0.5):  # reused at once (the abort still in flight) and after it settled
            it = c.generate("Tell me a story about a dragon", sampling_params=sp, rid="x0", stream=True)
            next(iter(it))
            it.close()
            time.sleep(gap_s)
            got = c.generate("The capital of France is", sampling_params=sp, rid="x0")
            assert got["text"] == want["text"] and got["meta_info"]["finish_reason"]["type"] == "length", got
        # the streamed variant and another request in between
        it = c.generate("Tell me a story about a dragon", sampling_params=sp, rid="x1", stream=True)
        next(iter(it))
        it.close()
        assert c.generate("The capital of France is", sampling_params=sp)["text"] == want["text"]
        chunks = list(c.generate("The capital of France is", sampling_params=sp, rid="x1", stream=True))
        assert chunks[-1]["text"] == want["text"]


@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_generate_script_refuses_a_timeout_that_is_not_positive(bad, capsys):
    gen = _load_generate()
    with pytest.raises(SystemExit) as e:
        gen.main(["--text", "hi", "--timeout", bad])
    assert e.value.code == 2 and "give a number of seconds above 0" in capsys.readouterr().err
