"""Fuzz the ZMQ front door: 4,000 random, truncated, mutated and oversized frames from several DEALERs while
real requests run. The front door neither crashes nor restarts, every real request gets its fault-free answer,
memory stays bounded (frames over ``MAX_FRAME_BYTES`` are refused at the socket) and nothing stays counted.

The fuzzers are subprocesses (``python tests/test_front_door_fuzz.py fuzz ENDPOINT SEED COUNT``) so that their
sending does not compete with the real client for the test process's GIL.
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ipc.messages import (  # noqa: E402
    AbortReq,
    ChatMessage,
    GenerateReq,
    HealthReq,
    ListLorasReq,
    LoadLoraReq,
    SamplingParams,
    UnloadLoraReq,
)
from ipc.sockets import MAX_FRAME_BYTES  # noqa: E402

FUZZERS = 4
FRAMES = 4_000
GREEDY = {"temperature": 0, "max_new_tokens": 24}
PROMPTS = [f"Fact number {i} about the sea:" for i in range(12)]
TAGS = ["GenerateReq", "AbortReq", "LoadLoraReq", "UnloadLoraReq", "ListLorasReq", "HealthReq", "GenerateOut", "Nope"]


# ---------------------------------------------------------------------------- the fuzzer (a subprocess)
def _valid(rng: random.Random) -> bytes:
    """A well-formed client message (some of them bad requests by value)."""
    enc = msgspec.msgpack.Encoder()
    k = rng.randrange(8)
    rid = f"f{rng.getrandbits(40):x}"
    if k == 0:
        sp = SamplingParams(max_new_tokens=rng.choice([1, 2, -5, 0, 10**9]), temperature=rng.choice([0.0, 1.0, -1.0]))
        return enc.encode(GenerateReq(text=rng.choice(["hi", "", "x" * 50]), sampling_params=sp, rid=rid))
    if k == 1:
        ids = [rng.randrange(-10, 60_000) for _ in range(rng.randrange(0, 40))]
        return enc.encode(GenerateReq(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=2), rid=rid))
    if k == 2:
        msgs = [ChatMessage(rng.choice(["user", "system", "robot"]), "hello") for _ in range(rng.randrange(0, 4))]
        return enc.encode(GenerateReq(messages=msgs, sampling_params=SamplingParams(max_new_tokens=2), rid=rid))
    if k == 3:
        return enc.encode(AbortReq(rng.choice([rid, "", "x" * 300])))
    if k == 4:
        return enc.encode(LoadLoraReq("a", "/nonexistent"))
    if k == 5:
        return enc.encode(UnloadLoraReq("a"))
    if k == 6:
        return enc.encode(rng.choice([HealthReq(), ListLorasReq()]))
    return enc.encode(GenerateReq(text="hi", lora_path=rng.choice(["", "nope"]), rid=rid))


def _junk_value(rng: random.Random, depth: int = 0) -> object:
    k = rng.randrange(8 if depth < 3 else 5)
    if k == 0:
        return rng.randrange(-(2**63), 2**63)
    if k == 1:
        return rng.random() * 10 ** rng.randrange(-5, 300)
    if k == 2:
        return "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(0, 20)))
    if k == 3:
        return rng.randbytes(rng.randrange(0, 20))
    if k == 4:
        return rng.choice([None, True, False])
    if k == 5:
        return [_junk_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    keys = ["type", "rid", "text", "input_ids", "messages", "sampling_params", "stream", "lora_path", "x"]
    return {rng.choice(keys): _junk_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


def fuzz_frame(rng: random.Random) -> list[bytes]:
    """One message (a list of frames) of a random kind."""
    k = rng.randrange(100)
    if k < 15:  # random bytes
        return [rng.randbytes(rng.randrange(0, 2000))]
    if k < 35:  # a truncated well-formed message
        f = _valid(rng)
        return [f[: rng.randrange(0, len(f))]]
    if k < 55:  # bit flips in a well-formed message
        f = bytearray(_valid(rng))
        for _ in range(rng.randrange(1, 4)):
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        return [bytes(f)]
    if k < 70:  # valid msgpack of the wrong shape, often with a real tag
        d = _junk_value(rng)
        if isinstance(d, dict) and rng.random() < 0.8:
            d["type"] = rng.choice(TAGS)
        return [msgspec.msgpack.encode(d)]
    if k < 80:  # a well-formed message (refused by value, or served)
        return [_valid(rng)]
    if k < 88:  # headers that promise far more than the frame holds
        head = rng.choice(
            [b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xf0", b"\xdf\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xff"]
        )
        return [
            rng.choice([b"", b"\x81\xa4type\xabGenerateReq\xa9input_ids"]) + head + rng.randbytes(rng.randrange(0, 64))
        ]
    if k < 92:  # several frames in one message
        return [_valid(rng) for _ in range(rng.randrange(2, 4))]
    if k < 97:  # large but under the bound: refused by size, cheaply
        n = rng.randrange(MAX_FRAME_BYTES // 4, MAX_FRAME_BYTES - 1024)
        if rng.random() < 0.5:
            return [msgspec.msgpack.encode({"type": "GenerateReq", "rid": "big", "input_ids": [7] * (n - 64)})]
        return [msgspec.msgpack.encode({"type": "GenerateReq", "rid": "big", "text": "y" * (n - 64)})]
    # over the bound: libzmq closes the connection before anything is allocated (the DEALER reconnects)
    return [b"\x00" * rng.randrange(MAX_FRAME_BYTES + 1, 4 * MAX_FRAME_BYTES)]


def fuzz(endpoint: str, seed: int, count: int) -> None:
    """Send ``count`` fuzz messages from one DEALER, reading whatever comes back; prints ``sent N got M``."""
    import zmq

    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    got = 0

    def drain() -> None:
        nonlocal got
        while sock.poll(0):
            sock.recv_multipart()
            got += 1

    for i in range(count):
        sock.send_multipart(fuzz_frame(rng))
        if i % 20 == 0:
            drain()
            time.sleep(0.001)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        if sock.poll(200):
            drain()
    print(f"sent {count} got {got}", flush=True)
    sock.close()
    ctx.term()


# ---------------------------------------------------------------------------- the test
pytestmark = pytest.mark.slow


def _proc_status(pid: int, key: str) -> float:
    m = re.search(rf"{key}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024


async def _real_requests(endpoint: str, streamed: list[str], plain_: list[str]) -> list[tuple[str, list[int]]]:
    """Stream each of ``streamed`` and request each of ``plain_``, all at once: (kind, output ids) in order."""
    from ipc.client import AsyncLoomClient

    async with AsyncLoomClient(endpoint, timeout_s=120) as c:

        async def stream(p: str) -> tuple[str, list[int]]:
            last = None
            async for chunk in c.generate_stream(p, sampling_params=GREEDY):
                last = chunk
            return "stream", last["output_ids"]

        async def plain(p: str) -> tuple[str, list[int]]:
            await asyncio.sleep(random.random())
            return "plain", (await c.generate(p, sampling_params=GREEDY))["output_ids"]

        return await asyncio.gather(*(stream(p) for p in streamed), *(plain(p) for p in plain_))


def test_fuzzed_front_door_keeps_serving(tmp_path, model_path):
    from loom_helpers import launch_cluster

    with launch_cluster(tmp_path) as h:
        pid = h.children["tokenizer_proc"]
        fault_free = asyncio.run(_real_requests(h.endpoint, PROMPTS, []))
        reference = {p: ids for p, (_, ids) in zip(PROMPTS, fault_free, strict=True)}
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # measure the peak from here
        before = _proc_status(pid, "VmHWM")
        t0 = time.monotonic()
        fuzzers = [
            subprocess.Popen(
                [sys.executable, __file__, "fuzz", h.endpoint, str(seed), str(FRAMES // FUZZERS)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for seed in range(FUZZERS)
        ]
        try:
            outs = asyncio.run(_real_requests(h.endpoint, PROMPTS, PROMPTS))
            reports = [f.communicate(timeout=120)[0].strip() for f in fuzzers]
        finally:
            for f in fuzzers:
                f.kill()
                f.wait()
        took = time.monotonic() - t0
        grew = _proc_status(pid, "VmHWM") - before
        print(f"\nfuzzers: {reports} in {took:.1f} s; the front door's peak RSS grew by {grew:.0f} MiB")
        assert all(r.startswith(f"sent {FRAMES // FUZZERS} got ") for r in reports), reports
        assert [ids for _, ids in outs] == [reference[p] for p in PROMPTS] * 2
        assert grew < 400, f"the front door grew by {grew:.0f} MiB"
        with h.client() as c:
            deadline = time.monotonic() + 15
            while c.health()["running"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.health() == {"message": "ok", "running": 0}
        assert h.children["tokenizer_proc"] == pid and "tokenizer_proc ready" in h.log()
        assert h.log().count("tokenizer_proc ready") == 1, "the front door was restarted"
        assert "Traceback" not in h.log(), h.log()[-3000:]


if __name__ == "__main__" and sys.argv[1:2] == ["fuzz"]:
    fuzz(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
