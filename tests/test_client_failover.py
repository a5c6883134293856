"""Clients that notice a server that is gone: never there, killed, frozen, or restarted mid-request.

A fake front door (``python tests/test_client_failover.py serve ...``) speaks Loom's client wire in a subprocess
so it can be killed with SIGKILL or frozen with SIGSTOP. No cluster starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ipc.client import AsyncLoomClient, LoomClient, LoomError  # noqa: E402
from ipc.codec import Codec  # noqa: E402
from ipc.messages import (  # noqa: E402
    AdminOut,
    ClientMsg,
    FinishReason,
    GenerateOut,
    GenerateReq,
    HealthReq,
    MetaInfo,
    ServerMsg,
)

GREEDY = {"temperature": 0, "max_new_tokens": 16}
SAMPLED = {"temperature": 0.7, "max_new_tokens": 16}
TOKENS = 12


def _text(ids: list[int]) -> str:
    return "".join(f"t{i} " for i in ids)


# ---------------------------------------------------------------- the fake front door (a subprocess)
def serve(endpoint: str, tokens: int, hang_after: int, base: int, delay: float) -> None:
    """A ROUTER answering each GenerateReq with ``tokens`` tokens (ids ``base..``), one stream chunk per token.

    ``hang_after >= 0``: send only that many chunks (a non-stream request gets no reply) and then go quiet.
    Prints ``ready`` once bound and ``got RID`` per request; SIGTERM closes the socket (removing its file).
    """
    codec_in: Codec = Codec(ClientMsg)
    codec_out: Codec = Codec(ServerMsg)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sock.bind(endpoint)
    print("ready", flush=True)
    try:
        while not stop.is_set():
            if not sock.poll(100):
                continue
            ident, frame = sock.recv_multipart()
            msg = codec_in.decode(frame)
            if isinstance(msg, HealthReq):
                sock.send_multipart([ident, codec_out.encode(AdminOut(True, "ok", {"running": 0}))])
            if not isinstance(msg, GenerateReq):
                continue
            rid = msg.rid or ""
            print(f"got {rid}", flush=True)
            sent = tokens if hang_after < 0 else hang_after
            steps = list(range(1, sent + 1)) if msg.stream else ([tokens] if sent == tokens else [])
            for k in steps:
                ids = list(range(base, base + k))
                fin = k == tokens
                meta = MetaInfo(rid, 3, k, FinishReason("length") if fin else None)
                sock.send_multipart([ident, codec_out.encode(GenerateOut(rid, _text(ids), ids, meta, fin))])
                time.sleep(delay)
    finally:
        sock.close()
        ctx.term()


class FakeServer:
    """The fake front door in a subprocess; ``kill``/``freeze`` simulate a crash or a hung machine."""

    def __init__(
        self, endpoint: str, *, tokens: int = TOKENS, hang_after: int = -1, base: int = 100, delay: float = 0.01
    ) -> None:
        cmd = [sys.executable, __file__, "serve", endpoint, str(tokens), str(hang_after), str(base), str(delay)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._got = threading.Condition()
        line = self.proc.stdout.readline().strip()
        assert line == "ready", f"fake server did not start: {line!r}"
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._got:
                self.lines.append(line.strip())
                self._got.notify_all()

    def wait_request(self, n: int = 1, timeout: float = 10.0) -> list[str]:
        """The rids of the first ``n`` requests once they have arrived."""
        with self._got:
            assert self._got.wait_for(lambda: len(self.lines) >= n, timeout), "no request reached the fake server"
            return [ln.split(" ", 1)[1] for ln in self.lines[:n]]

    def kill(self) -> float:
        """SIGKILL; returns the time it died."""
        self.proc.send_signal(signal.SIGKILL)
        died = time.monotonic()
        self.proc.wait(10)
        return died

    def freeze(self) -> float:
        """SIGSTOP (the process and its libzmq I/O thread stop answering); returns when."""
        self.proc.send_signal(signal.SIGSTOP)
        return time.monotonic()

    def stop(self) -> None:
        """End the process whatever its state (SIGTERM first, so the socket file goes)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        self.proc.stdout.close()


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    """Fake servers started by a test (append them); all are stopped afterwards."""
    started: list[FakeServer] = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for ipc socket files (paths must fit 107 bytes); nothing may be left in it."""
    d = Path(tempfile.mkdtemp(prefix="loomfo-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dead_endpoints(sock_dir: Path) -> list[str]:
    return [f"ipc://{sock_dir}/nobody.sock", f"tcp://127.0.0.1:{_free_tcp_port()}"]


def _expect_unavailable(fn, endpoint: str, within_s: float = 3.0) -> LoomError:
    t0 = time.monotonic()
    with pytest.raises(LoomError) as e:
        fn()
    took = time.monotonic() - t0
    assert e.value.kind == "unavailable", e.value.message
    assert endpoint in e.value.message and "unavailable" in e.value.message
    assert took < within_s, f"took {took:.2f} s"
    return e.value


def _assert_clean_stream(chunks: list[dict], ids: list[int]) -> None:
    """Each chunk extends the previous one (no repeat, nothing skipped); the last is the whole output."""
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"]) and len(b["text"]) > len(a["text"]), (a["text"], b["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["output_ids"] == ids and chunks[-1]["text"] == _text(ids)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}


FULL = list(range(100, 100 + TOKENS))


# ---------------------------------------------------------------- nothing listening
@pytest.mark.parametrize("which", [0, 1], ids=["ipc", "tcp"])
@pytest.mark.parametrize("sp", [GREEDY, SAMPLED], ids=["retryable", "not_retryable"])
def test_never_there_sync_fails_within_3s(sock_dir, which, sp):
    endpoint = _dead_endpoints(sock_dir)[which]
    with LoomClient(endpoint, timeout_s=60) as c:
        err = _expect_unavailable(lambda: c.generate("hi", sampling_params=sp), endpoint)
        assert "never reached" in err.message and err.rid
        _expect_unavailable(c.health, endpoint)  # and every later call too
    assert not list(sock_dir.iterdir())


def test_text_utf8_cannot_encode_is_a_bad_request_before_anything_is_sent(sock_dir):
    """A lone surrogate (e.g. half of an emoji cut from a UTF-16 source) used to escape as UnicodeEncodeError."""
    endpoint = _dead_endpoints(sock_dir)[0]
    with LoomClient(endpoint, timeout_s=60) as c:
        with pytest.raises(LoomError) as e:
            c.generate("ab\ud83d", sampling_params=GREEDY)
        assert e.value.kind == "bad_request" and "lone surrogate (U+D83D at position 2)" in e.value.message

    async def scenario() -> None:
        async with AsyncLoomClient(endpoint, timeout_s=60) as c:
            with pytest.raises(LoomError, match="not valid Unicode"):
                await c.generate("\udfff", sampling_params=GREEDY)

    asyncio.run(scenario())
    assert not list(sock_dir.iterdir())


@pytest.mark.parametrize(
    ("sp", "field"), [({"seed": 2**64}, "seed"), ({"max_new_tokens": 10**23}, "max_new_tokens")], ids=["seed", "max"]
)
def test_an_integer_msgpack_cannot_hold_is_a_bad_request_naming_the_field(sock_dir, sp, field):
    """It used to escape as OverflowError ("can't serialize ints ..."), a traceback from generate.py."""
    endpoint = _dead_endpoints(sock_dir)[0]
    why = f"sampling_params.{field} is an integer outside -2**63 .. 2**64 - 1"
    with LoomClient(endpoint, timeout_s=60) as c:
        with pytest.raises(LoomError) as e:
            c.generate("hi", sampling_params=sp)
        assert e.value.kind == "bad_request" and why in e.value.message

    async def scenario() -> None:
        async with AsyncLoomClient(endpoint, timeout_s=60) as c:
            with pytest.raises(LoomError, match=why.replace("*", r"\*")):
                await c.generate("hi", sampling_params=sp)

    asyncio.run(scenario())
    assert not list(sock_dir.iterdir())


def test_every_request_field_is_a_client_argument_and_an_empty_rid_is_refused(sock_dir):
    """The README's request fields hold for the ZMQ client too: allow_special_tokens_in_content reaches the server
    (it could be set over HTTP only); rid "" is refused as the server refuses it (it was silently replaced)."""
    endpoint = f"ipc://{sock_dir}/capture.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    try:
        with LoomClient(endpoint, timeout_s=0.5, retry=False) as c:
            msgs = [{"role": "user", "content": "hi"}]
            with pytest.raises(LoomError):  # nobody answers: it times out after sending
                c.generate(messages=msgs, allow_special_tokens_in_content=True, rid="r1", sampling_params=GREEDY)
            with pytest.raises(LoomError, match="rid must not be empty") as e:
                c.generate("hi", rid="", sampling_params=GREEDY)
            assert e.value.kind == "bad_request"
        codec = Codec(ClientMsg)
        sent = []
        while router.poll(1000):
            sent.append(codec.decode(router.recv_multipart()[-1]))
        reqs = [m for m in sent if isinstance(m, GenerateReq)]
        assert [(r.rid, r.allow_special_tokens_in_content) for r in reqs] == [("r1", True)], sent
    finally:
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("which", [0, 1], ids=["ipc", "tcp"])
def test_never_there_async_fails_within_3s(sock_dir, which):
    endpoint = _dead_endpoints(sock_dir)[which]

    async def scenario() -> None:
        async with AsyncLoomClient(endpoint, timeout_s=60) as c:
            t0 = time.monotonic()
            outs = await asyncio.gather(
                c.generate("a", sampling_params=GREEDY),
                c.generate("b", sampling_params=SAMPLED, retry=True),
                return_exceptions=True,
            )
            assert time.monotonic() - t0 < 3.0
            for e in outs:
                assert isinstance(e, LoomError) and e.kind == "unavailable" and endpoint in e.message, e

    asyncio.run(scenario())


def test_server_starting_within_the_connect_timeout_is_used(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/late.sock"
    with LoomClient(endpoint, timeout_s=30) as c:
        threading.Timer(0.5, lambda: servers.append(FakeServer(endpoint))).start()
        assert c.generate("hi", sampling_params=SAMPLED)["output_ids"] == FULL


# ---------------------------------------------------------------- killed or frozen, no retry
def test_killed_mid_stream_without_retry_is_unavailable_not_timeout(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    srv = FakeServer(endpoint, hang_after=3)
    servers.append(srv)
    with LoomClient(endpoint, timeout_s=60) as c:
        it = c.generate("hi", sampling_params=SAMPLED, stream=True)  # sampled: not retried by default
        got = [next(it)["text"] for _ in range(3)]
        assert got[-1] == _text(FULL[:3])
        died = srv.kill()
        with pytest.raises(LoomError) as e:
            next(it)
        assert e.value.kind == "unavailable" and "not resubmitted" in e.value.message, e.value.message
        assert endpoint in e.value.message
        assert time.monotonic() - died < 3.0


@pytest.mark.parametrize("client", ["sync", "async"])
def test_killed_mid_request_with_retry_false_fails_fast(sock_dir, servers, client):
    endpoint = f"ipc://{sock_dir}/front.sock"
    srv = FakeServer(endpoint, hang_after=0)  # takes the request, never answers
    servers.append(srv)
    died: list[float] = []

    def killer() -> None:
        srv.wait_request()
        died.append(srv.kill())

    kill_thread = threading.Thread(target=killer, daemon=True)
    kill_thread.start()

    async def in_async() -> LoomError:
        async with AsyncLoomClient(endpoint, timeout_s=60, retry=False) as c:
            with pytest.raises(LoomError) as e:
                await c.generate("hi", sampling_params=GREEDY)
            return e.value

    if client == "sync":
        with LoomClient(endpoint, timeout_s=60) as c:
            with pytest.raises(LoomError) as e:
                c.generate("hi", sampling_params=GREEDY, retry=False)
        err = e.value
    else:
        err = asyncio.run(in_async())
    kill_thread.join(10)
    assert err.kind == "unavailable" and "retry is off" in err.message, err.message
    assert died and time.monotonic() - died[0] < 3.0


def test_frozen_server_is_noticed_by_heartbeats(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    srv = FakeServer(endpoint, hang_after=2)
    servers.append(srv)
    with LoomClient(endpoint, timeout_s=60, retry=False) as c:
        it = c.generate("hi", sampling_params=GREEDY, stream=True)
        next(it), next(it)
        frozen = srv.freeze()  # the socket stays open: only missing PONGs can tell
        with pytest.raises(LoomError) as e:
            next(it)
        took = time.monotonic() - frozen
    assert e.value.kind == "unavailable" and took < 3.0, (e.value.message, took)


# ---------------------------------------------------------------- killed and restarted: retry
def test_restart_resumes_a_stream_without_repeating_text(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    first = FakeServer(endpoint, hang_after=5)
    servers.append(first)
    with LoomClient(endpoint, timeout_s=60) as c:
        it = c.generate("hi", sampling_params=GREEDY, stream=True, rid="story-1")
        chunks = [next(it) for _ in range(5)]
        first.kill()
        threading.Timer(1.0, lambda: servers.append(FakeServer(endpoint, delay=0.02))).start()
        chunks += list(it)
    _assert_clean_stream(chunks, FULL)
    assert len(chunks) == TOKENS  # the 5 replayed chunks were not yielded again
    assert servers[1].wait_request() == ["story-1"]  # resubmitted under the same request id


def test_restart_gives_the_complete_result_sync_and_seeded(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    first = FakeServer(endpoint, hang_after=0)
    servers.append(first)

    def restart() -> None:
        first.wait_request()
        first.kill()
        time.sleep(0.5)
        servers.append(FakeServer(endpoint))

    threading.Thread(target=restart, daemon=True).start()
    with LoomClient(endpoint, timeout_s=60) as c:
        out = c.generate("hi", sampling_params={**SAMPLED, "seed": 7}, rid="seeded")  # seeded: retried
    assert out["output_ids"] == FULL and out["meta_info"]["id"] == "seeded"


def test_restart_async_stream_and_request_resume(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    first = FakeServer(endpoint, hang_after=4, delay=0.0)
    servers.append(first)

    async def scenario() -> tuple[list[dict], dict]:
        async with AsyncLoomClient(endpoint, timeout_s=60) as c:
            plain = asyncio.ensure_future(c.generate("x", sampling_params=SAMPLED, retry=True, rid="plain"))
            chunks: list[dict] = []
            async for chunk in c.generate_stream("y", sampling_params=GREEDY, rid="streamed"):
                chunks.append(chunk)
                if len(chunks) == 4:
                    first.wait_request(2)
                    first.kill()
                    threading.Timer(0.5, lambda: servers.append(FakeServer(endpoint))).start()
            return chunks, await asyncio.wait_for(plain, 30)

    chunks, plain = asyncio.run(scenario())
    _assert_clean_stream(chunks, FULL)
    assert len(chunks) == TOKENS
    assert plain["output_ids"] == FULL
    assert sorted(servers[1].wait_request(2)) == ["plain", "streamed"]


def test_resumed_stream_that_diverges_is_a_server_error(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    first = FakeServer(endpoint, hang_after=3)
    servers.append(first)
    with LoomClient(endpoint, timeout_s=60) as c:
        it = c.generate("hi", sampling_params=GREEDY, stream=True)
        [next(it) for _ in range(3)]
        first.kill()
        servers.append(FakeServer(endpoint, base=500))  # regenerates different tokens
        with pytest.raises(LoomError) as e:
            next(it)
    assert e.value.kind == "server_error" and "diverged" in e.value.message, e.value.message


def test_retry_window_ends_with_unavailable(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    first = FakeServer(endpoint, hang_after=0)
    servers.append(first)
    threading.Thread(target=lambda: (first.wait_request(), first.kill()), daemon=True).start()
    with LoomClient(endpoint, timeout_s=60, retry_window_s=1.0) as c:
        t0 = time.monotonic()
        with pytest.raises(LoomError) as e:
            c.generate("hi", sampling_params=GREEDY)
    assert e.value.kind == "unavailable" and "waiting to be resubmitted" in e.value.message, e.value.message
    assert time.monotonic() - t0 < 5.0


def test_health_after_the_server_died_is_unavailable(sock_dir, servers):
    endpoint = f"ipc://{sock_dir}/front.sock"
    srv = FakeServer(endpoint)
    servers.append(srv)
    with LoomClient(endpoint, timeout_s=60) as c:
        assert c.health()["message"] == "ok"
        srv.kill()
        _expect_unavailable(c.health, endpoint)


# ---------------------------------------------------------------- scripts/generate.py
@pytest.mark.parametrize("which", [0, 1], ids=["ipc", "tcp"])
def test_generate_script_to_a_dead_address_exits_1_within_5s(sock_dir, which):
    endpoint = ["ipc:///nonexistent.sock", f"tcp://127.0.0.1:{_free_tcp_port()}"][which]
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "generate.py"), "--endpoint", endpoint, "--text", "hi"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=sock_dir,
    )
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and endpoint in lines[0] and "unavailable" in lines[0], r.stderr
    assert took < 5.0, took
    assert not os.path.exists("/nonexistent.sock")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="fake Loom front door for these tests")
    ap.add_argument("cmd", choices=["serve"])
    ap.add_argument("endpoint")
    ap.add_argument("tokens", type=int)
    ap.add_argument("hang_after", type=int)
    ap.add_argument("base", type=int)
    ap.add_argument("delay", type=float)
    a = ap.parse_args()
    serve(a.endpoint, a.tokens, a.hang_after, a.base, a.delay)
