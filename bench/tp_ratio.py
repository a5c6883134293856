#!/usr/bin/env python
"""TP=2 ÷ TP=1 decode throughput as paired runs: both clusters up at once, measured in turns.

    python bench/tp_ratio.py [--dtype bfloat16] [--quantization none] [--batch 32] [--new-tokens 64] [--repeats 3]

Two separate ``bench/serving.py --tp-size N`` runs minutes apart compare two machine states (this shared machine's
speed drifts by up to 2x within minutes). Here a TP=1 and a TP=2 cluster both run (the idle one only polls its
sockets) and take turns: batch 1, then ``--batch`` concurrent requests, each figure the median of ``--repeats``
and each ratio the median of the side-by-side pairs. Each worker's torch thread count is printed from its log
(TP=1 takes every core, each TP=2 rank half of them).
"""

from __future__ import annotations

import argparse
import re

from common import bench_header, chat_prompts, loadavg, loom_cluster, median
from serving import LoomRuns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=["none", "int8", "gguf"], default="none")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(bench_header("bench/tp_ratio.py: TP=2 / TP=1 decode tokens/s, paired", dtype=a.dtype, tp_size=2))
    prompts = chat_prompts(a.batch)
    flags = ["--dtype", a.dtype, "--quantization", a.quantization, "--max-total-tokens", "16384"]
    with loom_cluster(*flags, "--tp-size", "1") as c1, loom_cluster(*flags, "--tp-size", "2") as c2:
        runs = {1: LoomRuns(c1.endpoint, prompts, a.new_tokens), 2: LoomRuns(c2.endpoint, prompts, a.new_tokens)}
        threads = {tp: re.findall(r"rank \d+: \d+", c.worker_threads()) for tp, c in ((1, c1), (2, c2))}
        try:
            res: dict[str, list[tuple[float, float]]] = {"batch 1": [], f"{a.batch} concurrent": []}
            for _ in range(a.repeats):
                res["batch 1"].append((runs[1].one(), runs[2].one()))
                res[f"{a.batch} concurrent"].append((runs[1].many(), runs[2].many()))
        finally:
            for r in runs.values():
                r.close()
    print(f"\nworker threads: TP=1 {', '.join(threads[1])}; TP=2 {', '.join(threads[2])}")
    print(f"{a.new_tokens} new tokens per request, --quantization {a.quantization}, medians of {a.repeats} turns")
    print(f"{'':<20}{'TP=1 tok/s':>12}{'TP=2 tok/s':>12}{'TP2/TP1':>10}   pairs")
    for label, pairs in res.items():
        ratios = [t2 / t1 for t1, t2 in pairs]
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{label:<20}{median([x for x, _ in pairs]):>12.1f}{median([y for _, y in pairs]):>12.1f}"
              f"{median(ratios):>10.2f}   {shown}")  # fmt: skip
    print(f"load average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
