#!/usr/bin/env python
"""Prefix cache and chunked prefill, measured on real clusters (one run; fp32, the CPU default dtype).

    python bench/prefix_cache.py [--dtype auto] [--tp-size 1] [--repeats 3]

Prints three figures, each with its goal from issue 12:

1. TTFT of a request whose 1,000-token prefix is cached ÷ the same request uncached (goal <= 0.15). Each
   request is the prefix plus one fresh token with ``max_new_tokens`` 1, so its latency is its time to first
   token; medians over ``--repeats`` fresh prefixes.
2. Throughput of 64 requests that share a 500-token system prompt (each adds 16 tokens of its own and generates
   16), cache on ÷ ``--disable-radix-cache`` (goal >= 2). Nothing is warmed: the first request computes the
   shared prompt, the others wait one step for it and reuse it.
3. The longest gap between streamed tokens of 8 running streams while a 4,000-token prompt is admitted, with the
   default ``--chunked-prefill-size`` ÷ ``--chunked-prefill-size 0`` (whole prompts in one step), and each ÷ the
   streams' normal (median) gap (goal for chunked <= 3x normal).

Prompts are seeded random token ids (``input_ids``), so lengths are exact and only what a figure shares is
shared. Three clusters run one after the other: default flags, ``--disable-radix-cache``, and
``--chunked-prefill-size 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from common import bench_header, loom_cluster, median, random_prompt_ids

VOCAB = 49152
GREEDY_1 = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


def ttft_pair(endpoint: str, repeats: int) -> tuple[float, float]:
    """(median uncached, median cached) seconds to the first token of a 1,000-token-prefix request."""
    from ipc.client import LoomClient

    cold, warm = [], []
    with LoomClient(endpoint) as c:
        c.generate(input_ids=random_prompt_ids(16, VOCAB, 999), sampling_params=GREEDY_1)  # warm-up
        for k in range(repeats):
            prefix = random_prompt_ids(1000, VOCAB, 1000 + k)
            for times, tail in ((cold, 11), (warm, 12)):
                t = time.perf_counter()
                c.generate(input_ids=prefix + [300 + tail], sampling_params=GREEDY_1)
                times.append(time.perf_counter() - t)
    return median(cold), median(warm)


def shared_system_throughput(endpoint: str, n: int = 64, system_len: int = 500) -> float:
    """Requests per second for ``n`` requests sharing a ``system_len``-token prefix, all sent at once."""
    from ipc.client import AsyncLoomClient

    system = random_prompt_ids(system_len, VOCAB, 7)
    prompts = [system + random_prompt_ids(16, VOCAB, 100 + i) for i in range(n)]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def go() -> float:
        async with AsyncLoomClient(endpoint) as c:
            t = time.perf_counter()
            await asyncio.gather(*(c.generate(input_ids=p, sampling_params=sp) for p in prompts))
            return n / (time.perf_counter() - t)

    return asyncio.run(go())


def stream_gaps(endpoint: str, streams: int = 8, long_len: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """(normal median gap, longest gap while the long prompt is admitted, the long prompt's latency) in seconds.

    ``streams`` greedy streams run; once each has produced 8 chunks a ``long_len``-token prompt arrives; the
    longest gap between consecutive chunks of any stream from then until the long request finished is taken.
    """
    from ipc.client import AsyncLoomClient

    sp = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    window: list[float] = []
    done = asyncio.Event()

    async def stream(c: AsyncLoomClient, i: int) -> None:
        it = c.generate_stream(input_ids=random_prompt_ids(32, VOCAB, seed * 100 + i), sampling_params=sp)
        try:
            async for _ in it:
                arrivals[i].append(time.perf_counter())
                if done.is_set():
                    break
        finally:
            await it.aclose()

    async def long_prompt(c: AsyncLoomClient) -> None:
        while min(len(a) for a in arrivals) < 8:
            await asyncio.sleep(0.01)
        window.append(time.perf_counter())
        await c.generate(input_ids=random_prompt_ids(long_len, VOCAB, seed + 5000), sampling_params=GREEDY_1)
        window.append(time.perf_counter())
        await asyncio.sleep(0.5)  # the streams' next tokens after the long prefill count too
        done.set()

    async def go() -> None:
        async with AsyncLoomClient(endpoint) as c:
            await asyncio.gather(long_prompt(c), *(stream(c, i) for i in range(streams)))

    asyncio.run(go())
    start, end = window
    before = [b - a for ts in arrivals for a, b in zip(ts, ts[1:], strict=False) if b <= start and a >= ts[2]]
    during = [b - a for ts in arrivals for a, b in zip(ts, ts[1:], strict=False) if b > start and a < end + 0.5]
    return median(before), max(during), end - start


def main() -> None:
    """Run the three measurements and print one table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args()
    print(bench_header("prefix cache and chunked prefill", dtype=ns.dtype, tp_size=ns.tp_size), flush=True)
    from ipc.config import DEFAULT_CHUNKED_PREFILL_SIZE

    base = ["--dtype", ns.dtype, "--tp-size", str(ns.tp_size), "--log-level", "warning"]
    with loom_cluster(*base) as cl:
        cold, warm = ttft_pair(cl.endpoint, ns.repeats)
        rps_on = shared_system_throughput(cl.endpoint)
        normal, chunked_gap, chunked_long = stream_gaps(cl.endpoint, seed=1)
    with loom_cluster(*base, "--disable-radix-cache") as cl:
        rps_off = shared_system_throughput(cl.endpoint)
    with loom_cluster(*base, "--chunked-prefill-size", "0") as cl:
        normal0, whole_gap, whole_long = stream_gaps(cl.endpoint, seed=2)
    rows = [
        ("TTFT 1,000-token prefix, uncached", f"{cold * 1e3:.0f} ms", ""),
        ("TTFT 1,000-token prefix, cached", f"{warm * 1e3:.0f} ms", ""),
        ("  cached / uncached", f"{warm / cold:.3f}", "goal <= 0.15"),
        ("64 req sharing a 500-token system prompt, cache on", f"{rps_on:.2f} req/s", ""),
        ("64 req sharing a 500-token system prompt, cache off", f"{rps_off:.2f} req/s", ""),
        ("  on / off", f"{rps_on / rps_off:.2f}", "goal >= 2"),
        (f"8 streams, normal gap (chunk {DEFAULT_CHUNKED_PREFILL_SIZE} cluster)", f"{normal * 1e3:.0f} ms", ""),
        (
            f"  longest gap while a 4,000-token prompt arrives, chunk {DEFAULT_CHUNKED_PREFILL_SIZE}",
            f"{chunked_gap * 1e3:.0f} ms",
            f"{chunked_gap / normal:.1f}x normal (goal <= 3x); its TTFT {chunked_long:.1f} s",
        ),
        ("8 streams, normal gap (unchunked cluster)", f"{normal0 * 1e3:.0f} ms", ""),
        (
            "  longest gap while a 4,000-token prompt arrives, unchunked",
            f"{whole_gap * 1e3:.0f} ms",
            f"{whole_gap / normal0:.1f}x normal; its TTFT {whole_long:.1f} s",
        ),
        ("  chunked / unchunked longest gap", f"{chunked_gap / whole_gap:.3f}", ""),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
