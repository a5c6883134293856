"""Start-up micro-measurements that choose fast paths on the machine at hand (never by assumption)."""

from __future__ import annotations

import time
from collections.abc import Callable


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
