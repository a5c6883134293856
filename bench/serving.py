#!/usr/bin/env python
"""Decode throughput of Loom vs transformers ``generate`` on the same prompts (one run, bf16 by default).

    python bench/serving.py [--dtype bfloat16] [--new-tokens 64] [--batch 32] [--repeats 3] [--tp-size 1]
                            [--quantization {none,int8,gguf}] [--loom-args '--chunked-prefill-size 512']

Throughput = generated tokens / wall time (prefill included, the same for all). Every request generates
exactly ``--new-tokens`` tokens (Loom: ``ignore_eos``; transformers: ``min_new_tokens``; llama.cpp: EOS is not a
stop). Prints a header (CPU flags, torch threads), then one table of every figure: medians of ``--repeats`` runs,
the Loom / transformers and Loom / llama.cpp ratios and each engine's concurrent / batch-1 ratio.

llama.cpp columns appear when ``llama-cpp-python`` is installed (optional, never a Loom dependency; see
bench/llamacpp.py): it runs the same GGUF Loom converts (its own quantised weights) with Loom's prompt token ids,
on as many threads as Loom's workers, its ``n`` requests once one after another ("sequential", its high-level
API) and once decoded together through ``llama_batch`` ("batched"). See bench/scaling.py for tok/s against
concurrency and context length.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time

from common import bench_header, chat_prompts, loadavg, loom_cluster, median
from llamacpp import INSTALL_HINT, describe, loom_threads, measure


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
    p.add_argument(
        "--quantization",
        choices=["none", "int8", "gguf"],
        default=None,
        help="passed to launch.py as --quantization X (default: not passed, launch.py's own default)",
    )
    p.add_argument("--loom-args", default="", help="extra launch.py flags, e.g. '--chunked-prefill-size 512'")
    a = p.parse_args()
    from ipc.model_source import embedded_gguf_path, resolve_model_path

    model_path = str(resolve_model_path(None))
    title = "bench/serving.py: Loom vs transformers vs llama.cpp decode tokens/s"
    quant = f"Loom --quantization {a.quantization or '(not passed: launch.py default)'}"
    print(bench_header(title, dtype=a.dtype, tp_size=a.tp_size, extra=quant))
    prompts = chat_prompts(a.batch)
    flags = ["--dtype", a.dtype, "--max-total-tokens", "16384", "--tp-size", str(a.tp_size)]
    if a.quantization:
        flags += ["--quantization", a.quantization]
    flags += a.loom_args.split()
    with loom_cluster(*flags) as cluster:
        l1, lb = loom_runs(cluster.endpoint, prompts, a.new_tokens, a.repeats)
        # llama.cpp gets as many threads as Loom's workers logged, in all (else the rule they follow)
        logged = [int(n) for n in re.findall(r"rank \d+: (\d+) ", cluster.worker_threads())]
    h1, hb = hf_runs(model_path, a.dtype, prompts, a.new_tokens, a.repeats)
    try:
        lcpp = measure(
            embedded_gguf_path(),
            n=a.batch,
            new_tokens=a.new_tokens,
            repeats=a.repeats,
            n_threads=sum(logged) or loom_threads(a.tp_size),
        )
        lcpp_note = f"llama.cpp rows skipped: llama-cpp-python is not installed ({INSTALL_HINT})"
    except Exception as e:  # noqa: BLE001 - an optional comparison must not cost the Loom/transformers table
        lcpp, lcpp_note = None, f"llama.cpp rows skipped: llama-cpp-python failed: {type(e).__name__}: {e}"
    print(f"\n{a.new_tokens} new tokens per request, medians of {a.repeats} runs (tokens/s)")
    if lcpp is None:
        print(lcpp_note)
    else:
        print(describe(lcpp))
    w = 36  # label width
    hdr = f"{'':<{w}}{'Loom':>10}{'transformers':>14}{'Loom/HF':>10}"
    if lcpp is not None:
        hdr += f"{'llama.cpp':>11}{'Loom/llama.cpp':>16}"
    print(hdr)

    def row(label: str, loom: float | None, hf: float | None, cpp: float | None, ratios: bool = True) -> str:
        """One table line: figures (tok/s, or ratios themselves when ``ratios`` is False) and Loom's ratios."""
        fmt = ".1f" if ratios else ".2f"
        line = f"{label:<{w}}{'' if loom is None else format(loom, fmt):>10}{'' if hf is None else format(hf, fmt):>14}"
        line += f"{loom / hf:>10.2f}" if ratios and loom and hf else f"{'':>10}"
        if lcpp is not None:
            line += f"{'' if cpp is None else format(cpp, fmt):>11}"
            line += f"{loom / cpp:>16.2f}" if ratios and loom and cpp else ""
        return line

    print(row("batch 1", l1, h1, lcpp and lcpp.batch1))
    print(row(f"{a.batch} concurrent/padded/batched", lb, hb, lcpp and lcpp.batched))
    if lcpp is not None:
        print(row(f"{a.batch} sequential (one after another)", None, None, lcpp.sequential))
    print(row("concurrent / batch 1", lb / l1, hb / h1, lcpp and lcpp.batched / lcpp.batch1, ratios=False))
    print(f"load average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
