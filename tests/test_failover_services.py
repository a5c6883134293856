"""Failover drills of the scheduler, the front door and the launcher itself: a killed scheduler_proc or
tokenizer_proc is restarted and every request still finishes with the fault-free tokens (or its client is told
within seconds), adapters keep their uids, an adapter whose folder vanished is surfaced as never loaded, and a
killed launcher leaves nothing behind, also under a subreaper."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from loom_helpers import REPO, _find_children, launch_cluster
from lora_helpers import real_adapters
from prometheus_client.parser import text_string_to_metric_families
from test_failover_worker import adapter_uids, assert_streams_consistent, kill, mixed_requests, run_round

from ipc.client import LoomClient, LoomError
from ipc.config import free_tcp_port

pytestmark = pytest.mark.slow


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def restarts_metric(port: int) -> dict[str, float]:
    _, text = http_get(port, "/metrics")
    return {
        s.labels["process"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "loom_process_restarts_total"
    }


def counter_samples(port: int) -> dict[tuple, float]:
    """Every counter and histogram sample of /metrics, by (sample name, labels)."""
    _, text = http_get(port, "/metrics")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        if f.type in ("counter", "histogram")
        for s in f.samples
    }


def wait_healthy(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http_get(port, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the front door did not come back")


def http_post(port: int, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def restarts_besides_a_split(h, port: int) -> dict[str, float]:
    """``loom_process_restarts`` without the TP group's replacement when a scheduler died between its sends of one
    step (a rank stuck in that step's all-reduce is found and the group replaced; any kill of the scheduler
    mid-decode can cause it, and the launcher may count it a moment after the log says so)."""
    log = h.log()
    split = "is hung (ranks [" in log and "silent); asking the launcher to replace it" in log
    return {k: v for k, v in restarts_metric(port).items() if not (split and k == "gpu_worker")}


def test_scheduler_and_front_door_restarts_keep_requests_and_adapters(tmp_path):
    ad = real_adapters()
    doomed = tmp_path / "doomed"
    shutil.copytree(ad["r16-attn"], doomed)
    port = free_tcp_port()
    flags = ["--tp-size", "2", "--max-total-tokens", "2048", "--enable-lora", "--max-loras-per-batch", "4"]
    flags += ["--http-port", str(port), "--hang-timeout", "3", "--lora-paths", f"a={ad['r8-all']}", f"c={doomed}"]
    flags += [json.dumps({"lora_name": "p", "lora_path": str(ad["r32-qv"]), "pinned": True})]
    reqs = mixed_requests([None, "a", "p", "c"])
    with launch_cluster(tmp_path / "cluster", *flags) as h:
        uids = adapter_uids(h.endpoint)
        assert sorted(uids) == ["a", "c", "p"]
        ref, _ = run_round(h.endpoint, reqs)
        assert all(isinstance(t, str) for t in ref), ref

        # the scheduler dies mid-decode: the front door resubmits with the tokens already delivered
        outs, chunks = run_round(h.endpoint, reqs, kill(h, "scheduler_proc"))
        assert outs == ref, h.log()[-4000:]
        assert_streams_consistent(chunks)
        assert adapter_uids(h.endpoint) == uids
        with LoomClient(h.endpoint) as c:
            assert {a["name"]: a["pinned"] for a in c.list_loras()} == {"a": False, "c": False, "p": True}
        # the cluster log (the assertion message) says which process restarted, and why
        assert restarts_besides_a_split(h, port) == {"scheduler_proc": 1}, h.log()[-4000:]

        # the front door dies mid-decode: greedy clients resubmit and get the same tokens ...
        seen = counter_samples(port)
        outs, chunks = run_round(h.endpoint, reqs, kill(h, "tokenizer_proc"))
        assert outs == ref, h.log()[-4000:]
        assert_streams_consistent(chunks)
        wait_healthy(port)
        # ... and no counter a scraper saw goes back (the new front door carries the old one's over)
        now = counter_samples(port)
        back = {k: (v, now.get(k)) for k, v in seen.items() if now.get(k, -1.0) < v}
        assert not back and now[("loom_generation_tokens_total", ())] > seen[("loom_generation_tokens_total", ())], back
        assert adapter_uids(h.endpoint) == uids
        assert restarts_besides_a_split(h, port) == {"scheduler_proc": 1, "tokenizer_proc": 1}, h.log()[-4000:]

        # a hung scheduler or front door (SIGSTOP) stops its heartbeats: the launcher kills and restarts it
        for target in ("scheduler_proc", "tokenizer_proc"):
            outs, chunks = run_round(h.endpoint, reqs, kill(h, target, signal.SIGSTOP))
            assert outs == ref, h.log()[-4000:]
            assert_streams_consistent(chunks)
            assert f"{target} (pid" in h.log() and "sent no heartbeat for" in h.log()
        wait_healthy(port)
        # a scheduler stopped between its sends of one step to the two ranks leaves one rank in that step's first
        # all-reduce for ever: the next scheduler finds it silent for --step-timeout and has the group replaced
        # (CI saw this once; the requests still finished with the reference tokens)
        assert restarts_besides_a_split(h, port) == {"scheduler_proc": 2, "tokenizer_proc": 2}, h.log()[-4000:]

        # ... a request that cannot be retried (sampled, no seed) is told within seconds, never times out
        _find_children(h)
        got: dict = {}

        def sampled():
            try:
                with LoomClient(h.endpoint, timeout_s=120) as c:
                    sp = {"max_new_tokens": 200, "temperature": 0.8, "ignore_eos": True}
                    for _ in c.generate(text="Tell me a story.", sampling_params=sp, stream=True):
                        got.setdefault("first", time.monotonic())
            except LoomError as e:
                got["error"], got["at"] = e, time.monotonic()

        t = threading.Thread(target=sampled)
        t.start()
        while "first" not in got and t.is_alive():
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(h.children["tokenizer_proc"], signal.SIGKILL)
        t.join(60)
        assert isinstance(got.get("error"), LoomError) and got["error"].kind == "unavailable", got
        assert got["at"] - killed < 3.0
        wait_healthy(port)

        # an adapter folder deleted before a front-door restart is surfaced as never loaded
        shutil.rmtree(doomed)
        _find_children(h)
        os.kill(h.children["tokenizer_proc"], signal.SIGKILL)
        time.sleep(0.5)
        wait_healthy(port)
        assert adapter_uids(h.endpoint) == {k: v for k, v in uids.items() if k != "c"}
        with LoomClient(h.endpoint, timeout_s=60) as c, pytest.raises(LoomError) as e:
            c.generate(text="hi", lora_path="c", sampling_params={"max_new_tokens": 2})
        assert e.value.kind == "not_found"
        assert str(e.value) == "Got LoRA adapter that has never been loaded: c\nAll loaded adapters: ['a', 'p']"
        outs, _ = run_round(h.endpoint, reqs[:3])
        assert outs == ref[:3]
        assert "is no longer valid and is unloaded" in h.log()

        # the rebuilt registry answers admin calls consistently: loaded means "already loaded", never both
        with LoomClient(h.endpoint, timeout_s=60) as c:
            with pytest.raises(LoomError, match="a is already loaded"):
                c.load_lora_adapter("a", str(ad["r8-all"]))
            c.unload_lora_adapter("a")
            with pytest.raises(LoomError, match="never been loaded: a"):
                c.generate(text="hi", lora_path="a", sampling_params={"max_new_tokens": 2})
            c.load_lora_adapter("a", str(ad["r8-all"]))
            assert c.generate(**reqs[1])["text"] == ref[1]


_SUBREAPER_DRIVER = r"""
import ctypes, os, signal, subprocess, sys, time
libc = ctypes.CDLL("libc.so.6", use_errno=True)
if sys.argv[1] == "subreaper":
    libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans re-parent to us, as under docker --init
