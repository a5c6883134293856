"""Start-up micro-measurements that choose fast paths on the machine at hand (never by assumption)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gpu_worker.native_build import isa_caps

A = TypeVar("A", bool, int)  # a cached answer


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


def _choice_path(cache_dir: Path, name: str, key: str) -> Path:
    """Where :func:`cached_choice` keeps ``name``'s answer for ``key`` on this CPU (its model and flags, and
    :func:`~gpu_worker.native_build.isa_caps`, in the hash)."""
    flags = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            info = f.read()
        flags = " ".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))[:4000]
    with contextlib.suppress(ValueError):  # a bad LOOM_MARCH built no kernel: nothing to choose between
        flags += "|" + isa_caps()
    digest = hashlib.sha256(f"{platform.machine()}|{flags}|{key}".encode()).hexdigest()[:16]
    return cache_dir / f"{name}-{digest}.json"


def store_choice(cache_dir: Path, name: str, key: str, answer: int, how: str, contended: bool | None = None) -> None:
    """Keep ``answer`` as :func:`cached_choice`'s answer for ``name`` and ``key`` (written atomically; an unwritable
    folder only costs the next start a measurement). TP ranks that agreed on a value other than their own
    measurement store the agreed one, so a restart reads what the group used, whichever rank wrote last.
    ``contended``: whether the timing behind it ran while other processes held the cores (None: as the file
    already says), so that the next fresh start measures again (see :func:`cached_choice`)."""
    path = _choice_path(cache_dir, name, key)
    if contended is None:
        contended = False
        with contextlib.suppress(OSError, ValueError, AttributeError):
            contended = bool(json.loads(path.read_text()).get("contended", False))
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"faster": answer, "how": how, "contended": contended}))
        os.replace(tmp, path)


WAIT_SHARE = 0.5  # a timing whose threads waited for a core longer than this share of its wall time was contended
ATTEMPTS = 3  # timings per choice at most, while other processes hold the cores
# whether a cached answer that was timed under contention is measured again: yes in a fresh process, no in a TP
# group that replaces a failed one (gpu_worker.main), which must run the kernels the cluster has been running
remeasure_contended = True


def run_queue_wait() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a core, all threads together (the second
    field of Linux's ``/proc/self/task/*/schedstat``); None where the kernel does not report it."""
    total, seen = 0, False
    with contextlib.suppress(OSError):
        for task in os.scandir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"{task.path}/schedstat") as f:
                    total += int(f.read().split()[1])
                seen = True
    return total / 1e9 if seen else None


def timed_alone(measure: Callable[[], tuple[A, str]]) -> tuple[A, str, bool]:
    """``measure()`` until it runs with the cores to itself, at most :data:`ATTEMPTS` times: ``(answer, how,
    contended)``.

    A kernel timing while another process holds a core is not this machine's answer: OpenMP threads that lose
    their core stall every barrier for a scheduler time slice, which once timed a 0.6 ms 4-bit GEMM at 73 ms and
    turned the fast kernels off. A timing counts as contended when its threads waited for a core (Linux's run-queue
    delay, :func:`run_queue_wait`) longer than :data:`WAIT_SHARE` of its wall time; on a 2-core Xeon that share
    was 0.00-0.01 idle, 0.11-0.43 beside two ``nice -n 10`` busy loops (answers unchanged) and 0.67-0.87 beside
    one at normal priority (answers changed). A contended timing is repeated after a short pause; when no attempt
    ran alone, the answer is the least contended attempt's and ``contended`` is True. Where the kernel reports no
    run-queue delay, the first timing is taken as it is.
    """
    best: tuple[A, str, float] | None = None
    for attempt in range(ATTEMPTS):
        wall0, wait0 = time.perf_counter(), run_queue_wait()
        answer, how = measure()
        wall, wait1 = time.perf_counter() - wall0, run_queue_wait()
        if wait0 is None or wait1 is None:
            return answer, how, False
        share = (wait1 - wait0) / max(wall, 1e-9)
        if share <= WAIT_SHARE:
            return answer, how, False
        if best is None or share < best[2]:
            best = (answer, how, share)
        time.sleep(0.25 * (attempt + 1))
    assert best is not None
    note = f"timed while other processes held the cores (its threads waited for one {best[2]:.0%} of the time)"
    return best[0], f"{best[1]}; {note}", True


def cached_choice(cache_dir: Path, name: str, key: str, measure: Callable[[], tuple[A, str]]) -> tuple[A, str]:
    """``measure()`` (``(answer, how)``: whether a kernel is faster, or a threshold in rows; a bool or an int) run
    once per machine (through :func:`timed_alone`) and kept in ``cache_dir/{name}-{hash}.json``.

    A start-up timing on a shared machine can flip with the load of the moment; keeping the first answer, keyed
    by ``key`` plus the CPU's model and flags, gives every later start, and every restart after a failure, the
    same kernels and so the same outputs. An answer timed while other processes held the cores is kept too (a
    restarted TP group reads it, so a cluster keeps its kernels), but the next fresh start measures it again
    (:data:`remeasure_contended`). Delete the file to measure again. Returns ``(answer, how)``.
    """
    path = _choice_path(cache_dir, name, key)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        doc = json.loads(path.read_text())
        # bool is an int too; anything else is a damaged file: measure again
        if isinstance(doc["faster"], int) and not (doc.get("contended") and remeasure_contended):
            return doc["faster"], f"{doc['how']}, measured earlier ({path})"
    faster, how, contended = timed_alone(measure)
    store_choice(cache_dir, name, key, faster, how, contended)
    return faster, how
