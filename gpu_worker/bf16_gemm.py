"""Loom's own bf16 GEMM for CPUs with AVX512-BF16 (``csrc/bf16_gemm.c``) and the start-up choice to use it.

A worker serving dense bf16 weights on CPU holds its linears (and the LM head, as a copy where it is tied) as
:class:`Bf16GemmLinear` where :func:`gemm_pays` finds the kernel faster than oneDNN's packed product
(:class:`gpu_worker.packed_linear.PackedLinear`) and the plain one at 1 and 32 rows (``Worker._use_bf16_gemm``,
voted by the TP ranks and cached like every start-up timing). ``bench/bf16_gemm.py`` compares the two per shape.
A version with a mixed batch's LoRA expand fused into it measured no faster (``docs/performance.md``).
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


class Bf16GemmLinear:
    """``x @ W.T`` on Loom's kernel for a dense ``[N, K]`` bf16 weight held in its panels (:func:`pack_weight`).

    The same interface as :class:`gpu_worker.packed_linear.PackedLinear` (``mm``, ``out_features``,
    ``in_features``, ``dtype``, ``nbytes``), so the model multiplies with either. Activations must be bf16.
    """

    def __init__(self, w: torch.Tensor, fn: ctypes._CFuncPtr) -> None:  # type: ignore[name-defined]
        """Pack ``w`` ``[N, K]`` (bf16, CPU, K even; raises ValueError otherwise) for the kernel ``fn``."""
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        self.wp = pack_weight(w)
        self.fn = fn

    @property
    def nbytes(self) -> int:
        """Bytes of weight values held (the panels' zero columns past N not counted)."""
        return self.out_features * self.in_features * 2

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` bf16 -> ``[M, N]`` bf16 (fp32 sums, rounded once)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        return bf16_gemm(self.fn, x, self.wp, self.out_features)


def gemm_pays(w: torch.Tensor, fn: ctypes._CFuncPtr, rows: tuple[int, ...] = (1, 32)) -> tuple[bool, str]:  # type: ignore[name-defined]
    """Whether the kernel beats oneDNN's packed product and the plain one for weight ``w`` ``[N, K]`` here.

    Times each at every row count of ``rows`` (fastest of 7 calls) and asks the kernel to be the fastest at each.
    Returns ``(pays, how)``, ``how`` naming the timings for the log. Never raises: a kernel built without
    AVX512-BF16, or a weight it cannot take, means "no".
    """
    from gpu_worker.packed_linear import PackedLinear, _supported
    from gpu_worker.timing import best_time

    try:
        mine = Bf16GemmLinear(w, fn)
        dnnl = PackedLinear(w) if _supported(w.dtype, w.device) else None
        parts, pays = [], True
        for m in rows:
            x = torch.randn(m, w.shape[1], dtype=w.dtype)
            t_mine = best_time(lambda x=x: mine.mm(x), 7)
            others = {"plain": best_time(lambda x=x: x @ w.T, 7)}
            if dnnl is not None:
                others["oneDNN packed"] = best_time(lambda x=x: dnnl.mm(x), 7)
            pays = pays and t_mine < min(others.values())
            rest = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in others.items())
            parts.append(f"{m} rows: Loom {t_mine * 1e6:.0f} us, {rest}")
    except (RuntimeError, ValueError) as e:
        return False, f"not used ({e})"
    return pays, ("used" if pays else "not used") + " (" + "; ".join(parts) + ")"


def use_gemm(weights: dict, fn: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
    """Replace every layer's dense bf16 linears (even K) and a dense bf16 ``weights["lm_head"]`` with
    :class:`Bf16GemmLinear`, in place, as :func:`gpu_worker.packed_linear.pack_linears` does for oneDNN (a tied head
    is packed as a copy: the embedding lookup keeps the table). Returns how many were replaced."""
    from gpu_worker.packed_linear import pack_linears

    return pack_linears(
        weights,
        make=lambda w: Bf16GemmLinear(w, fn),
        fits=lambda w: w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0,
    )
