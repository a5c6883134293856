"""Weight-only quantised linear layers and embeddings: the stored form stays quantised, the GEMM reads it.

Two CPU kernels from PyTorch do the work; activations go in as bf16 (both kernels are 30-50x slower with
fp32 or fp16 inputs on CPU, measured here), outputs come back in the caller's dtype:

- ``Int4Linear``: 4-bit values in groups of 32 along the input dimension, each group with a scale and a zero,
  ``w = (q - 8) * scale + zero`` (``torch.ops.aten._weight_int4pack_mm_for_cpu``, the tinygemm layout). An
  asymmetric 4-bit group quantisation (GGUF ``Q4_1``: ``w = d*q + m``, so ``scale = d``, ``zero = m + 8d``;
  ``Q4_0``: ``w = d*(q - 8)``, ``zero = 0``) maps onto it one to one. An 8-bit group quantisation (GGUF ``Q8_0``:
  ``w = d*q``, q in [-128, 127]) is split into two 4-bit halves, ``q = 16*hi + lo``, stored side by side as a
  matrix of twice the width; the input is fed twice (``[x, x]``), so the product is exact in the same way.
- ``Int8Linear``: symmetric int8 with one scale per output row (``torch.ops.aten._weight_int8pack_mm``),
  quantised at load from any checkpoint (the ``--quantization int8`` mode).

Scales and zeros are held in bf16 (the kernels' requirement), so a GGUF weight is represented to bf16
precision, the same precision as the bf16 path on the dequantised checkpoint. At one row these kernels read
2-4x fewer bytes than a bf16 GEMM and run 2.5-4.5x faster; from about 16 rows up they are compute-bound and
slower than AMX bf16 GEMM. So on CPUs with AMX, ``Int4Linear`` multiplies batches on Loom's own kernel
(:mod:`gpu_worker.int4_batch`, over the same packed weights; ``bench/decode_step.py --int4-ab``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpu_worker.int4_batch import BatchKernel, GemvKernel, batch_mm

GROUP = 32  # GGUF block size and the int4 kernel's group size
_KERNEL_DTYPE = torch.bfloat16
_AMX_X = (torch.float32, torch.bfloat16)
# the overloads themselves: calling the packet (torch.ops.aten.X) resolves the overload on every call, ~1 us
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default

# the batched AMX kernel (gpu_worker.int4_batch.BatchKernel) Int4Linear.mm uses from its min_rows up; None = PyTorch's
# kernel for every batch. Set once per process by the worker (gpu_worker.int4_batch.choose_batch_kernel).
BATCH_KERNEL: BatchKernel | None = None
# the C few-row GEMV Int4Linear.mm uses up to its max_rows (below BATCH_KERNEL's min_rows); None = PyTorch's kernel.
# Set once per process by the worker (gpu_worker.int4_batch.choose_gemv_kernel).
GEMV_KERNEL: GemvKernel | None = None


class QuantizationError(ValueError):
    """Weights that cannot be quantised or repacked as asked; the message names the tensor and the reason."""


def check_device(device: torch.device) -> None:
    """Raise QuantizationError unless ``device`` has the weight-only kernels Loom uses (CPU today)."""
    if device.type != "cpu":
        raise QuantizationError(
            f"--quantization int8/gguf uses PyTorch's CPU weight-only kernels; device {device} is not supported "
            "yet: use --quantization none there"
        )


class Int4Linear:
    """``x @ W.T`` for a ``[N, K]`` weight stored as 4-bit groups of 32 (tinygemm layout).

    Attributes:
        packed: ``[N_pad, K2/2]`` uint8, from ``_convert_weight_to_int4pack_for_cpu`` (``N_pad`` = N rounded up
            to 16, the kernel's row multiple; ``K2`` = K, or 2K when ``dup_input``).
        scales_zeros: ``[K2/32, N_pad, 2]`` bf16.
        out_features: N. in_features: K (the caller's input width).
        dup_input: the input is fed twice (an 8-bit weight split into two 4-bit halves).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dup_input: bool = False) -> None:
        """Pack ``q [N, K2]`` (integers 0..15, any int dtype) with ``scale``/``zero`` ``[N, K2/32]`` (fp32).

        Raises:
            QuantizationError: ``K2`` is not a multiple of 32 or a value is outside 0..15.
        """
        n, k2 = q.shape
        if k2 % GROUP:
            raise QuantizationError(f"4-bit weight of width {k2} is not a whole number of {GROUP}-blocks")
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise QuantizationError("4-bit weight values must lie in 0..15")
        pad = -n % 16
        if pad:
            q = torch.cat([q, torch.full((pad, k2), 8, dtype=q.dtype)])
            scale = torch.cat([scale, torch.zeros(pad, scale.shape[1], dtype=scale.dtype)])
            zero = torch.cat([zero, torch.zeros(pad, zero.shape[1], dtype=zero.dtype)])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack([scale.float(), zero.float()], dim=-1)  # [N_pad, G, 2]
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(_KERNEL_DTYPE)
        self.out_features = n
        self.in_features = k2 // 2 if dup_input else k2
        self.dup_input = dup_input

    @property
    def nbytes(self) -> int:
        """Bytes held (packed values plus scales and zeros)."""
        return self.packed.nbytes + self.scales_zeros.nbytes

    def out_rows(self, lo: int, hi: int) -> Int4Linear:
        """Output rows ``[lo, hi)`` as an Int4Linear sharing the packed values (scales and zeros copied, small).

        The kernel's packed layout interleaves rows in blocks: a cut at a multiple of 64 rows reproduces the
        whole weight's products bit for bit (measured; 16 does not).

        Raises:
            QuantizationError: ``lo`` or ``hi`` (other than the last row) is not a multiple of 64.
        """
        if lo % 64 or (hi % 64 and hi != self.out_features):
            raise QuantizationError(f"a 4-bit weight can only be cut at multiples of 64 rows, not [{lo}, {hi})")
        part = Int4Linear.__new__(Int4Linear)
        end = hi if hi != self.out_features else self.packed.shape[0]  # the last share keeps the row padding
        part.packed = self.packed[lo:end]
        part.scales_zeros = self.scales_zeros[:, lo:end].contiguous()
        part.out_features, part.in_features, part.dup_input = hi - lo, self.in_features, self.dup_input
        return part

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` (any float dtype) -> ``[M, N]`` in ``x.dtype``.

        From :data:`BATCH_KERNEL`'s ``min_rows`` rows up the C batch kernel of :mod:`gpu_worker.int4_batch` computes
        it, up to :data:`GEMV_KERNEL`'s ``max_rows`` rows its C GEMV (both where the packed layout and ``x.dtype``
        allow); otherwise PyTorch's 4-bit kernel (:meth:`mm_torch`).
        """
        if self.packed.shape[0] % 64 == 0 and x.dtype in _AMX_X:
            bk, gk, m = BATCH_KERNEL, GEMV_KERNEL, x.shape[0]
            fn = (
                bk.fn if bk is not None and m >= bk.min_rows else gk.fn if gk is not None and m <= gk.max_rows else None
            )
            if fn is not None:
                xk = torch.cat([x, x], dim=-1) if self.dup_input else x
                return batch_mm(fn, xk, self.packed, self.scales_zeros, self.out_features)
        return self.mm_torch(x)

    def mm_torch(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`mm` on PyTorch's 4-bit kernel, whatever the batch size."""
        xk = x if x.dtype == _KERNEL_DTYPE else x.to(_KERNEL_DTYPE)
        if self.dup_input:
            xk = torch.cat([xk, xk], dim=-1)
        out = _INT4_MM(xk, self.packed, GROUP, self.scales_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out if out.dtype == x.dtype else out.to(x.dtype)


class Int8Linear:
    """``x @ W.T`` for a ``[N, K]`` weight stored as int8 with one bf16 scale per output row.

    Attributes:
        q: ``[N, K]`` int8. scales: ``[N]`` bf16 (``w[n, :] ~ q[n, :] * scales[n]``).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.q = q.contiguous()
        self.scales = scales.to(_KERNEL_DTYPE).contiguous()
        self.out_features, self.in_features = q.shape

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.q.nbytes + self.scales.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` (any float dtype) -> ``[M, N]`` in ``x.dtype``."""
        xk = x if x.dtype == _KERNEL_DTYPE else x.to(_KERNEL_DTYPE)
        out = _INT8_MM(xk, self.q, self.scales)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def out_rows(self, lo: int, hi: int) -> Int8Linear:
        """Output rows ``[lo, hi)`` as an Int8Linear viewing the same values and scales."""
        return Int8Linear(self.q[lo:hi], self.scales[lo:hi])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantised rows ``[T, K]`` in ``dtype`` (the embedding lookup of a tied int8 table)."""
        return (self.q[ids].float() * self.scales[ids].float()[:, None]).to(dtype)


QuantLinear = Int4Linear | Int8Linear  # what ``LlamaShard._mm`` accepts besides a dense tensor


def cached_int4_choice(dense_dtype: torch.dtype, cache_dir: Path, group: object | None = None) -> tuple[bool, str]:
    """:func:`int4_beats_dense`, measured once per machine and kept in ``cache_dir``, agreed by the TP ranks of
    ``group`` (all must find it faster, so every rank holds the same kind of weights): ``(faster, how)``.

    A start-up timing on a shared 2-core machine can flip with the load of the moment; keeping the first answer
    (keyed by CPU model and flags, torch version and dtype) gives every later start, and every restart after a
    failure, the same weights and so the same outputs (:func:`gpu_worker.timing.agreed_choice`). Delete the file
    to measure again.
    """
    from gpu_worker.timing import agreed_choice

    def measure() -> tuple[bool, str]:
        faster, t4, td = int4_beats_dense(dense_dtype)
        dense = str(dense_dtype).replace("torch.", "")
        return faster, f"one row through 8 gate matrices: 4-bit {t4 * 1e6:.0f} us, {dense} {td * 1e6:.0f} us"

    vote, how, own = agreed_choice(cache_dir, "int4-vs-dense", f"{torch.__version__}|{dense_dtype}", measure, group)
    return bool(vote), how + ("; another TP rank found the dense path faster" if own and not vote else "")


def int4_beats_dense(dense_dtype: torch.dtype, matrices: int = 8) -> tuple[bool, float, float]:
    """Whether the 4-bit kernel decodes one row faster than a dense ``dense_dtype`` GEMM on this CPU.

    Times one row through ``matrices`` distinct ``[1536, 576]`` weights (SmolLM2's gate half; 8 of them are
    28 MB in fp32, more than a cache holds, as a real decode step streams its weights), fastest of 5 passes.
    Returns ``(faster, int4 seconds, dense seconds)``.
    """
    from gpu_worker.timing import best_time

    g = torch.Generator().manual_seed(0)
    n, k = 1536, 576
    dense = [torch.randn(n, k, generator=g).to(dense_dtype) for _ in range(matrices)]
    quant = [
        Int4Linear(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // GROUP), torch.zeros(n, k // GROUP))
        for _ in range(matrices)
    ]
    xd = torch.randn(1, k, generator=g).to(dense_dtype)
    xq = xd.to(_KERNEL_DTYPE)
    t_quant = best_time(lambda: [w.mm(xq) for w in quant], 5)
    t_dense = best_time(lambda: [xd @ w.T for w in dense], 5)
    return t_quant < t_dense, t_quant, t_dense


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of ``w [N, K]``: ``(q [N, K] int8, scales [N] fp32)``, ``w ~ q * scales[:, None]``.

    The scale is ``max|w[n]| / 127`` (rows of zeros get scale 1), values round to nearest. Scales are then
    rounded to bf16 *before* quantising, so that the kernel's bf16 scale is the one the values were made for.
    """
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(_KERNEL_DTYPE).float()
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class GGUFEmbedding:
    """An embedding table left in the GGUF file (``Q8_0``, ``Q4_0`` or ``Q4_1`` blocks, memory-mapped read-only).

    Looking rows up decodes only their blocks, so the table costs this process only the pages of the tokens
    it has met (SmolLM2's 49,152-row table is 30 MB in Q8_0 and would double the quantised model's resident
    size if copied; the LM head keeps its own repacked copy for the GEMM). The map is made fresh after loading,
    so the pages the loader read do not stay counted. As with any mapped weights, the file must not be
    rewritten in place while a server runs (replacing it, as pip does, is safe).
    """

    def __init__(self, path: str, offset: int, rows: int, row_bytes: int, kind: str) -> None:
        self.raw = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(rows, row_bytes))
        self.kind = kind

    @property
    def nbytes(self) -> int:
        """Bytes of private memory held (none: the table stays in the file's page cache)."""
        return 0

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[T, K]`` of ``ids [T]`` dequantised in fp32, then cast to ``dtype``."""
        raw = self.raw[ids.cpu().numpy()]
        if self.kind == "Q8_0":
            q, scale = decode_q8_0_blocks(raw)
            zero = None
        else:
            q, scale, zero = decode_q4_blocks(raw, self.kind)
        t = len(ids)
        w = torch.from_numpy(q).float().view(t, -1, GROUP) * torch.from_numpy(scale)[:, :, None]
        if zero is not None:
            w += torch.from_numpy(zero)[:, :, None]
        return w.view(t, -1).to(device=ids.device, dtype=dtype)


# ---- GGUF block layouts (ggml's quants): one row is a run of blocks of 32 weights ----


def _fp16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def decode_q4_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split GGUF ``Q4_0``/``Q4_1`` rows into ``(q [N, K] uint8 0..15, scale [N, G] fp32, zero [N, G] fp32)``.

    ``raw`` is ``[N, G * block_bytes]`` uint8 (``Q4_0``: fp16 d + 16 bytes; ``Q4_1``: fp16 d, fp16 m + 16 bytes;
    byte j of a block holds weight j in its low nibble and weight j + 16 in its high nibble).
    ``w = q * scale + zero``: ``Q4_1`` gives ``scale = d, zero = m``; ``Q4_0`` gives ``scale = d, zero = -8d``.
    """
    head = 2 if kind == "Q4_0" else 4
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, head + 16)
    d = _fp16(blocks[:, :, 0:2])
    zero = _fp16(blocks[:, :, 2:4]) if kind == "Q4_1" else -8.0 * d
    qs = blocks[:, :, head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, -1)
    return q, d, zero


def decode_q8_0_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split GGUF ``Q8_0`` rows ``[N, G * 34]`` uint8 into ``(q [N, K] int8, d [N, G] fp32)``, ``w = q * d``."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = _fp16(blocks[:, :, 0:2])
    q = blocks[:, :, 2:].copy().view(np.int8).reshape(n, -1)
    return q, d


def int4_from_affine(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Linear:
    """An Int4Linear for ``w = q * scale + zero`` (q 0..15, groups of 32): the kernel's zero is ``zero + 8*scale``."""
    return Int4Linear(q, scale, zero + 8.0 * scale)


def int4_from_q8(q: torch.Tensor, d: torch.Tensor) -> Int4Linear:
    """An Int4Linear for ``w = q * d`` (q int8, groups of 32), exact: ``q = 16*hi + lo`` as two 4-bit halves.

    ``hi = q >> 4`` in -8..7 is stored as ``hi + 8`` with scale ``16d``, zero 0; ``lo = q & 15`` in 0..15 with
    scale ``d``, zero ``8d``. The halves sit side by side (``[N, 2K]``) and the input is fed twice.
    """
    qi = q.to(torch.int32)
    hi, lo = (qi >> 4) + 8, qi & 15
    zeros = torch.zeros_like(d)
    return Int4Linear(
        torch.cat([hi, lo], dim=1), torch.cat([16.0 * d, d], dim=1), torch.cat([zeros, 8.0 * d], dim=1), True
    )
