"""The failover drill's workload: the requests of a round, sending them with a fault at a phase's moment,
and classifying each answer against the fault-free reference.

Imported by ``failover_drill.py``, which puts the repository on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from drill_cluster import DrillError, call_admin

from ipc.client import AsyncLoomClient, LoomClient, LoomError

PHASES = ("idle", "prefill", "decode", "lora-load")
DECODE_CHUNKS = 3  # the decode phase kills once a streamed request has this many chunks
LOAD_PREFIX = "drill-load-"
STATUSES = ("identical", "error", "hung", "wrong", "diverged")
PROMPTS: list[dict[str, Any]] = [
    {"text": "The capital of France is"},
    {"messages": [{"role": "user", "content": "Name three colours of the rainbow."}]},
    {"text": "Once upon a time"},
    {"text": "def add(a, b):"},
    {"text": "My favourite food is"},
    {"messages": [{"role": "user", "content": "What is two plus two?"}]},
    {"text": "The quick brown fox"},
]


@dataclass(frozen=True)
class ReqSpec:
    """One request of the workload; ``label`` is stable across rounds (the reference is keyed by it)."""

    label: str
    kwargs: dict[str, Any] = field(hash=False)
    stream: bool
    lora: str | None


def build_workload(adapters: list[str], base_requests: int, new_tokens: int) -> list[ReqSpec]:
    """One greedy request per adapter, ``base_requests`` greedy base ones and one seeded sampled one,
    alternately streamed (the first is streamed)."""
    greedy = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    seeded = {"max_new_tokens": new_tokens, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    jobs: list[tuple[str, str | None, dict[str, Any]]] = [(f"lora:{a}", a, greedy) for a in sorted(adapters)]
    jobs += [(f"base:{i}", None, greedy) for i in range(base_requests)]
    jobs.append(("seeded", None, seeded))
    out = []
    for i, (label, lora, sp) in enumerate(jobs):
        kw = {**PROMPTS[i % len(PROMPTS)], "sampling_params": dict(sp), "lora_path": lora}
        out.append(ReqSpec(label, kw, i % 2 == 0, lora))
    return out


@dataclass
class ReqRecord:
    """What one request got: every chunk ``(wall time, text, output ids)``, an error, or nothing (hung)."""

    spec: ReqSpec
    chunks: list[tuple[float, str, list[int]]] = field(default_factory=list)
    error: LoomError | None = None
    hung: bool = False
    done: bool = False


@dataclass
class KillInfo:
    """One kill: which process, when (wall clock), where the cluster log stood, and whether it came too late
    (``late``: every request had already finished, so the phase's moment never came)."""

    name: str
    pid: int
    signal: str
    wall: float  # time.time() just before the signal was sent
    log_offset: int
    mono: float = 0.0  # time.monotonic() just before the signal was sent
    ok: bool = True
    error: str = ""
    late: bool = False


@dataclass
class LoadRecord:
    """The adapter load of a ``lora-load`` round."""

    name: str
    path: str
    status: str = "pending"  # ok | error | hung
    detail: str = ""
    in_flight_at_kill: bool | None = None
    unloaded: bool = False


async def drive(
    endpoint: str,
    reqs: list[ReqSpec],
    timeout_s: float,
    phase: str | None = None,
    fire: Callable[[], KillInfo] | None = None,
    load: LoadRecord | None = None,
    prefill_delay_s: float = 0.0,
    load_delay_s: float = 0.02,
    after: Callable[[KillInfo], Awaitable[None]] | None = None,
) -> tuple[list[ReqRecord], KillInfo | None]:
    """Run the workload once; with ``phase`` and ``fire``, call ``fire()`` once at that phase's moment, and then
    run ``after(kill)`` alongside the requests (the launcher target: watch its children go, start a fresh
    cluster); returns once the requests and ``after`` are done."""
    recs = [ReqRecord(s) for s in reqs]
    client = AsyncLoomClient(endpoint, timeout_s=timeout_s + 30)
    decoding = asyncio.Event()
    kill: list[KillInfo] = []
    followers: list[asyncio.Future[None]] = []

    def do_kill() -> None:
        if fire is not None and not kill:
            kill.append(fire())
            if after is not None:
                followers.append(asyncio.ensure_future(after(kill[0])))

    async def one(rec: ReqRecord) -> None:
        if rec.spec.stream:
            stream = client.generate_stream(**rec.spec.kwargs)
            try:
                async for ch in stream:
                    rec.chunks.append((time.time(), ch["text"], list(ch["output_ids"])))
                    if len(rec.chunks) >= DECODE_CHUNKS:
                        decoding.set()
            finally:
                await stream.aclose()  # at once (it aborts the request), not when garbage-collected
        else:
            out = await client.generate(**rec.spec.kwargs)
            rec.chunks.append((time.time(), out["text"], list(out["output_ids"])))

    async def guarded(rec: ReqRecord) -> None:
        try:
            await asyncio.wait_for(one(rec), timeout_s)
            rec.done = True
        except asyncio.TimeoutError:
            rec.hung = True
        except LoomError as e:
            if e.kind == "timeout":
                rec.hung = True
            else:
                rec.error = e

    try:
        if phase is not None:
            await _connect(client, timeout_s)
        if phase == "idle":
            do_kill()
        tasks = [asyncio.ensure_future(guarded(r)) for r in recs]
        everything = asyncio.ensure_future(asyncio.gather(*tasks))
        load_task = None
        if phase == "prefill":
            await asyncio.sleep(prefill_delay_s)  # every task has sent its request by the first yield
            do_kill()
        elif phase == "decode":
            waiter = asyncio.ensure_future(decoding.wait())
            await asyncio.wait({waiter, everything}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            do_kill()
            if kill:
                kill[0].late = everything.done()
        elif phase == "lora-load" and load is not None:
            started = threading.Event()
            load_task = asyncio.ensure_future(asyncio.to_thread(_load_adapter, endpoint, load, timeout_s, started))
            while not started.is_set():
                await asyncio.sleep(0.002)
            await asyncio.sleep(load_delay_s)
            load.in_flight_at_kill = not load_task.done()
            do_kill()
        elif phase is not None:
            do_kill()
        await everything
        if load_task is not None:
            await load_task
        for f in followers:
            await f
    finally:
        for f in followers:
            f.cancel()
        client.close()
    return recs, (kill[0] if kill else None)


async def _connect(client: AsyncLoomClient, timeout_s: float) -> None:
    """Send a one-token request so the client is connected before the fault, as a long-lived client is (one
    that never reached the server fails after its connect timeout, without resubmitting: see ipc.client)."""
    try:
        sp = {"max_new_tokens": 1, "temperature": 0}
        await asyncio.wait_for(client.generate(text="hi", sampling_params=sp), timeout_s)
    except (LoomError, asyncio.TimeoutError) as e:
        raise DrillError(f"the warm-up request before the fault failed: {e or 'no answer'}") from e


def _load_adapter(endpoint: str, load: LoadRecord, timeout_s: float, started: threading.Event) -> None:
    """Load ``load.path`` as ``load.name`` (run in a thread: the blocking client has the admin calls)."""
    try:
        with LoomClient(endpoint, timeout_s=timeout_s) as c:
            started.set()
            c.load_lora_adapter(load.name, load.path)
        load.status = "ok"
    except LoomError as e:
        load.status = "hung" if e.kind == "timeout" else "error"
        load.detail = f"{e.kind}: {e}"
    finally:
        started.set()


def classify(rec: ReqRecord, ref: ReqRecord, strict: bool) -> tuple[str, str]:
    """``(status, detail)``: identical | error | hung | wrong | diverged, compared with the reference."""
    if rec.hung or not (rec.done or rec.error):
        return "hung", "no answer"
    for (_, a, ia), (_, b, ib) in zip(rec.chunks, rec.chunks[1:], strict=False):
        if not b.startswith(a) or ib[: len(ia)] != ia:
            return "wrong", f"stream went back: {a!r} -> {b!r}"
    if rec.error is not None:
        return "error", f"{rec.error.kind}: {rec.error}"
    _, text, ids = rec.chunks[-1]
    _, rtext, rids = ref.chunks[-1]
    if ids == rids and text == rtext:
        return "identical", ""
    n = next((i for i, (x, y) in enumerate(zip(ids, rids, strict=False)) if x != y), min(len(ids), len(rids)))
    detail = f"tokens differ from token {n} on: {text!r} vs reference {rtext!r}"
    return ("wrong" if strict else "diverged"), detail


def adapter_uids(endpoint: str) -> dict[str, str]:
    """``{name: uid}`` of the loaded adapters (the drill's own loads left out); waits out a front door that is
    down for a few seconds (restarting)."""
    loras = call_admin(endpoint, lambda c: c.list_loras())
    return {a["name"]: a["uid"] for a in loras if not a["name"].startswith(LOAD_PREFIX)}


def probe_never_loaded(endpoint: str, name: str) -> bool:
    """Whether a request for adapter ``name`` fails with the never-been-loaded error."""
    sp = {"max_new_tokens": 1, "temperature": 0}
    try:
        call_admin(endpoint, lambda c: c.generate(text="hi", lora_path=name, sampling_params=sp))
    except LoomError as e:
        return e.kind == "not_found" and f"never been loaded: {name}" in str(e)
    return False
