"""Start-up micro-measurements that choose fast paths on the machine at hand (never by assumption)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gpu_worker.native_build import isa_caps

A = TypeVar("A", bool, int)  # a cached answer
log = logging.getLogger(__name__)


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` timed calls of ``fn`` after one warm-up call, in seconds (wall clock).

    The minimum, not the median: a start-up measurement compares two kernels, and on a shared machine
    other processes only ever add time.
    """
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@functools.cache
def _cpu_identity() -> str:
    """This CPU's ``model name`` and ``flags`` lines of /proc/cpuinfo ("" where there are none), read once."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            info = f.read()
        return " ".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))[:4000]
    return ""


def _choice_path(cache_dir: Path, name: str, key: str) -> Path:
    """Where ``name``'s answer for ``key`` is kept on this CPU (its model and flags, and any narrowing of the
    instruction set, :func:`~gpu_worker.native_build.isa_caps`, in the hash)."""
    flags = _cpu_identity()
    with contextlib.suppress(ValueError):  # a bad LOOM_MARCH built no kernel: nothing to choose between
        caps = isa_caps()
        if caps != "march=native":  # the native answers keep the files they had before LOOM_MARCH existed
            flags += "|" + caps
    digest = hashlib.sha256(f"{platform.machine()}|{flags}|{key}".encode()).hexdigest()[:16]
    return cache_dir / f"{name}-{digest}.json"


def _read_choice(path: Path) -> tuple[int, str] | None:
    """The answer and its note kept at ``path``; None for no file or a damaged one (measure again)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        doc = json.loads(path.read_text())
        # bool is an int too; one past +-2**62 would not survive the ranks' int64 vote
        if isinstance(doc["faster"], int) and abs(doc["faster"]) <= 1 << 62:
            return int(doc["faster"]), str(doc["how"])
    return None


def store_choice(cache_dir: Path, name: str, key: str, answer: int, how: str) -> bool:
    """Keep ``answer`` as ``name``'s answer for ``key``, written atomically. Returns False where it could not be
    written (an unwritable folder only costs the next start a measurement); leaves no partial file."""
    path = _choice_path(cache_dir, name, key)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"faster": answer, "how": how}))
        os.replace(tmp, path)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


WAIT_SHARE = 0.2  # a timing during which one of its threads waited for a core longer than this share was contended
ATTEMPTS = 3  # timings per choice at most, while the cores are taken
# where this cluster keeps the answers its TP group used (gpu_worker.main: a folder in the cluster's socket folder,
# removed with the cluster), and whether this group replaces a failed one: a replacement takes those answers, so
# it runs the kernels the cluster has been running whatever the machine-wide cache says by then
cluster_record: Path | None = None
replacement = False


def run_queue_waits() -> dict[int, int] | None:
    """Nanoseconds each thread of this process has spent runnable but waiting for a core, by thread id (the
    second field of Linux's ``/proc/self/task/<tid>/schedstat``); None where the kernel does not report it."""
    waits: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for task in os.scandir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"{task.path}/schedstat") as f:
                    waits[int(task.name)] = int(f.read().split()[1])
    return waits or None


def timed_alone(measure: Callable[[], tuple[A, str]]) -> tuple[A, str, bool]:
    """``measure()`` until it runs with the cores to itself, at most :data:`ATTEMPTS` times: ``(answer, how,
    contended)``.

    A kernel timing while another process holds a core is not this machine's answer: OpenMP threads that lose
    their core stall every barrier for a scheduler time slice, which once timed a 0.6 ms 4-bit GEMM at 73 ms and
    turned the fast kernels off. A timing counts as contended when one of its threads waited for a core (its
    run-queue delay, :func:`run_queue_waits`, over the threads present at its end) longer than
    :data:`WAIT_SHARE` of the timing's wall time. That worst thread's share, on a 2-core Xeon with 2 threads over
    the three 4-bit timings: 0.00-0.06 idle, 0.09-0.20 beside two ``nice -n 10`` busy loops, 0.25-0.48 beside one
    at normal priority (where answers changed). A contended timing is repeated after a short pause; when no
    attempt ran alone, the answer is the least contended attempt's and ``contended`` is True. Where the kernel
    reports no run-queue delay, the first timing is taken as it is.
    """
    best: tuple[A, str, float] | None = None
    for attempt in range(ATTEMPTS):
        wall0, before = time.perf_counter(), run_queue_waits()
        answer, how = measure()
        wall, after = time.perf_counter() - wall0, run_queue_waits()
        if before is None or after is None:
            return answer, how, False
        worst = max((w - before.get(tid, 0) for tid, w in after.items()), default=0) / 1e9
        share = worst / max(wall, 1e-9)
        if share <= WAIT_SHARE:
            return answer, how, False
        if best is None or share < best[2]:
            best = (answer, how, share)
        if attempt + 1 < ATTEMPTS:
            time.sleep(0.25 * (attempt + 1))
    assert best is not None
    note = f"timed while the cores were taken (a thread waited for one {best[2]:.0%} of the time)"
    return best[0], f"{best[1]}; {note}", True


