"""How many intra-op (OpenMP) threads a CPU rank should use, decided by a short measurement at start-up.

``cpu_count // tp_size`` threads is right on an idle machine and badly wrong on a busy one: OpenMP threads spin
at their barriers, so when another process holds one of "our" cores every matmul waits for a descheduled thread
(a soak run measured decode falling from 73 to 3.5 tok/s with 2 threads and one competing process, while 1
thread gave 33-43 tok/s either way). So we time a decode-shaped matmul at each candidate count and take the
fastest, preferring fewer threads unless more are clearly faster.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

# [32, 576] @ [576, 1536]: a decode step's gate/up projection for SmolLM2 at batch 32. At 8 rows (before) two
# threads took 0.65-0.9 of one thread's time on an idle 2-core EPYC, close to the margin, so the pick flipped with
# the machine's noise (1 thread served 35% slower at 32 concurrent); at 32 rows 0.55-0.61. With another process's
# OpenMP threads spinning on the cores, two threads took 15-24x one thread's time at 32 rows (8 rows: 0.9-1.4x in
# a third of windows, so the collapse went unseen)
PROBE_ROWS, PROBE_IN, PROBE_OUT = 32, 576, 1536
# more threads this many times slower than the best count: OpenMP threads waiting for a core another process holds
COLLAPSE = 2.0


def usable_cpus() -> int:
    """CPUs this process may run on (``sched_getaffinity``), else ``os.cpu_count()``; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _candidates(cap: int) -> list[int]:
    """1, 2, 4, ... up to ``cap``, and ``cap`` itself."""
    out = [1]
    while out[-1] * 2 < cap:
        out.append(out[-1] * 2)
    if cap > 1:
        out.append(cap)
    return out


def _window(cands: list[int], probes: list[tuple[torch.Tensor, torch.Tensor]], budget_s: float) -> dict[int, float]:
    """One measuring window: each count's score (µs), the geometric mean over ``probes`` of its median call time,
    from interleaved rounds (so a burst of load hits every count alike) until ``budget_s`` is spent (at least two
    rounds, at most 50)."""
    times: dict[int, list[list[float]]] = {n: [[] for _ in probes] for n in cands}
    deadline = time.perf_counter() + budget_s
    with torch.inference_mode():
        rounds = 0
        while rounds < 2 or (time.perf_counter() < deadline and rounds < 50):
            rounds += 1
            for n in cands:
                torch.set_num_threads(n)
                for i, (x, w) in enumerate(probes):
                    x @ w.T  # warm this thread count (pool resize, caches)
                    for _ in range(3):
                        t = time.perf_counter()
                        x @ w.T
                        times[n][i].append(time.perf_counter() - t)
    return {
        n: 1e6 * math.exp(sum(math.log(max(statistics.median(ts), 1e-9)) for ts in per) / len(per))
        for n, per in times.items()
    }


def measure_threads(
    cap: int,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    budget_s: float = 0.2,
    margin: float = 0.15,
    windows: int = 3,
    pause_s: float = 0.5,
) -> tuple[int, dict[int, float]]:
    """Time the probe matmul at each candidate thread count up to ``cap`` and pick one.

    The pick is the fewest threads whose score is within ``margin`` (a fraction) of the best: more threads must
    earn their keep, since they are the ones that collapse when the machine gets busy. A window (``budget_s`` of
    interleaved rounds, :func:`_window`) that picks fewer threads than its fastest count is ambiguous: a burst of
    other work during it can cost more threads their margin (with the earlier 8-row probe, 3 of 40 single
    windows on an idle 2-core EPYC; the worker then served 35% slower for its whole life). So is one where more
    threads collapse (:data:`COLLAPSE` times the best score): another process's OpenMP threads busy on the same
    cores do that in bursts (a cluster start took 1 thread at 580 / 12663 us while one ran), and most windows
    between its bursts pick more threads. So up to ``windows`` windows run, ``pause_s`` apart, until the pick is
    the fastest count and nothing collapsed, each count scoring its median window: a burst rarely spans most of
    them, while load that lasts slows them all (a best-window score let one lucky window past such a neighbour).

    Leaves ``torch.get_num_threads()`` as it was. Returns ``(threads, {threads: score in µs})``.
    """
    cands = _candidates(max(1, cap))
    if len(cands) == 1:
        return 1, {}
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    probes = []
    for dt in dtypes:
        x = torch.randn(PROBE_ROWS, PROBE_IN, generator=gen).to(dt)
        w = torch.randn(PROBE_OUT, PROBE_IN, generator=gen).to(dt)
        probes.append((x, w))
    seen: dict[int, list[float]] = {n: [] for n in cands}
    try:
        for i in range(max(1, windows)):
            for n, sc in _window(cands, probes, budget_s).items():
                seen[n].append(sc)
            scores = {n: statistics.median(v) for n, v in seen.items()}
            pick = _pick(scores, margin)
            if pick == min(scores, key=scores.__getitem__) and not collapsed(scores):
                break
            if i + 1 < windows:
                time.sleep(pause_s)
    finally:
        torch.set_num_threads(before)
    return pick, scores


