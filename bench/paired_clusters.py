#!/usr/bin/env python
"""Two Loom configurations as paired runs: both clusters up at once, measured in turns (TP=2 / TP=1 by default).

    python bench/paired_clusters.py [--a '--tp-size 1'] [--b '--tp-size 2'] [--dtype bfloat16] [--quantization none]
                                    [--batch 32] [--new-tokens 64] [--repeats 5]

Two separate ``bench/serving.py`` runs minutes apart compare two machine states (this shared machine's speed
drifts by up to 2x within minutes). Here cluster A (``--a`` flags) and cluster B (``--b``) both run (the idle one
only polls its sockets: under 1% of a core) and take turns: batch 1, then ``--batch`` concurrent requests, each
figure the median of ``--repeats`` and each ratio B / A the median of the side-by-side pairs. ``--dtype`` and
``--quantization`` go to both unless ``--a``/``--b`` set them. Each worker's torch thread count is printed from
its log (TP=1 takes every core, each TP=2 rank half of them). Examples: the TP goal of issue 10 (the default);
``--a '--quantization none' --b '--quantization gguf'`` for 4-bit against bf16 weights at 32 concurrent.
"""

from __future__ import annotations

import argparse
import re

from common import bench_header, chat_prompts, loadavg, loom_cluster, median
from serving import LoomRuns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", default="--tp-size 1", help="launch.py flags of cluster A (the denominator)")
    p.add_argument("--b", default="--tp-size 2", help="launch.py flags of cluster B (the numerator)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=["none", "int8", "gguf"], default="none")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    tps = [int(t) for t in re.findall(r"--tp-size[ =](\d+)", f"{a.a} {a.b}")] or [1]
    title = "bench/paired_clusters.py: B / A decode tokens/s, paired"
    print(bench_header(title, dtype=a.dtype, tp_size=max(tps), extra=f"A: {a.a}; B: {a.b} (largest TP size above)"))
    prompts = chat_prompts(a.batch)

    def flags(extra: str) -> list[str]:
        own = extra.split()
        out = ["--max-total-tokens", "16384"]
        out += [] if "--dtype" in own else ["--dtype", a.dtype]
        out += [] if "--quantization" in own else ["--quantization", a.quantization]
        return out + own

    with loom_cluster(*flags(a.a)) as ca, loom_cluster(*flags(a.b)) as cb:
        runs = {"A": LoomRuns(ca.endpoint, prompts, a.new_tokens), "B": LoomRuns(cb.endpoint, prompts, a.new_tokens)}
        threads = {k: re.findall(r"rank \d+: \d+", c.worker_threads()) for k, c in (("A", ca), ("B", cb))}
        try:
            res: dict[str, list[tuple[float, float]]] = {"batch 1": [], f"{a.batch} concurrent": []}
            for i in range(a.repeats):
                order = ("A", "B") if i % 2 == 0 else ("B", "A")  # neither always goes first
                for label, fn in (("batch 1", "one"), (f"{a.batch} concurrent", "many")):
                    got = {k: getattr(runs[k], fn)() for k in order}
                    res[label].append((got["A"], got["B"]))
        finally:
            for r in runs.values():
                r.close()
    print(f"\nA: {' '.join(flags(a.a))} (worker threads {', '.join(threads['A'])})")
    print(f"B: {' '.join(flags(a.b))} (worker threads {', '.join(threads['B'])})")
    print(f"{a.new_tokens} new tokens per request, medians of {a.repeats} turns (the order alternates)")
    print(f"{'':<20}{'A tok/s':>10}{'B tok/s':>10}{'B / A':>8}   pairs")
    for label, pairs in res.items():
        ratios = [y / x for x, y in pairs]
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{label:<20}{median([x for x, _ in pairs]):>10.1f}{median([y for _, y in pairs]):>10.1f}"
              f"{median(ratios):>8.2f}   {shown}")  # fmt: skip
    print(f"load average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
