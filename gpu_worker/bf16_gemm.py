"""Loom's own bf16 GEMM for CPUs with AVX512-BF16 (``csrc/bf16_gemm.c``): measured, not yet used by the workers.

``bench/bf16_gemm.py`` times it against oneDNN's packed GEMM (:class:`gpu_worker.packed_linear.PackedLinear`, what a
bf16 worker multiplies with today) at the model's decode shapes. It exists as the base of a GEMM that would read
a mixed batch's adapter weights while it computes (issue 10); until that is built and measured in whole steps, the
workers keep oneDNN.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_worker.native_build import CSRC, arg_block, load_kernel

SOURCE = CSRC / "bf16_gemm.c"
PANEL = 48  # output columns per packed panel (the kernel's NR: 3 zmm registers of 16 fp32)
LOAD_NOTES: dict[Path, str] = {}


@cache
def load_gemm(cache_dir: Path) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The ``loom_bf16_gemm`` C function, built into ``cache_dir`` on first use; None where it cannot be built
    (the reason is kept in ``LOAD_NOTES[cache_dir]``). A CPU without AVX512-BF16 gets a build whose calls return 3
    (see :func:`bf16_gemm`)."""
    lib = load_kernel(SOURCE, cache_dir, "bf16 GEMM", LOAD_NOTES, {"loom_bf16_gemm": [ctypes.c_void_p]}, logging.INFO)
    return None if lib is None else lib.loom_bf16_gemm


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[N, K]`` bf16 (K even) in the kernel's panels: ``[ceil(N / 48), K / 2, 48, 2]``, element
    ``[p, q, c, h] = w[48 p + c, 2 q + h]``, zero past row N. Raises ValueError for another dtype or an odd K."""
    n, k = w.shape
    if w.dtype != torch.bfloat16 or k % 2:
        raise ValueError(f"the bf16 GEMM packs bf16 [N, K] weights with an even K, got {w.dtype} {tuple(w.shape)}")
    np_ = -(-n // PANEL)
    wp = F.pad(w, (0, 0, 0, np_ * PANEL - n))
    return wp.view(np_, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_gemm(fn: ctypes._CFuncPtr, x: torch.Tensor, wp: torch.Tensor, n_out: int) -> torch.Tensor:  # type: ignore[name-defined]
    """``x`` ``[M, K]`` bf16 (rows contiguous) times the packed weight ``wp`` (:func:`pack_weight` of ``[n_out, K]``):
    ``[M, n_out]`` bf16, accumulated in fp32. Raises ValueError for mismatched shapes or dtypes and RuntimeError
    where the kernel was built without AVX512-BF16."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or wp.shape[1] * 2 != k or wp.shape[0] * PANEL < n_out:
        raise ValueError(f"bf16 GEMM: x {x.dtype} {tuple(x.shape)} does not fit packed weights {tuple(wp.shape)}")
    out = torch.empty(m, n_out, dtype=torch.bfloat16)
    rc = fn(arg_block(m, k, n_out, x.data_ptr(), x.stride(0), wp.data_ptr(), out.data_ptr(), out.stride(0)))
    if rc == 3:
        raise RuntimeError("the bf16 GEMM was built without AVX512-BF16 (this CPU or LOOM_MARCH lacks it)")
    if rc:
        raise ValueError(f"bf16 GEMM refused M={m}, K={k}, n_out={n_out} (code {rc})")
    return out
