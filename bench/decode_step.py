#!/usr/bin/env python
"""One worker's decode step in-process (no sockets, no scheduler): where a step's time goes.

    python bench/decode_step.py [--batch 32] [--context 256] [--dtype bfloat16] [--lora 0] [--steps 20]
                                [--lora-backend auto|cpu-sgmv|torch] [--attn-ab] [--ops-ab] [--int4-ab]

Prefills ``--batch`` requests of ``--context`` tokens each (random token ids, lengths spread +-25% so rows
differ), then times ``--steps`` decode steps of the whole batch and prints the median step time and tok/s.
``--lora N`` loads N synthetic adapters (ranks 8..64, all seven linears) and spreads the requests over them
plus the base model, so the LoRA apply cost shows as the ratio to ``--lora 0``. ``--profile`` prints
torch.profiler's top operators.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    p.add_argument("--lora", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--slot-dtype", default="", help="force the LoRA slot dtype (default: measured at start-up)")
    p.add_argument("--lora-path", default="", choices=["", "batched", "segments"], help="force a torch LoRA apply path")
    p.add_argument("--lora-backend", default="auto", choices=["auto", "cpu-sgmv", "torch"], help="--lora-backend")
    p.add_argument(
        "--lora-ab",
        action="store_true",
        help="with --lora N: blocks of 5 steps in turns with the cpu-sgmv kernel, the torch path, and no adapters "
        "(the same requests as base-model requests); prints each one's median and the ratios to base",
    )
    p.add_argument(
        "--lora-gemm-ab",
        action="store_true",
        help="with --lora N, bf16 on Loom's bf16 GEMM: blocks of 5 steps in turns with each projection's GEMM and "
        "LoRA in one kernel call (fused, the default where it applies), the two calls one after the other (unfused), "
        "and no adapters; prints each one's median and the ratios to base",
    )
    p.add_argument(
        "--mirror",
        default="on",
        choices=["on", "off", "ab"],
        help="decode KV mirror (gpu_worker/decode_mirror.py): on, off, or ab = blocks of 5 steps in turns; a worker "
        "whose decode attention runs on the C kernel keeps none (it reads the paged cache in place)",
    )
    p.add_argument(
        "--int4-ab",
        action="store_true",
        help="with --quantization gguf: blocks of 5 steps in turns with the C 4-bit kernels as chosen at start-up "
        "(batch kernel and few-row GEMV) and with PyTorch's 4-bit kernel only (gpu_worker/int4_batch.py)",
    )
    p.add_argument(
        "--attn-ab",
        action="store_true",
        help="blocks of 5 steps in turns with decode attention on the C kernel as chosen at start-up and on SDPA "
        "(gpu_worker/decode_attention.py)",
    )
    p.add_argument(
        "--ops-ab",
        action="store_true",
        help="blocks of 5 steps in turns with the fused C layer ops (add + RMSNorm, rotary + KV write, SiLU * up) and "
        "with PyTorch's ops (gpu_worker/layer_ops.py)",
    )
    a = p.parse_args()
    if (a.lora_ab or a.lora_gemm_ab) and a.lora < 1:
        p.error("--lora-ab and --lora-gemm-ab need --lora N (N >= 1 adapters to compare against the base model)")
    if a.lora_ab and a.lora_gemm_ab:
        p.error("--lora-ab and --lora-gemm-ab: choose one")
    # each A/B flag runs blocks of 5 steps per arm in turns, the first step of a block not counted
    arms = max([3 * (a.lora_ab or a.lora_gemm_ab), 2 * (a.mirror == "ab" or a.int4_ab or a.attn_ab or a.ops_ab)])
    if arms and a.steps < 5 * arms:
        p.error(f"--steps {a.steps} is too few for the A/B runs asked: blocks of 5 steps for each of {arms} arms "
                f"need --steps >= {5 * arms}")  # fmt: skip
    from common import bench_header

    print(bench_header("bench/decode_step.py: one worker's decode step", dtype=a.dtype, tp_size=1,
                       extra=f"quantization {a.quantization}"), flush=True)  # fmt: skip
    import msgspec
    import torch

    from gpu_worker.worker import Worker
    from ipc.config import Endpoints, ServerArgs
    from ipc.messages import BatchReq, ForwardBatch, WorkerLoraLoad, WorkerSampling
    from ipc.model_source import resolve_model_path

    if a.threads:
        torch.set_num_threads(a.threads)
    import gpu_worker.lora_pool as lp

    if a.slot_dtype:
        lp.measure_slot_dtype = lambda d, dev, group=None: getattr(torch, a.slot_dtype)
    if a.lora_path:
        lp.LoraBatch.PAD_LIMIT = 1e9 if a.lora_path == "batched" else -1e9
    model_path = str(resolve_model_path(None))
    rng = random.Random(0)
    lens = [max(2, int(a.context * rng.uniform(0.75, 1.25))) for _ in range(a.batch)]
    total = sum(lens) + a.batch * (a.steps + 2)
    eps = Endpoints(front="inproc://f", to_scheduler="", to_tokenizer="", workers="", control="", dist_init="")
    args = ServerArgs(
        model_path=model_path, dtype=a.dtype, quantization=a.quantization, device="cpu", endpoints=eps,
        max_total_tokens=total,
        max_running_requests=a.batch, context_length=max(lens) + a.steps + 2, enable_lora=a.lora > 0,
        max_loras_per_batch=max(a.lora, 1), max_lora_rank=64, lora_backend=a.lora_backend,
    )  # fmt: skip
    w = Worker(args)
    uids: list[str | None] = [None]
    if a.lora:
        from make_adapters import bench_adapters, make_adapters

        from ipc.model_source import cache_root

        ads = make_adapters(model_path, cache_root() / "bench-adapters", bench_adapters(a.lora))
        for i, (name, path) in enumerate(sorted(ads.items())):
            ack = w.load_lora(WorkerLoraLoad(i, f"u{i:04d}", name, str(path)))
            assert ack.ok, ack.error
            uids.append(f"u{i:04d}")
    pools = {}
    modes = ["cpu-sgmv", "torch", "base"]
    if a.lora_gemm_ab:
        modes = ["fused", "unfused", "base"]
    if a.lora_ab or a.lora_gemm_ab:
        from gpu_worker.lora_pool import LoraPool

        for mode in modes[:2]:
            backend = "torch" if mode == "torch" else "cpu-sgmv"
            pool = LoraPool(msgspec.structs.replace(args, lora_backend=backend), w.cfg, w.plan, w.dtype, w.device)
            for i, (name, path) in enumerate(sorted(ads.items())):
                pool.load(f"u{i:04d}", name, str(path))
            if mode == "unfused":
                pool.sgmv_gemm = None
            elif mode == "fused" and pool.sgmv_gemm is None:
                print("--lora-gemm-ab: no fused kernel here (not bf16, no C kernel, or LOOM_LORA_GEMM=0)")
            pools[mode] = pool
    if a.lora_gemm_ab:
        kind = type(w.model.w["layers"][0]["qkv"]).__name__
        print(f"--lora-gemm-ab: fused kernel {pools['fused'].sgmv_gemm is not None}, base linears {kind}")
    greedy = WorkerSampling(0.0, 1.0, -1, None)
    lora_of = [uids[i % len(uids)] for i in range(a.batch)]
    active = [lora_of]  # --lora-ab's base blocks send the same requests without adapters
    slot = 0
    slots: list[list[int]] = []
    for n in lens:
        slots.append(list(range(slot, slot + n + a.steps + 2)))
        slot += n + a.steps + 2
    ids = [[rng.randrange(100, 40000) for _ in range(n)] for n in lens]
    for i in range(a.batch):  # prefill one by one (keeps peak memory low)
        w.forward_logits(ForwardBatch(0, [BatchReq(f"r{i}", i, ids[i], 0, slots[i][: lens[i]], lora_of[i], greedy)]))
    times = []

    def step(k: int) -> None:
        reqs = [
            BatchReq(f"r{i}", i, [1000 + k], lens[i] + k, [slots[i][lens[i] + k]], active[0][i], greedy)
            for i in range(a.batch)
        ]
        w.forward_logits(ForwardBatch(k + 1, reqs))

    import gpu_worker.quant as quant

    chosen, chosen_gemv = quant.BATCH_KERNEL, quant.GEMV_KERNEL
    if a.int4_ab:
        print(f"4-bit C kernels chosen at start-up: batch {chosen}, GEMV {chosen_gemv}")
    by_int4: dict[str, list[float]] = {"c": [], "torch": []}
    chosen_attn = w.model.decode_attn
    if a.attn_ab:
        print(f"C decode attention chosen at start-up: {chosen_attn is not None}")
    by_attn: dict[str, list[float]] = {"c": [], "sdpa": []}
    chosen_ops = w.model.layer_ops
    by_ops: dict[str, list[float]] = {"c": [], "torch": []}
    mirror = w.decode_mirror
    if a.mirror == "ab" and mirror is None:
        print("no decode KV mirror in this worker (decode attention on the C kernel reads the paged cache in place)")
        a.mirror = "off"
    if a.mirror == "off":
        w.decode_mirror = None
    step(0)
    by_mode: dict[str, list[float]] = {"on": [], "off": []}
    lora_ab = a.lora_ab or a.lora_gemm_ab
    by_lora: dict[str, list[float]] = {m: [] for m in modes}
    for k in range(1, a.steps + 1):
        if lora_ab:  # the first step of a block is not counted (it fills slots and the decode mirror)
            mode = modes[(k - 1) // 5 % 3]
            active[0] = [None] * a.batch if mode == "base" else lora_of
            if mode != "base":
                w.lora = pools[mode]
        if a.mirror == "ab":  # the first step of an "on" block refills the mirror: not counted
            on = (k - 1) // 5 % 2 == 0
            w.decode_mirror = mirror if on else None
        if a.int4_ab:
            kern = "c" if (k - 1) // 5 % 2 == 0 else "torch"
            quant.BATCH_KERNEL = chosen if kern == "c" else None
            quant.GEMV_KERNEL = chosen_gemv if kern == "c" else None
        if a.attn_ab:
            attn = "c" if (k - 1) // 5 % 2 == 0 else "sdpa"
            w.model.decode_attn = chosen_attn if attn == "c" else None
        if a.ops_ab:
            ops = "c" if (k - 1) // 5 % 2 == 0 else "torch"
            w.model.layer_ops = chosen_ops if ops == "c" else None
        t = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - t)
        if a.int4_ab and (k - 1) % 5:
            by_int4[kern].append(times[-1])
        if a.ops_ab and (k - 1) % 5:
            by_ops[ops].append(times[-1])
        if a.attn_ab and (k - 1) % 5:
            by_attn[attn].append(times[-1])
        if a.mirror == "ab" and (k - 1) % 5:
            by_mode["on" if on else "off"].append(times[-1])
        if lora_ab and (k - 1) % 5:
            by_lora[mode].append(times[-1])
    med = statistics.median(times)
    if lora_ab:
        ms = {m: statistics.median(v) * 1e3 for m, v in by_lora.items() if v}
        print(
            " ".join(f"{m} {t:.1f} ms" for m, t in ms.items())
            + " per step; LoRA/base throughput: "
            + " ".join(f"{m} {ms['base'] / ms[m]:.2f}" for m in modes[:2] if m in ms and "base" in ms)
        )
        print(lora_bounds_line(model_path, ads, lora_of, a, ms.get("base")))
    if a.int4_ab:
        amx_ms, torch_ms = (statistics.median(by_int4[m]) * 1e3 for m in ("c", "torch"))
        speedup = torch_ms / amx_ms
        print(f"4-bit GEMMs: C kernels {amx_ms:.1f} ms, torch only {torch_ms:.1f} ms per step: {speedup:.2f}x")
    if a.ops_ab:
        c_ms, torch_ms = (statistics.median(by_ops[m]) * 1e3 for m in ("c", "torch"))
        print(f"layer ops: C {c_ms:.1f} ms, PyTorch {torch_ms:.1f} ms per step: {torch_ms / c_ms:.2f}x")
    if a.attn_ab:
        c_ms, sdpa_ms = (statistics.median(by_attn[m]) * 1e3 for m in ("c", "sdpa"))
        print(f"decode attention: C kernel {c_ms:.1f} ms, SDPA {sdpa_ms:.1f} ms per step: {sdpa_ms / c_ms:.2f}x")
    if a.mirror == "ab":
        on_ms, off_ms = (statistics.median(by_mode[m]) * 1e3 for m in ("on", "off"))
        print(f"decode KV mirror on {on_ms:.1f} ms, off {off_ms:.1f} ms per step: off/on {off_ms / on_ms:.2f}")
    print(
        f"batch {a.batch} context ~{a.context} {a.dtype} lora {a.lora} threads {torch.get_num_threads()}: "
        f"step {med * 1e3:.1f} ms (median of {a.steps}{', every arm' if arms else ''}), {a.batch / med:.1f} tok/s"
    )
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for k in range(a.steps + 1, a.steps + 2):
                step(k)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    tempfile.gettempdir()


def lora_bounds_line(model_path: str, ads: dict, lora_of: list, a, base_ms: float | None) -> str:
    """The step's mixed/base ceilings (bench/lora_bounds.py), with the measured base step and plain-sum bandwidth."""
    import torch
    from lora_bounds import adapter_params, batch_bounds, describe, plain_sum_gbps

    from ipc.model_config import load_model_config

    if a.quantization != "none":
        return f"(mixed/base ceilings are printed for --quantization none only; this run: {a.quantization})"
    names = {f"u{i:04d}": name for i, name in enumerate(sorted(ads))}
    params = {name: adapter_params(ads[name]) for name in ads}
    bounds = batch_bounds(load_model_config(model_path), params, [names.get(u) for u in lora_of])
    elem = torch.empty(0, dtype=getattr(torch, a.dtype)).element_size()
    return describe(bounds, elem, base_ms, plain_sum_gbps())


if __name__ == "__main__":
    main()