def _all_ranks_max(values: list[int], group: object | None) -> list[int]:
    """The element-wise maximum of ``values`` over every TP rank of ``group`` (None: this process alone)."""
    if group is None:
        return values
    import torch
    import torch.distributed as dist

    on_gpu = dist.get_backend(group) == "nccl"  # NCCL reduces device tensors only
    t = torch.tensor(values, dtype=torch.int64, device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def agreed_choice(
    cache_dir: Path,
    name: str,
    key: str,
    measure: Callable[[], tuple[int, str]] | None,
    group: object | None = None,
    *,
    highest: bool = False,
    lacking: int = 0,
    normalize: Callable[[int], int] | None = None,
) -> tuple[int, str, int]:
    """The answer to ``name`` (whether a kernel is faster, or a threshold in rows) that every TP rank of ``group``
    takes: ``(agreed, how, own)``, ``own`` being this rank's before the vote.

    This rank's answer is, in order: the cluster's record (:data:`cluster_record`) in a replacement group; else
    the machine's, kept in ``cache_dir/{name}-{hash}.json`` by an earlier start; else ``measure()`` through
    :func:`timed_alone`; ``lacking`` when ``measure`` is None (this rank cannot run the kernel) or raises (logged).
    ``normalize`` maps a value read from a file (an older file's encoding) before the vote. The ranks then take the
    highest answer (``highest``) or the lowest, in one all-reduce that also tells whether any rank's timing was
    contended and whether any rank lacked the kernel. The agreed answer goes into the cluster's record (a
    replacement group reads it) and, when every rank timed or read an answer and none was contended, into the
    machine's file, so later starts choose the same without measuring (a start-up timing on a shared machine can
    flip with the load of the moment). A contended answer is measured again by the next fresh start; a vote that a
    rank without the kernel decided is not kept. Delete the file to measure again.
    """
    own, note, contended, source = lacking, "", False, "lacking"  # note: how the answer came about, as kept
    path = _choice_path(cache_dir, name, key)
    if measure is not None and replacement and cluster_record is not None:
        if (recorded := _read_choice(_choice_path(cluster_record, name, key))) is not None:
            (own, note), source = recorded, "cluster"
    if measure is not None and source == "lacking":
        if (kept := _read_choice(path)) is not None:
            (own, note), source = kept, "machine"
        else:
            try:
                own, note, contended = timed_alone(measure)
                source = "measured"
            except Exception as e:  # noqa: BLE001 - the ranks must still vote together; this one as if it lacked
                log.warning("%s: the start-up timing failed (%s: %s); this TP rank votes %d", name,
                            type(e).__name__, e, lacking)  # fmt: skip
                own, note, source = lacking, f"the timing failed: {type(e).__name__}: {e}", "failed"
    if normalize is not None and source in ("cluster", "machine"):
        own = normalize(own)
    short = source in ("lacking", "failed")
    signed, busy, any_short = _all_ranks_max([own if highest else -own, int(contended), int(short)], group)
    agreed = signed if highest else -signed
    how = {
        "cluster": f"{note}, as the TP group this one replaces ran",
        "machine": f"{note}, measured earlier ({path})",
    }.get(source, note)
    if source == "cluster" and agreed != own:
        log.warning("%s: this TP group takes %d where the group it replaces took %d (a rank lacks the kernel now)",
                    name, agreed, own)  # fmt: skip
    if agreed != own:
        note = f"{note} (this rank's answer, {own}; the TP ranks agreed on {agreed})"
    if cluster_record is not None and source != "cluster" and not store_choice(cluster_record, name, key, agreed, note):
        log.warning("%s: could not record the choice in %s; a replacement TP group will choose again", name,
                    cluster_record)  # fmt: skip
    if busy:
        how += "; not kept for later starts (a TP rank's timing was contended)"
    elif not any_short and (source == "measured" or (source == "machine" and agreed != own)):
        store_choice(cache_dir, name, key, agreed, note)  # what the group used, whichever rank writes last
    return agreed, how, own