work, repo = sys.argv[2], sys.argv[3]
log = open(os.path.join(work, "launch.log"), "wb")
p = subprocess.Popen([sys.executable, os.path.join(repo, "launch.py"), "--zmq-endpoint", f"ipc://{work}/front.sock",
                      "--max-total-tokens", "1024"], cwd=repo, stdout=log, stderr=subprocess.STDOUT)
deadline = time.monotonic() + 240
while b"Loom ready" not in open(os.path.join(work, "launch.log"), "rb").read():
    assert p.poll() is None and time.monotonic() < deadline, "not ready"
    time.sleep(0.2)
def ppid(pid):
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return -1
kids = [int(x) for x in os.listdir("/proc") if x.isdigit() and ppid(x) == p.pid]
sock_dir = None
for k in kids:
    cmd = open(f"/proc/{k}/cmdline", "rb").read().split(b"\0")
    if b"--config-file" in cmd:
        sock_dir = os.path.dirname(cmd[cmd.index(b"--config-file") + 1].decode())
os.kill(p.pid, signal.SIGKILL)
p.wait()
t0 = time.monotonic()
alive = set(kids)
while alive and time.monotonic() - t0 < 10:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap re-parented children (we may be their subreaper)
            pass
    except ChildProcessError:
        pass
    for k in list(alive):
        try:
            state = open(f"/proc/{k}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "gone"):
            alive.discard(k)
    time.sleep(0.05)
took = time.monotonic() - t0
print(f"children={len(kids)} left={sorted(alive)} took={took:.2f} sockdir={os.path.exists(sock_dir)}"
      f" front={os.path.exists(os.path.join(work, 'front.sock'))}")
"""


@pytest.mark.parametrize("mode", ["plain", "subreaper"])
def test_a_killed_launcher_leaves_nothing_behind(tmp_path, model_path, mode):
    shm_before = set(os.listdir("/dev/shm"))
    p = subprocess.run(
        [sys.executable, "-c", _SUBREAPER_DRIVER, mode, str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr + (tmp_path / "launch.log").read_text()
    facts = dict(kv.split("=", 1) for kv in p.stdout.split())
    assert facts["children"] == "3" and facts["left"] == "[]", p.stdout
    assert float(facts["took"]) < 2.0, p.stdout
    assert facts["sockdir"] == "False" and facts["front"] == "False", p.stdout
    assert not (set(os.listdir("/dev/shm")) - shm_before)


def test_a_lora_load_cut_short_by_a_front_door_restart_is_answered_then_adopted(tmp_path):
    """A load waiting on a stopped worker when the front door is restarted (SIGTERM) gets a JSON 503 at once,
    not a bare 500 after uvicorn's grace period (found by a new-user trial); the ranks finish the load later,
    and the new front door adopts the adapter, which then serves (under the uid the ranks hold)."""
    ad = real_adapters()
    port = free_tcp_port()
    flags = ["--max-total-tokens", "2048", "--enable-lora", "--max-lora-rank", "32", "--http-port", str(port)]
    flags += ["--lora-paths", f"a={ad['r8-all']}"]
    with launch_cluster(tmp_path / "cluster", *flags) as h:
        _find_children(h)
        worker, front = h.children["gpu_worker[0]"], h.children["tokenizer_proc"]
        answer: dict[str, object] = {}

        def load() -> None:
            t0 = time.monotonic()
            answer["reply"] = http_post(port, "/load_lora_adapter", {"lora_name": "z", "lora_path": str(ad["r32-qv"])})
            answer["took"] = time.monotonic() - t0

        os.kill(worker, signal.SIGSTOP)  # the load cannot finish
        try:
            t = threading.Thread(target=load)
            t.start()
            time.sleep(0.5)
            os.kill(front, signal.SIGTERM)  # restarts the front door alone
            t.join(30)
        finally:
            os.kill(worker, signal.SIGCONT)
        status, body = answer["reply"]
        assert status == 503 and answer["took"] < 4.0, (answer, h.log()[-3000:])
        assert "z: the load was cut short (the front door is restarting)" in json.loads(body)["error"]["message"]
        wait_healthy(port)  # the new front door: the old one says 503 from its SIGTERM on

        def listed() -> list[str]:
            try:
                return sorted(adapter_uids(h.endpoint))
            except LoomError as e:  # only while a front door is not up
                assert e.kind in ("unavailable", "timeout"), e
                return []

        deadline = time.monotonic() + 20
        while listed() != ["a", "z"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert listed() == ["a", "z"], h.log()[-3000:]
        with LoomClient(h.endpoint) as c:
            out = c.generate("Hi", sampling_params={"max_new_tokens": 2, "temperature": 0}, lora_path="z")
        assert out["meta_info"]["completion_tokens"] == 2


def test_every_child_killed_at_once_keeps_the_adapters_under_their_uids(tmp_path):
    """The front door, the scheduler and the TP rank die together (kill -9 of all three mid-decode): no process
    still holds the adapters, so the new front door restores them from the registry its predecessor wrote
    (tokenizer_proc/registry_journal.py), start-up and run-time loads alike, under the same uids; every request
    finishes with the fault-free tokens, and an adapter whose folder vanished meanwhile is never loaded."""
    ad = real_adapters()
    doomed = tmp_path / "doomed"
    shutil.copytree(ad["r16-attn"], doomed)
    flags = ["--max-total-tokens", "2048", "--enable-lora", "--max-loras-per-batch", "4", "--hang-timeout", "3"]
    flags += ["--max-lora-rank", "32", "--lora-paths", f"a={ad['r8-all']}"]
    reqs = mixed_requests([None, "a", "p", "c"])
    with launch_cluster(tmp_path / "cluster", *flags) as h:
        with LoomClient(h.endpoint, timeout_s=60) as c:
            c.load_lora_adapter("p", str(ad["r32-qv"]), pinned=True)
            c.load_lora_adapter("c", str(doomed))
        uids = adapter_uids(h.endpoint)
        assert sorted(uids) == ["a", "c", "p"]
        ref, _ = run_round(h.endpoint, reqs)
        assert all(isinstance(t, str) for t in ref) and len(set(ref)) == 4, ref

        _find_children(h)
        pids = [h.children[n] for n in ("gpu_worker[0]", "scheduler_proc", "tokenizer_proc")]
        outs, chunks = run_round(h.endpoint, reqs, lambda: [os.kill(p, signal.SIGKILL) for p in pids])
        assert outs == ref, h.log()[-4000:]
        assert_streams_consistent(chunks)
        assert adapter_uids(h.endpoint) == uids
        with LoomClient(h.endpoint) as c:
            assert {a["name"]: a["pinned"] for a in c.list_loras()} == {"a": False, "c": False, "p": True}
        log = h.log()
        assert "LoRA registry carried over from the previous front door: ['a', 'c', 'p']" in log, log[-4000:]

        # again with c's folder gone: c cannot be restored, its request fails as never loaded, the rest are exact
        shutil.rmtree(doomed)
        _find_children(h)
        pids = [h.children[n] for n in ("gpu_worker[0]", "scheduler_proc", "tokenizer_proc")]
        outs, chunks = run_round(h.endpoint, reqs, lambda: [os.kill(p, signal.SIGKILL) for p in pids])
        assert outs[:3] == ref[:3], h.log()[-4000:]
        assert isinstance(outs[3], LoomError) and outs[3].kind == "not_found", outs[3]
        assert str(outs[3]) == "Got LoRA adapter that has never been loaded: c\nAll loaded adapters: ['a', 'p']"
        assert adapter_uids(h.endpoint) == {k: v for k, v in uids.items() if k != "c"}
        assert "LoRA adapter c (uid" in h.log()
