#!/usr/bin/env python
"""Loom's own bf16 GEMM (gpu_worker/csrc/bf16_gemm.c) against oneDNN's packed GEMM, at the model's decode shapes.

    python bench/bf16_gemm.py [--rows 1,8,32,64] [--repeats 9]

For each linear of a layer (q|k|v, o, gate|up, down, at TP=1) and the LM head, and each row count: the time of one
call, median over ``--repeats`` rounds that call both in turns (paired, since this machine's speed drifts), each
round over as many distinct weights as the model has layers (so the weights come from memory, as in a decode
step; the LM head has one). Prints GFLOP/s and the ratio kernel / oneDNN (below 1: the kernel is faster), and the
largest difference of their outputs. A bf16 worker takes the kernel where its own start-up timing finds it faster
(see the module doc of gpu_worker/bf16_gemm.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from common import bench_header, median  # noqa: E402

from gpu_worker.bf16_gemm import LOAD_NOTES, bf16_gemm, load_gemm, pack_weight  # noqa: E402
from gpu_worker.packed_linear import PackedLinear  # noqa: E402
from ipc.model_config import load_model_config  # noqa: E402
from ipc.model_source import cache_root, resolve_model_path  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()
    print(bench_header("bench/bf16_gemm.py: Loom's bf16 GEMM vs oneDNN's packed GEMM", dtype="bfloat16", tp_size=1))
    fn = load_gemm(cache_root() / "kernels")
    if fn is None:
        print(f"the kernel is unavailable here: {LOAD_NOTES.get(cache_root() / 'kernels', '')}")
        return
    cfg = load_model_config(resolve_model_path(None))
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {
        "q|k|v": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h),
        "o": (h, cfg.num_heads * d),
        "gate|up": (2 * cfg.intermediate_size, h),
        "down": (h, cfg.intermediate_size),
        "LM head": (cfg.vocab_size, h),
    }
    g = torch.Generator().manual_seed(0)
    print(f"\n{'linear':8} {'N x K':>12} {'rows':>5} {'oneDNN us':>10} {'Loom us':>9} {'GF/s oneDNN':>12} "
          f"{'GF/s Loom':>10} {'Loom/oneDNN':>12} {'max |diff|':>11}")  # fmt: skip
    for name, (n, k) in shapes.items():
        count = 1 if name == "LM head" else cfg.num_layers
        ws = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for _ in range(count)]
        dnnl = [PackedLinear(w) for w in ws]
        mine = [pack_weight(w) for w in ws]
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, generator=g).bfloat16()
            diff = (bf16_gemm(fn, x, mine[0], n).float() - dnnl[0].mm(x).float()).abs().max().item()
            td, tl = [], []
            for _ in range(a.repeats + 1):
                t = time.perf_counter()
                for pl in dnnl:
                    pl.mm(x)
                td.append((time.perf_counter() - t) / count)
                t = time.perf_counter()
                for wp in mine:
                    bf16_gemm(fn, x, wp, n)
                tl.append((time.perf_counter() - t) / count)
            td, tl = td[1:], tl[1:]  # the first round warms both
            ratio = median([b / a_ for a_, b in zip(td, tl, strict=True)])
            gf_d, gf_l = 2 * m * n * k / median(td) / 1e9, 2 * m * n * k / median(tl) / 1e9
            print(f"{name:8} {f'{n}x{k}':>12} {m:>5} {median(td) * 1e6:>10.0f} {median(tl) * 1e6:>9.0f} "
                  f"{gf_d:>12.0f} {gf_l:>10.0f} {ratio:>12.2f} {diff:>11.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
