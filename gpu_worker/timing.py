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


def store_choice(cache_dir: Path, name: str, key: str, answer: int, how: str) -> None:
    """Keep ``answer`` as :func:`cached_choice`'s answer for ``name`` and ``key`` (written atomically; an unwritable
    folder only costs the next start a measurement). TP ranks that agreed on a value other than their own
    measurement store the agreed one, so a restart reads what the group used, whichever rank wrote last."""
    path = _choice_path(cache_dir, name, key)
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"faster": answer, "how": how}))
        os.replace(tmp, path)


def cached_choice(cache_dir: Path, name: str, key: str, measure: Callable[[], tuple[A, str]]) -> tuple[A, str]:
    """``measure()`` (``(answer, how)``: whether a kernel is faster, or a threshold in rows; a bool or an int) run
    once per machine and kept in ``cache_dir/{name}-{hash}.json``.

    A start-up timing on a shared machine can flip with the load of the moment; keeping the first answer, keyed
    by ``key`` plus the CPU's model and flags, gives every later start, and every restart after a failure, the
    same kernels and so the same outputs. Delete the file to measure again. Returns ``(answer, how)``.
    """
    path = _choice_path(cache_dir, name, key)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        doc = json.loads(path.read_text())
        if isinstance(doc["faster"], int):  # bool is an int too; anything else is a damaged file: measure again
            return doc["faster"], f"{doc['how']}, measured earlier ({path})"
    faster, how = measure()
    store_choice(cache_dir, name, key, faster, how)
    return faster, how
