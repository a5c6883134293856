#!/usr/bin/env python
"""Decode throughput of Loom vs transformers ``generate`` on the same prompts (one run, bf16 by default).

    python bench/serving.py [--dtype bfloat16] [--new-tokens 64] [--batch 32] [--repeats 3] [--tp-size 1]
                            [--loom-args '--chunked-prefill-size 512']

Throughput = generated tokens / wall time (prefill included, the same for both). Every request generates
exactly ``--new-tokens`` tokens (Loom: ``ignore_eos``; transformers: ``min_new_tokens``). Prints a header (CPU
flags, torch threads), then one table of every figure: medians of ``--repeats`` runs, the Loom / transformers
ratios and each engine's concurrent / batch-1 ratio. See bench/scaling.py for tok/s against concurrency and
context length.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from common import bench_header, chat_prompts, loadavg, loom_cluster, median


def loom_runs(endpoint: str, prompts: list, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(batch-1 tok/s, concurrent tok/s) medians from a running cluster."""
    from ipc.client import AsyncLoomClient, LoomClient

    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with LoomClient(endpoint) as c:
        c.generate(messages=prompts[0], sampling_params={**sp, "max_new_tokens": 4})  # warm-up
        one = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = c.generate(messages=prompts[0], sampling_params=sp)
            one.append(out["meta_info"]["completion_tokens"] / (time.perf_counter() - t))

    async def batch() -> float:
        client = AsyncLoomClient(endpoint)
        try:
            t = time.perf_counter()
            outs = await asyncio.gather(*[client.generate(messages=m, sampling_params=sp) for m in prompts])
            return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t)
        finally:
            client.close()

    many = [asyncio.run(batch()) for _ in range(repeats)]
    return median(one), median(many)


def hf_runs(model_path: str, dtype: str, prompts: list, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(batch-1 tok/s, padded-batch tok/s) medians for transformers ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 2}

    def run(batch_texts: list[str]) -> float:
        enc = tok(batch_texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, **kw)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(batch_texts) / (time.perf_counter() - t)

    run(texts[:1])  # warm-up
    return median([run(texts[:1]) for _ in range(repeats)]), median([run(texts) for _ in range(repeats)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--loom-args", default="", help="extra launch.py flags, e.g. '--chunked-prefill-size 512'")
    a = p.parse_args()
    from ipc.model_source import resolve_model_path

    model_path = str(resolve_model_path(None))
    print(bench_header("bench/serving.py: Loom vs transformers decode tokens/s", dtype=a.dtype, tp_size=a.tp_size))
    prompts = chat_prompts(a.batch)
    flags = ["--dtype", a.dtype, "--max-total-tokens", "16384", "--tp-size", str(a.tp_size), *a.loom_args.split()]
    with loom_cluster(*flags) as cluster:
        l1, lb = loom_runs(cluster.endpoint, prompts, a.new_tokens, a.repeats)
    h1, hb = hf_runs(model_path, a.dtype, prompts, a.new_tokens, a.repeats)
    print(f"\n{a.new_tokens} new tokens per request, medians of {a.repeats} runs (tokens/s)")
    print(f"{'':<28}{'Loom':>10}{'transformers':>14}{'Loom/HF':>10}")
    print(f"{'batch 1':<28}{l1:>10.1f}{h1:>14.1f}{l1 / h1:>10.2f}")
    print(f"{f'{a.batch} concurrent / padded':<28}{lb:>10.1f}{hb:>14.1f}{lb / hb:>10.2f}")
    print(f"{'concurrent / batch 1':<28}{lb / l1:>10.2f}{hb / h1:>14.2f}")
    print(f"load average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