def collapsed(scores: dict[int, float]) -> bool:
    """Whether some thread count scored over :data:`COLLAPSE` times the best (threads waiting for a busy core)."""
    return max(scores.values()) > COLLAPSE * min(scores.values())


def _pick(scores: dict[int, float], margin: float) -> int:
    """The fewest threads whose score is within ``margin`` of the best score."""
    best = min(scores.values())
    return min(n for n, sc in scores.items() if sc <= best * (1 + margin))


def thread_cap(tp_size: int) -> int:
    """This rank's share of the usable CPUs: ``sched_getaffinity // tp_size``, at least 1.

    With ``OMP_NUM_THREADS`` set, the current ``torch.get_num_threads()`` instead (the override wins).
    """
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    return max(1, usable_cpus() // max(1, tp_size))


def pick_num_threads(tp_size: int) -> tuple[int, str]:
    """Threads for one CPU rank of a ``tp_size`` group: ``(count, why)`` for the log; does not set them.

    ``OMP_NUM_THREADS`` in the environment wins (torch already applied it). Otherwise :func:`thread_cap` caps a
    measurement by :func:`measure_threads` (skipped when the cap is 1; costs about 0.2-0.4 s otherwise). Call it
    late in start-up: the cluster's other processes start at the same time and their imports would count as load.
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        return torch.get_num_threads(), f"OMP_NUM_THREADS={env}"
    cap = thread_cap(tp_size)
    if cap == 1:
        return 1, f"{usable_cpus()} usable CPU(s) / tp_size {tp_size}"
    t0 = time.perf_counter()
    n, scores = measure_threads(cap)
    shown = ", ".join(f"{k}: {v:.0f} us" for k, v in scores.items())
    busy = "; more threads stayed slow in every window: another process is using these cores"
    busy = busy if collapsed(scores) else ""
    return n, f"measured in {time.perf_counter() - t0:.2f} s, cap {cap} ({shown}){busy}"


class ThreadRecheck:
    """Measure again, while the rank is idle, when start-up picked fewer threads than its cap.

    The start-up pick lasts the worker's life, and a burst of other work during it (the cluster's other
    processes, a client preparing its load) can make the extra threads look no faster: on a 2-core Zen 5 a
    1.6 s burst left a rank on 1 thread (``1: 352 us, 2: 333 us``), which then served 216 tok/s at 64 concurrent
    against ~1,300 on 2. So a rank below its cap measures one more window (:func:`measure_threads`, ~0.2 s)
    after ``idle_s`` without a step (``first_s`` after start-up at the soonest), at most ``checks`` times ``gap_s``
    apart, and takes that window's pick only where it is unambiguous (the fastest count: more threads must be
    clearly faster, and fewer are taken where more collapse). A step that arrives meanwhile waits for the window.
    With ``OMP_NUM_THREADS`` set, :func:`thread_cap` is the count already in use, so it never measures.
    """

    def __init__(
        self, threads: int, cap: int, idle_s: float = 1.0, first_s: float = 3.0, gap_s: float = 10.0, checks: int = 3
    ) -> None:
        self.threads, self.cap = threads, cap
        self.idle_s, self.gap_s, self.left = idle_s, gap_s, checks
        self.last_work = time.monotonic()
        self.last_check = self.last_work - gap_s + first_s  # the start-up measurement, as if ``gap_s`` apart

    def worked(self) -> None:
        """A step just ended (the rank is not idle)."""
        self.last_work = time.monotonic()

    def due(self) -> bool:
        """Whether to measure now: below the cap, checks left, idle for ``idle_s`` and ``gap_s`` since the last."""
        now = time.monotonic()
        return (
            self.threads < self.cap
            and self.left > 0
            and now - self.last_work >= self.idle_s
            and now - self.last_check >= self.gap_s
        )

    def run(self) -> str | None:
        """Measure one window and apply an unambiguous new pick (``torch.set_num_threads``): a line for the log
        when the count changed, else None."""
        self.left -= 1
        t0 = time.perf_counter()
        n, scores = measure_threads(self.cap, windows=1)
        self.last_check = time.monotonic()
        fastest = min(scores, key=scores.__getitem__) if scores else n
        if n != fastest or n == self.threads:
            return None
        old, self.threads = self.threads, n
        torch.set_num_threads(n)
        shown = ", ".join(f"{k}: {v:.0f} us" for k, v in scores.items())
        took = time.perf_counter() - t0
        return f"{old} -> {n} intra-op thread(s), measured again while idle in {took:.2f} s ({shown})"
