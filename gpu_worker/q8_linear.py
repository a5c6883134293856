"""An 8-bit group-quantised linear layer (GGUF ``Q8_0``: ``w = d * q``, q an int8, one scale per 32 inputs) on Loom's
own C kernels (``csrc/q8_linear.c``).

PyTorch has no CPU kernel for 8-bit weights with group scales, so ``Q8_0`` otherwise goes through its 4-bit kernel
as two 4-bit halves with the input fed twice (:func:`gpu_worker.quant.int4_from_q8`): twice the MACs. For SmolLM2's
tied LM head (49,152 x 576 in ``Q8_0``) that was a third of a token's weight reads at one row. Here a few rows take
a GEMV that reads each weight once, and batches the batch GEMM of :mod:`gpu_worker.int4_batch` on the same
instruction set (AMX, else AVX512-BF16 dot products; from the same measured batch size as the 4-bit weights). Scales
are held in bf16, as the 4-bit path holds them, so ``q * d`` is exact in fp32 and both kernels compute with exactly
the weights the 4-bit halves represented."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from gpu_worker.int4_batch import Q8_ENTRY
from gpu_worker.native_build import CSRC, arg_block, load_kernel

SOURCE = CSRC / "q8_linear.c"
GROUP = 32
ROW_BLOCK = 64  # rows per block of the packed layout: TP shares cut at multiples of it
GEMV_MAX_ROWS = 8  # the C GEMV's largest row count per call (csrc/q8_linear.c)
LOAD_NOTES: dict[Path, str] = {}  # why load_q8(cache_dir) has no library, or runs single-threaded


@cache
def load_q8(cache_dir: Path) -> ctypes.CDLL | None:
    """The built library (``loom_q8_gemv``, ``loom_q8_amx``, ``loom_q8_dot``, ``loom_q8_fma``; argtypes set), built
    into ``cache_dir`` on first use; None (the reason logged and kept in ``LOAD_NOTES[cache_dir]``) where no compiler
    works."""
    sig = {name: [ctypes.c_void_p] for name in ("loom_q8_gemv", "loom_q8_amx", "loom_q8_dot", "loom_q8_fma")}
    return load_kernel(SOURCE, cache_dir, "8-bit C kernels", LOAD_NOTES, sig)


class Q8Linear:
    """``x @ W.T`` for a ``[N, K]`` weight of int8 groups of 32 with a bf16 scale each.

    Attributes:
        qp: ``[N_pad / 64, K, 64]`` int8: each 64-row block's values input by input (``N_pad`` = N rounded up to
            64, padding rows zero).
        d: ``[K / 32, N_pad]`` bf16 scales.
        out_features: N. in_features: K.
    """

    def __init__(self, q: torch.Tensor, d: torch.Tensor, lib: ctypes.CDLL) -> None:
        """Pack ``q [N, K]`` (int8 values) with scales ``d [N, K/32]`` (any float dtype; held as bf16).

        Raises:
            ValueError: ``K`` is not a multiple of 32, or the shapes disagree.
        """
        n, k = q.shape
        if k % GROUP or d.shape != (n, k // GROUP):
            raise ValueError(f"8-bit weight [{n}, {k}] with scales {tuple(d.shape)}: groups of {GROUP} expected")
        pad = -n % ROW_BLOCK
        q8 = torch.cat([q.to(torch.int8), torch.zeros(pad, k, dtype=torch.int8)]) if pad else q.to(torch.int8)
        self.qp = q8.view(-1, ROW_BLOCK, k).transpose(1, 2).contiguous()
        dd = torch.cat([d.float(), torch.zeros(pad, k // GROUP)]) if pad else d.float()
        self.d = dd.to(torch.bfloat16).T.contiguous()
        self.out_features, self.in_features = n, k
        self.lib = lib

    @property
    def nbytes(self) -> int:
        """Bytes held (values and scales)."""
        return self.qp.nbytes + self.d.nbytes

    def out_rows(self, lo: int, hi: int) -> Q8Linear:
        """Output rows ``[lo, hi)`` sharing the values (a view; scales copied, small).

        Raises:
            ValueError: ``lo`` or ``hi`` (other than the last row) is not a multiple of 64.
        """
        if lo % ROW_BLOCK or (hi % ROW_BLOCK and hi != self.out_features):
            raise ValueError(f"an 8-bit weight can only be cut at multiples of {ROW_BLOCK} rows, not [{lo}, {hi})")
        part = Q8Linear.__new__(Q8Linear)
        end = -(-hi // ROW_BLOCK) * ROW_BLOCK
        part.qp = self.qp[lo // ROW_BLOCK : end // ROW_BLOCK]
        part.d = self.d[:, lo:end].contiguous()
        part.out_features, part.in_features, part.lib = hi - lo, self.in_features, self.lib
        return part

    def dense(self) -> torch.Tensor:
        """The weight ``[N, K]`` in fp32, exactly as the kernels multiply it (for tests)."""
        n_pad = self.qp.shape[0] * ROW_BLOCK
        q = self.qp.transpose(1, 2).reshape(n_pad, self.in_features).float()
        return (q * self.d.float().T.repeat_interleave(GROUP, dim=1))[: self.out_features]

    def mm(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [M, K]`` (fp32 or bf16; another float dtype goes through fp32) -> ``[M, N]`` in ``x.dtype``, or in
        ``out_dtype`` (fp32 or bf16) where given: the kernels sum in fp32, so an fp32 output of a bf16 input is
        not rounded to bf16 (the LM head's logits, whose bf16 steps of 0.125 at |logit| >= 16 made exact ties).

        Batches from the 4-bit weights' measured threshold (:data:`gpu_worker.quant.BATCH_KERNEL`) run on the batch
        kernel of its instruction set (AMX, AVX512-BF16 or AVX2-FMA), fewer rows (or every batch where there is
        none) on the GEMV, 8 rows per call.

        Raises:
            MemoryError: the batch kernel could not allocate its buffers.
        """
        from gpu_worker import quant

        m = x.shape[0]
        want = out_dtype or x.dtype
        out_dtype = want if want in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty(m, self.out_features, dtype=out_dtype)
        n_pad, k = self.qp.shape[0] * ROW_BLOCK, self.in_features
        ob = int(out_dtype == torch.bfloat16)
        bk = quant.BATCH_KERNEL
        o, w = (out.stride(0), ob), (self.out_features, self.qp.data_ptr(), self.d.data_ptr())
        if bk is not None and m >= bk.min_rows and x.dtype in (torch.float32, torch.bfloat16):
            xs = x if x.stride(1) == 1 else x.contiguous()
            xb = int(x.dtype == torch.bfloat16)
            batch = getattr(self.lib, Q8_ENTRY[bk.isa])
            rc = batch(arg_block(m, n_pad, k, xs.data_ptr(), xs.stride(0), xb, out.data_ptr(), *o, *w))
            if rc == 2:
                raise MemoryError(f"8-bit {bk.isa} batch kernel: out of memory")
            if rc == 0:
                return out if out.dtype == want else out.to(want)
        xf = x.float().contiguous()
        for r0 in range(0, m, GEMV_MAX_ROWS):
            rows = min(GEMV_MAX_ROWS, m - r0)
            rc = self.lib.loom_q8_gemv(arg_block(rows, n_pad, k, xf[r0].data_ptr(), out[r0].data_ptr(), *o, *w))
            if rc:
                raise ValueError(f"8-bit GEMV refused x {tuple(x.shape)} for a [{self.out_features}, {k}] weight")
        return out if out.dtype == want else out.to(want)
