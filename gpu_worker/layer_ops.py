"""A decoder layer's small CPU operations fused in C (``csrc/layer_ops.c``): residual add + RMSNorm, rotary
embedding + KV-cache write, SiLU(gate) * up.

At one decode row PyTorch spends ~85 us per layer on these on a 2-core CPU (RMSNorm alone is about eight tensor
ops), a fifth of a 4-bit step, almost all of it per-op dispatch. Each C call does the arithmetic of the PyTorch
code it replaces with the same roundings (every intermediate PyTorch rounds to bf16 is rounded to bf16); sums of
squares and exp may differ by an fp32 ulp. :class:`~gpu_worker.model.LlamaShard` uses them on CPU for fp32 and
bf16 activations when the library builds (no timing: fewer, larger calls are never slower), and PyTorch's ops
otherwise.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from gpu_worker.native_build import CSRC, arg_block, load_kernel

SOURCE = CSRC / "layer_ops.c"
_DTYPES = (torch.float32, torch.bfloat16)
LOAD_NOTES: dict[Path, str] = {}  # why load_layer_ops(cache_dir) has no library, or runs single-threaded


@cache
def load_layer_ops(cache_dir: Path) -> ctypes.CDLL | None:
    """The built library (argtypes set), built into ``cache_dir`` on first use; None (the reason logged and kept in
    ``LOAD_NOTES[cache_dir]``) where no compiler works."""
    sig = {"loom_add_rms_norm": [ctypes.c_void_p, ctypes.c_float], "loom_rope_store": [ctypes.c_void_p],
           "loom_silu_mul": [ctypes.c_void_p]}  # fmt: skip
    return load_kernel(SOURCE, cache_dir, "fused layer ops", LOAD_NOTES, sig)


class LayerOps:
    """The fused operations on one library. Tensors are CPU, fp32 or bf16 (all of a call alike), rows contiguous.

    Arguments go to the C functions as one block (:func:`gpu_worker.native_build.arg_block`).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @staticmethod
    def takes(t: torch.Tensor, width: int) -> bool:
        """Whether a ``[rows, width]`` activation of this dtype and device can go through these ops."""
        return t.device.type == "cpu" and t.dtype in _DTYPES and width % 32 == 0

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += delta`` in place (``delta`` None: no add), then return ``w * rms_norm(x)`` ``[rows, n]``.

        ``x``, ``delta`` ``[rows, n]`` with contiguous rows, ``w`` ``[n]``; all one dtype (fp32/bf16).

        Raises:
            ValueError: a layout or dtype it does not take.
        """
        rows, n = x.shape
        if (
            x.stride(1) != 1
            or w.dtype != x.dtype
            or not w.is_contiguous()
            or (delta is not None and (delta.dtype != x.dtype or delta.stride(1) != 1 or delta.shape != x.shape))
        ):
            raise ValueError(f"add_rms_norm: x {x.dtype} {tuple(x.stride())}, w {w.dtype}")
        h = torch.empty(rows, n, dtype=x.dtype)
        dp, ds = (0, 0) if delta is None else (delta.data_ptr(), delta.stride(0))
        a = arg_block(rows, n, x.data_ptr(), x.stride(0), dp, ds, w.data_ptr(), h.data_ptr(), n, _bf16(x))
        if self.lib.loom_add_rms_norm(a, eps):
            raise ValueError(f"add_rms_norm refused width {n} (a multiple of 16)")
        return h

    def rope_store(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kc: torch.Tensor | None,
        vc: torch.Tensor | None,
        slots: torch.Tensor | None,
    ) -> None:
        """Rotary embedding of the q and k heads of ``qkv`` ``[T, (nq + 2 nkv) d]`` in place; then each token's k and
        v heads into rows ``slots [T]`` (int64) of the paged caches ``kc``/``vc`` ``[slots, nkv, d]`` (None: no
        write). ``heads`` = (nq, nkv, d); ``cos``/``sin`` ``[T, d]`` contiguous in ``qkv``'s dtype, ``sin`` signed
        (see ``LlamaShard._rope``).

        Raises:
            ValueError: a layout or dtype it does not take.
        """
        nq, nkv, d = heads
        t = qkv.shape[0]
        ok = qkv.stride(1) == 1 and cos.dtype == sin.dtype == qkv.dtype and cos.is_contiguous() and sin.is_contiguous()
        if kc is not None:
            ok = ok and kc.dtype == vc.dtype == qkv.dtype and kc.is_contiguous() and vc.is_contiguous()
            ok = ok and slots is not None and slots.dtype == torch.int64 and slots.is_contiguous()
        if not ok or cos.shape != (t, d) or qkv.shape[1] < (nq + 2 * nkv) * d:
            raise ValueError(f"rope_store: qkv {qkv.dtype} {tuple(qkv.shape)}, cos {cos.dtype} {tuple(cos.shape)}")
        kp, vp, sp = (0, 0, 0) if kc is None else (kc.data_ptr(), vc.data_ptr(), slots.data_ptr())
        a = arg_block(t, nq, nkv, d, qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), kp, vp, sp,
                       _bf16(qkv))  # fmt: skip
        if self.lib.loom_rope_store(a):
            raise ValueError(f"rope_store refused head_dim {d} (a multiple of 32)")

    def silu_mul(self, gu: torch.Tensor, f: int) -> torch.Tensor:
        """``silu(gate) * up`` ``[rows, f]`` for ``gu`` ``[rows, 2f]`` = gate | up (contiguous rows, fp32/bf16).

        Raises:
            ValueError: a layout or dtype it does not take.
        """
        if gu.stride(1) != 1 or gu.shape[1] != 2 * f or gu.dtype not in _DTYPES:
            raise ValueError(f"silu_mul: gu {gu.dtype} {tuple(gu.shape)} for {f}")
        out = torch.empty(gu.shape[0], f, dtype=gu.dtype)
        if self.lib.loom_silu_mul(arg_block(gu.shape[0], f, gu.data_ptr(), gu.stride(0), out.data_ptr(), f, _bf16(gu))):
            raise ValueError(f"silu_mul refused width {f} (a multiple of 16)")
        return out


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def layer_ops(cache_dir: Path) -> tuple[LayerOps | None, str]:
    """The fused ops built into ``cache_dir / "kernels"``, or None; with a line saying which."""
    lib = load_layer_ops(cache_dir / "kernels")
    if lib is None:
        return None, f"layer ops on PyTorch (C library unavailable: {LOAD_NOTES.get(cache_dir / 'kernels', '')})"
    return LayerOps(lib), "layer ops (add + RMSNorm, rotary + KV write, SiLU * up) in C"
