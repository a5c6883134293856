#!/usr/bin/env python
"""Failover drills: start a Loom cluster, keep a mixed load running, kill a process, check every request.

    python scripts/failover_drill.py --rounds 10 --targets 'gpu_worker[0],gpu_worker[1]' --signals KILL \\
        --phases idle,prefill,decode,lora-load --new-tokens 12 -- \\
        --tp-size 2 --enable-lora --lora-paths a=/path/to/adapter b=/path/to/other --step-timeout 3

Everything after ``--`` is passed to ``launch.py`` as is (the drill adds its own private ``--zmq-endpoint``,
and ``--crash-loop-deaths ROUNDS+1`` unless you pass that flag, so its own kills never count as a crash loop).

First the drill runs the workload once without a fault: the reference. The workload is one greedy request per
adapter that ``list_loras`` shows, ``--base-requests`` greedy base-model requests and one seeded sampled request
(temperature 0.8, seed 7), every one with ``ignore_eos`` and ``--new-tokens`` tokens, half of them streamed.
Then each round

1. waits until the cluster is healthy and the current TP group's worker pids are known,
2. sends the workload and sends ``--signals`` to ``--targets`` at a ``--phases`` moment:
   ``idle`` (kill first, then submit: the requests wait for the new group), ``prefill`` (submit, then kill at
   once), ``decode`` (kill once a streamed request has 3 chunks) or ``lora-load`` (a copy of an adapter is loaded
   under a new name concurrently with the workload, and the kill lands while the load is in flight; the load
   must succeed or fail with a clear error, and is unloaded afterwards),
3. checks every request against the reference: ``identical``, ``error`` (failed with a clear LoomError, such as
   ``not_found`` "never been loaded" for an adapter a restart lost, or ``unavailable`` for a lost connection),
   ``hung`` (no answer within ``--request-timeout``) or ``wrong`` (other tokens, or a stream whose chunks are not
   each a prefix of the next), and whether the adapters kept their uids (restored) or were lost (then a request
   for one must fail with the never-been-loaded error).

Targets: ``gpu_worker[N]`` (a TP rank), ``random`` (a rank drawn with the seeded RNG), and ``scheduler_proc``,
``tokenizer_proc`` (restarted by the launcher) and ``launcher``.
Signals: KILL, TERM, SEGV, STOP (STOP = a hang, found by the scheduler's ``--step-timeout`` / ``--lora-op-timeout``:
pass a small ``--step-timeout``, e.g. 3, through), or any other signal name. Lists cycle (phases fastest, then
targets, so every target meets every phase; signals cycle on their own) or, with ``--draw random``, are drawn
with ``--seed``; ``NAME*N`` repeats an entry (``--signals 'KILL*9,STOP'``: one hang every ten rounds).

bf16 / fp16: greedy output can depend on the batch's composition, and a resumed request is re-prefilled in a
different batch, so with ``--dtype bfloat16`` or ``float16`` a request whose tokens differ from the reference
counts as ``diverged`` (reported, not a failure); with ``float32`` or ``auto`` it counts as ``wrong``.

Prints one row per round and a summary (``--json``: one JSON object instead, the table goes to stderr). Exits 1
if any request hung or was wrong, or the cluster died (a crash loop, or a target whose death stops it), 2 for
bad flags. Nothing is left behind: no process, socket file or temp folder (the cluster log only with ``--log``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ipc.client import AsyncLoomClient, LoomClient, LoomError  # noqa: E402

PHASES = ("idle", "prefill", "decode", "lora-load")
SERVICE_TARGETS = ("scheduler_proc", "tokenizer_proc", "launcher")
DECODE_CHUNKS = 3  # the decode phase kills once a streamed request has this many chunks
LOAD_PREFIX = "drill-load-"
STRICT_DTYPES = ("float32", "auto")
PROMPTS: list[dict[str, Any]] = [
    {"text": "The capital of France is"},
    {"messages": [{"role": "user", "content": "Name three colours of the rainbow."}]},
    {"text": "Once upon a time"},
    {"text": "def add(a, b):"},
    {"text": "My favourite food is"},
    {"messages": [{"role": "user", "content": "What is two plus two?"}]},
    {"text": "The quick brown fox"},
]
_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_RESTART = re.compile(r"restarting the TP group as epoch (\d+)")
_HUNG = re.compile(r"TP group epoch (\d+) is hung")
_SERVICE_RESTART = re.compile(r"(\S+) exited with code .*; restarting it as incarnation (\d+)")
_UP = re.compile(r"TP group epoch \d+ is up in ([\d.]+) s|\S+ is back \(pid \d+\) in ([\d.]+) s")
_SERVING = re.compile(
    r"TP group epoch (\d+) serving again: (\d+) requests resumed, adapters restored \[(.*?)\], lost \[(.*?)\] "
    r"\(([\d.]+) s\)"
)
_STOPPING = re.compile(r"exited with code .*; stopping the cluster|failed \d+ times within|received; shutting down")
_DETECT = (_RESTART, _HUNG, _SERVICE_RESTART, _STOPPING)


class DrillError(RuntimeError):
    """The drill cannot go on (the cluster did not start, or its reference run failed)."""


class ClusterDied(RuntimeError):
    """The launcher exited: the cluster is gone."""


# ----------------------------------------------------------------------------- processes (Linux /proc)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def pid_state(pid: int) -> str | None:
    """The process state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...) or None if there is none."""
    f = _stat_fields(pid)
    return f[0] if f else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    return pid_state(pid) not in (None, "Z")


def cmdline(pid: int) -> list[str]:
    """The argument vector of ``pid`` (empty if it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def children_of(ppid: int) -> list[int]:
    """Direct children of ``ppid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            f = _stat_fields(int(d.name))
            if f and int(f[1]) == ppid:
                out.append(int(d.name))
    return out


# ----------------------------------------------------------------------------- the cluster log


def log_time(line: str) -> float | None:
    """Wall-clock seconds of a log line's ``%(asctime)s`` prefix (local time, ms), or None."""
    m = _TS.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class LogFacts:
    """What the cluster log says happened after a kill."""

    detect_line: str = ""
    detect_wall: float | None = None
    up_s: float | None = None  # launcher: "TP group epoch N is up in X s" (or "NAME is back (pid P) in X s")
    serving_s: float | None = None  # scheduler: "... serving again ... (X s)"
    resumed: int | None = None
    restored_log: str = ""
    lost_log: str = ""
    stopping_line: str = ""


def scan_log(text: str) -> LogFacts:
    """The first detection, group-up, serving-again and cluster-stopping lines in ``text``."""
    f = LogFacts()
    for line in text.splitlines():
        if not f.detect_line and any(p.search(line) for p in _DETECT):
            f.detect_line, f.detect_wall = line, log_time(line)
        if f.up_s is None and (m := _UP.search(line)):
            f.up_s = float(m.group(1) or m.group(2))
        if f.serving_s is None and (m := _SERVING.search(line)):
            f.resumed, f.restored_log, f.lost_log = int(m.group(2)), m.group(3), m.group(4)
            f.serving_s = float(m.group(5))
        if not f.stopping_line and _STOPPING.search(line):
            f.stopping_line = line
    return f


# ----------------------------------------------------------------------------- the cluster


class Cluster:
    """A ``launch.py`` started by the drill: its own session, a private endpoint, its log in a file."""

    def __init__(self, flags: list[str], tp_size: int, work: Path, log_path: Path) -> None:
        self.flags = flags
        self.tp_size = tp_size
        self.work = work
        self.endpoint = f"ipc://{work}/front.sock"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.config_file = ""
        self.seen: dict[int, str] = {}  # every child pid ever seen -> its name

    # -------------------------------------------------------------- start / stop
    def start(self, ready_timeout_s: float) -> None:
        """Start launch.py and wait for "Loom ready:". Raises DrillError with the log's tail if it fails."""
        cmd = [sys.executable, str(REPO / "launch.py"), "--zmq-endpoint", self.endpoint, *self.flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as logf:  # from empty: epochs are read from the log
            self.proc = subprocess.Popen(
                cmd, cwd=str(REPO), stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=_launcher_preexec
            )
        deadline = time.monotonic() + ready_timeout_s
        while "Loom ready:" not in self.log():
            self.children()
            if self.proc.poll() is not None:
                raise DrillError(f"launch.py exited with code {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise DrillError(f"launch.py did not print 'Loom ready:' within {ready_timeout_s:g} s")
            time.sleep(0.2)
        self.children()

    def stop(self) -> None:
        """Stop the cluster (SIGINT, then SIGKILL for stragglers) and remove its sockets and config folder."""
        if self.proc is None:
            return
        for pid in self._ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a rank left stopped would hold up the launcher's shutdown
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while self._ours() and time.monotonic() < deadline:  # children stop on their own once the launcher is gone
            time.sleep(0.1)
        for pid in self._ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.config_file:
            shutil.rmtree(Path(self.config_file).parent, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.endpoint[len("ipc://") :])

    def _ours(self) -> list[int]:
        """Child pids seen so far that still run this cluster's config (never a reused pid)."""
        return [p for p in self.seen if pid_alive(p) and self.config_file and self.config_file in cmdline(p)]

    # -------------------------------------------------------------- state
    def alive(self) -> bool:
        """Whether the launcher still runs."""
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        """The cluster log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        """Bytes in the cluster log now (where a later :meth:`log_since` starts)."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        """The cluster log from byte ``offset`` on."""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def epoch(self) -> int:
        """The TP group epoch the launcher last started (1 until the first restart)."""
        return max((int(m.group(1)) for m in _RESTART.finditer(self.log())), default=1)

    def children(self) -> dict[str, tuple[int, int]]:
        """``{name: (pid, epoch)}`` of the launcher's children now (worker names ``gpu_worker[N]``)."""
        out: dict[str, tuple[int, int]] = {}
        if self.proc is None:
            return out
        for pid in children_of(self.proc.pid):
            cmd = cmdline(pid)
            if "--config-file" not in cmd:
                continue
            self.config_file = cmd[cmd.index("--config-file") + 1]
            epoch = int(cmd[cmd.index("--epoch") + 1]) if "--epoch" in cmd else 0
            if "gpu_worker.main" in cmd:
                name = f"gpu_worker[{cmd[cmd.index('--rank') + 1]}]"
            else:
                name = next((m.split(".")[0] for m in cmd if m.endswith("_proc.main")), f"pid{pid}")
            if name in out and out[name][1] >= epoch:
                continue
            out[name] = (pid, epoch)
            self.seen[pid] = name
        return out

    def workers_ready(self) -> dict[str, int] | None:
        """Worker pids of the current epoch if every rank runs (none stopped), else None."""
        epoch = self.epoch()
        kids = self.children()
        out = {}
        for r in range(self.tp_size):
            pid, e = kids.get(f"gpu_worker[{r}]", (0, -1))
            if e != epoch or pid_state(pid) not in ("R", "S", "D"):
                return None
            out[f"gpu_worker[{r}]"] = pid
        return out

    def died(self) -> ClusterDied:
        """A ClusterDied naming the launcher's exit code and the log line that says why."""
        code = self.proc.poll() if self.proc else None
        how = f"was killed by {signal.Signals(-code).name}" if code and code < 0 else f"exited with code {code}"
        why = scan_log(self.log()).stopping_line or "no reason in the log"
        return ClusterDied(f"launch.py {how}: {why.strip()}")

    def wait_serving(self, timeout_s: float) -> dict[str, int]:
        """Wait until health says ok and every rank of the current epoch runs; returns ``{name: pid}`` of every
        child. Raises ClusterDied if the launcher exits, DrillError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        why = ""
        while True:
            if not self.alive():
                raise self.died()
            workers = self.workers_ready()
            if workers is None:
                why = "not every rank of the current TP group epoch is running"
            else:
                try:
                    with LoomClient(self.endpoint, timeout_s=5) as c:
                        c.health()
                    kids = {n: p for n, (p, _) in self.children().items()}
                    return {**kids, **workers}
                except LoomError as e:
                    why = f"health: {e}"
            if time.monotonic() > deadline:
                raise DrillError(f"the cluster did not become healthy within {timeout_s:g} s ({why})")
            time.sleep(0.2)


def _launcher_preexec() -> None:
    """In the launcher before exec: its own session, and SIGTERM (a clean stop) if the drill dies."""
    os.setsid()
    from ipc.proc import set_parent_death_signal

    set_parent_death_signal()


# ----------------------------------------------------------------------------- the workload


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
) -> tuple[list[ReqRecord], KillInfo | None]:
    """Run the workload once; with ``phase`` and ``fire``, call ``fire()`` once at that phase's moment."""
    recs = [ReqRecord(s) for s in reqs]
    client = AsyncLoomClient(endpoint, timeout_s=timeout_s + 30)
    decoding = asyncio.Event()
    kill: list[KillInfo] = []

    def do_kill() -> None:
        if fire is not None and not kill:
            kill.append(fire())

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
    finally:
        client.close()
    return recs, (kill[0] if kill else None)


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


# ----------------------------------------------------------------------------- rounds


@dataclass
class Plan:
    """What one round does."""

    round: int
    target: str
    signal: str
    phase: str


@dataclass
class RoundResult:
    """Everything measured in one round (the JSON output holds these as they are)."""

    round: int
    target: str
    process: str
    pid: int
    signal: str
    phase: str
    epoch_before: int
    kill_time: str = ""  # local wall clock, like the log's timestamps
    epoch_after: int | None = None
    detected: bool = False
    detect_s: float | None = None
    detect_line: str = ""
    first_token_s: float | None = None
    group_up_s: float | None = None
    serving_again_s: float | None = None
    resumed: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    adapters_restored: list[str] = field(default_factory=list)
    adapters_lost: list[str] = field(default_factory=list)
    adapters_lost_surfaced: list[str] = field(default_factory=list)
    adapters_uid_changed: list[str] = field(default_factory=list)
    load: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


STATUSES = ("identical", "error", "hung", "wrong", "diverged")


def expand(spec: str) -> list[str]:
    """``"A*2,B"`` -> ``["A", "A", "B"]``."""
    out: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, times = item.partition("*")
        out += [name.strip()] * (int(times) if times else 1)
    return out


def make_plans(n: int, targets: list[str], signals: list[str], phases: list[str], draw: str, seed: int) -> list[Plan]:
    """The rounds: lists cycle (phases fastest, then targets; signals on their own), or are drawn at random."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        if draw == "random":
            plans.append(Plan(i + 1, rng.choice(targets), rng.choice(signals), rng.choice(phases)))
        else:
            t = targets[(i // len(phases)) % len(targets)]
            plans.append(Plan(i + 1, t, signals[i % len(signals)], phases[i % len(phases)]))
    return plans


def adapter_uids(endpoint: str) -> dict[str, str]:
    """``{name: uid}`` of the loaded adapters (the drill's own loads left out)."""
    with LoomClient(endpoint, timeout_s=60) as c:
        return {a["name"]: a["uid"] for a in c.list_loras() if not a["name"].startswith(LOAD_PREFIX)}


def probe_never_loaded(endpoint: str, name: str) -> bool:
    """Whether a request for adapter ``name`` fails with the never-been-loaded error."""
    try:
        with LoomClient(endpoint, timeout_s=60) as c:
            c.generate(text="hi", lora_path=name, sampling_params={"max_new_tokens": 1, "temperature": 0})
    except LoomError as e:
        return e.kind == "not_found" and f"never been loaded: {name}" in str(e)
    return False


class Drill:
    """The rounds against one cluster, and what they found."""

    def __init__(self, cluster: Cluster, a: argparse.Namespace, strict: bool, lora_root: str) -> None:
        self.c = cluster
        self.a = a
        self.strict = strict
        self.lora_root = lora_root
        self.rng = random.Random(a.seed)
        self.ref: dict[str, ReqRecord] = {}
        self.workload_all: list[ReqSpec] = []
        self.load_source = ""
        self.rounds: list[RoundResult] = []
        self.died: str | None = None
        self.error: str | None = None  # why the rounds stopped early (other than the cluster dying)
        self.cleanup_dirs: list[str] = []  # the copy of an adapter the lora-load phase loads

    def reference(self) -> None:
        """Run the workload once without a fault; every later round is compared with it."""
        self.c.wait_serving(self.a.recover_timeout)
        loras = adapter_uids(self.c.endpoint)
        self.workload_all = build_workload(list(loras), self.a.base_requests, self.a.new_tokens)
        recs, _ = asyncio.run(drive(self.c.endpoint, self.workload_all, self.a.request_timeout))
        bad = [f"{r.spec.label}: {r.error or 'no answer'}" for r in recs if not r.done]
        if bad:
            raise DrillError(f"the fault-free reference run failed: {'; '.join(bad)}")
        self.ref = {r.spec.label: r for r in recs}
        if "lora-load" in self.a.phase_list:
            with LoomClient(self.c.endpoint, timeout_s=60) as c:
                src = sorted(c.list_loras(), key=lambda x: x["name"])
            if not src:
                raise DrillError("phase lora-load needs an adapter to copy: pass --enable-lora --lora-paths ...")
            parent = tempfile.mkdtemp(prefix="loom-drill-adapter-", dir=self.lora_root or self.c.work)
            self.load_source = str(Path(parent) / "copy")
            shutil.copytree(src[0]["path"], self.load_source)
            self.cleanup_dirs.append(parent)

    def resolve(self, target: str, pids: dict[str, int]) -> tuple[str, int]:
        """The process name and pid that ``target`` means now."""
        if target == "random":
            target = f"gpu_worker[{self.rng.randrange(self.c.tp_size)}]"
        if target == "launcher":
            assert self.c.proc is not None
            return target, self.c.proc.pid
        if target not in pids:
            raise DrillError(f"no process {target} in the cluster (running: {sorted(pids)})")
        return target, pids[target]

    def run_round(self, plan: Plan) -> RoundResult:
        """One round: wait for a healthy cluster, run the workload with the kill, check everything."""
        pids = self.c.wait_serving(self.a.recover_timeout)
        name, pid = self.resolve(plan.target, pids)
        before = adapter_uids(self.c.endpoint)
        res = RoundResult(plan.round, plan.target, name, pid, plan.signal, plan.phase, self.c.epoch())
        reqs = [s for s in self.workload_all if s.lora is None or s.lora in before]
        sig = signal.Signals[f"SIG{plan.signal}"]

        def fire() -> KillInfo:
            info = KillInfo(name, pid, plan.signal, time.time(), self.c.log_size())
            try:
                os.kill(pid, sig)
            except OSError as e:
                info.ok, info.error = False, str(e)
            return info

        load = None
        if plan.phase == "lora-load":
            load = LoadRecord(f"{LOAD_PREFIX}{plan.round}", self.load_source)
        recs, kill = asyncio.run(
            drive(
                self.c.endpoint,
                reqs,
                self.a.request_timeout,
                plan.phase,
                fire,
                load,
                self.a.prefill_delay,
                self.a.load_delay,
            )
        )
        assert kill is not None
        res.kill_time = datetime.fromtimestamp(kill.wall).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        if not kill.ok:
            res.notes.append(f"kill failed: {kill.error}")
        if kill.late:
            res.notes.append("no streamed request reached the decode trigger: the kill came after the workload")
        try:
            self._settle(res, kill, before, load)
        except ClusterDied as e:
            self.died = str(e)
            res.notes.append(f"cluster died: {e}")
        except (DrillError, LoomError) as e:
            self.error = str(e)
            res.notes.append(f"cannot go on: {e}")
        self._score(res, recs, kill)
        if load is not None:
            res.load = asdict(load)
            if load.status == "hung":
                res.counts["hung"] += 1
                res.notes.append(f"load of {load.name} got no answer")
            elif load.status == "error":
                res.notes.append(f"load of {load.name} failed: {load.detail}")
            if load.in_flight_at_kill is False:
                res.notes.append("the load had finished before the kill")
            elif load.status == "ok":
                res.notes.append(f"load of {load.name} ok (in flight at the kill)")
        return res

    def _settle(self, res: RoundResult, kill: KillInfo, before: dict[str, str], load: LoadRecord | None) -> None:
        """After the requests: let the cluster recover, then compare the adapters with ``before``."""
        if kill.signal != "STOP":
            deadline = time.monotonic() + 10
            while pid_alive(kill.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        if pid_state(kill.pid) == "T":
            os.kill(kill.pid, signal.SIGCONT)
            res.notes.append(f"{kill.name} was still stopped after the round (hang never detected); sent SIGCONT")
        elif pid_alive(kill.pid) and kill.ok and kill.signal != "STOP":
            res.notes.append(f"{kill.name} survived SIG{kill.signal}")
        if not self.c.alive():
            raise self.c.died()
        self.c.wait_serving(self.a.recover_timeout)
        res.epoch_after = self.c.epoch()
        after = adapter_uids(self.c.endpoint)
        res.adapters_restored = sorted(n for n, u in before.items() if after.get(n) == u)
        res.adapters_uid_changed = sorted(n for n, u in before.items() if n in after and after[n] != u)
        res.adapters_lost = sorted(n for n in before if n not in after)
        res.adapters_lost_surfaced = [n for n in res.adapters_lost if probe_never_loaded(self.c.endpoint, n)]
        for n in res.adapters_uid_changed:
            res.notes.append(f"adapter {n} came back under a new uid")
        for n in sorted(set(res.adapters_lost) - set(res.adapters_lost_surfaced)):
            res.notes.append(f"adapter {n} is gone but a request for it did not fail with 'never been loaded'")
        if load is not None and load.status == "ok":
            with LoomClient(self.c.endpoint, timeout_s=self.a.request_timeout) as c:
                if not any(x["name"] == load.name for x in c.list_loras()):
                    res.notes.append(f"{load.name} loaded ok but is not listed")
                    return
                try:
                    c.unload_lora_adapter(load.name)
                    load.unloaded = True
                except LoomError as e:
                    res.notes.append(f"unload of {load.name} failed: {e.kind}: {e}")

    def _score(self, res: RoundResult, recs: list[ReqRecord], kill: KillInfo) -> None:
        """Classify every request; detection and kill-to-first-token from the log and the chunk times."""
        facts = scan_log(self.c.log_since(kill.log_offset))
        res.detect_line = facts.detect_line.strip()
        if facts.detect_wall is not None:
            res.detected = True
            res.detect_s = round(facts.detect_wall - kill.wall, 3)
        res.group_up_s, res.serving_again_s, res.resumed = facts.up_s, facts.serving_s, facts.resumed
        # a chunk that left before the kill can still arrive just after it: count only chunks after detection
        since = max(kill.wall, facts.detect_wall or kill.wall)
        firsts = [t for r in recs for t, _, _ in r.chunks if t > since]
        res.first_token_s = round(min(firsts) - kill.wall, 3) if firsts else None
        res.counts = dict.fromkeys(STATUSES, 0)
        lost = set(res.adapters_lost)
        for r in recs:
            status, detail = classify(r, self.ref[r.spec.label], self.strict)
            if status == "error" and r.spec.lora in lost and r.error is not None and r.error.kind != "not_found":
                detail += " (its adapter was lost, but the error is not the never-been-loaded one)"
            res.counts[status] += 1
            res.requests.append({"label": r.spec.label, "stream": r.spec.stream, "status": status, "detail": detail})
            if status != "identical":
                res.notes.append(f"{r.spec.label}: {status} {detail}".strip())


# ----------------------------------------------------------------------------- output


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


HEADER = (
    f"{'round':>5}  {'target':<14} {'signal':<6} {'phase':<9} {'detect':>7} {'up':>7} {'1st tok':>8} "
    f"{'ident':>5} {'error':>5} {'hung':>4} {'wrong':>5} {'div':>3}  {'adapters':<16} notes"
)


def row(r: RoundResult) -> str:
    """One table row."""
    c = r.counts
    target = r.process if r.target != "random" else f"{r.process}*"
    n = len(r.adapters_restored) + len(r.adapters_lost) + len(r.adapters_uid_changed)
    ad = f"{len(r.adapters_restored)}/{n} kept" + (f", {len(r.adapters_lost)} lost" if r.adapters_lost else "")
    if r.epoch_after is None:  # the cluster never came back: nothing to compare
        ad = "-"
    notes = "; ".join(n.replace("\n", " ") for n in r.notes)
    return (
        f"{r.round:>5}  {target:<14} {r.signal:<6} {r.phase:<9} {_fmt(r.detect_s):>7} {_fmt(r.group_up_s):>7} "
        f"{_fmt(r.first_token_s):>8} {c.get('identical', 0):>5} {c.get('error', 0):>5} {c.get('hung', 0):>4} "
        f"{c.get('wrong', 0):>5} {c.get('diverged', 0):>3}  {ad:<16} {notes}"
    ).rstrip()


def summarize(rounds: list[RoundResult], died: str | None) -> dict[str, Any]:
    """Totals, median and worst detection / kill-to-first-token, and the verdict."""

    def stats(xs: list[float]) -> dict[str, float | None]:
        return {"median": statistics.median(xs) if xs else None, "worst": max(xs) if xs else None}

    totals = dict.fromkeys(STATUSES, 0)
    for r in rounds:
        for k, v in r.counts.items():
            totals[k] += v
    s: dict[str, Any] = {
        "rounds": len(rounds),
        "rounds_detected": sum(r.detected for r in rounds),
        "detect_s": stats([r.detect_s for r in rounds if r.detect_s is not None]),
        "first_token_s": stats([r.first_token_s for r in rounds if r.first_token_s is not None]),
        "group_up_s": stats([r.group_up_s for r in rounds if r.group_up_s is not None]),
        "requests": totals,
        "adapters_restored": sum(len(r.adapters_restored) for r in rounds),
        "adapters_lost": sum(len(r.adapters_lost) for r in rounds),
        "adapters_lost_surfaced": sum(len(r.adapters_lost_surfaced) for r in rounds),
        "adapters_uid_changed": sum(len(r.adapters_uid_changed) for r in rounds),
        "cluster_died": died,
    }
    s["ok"] = totals["hung"] == 0 and totals["wrong"] == 0 and died is None
    return s


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The summary as text."""
    d, f, u, t = s["detect_s"], s["first_token_s"], s["group_up_s"], s["requests"]
    lines = [
        f"rounds: {s['rounds']} ({s['rounds_detected']} detected in the log)",
        f"detection: median {_fmt(d['median'], ' s')}, worst {_fmt(d['worst'], ' s')}; "
        f"kill -> first token: median {_fmt(f['median'], ' s')}, worst {_fmt(f['worst'], ' s')}; "
        f"group up: median {_fmt(u['median'], ' s')}, worst {_fmt(u['worst'], ' s')}",
        f"requests: {t['identical']} identical, {t['error']} failed with a clear error, {t['hung']} hung, "
        f"{t['wrong']} wrong, {t['diverged']} diverged (bf16/fp16 only)",
        f"adapters: {s['adapters_restored']} restored under the same uid, {s['adapters_lost']} lost "
        f"({s['adapters_lost_surfaced']} surfaced as never loaded), {s['adapters_uid_changed']} with a new uid",
    ]
    if s["cluster_died"]:
        lines.append(f"CLUSTER DIED: {s['cluster_died']}")
    lines.append("result: " + ("PASS" if s["ok"] else "FAIL"))
    return lines


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The drill's own flags (``launch.py`` flags go after ``--``)."""
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] -- [launch.py flags]",
    )
    a = p.add_argument
    a("--rounds", type=int, default=10)
    a("--targets", default="gpu_worker[0]", help="comma list: gpu_worker[N], random, " + ", ".join(SERVICE_TARGETS))
    a("--signals", default="KILL", help="comma list of signal names: KILL, TERM, SEGV, STOP (a hang), ...")
    a("--phases", default=",".join(PHASES), help="comma list of " + ", ".join(PHASES))
    a("--draw", choices=["cycle", "random"], default="cycle", help="cycle through the lists or draw with --seed")
    a("--seed", type=int, default=0, help="seed of the random draws (--draw random, target 'random')")
    a("--new-tokens", type=int, default=12, help="tokens per request (ignore_eos), at least 4")
    a("--base-requests", type=int, default=2, help="greedy base-model requests per round")
    a("--request-timeout", type=float, default=120.0, help="a request without an answer this long is hung")
    a("--recover-timeout", type=float, default=180.0, help="seconds to wait for a healthy cluster between rounds")
    a("--ready-timeout", type=float, default=300.0, help="seconds to wait for the cluster to start")
    a("--prefill-delay", type=float, default=0.0, help="prefill phase: seconds between submitting and the kill")
    a("--load-delay", type=float, default=0.02, help="lora-load phase: seconds between sending the load and the kill")
    a("--log", default="", help="write the cluster log to this file and keep it (default: a temp file, removed)")
    a("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The drill's own arguments and the ``launch.py`` flags after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace, flags: list[str]) -> argparse.Namespace:
    """Validate the drill's flags and parse the launch flags; exits 2 (argparse) on a mistake."""
    import launch

    if any(f == "--zmq-endpoint" or f.startswith("--zmq-endpoint=") for f in flags):
        p.error("the drill chooses its own --zmq-endpoint; do not pass one")
    try:
        ns = launch.build_parser().parse_args(flags)
    except SystemExit:
        p.error("the launch.py flags after -- are not valid (see above)")
    a.targets_list, a.signal_list, a.phase_list = expand(a.targets), expand(a.signals), expand(a.phases)
    if not (a.targets_list and a.signal_list and a.phase_list):
        p.error("--targets, --signals and --phases need at least one entry each")
    for t in a.targets_list:
        m = re.fullmatch(r"gpu_worker\[(\d+)\]", t)
        if m is None and t not in ("random", *SERVICE_TARGETS):
            p.error(f"unknown target {t!r}: use gpu_worker[N], random, " + ", ".join(SERVICE_TARGETS))
        if m is not None and int(m.group(1)) >= ns.tp_size:
            p.error(f"target {t} does not exist at --tp-size {ns.tp_size}")
    for s in a.signal_list:
        if f"SIG{s}" not in signal.Signals.__members__:
            p.error(f"unknown signal {s!r} (use names without SIG: KILL, TERM, SEGV, STOP, ...)")
    for ph in a.phase_list:
        if ph not in PHASES:
            p.error(f"unknown phase {ph!r}: use " + ", ".join(PHASES))
    if "lora-load" in a.phase_list and not (ns.enable_lora and ns.lora_paths):
        p.error("phase lora-load needs --enable-lora and at least one --lora-paths adapter after --")
    if a.new_tokens < DECODE_CHUNKS + 1:
        p.error(f"--new-tokens must be at least {DECODE_CHUNKS + 1} (the decode phase kills after {DECODE_CHUNKS})")
    if a.rounds < 1 or a.base_requests < 0:
        p.error("--rounds must be at least 1 and --base-requests at least 0")
    a.launch = ns
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the drill; 0 when nothing hung or was wrong and the cluster survived, else 1 (2: bad flags)."""
    own, flags = split_argv(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = check_args(p, p.parse_args(own), flags)
    ns = a.launch
    if not any(f.startswith("--crash-loop-deaths") for f in flags):
        flags = [*flags, "--crash-loop-deaths", str(a.rounds + 1)]
    strict = ns.dtype in STRICT_DTYPES
    out = sys.stderr if a.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    work = Path(tempfile.mkdtemp(prefix="loom-drill-"))
    log_path = Path(a.log).resolve() if a.log else work / "cluster.log"
    cluster = Cluster(flags, ns.tp_size, work, log_path)
    drill = Drill(cluster, a, strict, ns.lora_root)
    plans = make_plans(a.rounds, a.targets_list, a.signal_list, a.phase_list, a.draw, a.seed)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    error = ""
    try:
        t0 = time.monotonic()
        cluster.start(a.ready_timeout)
        drill.reference()
        say(
            f"Loom failover drill: {a.rounds} rounds, tp_size={ns.tp_size}, dtype={ns.dtype} "
            f"({'tokens must match exactly' if strict else 'mismatches count as diverged'}), "
            f"{len(drill.workload_all)} requests x {a.new_tokens} tokens per round; cluster ready and reference "
            f"done in {time.monotonic() - t0:.1f} s; log: {log_path}"
        )
        say(HEADER)
        for plan in plans:
            r = drill.run_round(plan)
            drill.rounds.append(r)
            say(row(r))
            if drill.died or drill.error:
                break
        error = drill.error or ""
    except (DrillError, ClusterDied, LoomError) as e:
        error = str(e)
        if isinstance(e, ClusterDied):
            drill.died = error
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        tail = cluster.log().splitlines()[-40:]
        cluster.stop()
        for d in drill.cleanup_dirs:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    s = summarize(drill.rounds, drill.died)
    if error:
        s["ok"] = False
        s["error"] = error
    for line in summary_lines(s):
        say(line)
    if error and error != drill.died:
        say(f"error: {error}")
    if not s["ok"]:
        say("last lines of the cluster log:\n  " + "\n  ".join(tail))
    if a.json:
        doc = {
            "config": {
                "rounds": a.rounds,
                "targets": a.targets_list,
                "signals": a.signal_list,
                "phases": a.phase_list,
                "draw": a.draw,
                "seed": a.seed,
                "new_tokens": a.new_tokens,
                "tp_size": ns.tp_size,
                "dtype": ns.dtype,
                "strict": strict,
                "launch_flags": flags,
                "workload": [{"label": s.label, "stream": s.stream, "lora": s.lora} for s in drill.workload_all],
            },
            "cluster": {
                "launcher_pid": cluster.proc.pid if cluster.proc else None,
                "pids": {str(pid): name for pid, name in cluster.seen.items()},
                "config_file": cluster.config_file,
                "endpoint": cluster.endpoint,
                "work_dir": str(work),
                "log": str(log_path) if a.log else None,
            },
            "rounds": [asdict(r) for r in drill.rounds],
            "summary": s,
        }
        print(json.dumps(doc, indent=2), flush=True)
    return 0 if s["ok"] else 1


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
