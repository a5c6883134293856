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
API) and once decoded together through ``llama_batch`` ("batched"); and, while Loom's cluster is still up, batch 1
again with Loom and llama.cpp taking turns, whose median paired ratio is steadier than the ratio of medians
measured minutes apart. See bench/scaling.py for tok/s against concurrency and context length.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time

from common import bench_header, chat_prompts, loadavg, loom_cluster, median
from llamacpp import INSTALL_HINT, BatchOne, describe, loom_threads, measure


class LoomRuns:
    """Timed generations against a running cluster: one request alone, or every prompt at once."""

    def __init__(self, endpoint: str, prompts: list, new_tokens: int) -> None:
        from ipc.client import LoomClient

        self.endpoint, self.prompts = endpoint, prompts
        self.sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        self.client = LoomClient(endpoint)
        self.client.generate(messages=prompts[0], sampling_params={**self.sp, "max_new_tokens": 4})  # warm-up

    def one(self) -> float:
        """Batch-1 tok/s."""
        t = time.perf_counter()
        out = self.client.generate(messages=self.prompts[0], sampling_params=self.sp)
        return out["meta_info"]["completion_tokens"] / (time.perf_counter() - t)

    def many(self) -> float:
        """tok/s with every prompt in flight at once."""
        from ipc.client import AsyncLoomClient

        async def batch() -> float:
            client = AsyncLoomClient(self.endpoint)
            try:
                t = time.perf_counter()
                gens = [client.generate(messages=m, sampling_params=self.sp) for m in self.prompts]
                outs = await asyncio.gather(*gens)
                return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t)
            finally:
                client.close()

        return asyncio.run(batch())

    def close(self) -> None:
        self.client.close()


class HFRuns:
    """Timed transformers ``generate`` calls in this process: one prompt, or every prompt as a padded batch."""

    def __init__(self, model_path: str, dtype: str, prompts: list, new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        self.texts = [self.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
        self.kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 2}
        self._run(self.texts[:1])  # warm-up

    def _run(self, batch_texts: list[str]) -> float:
        enc = self.tok(batch_texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(**enc, **self.kw)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(batch_texts) / (time.perf_counter() - t)

    def one(self) -> float:
        """Batch-1 tok/s."""
        return self._run(self.texts[:1])

    def many(self) -> float:
        """tok/s of one padded batch of every prompt."""
        return self._run(self.texts)


def paired(loom, hf, repeats: int) -> tuple[float, float, float]:
    """Alternate ``loom()`` and ``hf()`` ``repeats`` times: (Loom median, HF median, median of the paired ratios).

    On a shared machine whose speed drifts by 2x within minutes, a ratio of two runs made side by side is far
    steadier than a ratio of medians taken minutes apart.
    """
    pairs = [(loom(), hf()) for _ in range(repeats)]
    return median([x for x, _ in pairs]), median([y for _, y in pairs]), median([x / y for x, y in pairs])


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
        loom = LoomRuns(cluster.endpoint, prompts, a.new_tokens)
        hf = HFRuns(model_path, a.dtype, prompts, a.new_tokens)  # loaded while the cluster idles
        try:  # Loom and transformers take turns, so both see the same machine
            l1, h1, r1 = paired(loom.one, hf.one, a.repeats)
            lb, hb, rb = paired(loom.many, hf.many, a.repeats)
        finally:
            loom.close()
        del hf
        # llama.cpp gets as many threads as Loom's workers logged, in all (else the rule they follow)
        logged = [int(n) for n in re.findall(r"rank \d+: (\d+) ", cluster.worker_threads())]
        cpp_one = None  # batch 1 again, Loom and llama.cpp in turns: the ratio that issue 13 asks about
        try:
            one = BatchOne.load(embedded_gguf_path(), prompts[0], a.new_tokens, sum(logged) or loom_threads(a.tp_size))
            if one is not None:
                loom = LoomRuns(cluster.endpoint, prompts, a.new_tokens)
                try:
                    cpp_one = paired(loom.one, one.one, a.repeats)
                finally:
                    loom.close()
                    one.close()
        except Exception as e:  # noqa: BLE001 - optional, as below
            print(f"paired llama.cpp batch-1 runs skipped: {type(e).__name__}: {e}")
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
    print(
        f"\n{a.new_tokens} new tokens per request, medians of {a.repeats} runs (tokens/s); Loom and transformers "
        "ran in turns, Loom/HF is the median of the side-by-side ratios"
    )
    if lcpp is None:
        print(lcpp_note)
    else:
        print(describe(lcpp))
    w = 36  # label width
    hdr = f"{'':<{w}}{'Loom':>10}{'transformers':>14}{'Loom/HF':>10}"
    if lcpp is not None:
        hdr += f"{'llama.cpp':>11}{'Loom/llama.cpp':>16}"
    print(hdr)

    def row(
        label: str, loom: float | None, hf: float | None, cpp: float | None, ratios: bool = True, pair: float = 0.0
    ) -> str:
        """One table line: figures (tok/s, or ratios themselves when ``ratios`` is False) and Loom's ratios."""
        fmt = ".1f" if ratios else ".2f"
        line = f"{label:<{w}}{'' if loom is None else format(loom, fmt):>10}{'' if hf is None else format(hf, fmt):>14}"
        line += f"{pair or loom / hf:>10.2f}" if ratios and loom and hf else f"{'':>10}"
        if lcpp is not None:
            line += f"{'' if cpp is None else format(cpp, fmt):>11}"
            line += f"{loom / cpp:>16.2f}" if ratios and loom and cpp else ""
        return line

    print(row("batch 1", l1, h1, lcpp and lcpp.batch1, pair=r1))
    if cpp_one is not None:
        lo, co, ro = cpp_one
        line = f"{'batch 1, Loom and llama.cpp in turns':<{w}}{lo:>10.1f}{'':>24}"
        print(line + f"{co:>11.1f}{ro:>16.2f}   (median of paired ratios)")
    print(row(f"{a.batch} concurrent/padded/batched", lb, hb, lcpp and lcpp.batched, pair=rb))
    if lcpp is not None:
        print(row(f"{a.batch} sequential (one after another)", None, None, lcpp.sequential))
    print(row("concurrent / batch 1", lb / l1, hb / h1, lcpp and lcpp.batched / lcpp.batch1, ratios=False))
    print(f"load average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
