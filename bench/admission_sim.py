#!/usr/bin/env python
"""What the scheduler's adapter admission allows under Zipf traffic: rows per step and modelled throughput.

    python bench/admission_sim.py [--adapters 1000] [--hot-adapters 8] [--slots 8,16,32,64] [--requests 256]
                                  [--concurrency 32] [--new-tokens 32] [--prompt-tokens 64] [--zipf-alpha 1.0]
                                  [--starvation-steps 64] [--step-base-ms 24] [--step-row-ms 1.0]
                                  [--ranks 8,12,16] [--max-lora-rank 16,64]

Drives the real ``scheduler_proc.scheduler.Scheduler`` (no model, no sockets) with the traffic of
``bench/many_adapters.py``: ``--concurrency`` requests in flight, each naming an adapter drawn Zipf over
``--adapters`` (or ``--hot-adapters`` for the comparison), a new request as soon as one finishes. A step's
time is modelled as ``step-base-ms + step-row-ms x rows`` (the defaults fit ``bench/decode_step.py`` on the
2-core AVX-512 CPU, bf16: ~25 ms at 1 row, ~55 ms at 32). Adapter loads cost nothing here, so the ratio
printed is what admission alone allows: with fewer slots than distinct adapters in flight, most requests wait
for a slot however fast loads are, and the many/few ratio of ``bench/many_adapters.py`` cannot pass it.

Adapters take rank rows at their own rank (adapter ``k`` has rank ``--ranks[k mod n]``, as
``bench/many_adapters.py`` makes them), out of ``slots x --max-lora-rank`` rows: each ``--max-lora-rank`` value
is a row of the table. With ``--max-lora-rank`` at the adapters' largest rank, 8 slots hold about 10 adapters of
ranks 8-16; a server sized for rank-64 adapters holds about 40 of them in the same 8 slots.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.lora_config import lora_rows  # noqa: E402
from ipc.messages import SamplingParams, TokenizedReq  # noqa: E402
from scheduler_proc.scheduler import Scheduler  # noqa: E402


def simulate(a: argparse.Namespace, adapters: int, slots: int, max_rank: int = 0) -> tuple[float, float, float]:
    """(modelled tokens/s, mean rows per step, mean distinct adapters among the requests in flight).

    ``max_rank`` > 0: adapters take rank rows at ``a.ranks`` (cycled) out of ``slots`` slots of ``max_rank``;
    0: each takes a whole slot."""
    rng = random.Random(0)
    weights = [1 / (k + 1) ** a.zipf_alpha for k in range(adapters)]
    s = Scheduler(
        max_running=max(64, a.concurrency),
        kv_capacity=10_000_000,
        context_len=a.prompt_tokens + a.new_tokens + 8,
        eos_ids=[2],
        max_loras_per_batch=slots,
        starvation_steps=a.starvation_steps,
        max_lora_rank=max_rank or 64,
    )
    if max_rank:
        ranks = [int(r) for r in a.ranks.split(",")]
        s.adapter_rows = {f"a{k:05d}": lora_rows(ranks[k % len(ranks)]) for k in range(adapters)}
    ids = itertools.count()
    sent = done = tokens = 0
    ms = 0.0
    rows: list[int] = []
    distinct: list[int] = []

    def submit() -> None:
        nonlocal sent
        rid, uid = f"r{next(ids)}", f"a{rng.choices(range(adapters), weights)[0]:05d}"
        sp = SamplingParams(max_new_tokens=a.new_tokens, temperature=0, ignore_eos=True)
        s.add(TokenizedReq(rid, [5] * a.prompt_tokens, sp, uid))
        sent += 1

    for _ in range(a.concurrency):
        submit()
    while done < a.requests:
        fb = s.next_batch()
        assert fb is not None
        rows.append(len(fb.reqs))
        distinct.append(len({r.lora_uid for r in s.waiting} | {r.lora_uid for r in s.running.values()}))
        ms += a.step_base_ms + a.step_row_ms * len(fb.reqs)
        for out in s.on_result([9] * len(fb.reqs)):
            tokens += len(out.new_ids)
            if out.finished:
                done += 1
                if sent < a.requests:
                    submit()
    return tokens / ms * 1e3, sum(rows) / len(rows), sum(distinct) / len(distinct)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--hot-adapters", type=int, default=8)
    p.add_argument("--slots", default="8,16,32,64", help="--max-loras-per-batch values to compare")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--starvation-steps", type=int, default=64)
    p.add_argument("--step-base-ms", type=float, default=24.0)
    p.add_argument("--step-row-ms", type=float, default=1.0)
    p.add_argument("--ranks", default="8,12,16", help="adapter ranks, cycled over the adapters")
    p.add_argument("--max-lora-rank", default="16,64", help="values to compare; 0 = every adapter takes a slot")
    a = p.parse_args()
    print(f"{'slots':>5} {'max rank':>8} {'few tok/s':>10} {'many tok/s':>11} {'many/few':>9} {'rows few':>9} "
          f"{'rows many':>10} {'in flight':>10}")  # fmt: skip
    for slots in (int(x) for x in a.slots.split(",")):
        for mr in (int(x) for x in a.max_lora_rank.split(",")):
            few, rows_few, _ = simulate(a, a.hot_adapters, slots, mr)
            many, rows_many, flight = simulate(a, a.adapters, slots, mr)
            print(f"{slots:>5} {mr or 'slot':>8} {few:>10.1f} {many:>11.1f} {many / few:>9.2f} {rows_few:>9.1f} "
                  f"{rows_many:>10.1f} {flight:>10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
