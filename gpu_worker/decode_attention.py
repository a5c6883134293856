"""Decode attention in C (``csrc/decode_attention.c``): one new query token per row against its KV history.

PyTorch's SDPA on CPU costs 30-70 us per call for one query row, and at 32 rows of ~256 positions with a padding
mask about 1 ms per layer on a 2-core CPU, several times what streaming K and V once takes. The C kernel reads
each (row, KV head)'s keys and values once for all its query heads, with an online softmax in fp32; rows of
different lengths need no mask, only their lengths. Whether it is used is measured once per machine against
SDPA (:func:`choose_decode_attention`), like Loom's other kernels.

Numerics: fp32 scores, softmax and accumulation (SDPA's CPU kernel rounds bf16 probabilities before P.V), so the
result is at least as close to an fp32 reference; it differs from SDPA's by rounding only.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_worker.native_build import CSRC, arg_block, load_kernel

SOURCE = CSRC / "decode_attention.c"
MAX_HEAD_DIM = 256
MAX_GROUP = 16  # query heads per KV head

# why the last load_decode_attention(cache_dir) has no kernel, or runs it single-threaded ("" = built with OpenMP)
LOAD_NOTES: dict[Path, str] = {}

DecodeAttention = Callable[..., torch.Tensor]  # (q, k, v, lengths, scale, index=None) -> out, see decode_attention


@cache
def load_decode_attention(cache_dir: Path) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The ``loom_decode_attention`` C function (argtypes set), built into ``cache_dir`` on first use; None (the
    reason logged and kept in ``LOAD_NOTES[cache_dir]``) where no compiler works."""
    lib = load_kernel(SOURCE, cache_dir, "C decode attention", LOAD_NOTES,
                      {"loom_decode_attention": [ctypes.c_void_p, ctypes.c_float]})  # fmt: skip
    return None if lib is None else lib.loom_decode_attention


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes (else the caller uses SDPA): CPU, fp32 or bf16 alike,
    head_dim a multiple of 16 (32 for bf16) up to 256, at most 16 query heads per KV head."""
    nq, nkv, d = q.shape[1], k.shape[1], q.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == q.dtype
        and d % (32 if q.dtype == torch.bfloat16 else 16) == 0
        and d <= MAX_HEAD_DIM
        and nq % nkv == 0
        and nq // nkv <= MAX_GROUP
    )


def decode_attention(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | None,
    scale: float,
    index: torch.Tensor | None = None,
    check_index: bool = True,
) -> torch.Tensor:
    """Softmax attention of ``q [G, nq, d]`` over each row's keys and values -> ``[G, nq, d]`` in ``q.dtype``.

    Without ``index``, ``k``/``v`` are ``[G, nkv, L, d]`` (any strides whose last dimension is contiguous: a view of
    the decode mirror, a transposed gather). With ``index`` ``[G, L]`` int64, ``k``/``v`` are the paged cache
    ``[slots, nkv, d]`` and position ``j`` of row ``g`` is cache row ``index[g, j]``, read in place (no gather).
    Query head ``h`` reads KV head ``h // (nq / nkv)`` (grouped-query attention, SDPA's ``enable_gqa``). Row ``g``
    attends to its first ``lengths[g]`` positions (``[G]`` int64; None: all ``L``). fp32 or bf16, all alike.
    ``check_index=False`` skips checking that ``index`` stays inside the cache (for a caller that checked it once
    for all layers: a row outside would be read out of bounds).

    Histories over 512 keys are attended in equal chunks on separate threads and merged (flash-decoding): a row's
    result depends on its own length only, never on the rows batched with it.

    Raises:
        ValueError: a shape, dtype, length or cache row the kernel does not take (see :func:`supports`).
        MemoryError: no memory for the chunks' partial results.
    """
    g, nq, d = q.shape
    if index is None:
        nkv, length = k.shape[1], k.shape[2]
        ok = k.dim() == 4 and k.shape[0] == g and v.shape == k.shape
    else:
        nkv, length = k.shape[1], index.shape[1]
        ok = k.dim() == 3 and v.shape == k.shape and index.shape[0] == g and index.dtype == torch.int64
        if ok and check_index and index.numel() and (int(index.min()) < 0 or int(index.max()) >= k.shape[0]):
            raise ValueError(f"C decode attention: cache rows {int(index.min())}..{int(index.max())} of {k.shape[0]}")
    if not ok or not supports(q, k) or v.dtype != q.dtype:
        raise ValueError(f"C decode attention: q {q.dtype} {tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    lens = None if lengths is None else lengths.to(torch.int64).contiguous()
    idx = None if index is None else index.contiguous()
    out = torch.empty(g, nq, d, dtype=q.dtype)
    if idx is None:
        kst, vst = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
    else:
        kst, vst = (0, k.stride(1), k.stride(0)), (0, v.stride(1), v.stride(0))
    args = arg_block(g, nq, nkv, d, length, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), *kst,
                     v.data_ptr(), *vst, 0 if lens is None else lens.data_ptr(), out.data_ptr(), out.stride(0),
                     out.stride(1), int(q.dtype == torch.bfloat16), 0 if idx is None else idx.data_ptr())  # fmt: skip
    rc = fn(args, scale)
    if rc == -2:
        raise MemoryError("C decode attention: no memory for the split histories' partial results")
    if rc:
        shown = "all" if lens is None else lens.tolist()[:8]
        raise ValueError(f"C decode attention refused lengths {shown} (L = {length}) or its shapes")
    return out


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None, scale: float):
    """The same as :func:`decode_attention` through PyTorch's SDPA (a padding mask for unequal lengths)."""
    mask = None
    if lengths is not None:
        mask = (torch.arange(k.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def _faster_than_sdpa(fn: ctypes._CFuncPtr) -> tuple[bool, str]:  # type: ignore[name-defined]
    """Time the kernel against SDPA at 1 row of 128 positions and 16 rows of ~256 (a mask), bf16, SmolLM2's heads
    (9 query, 3 KV, 64 dims); faster at both by 1.1x -> True, with a line of the timings."""
    from gpu_worker.timing import best_time

    gen = torch.Generator().manual_seed(0)
    parts, wins = [], True
    for rows, length in ((1, 128), (16, 256)):
        q = torch.randn(rows, 9, 64, generator=gen).to(torch.bfloat16)
        k = torch.randn(rows, 3, length, 64, generator=gen).to(torch.bfloat16)
        v = torch.randn(rows, 3, length, 64, generator=gen).to(torch.bfloat16)
        lens = torch.randint(length // 2, length + 1, (rows,), generator=gen) if rows > 1 else None
        t_c = best_time(lambda: [decode_attention(fn, q, k, v, lens, 0.125) for _ in range(10)], 5)  # noqa: B023
        t_s = best_time(lambda: [sdpa_decode(q, k, v, lens, 0.125) for _ in range(10)], 5)  # noqa: B023
        parts.append(f"{rows} x {length}: C {t_c * 1e5:.0f} us, SDPA {t_s * 1e5:.0f} us")
        wins = wins and t_c * 1.1 < t_s
    return wins, "; ".join(parts)


class CDecodeAttention:
    """The C kernel as the ``(q, k, v, lengths, scale, index=None) -> out`` callable
    :class:`~gpu_worker.model.LlamaShard` takes; it does not check ``index`` against the cache (the worker checks
    each step's slot tables once). ``fn`` is the C function itself, which a pure decode step binds once for all
    layers (:mod:`gpu_worker.bound_decode`)."""

    def __init__(self, fn: ctypes._CFuncPtr) -> None:  # type: ignore[name-defined]
        self.fn = fn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None, scale: float,
                 index: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """:func:`decode_attention` on this kernel, ``index`` unchecked."""
        return decode_attention(self.fn, q, k, v, lengths, scale, index, check_index=False)


def as_callable(fn: ctypes._CFuncPtr) -> CDecodeAttention:  # type: ignore[name-defined]
    """``fn`` as the callable :class:`~gpu_worker.model.LlamaShard` takes (see :class:`CDecodeAttention`)."""
    return CDecodeAttention(fn)


def choose_decode_attention(cache_dir: Path, group: object | None = None) -> tuple[DecodeAttention | None, str]:
    """The C decode attention as a callable ``(q, k, v, lengths, scale) -> out`` where it is faster than SDPA on
    this machine (measured once, cached), else None; with a line saying why. TP ranks agree (all or none)."""
    fn = load_decode_attention(cache_dir / "kernels")
    from gpu_worker.timing import agreed_choice

    key = f"{torch.__version__}|{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}"
    measure = None if fn is None else (lambda: _faster_than_sdpa(fn))
    vote, how, own = agreed_choice(cache_dir / "kernel-choice", "decode-attention", key, measure, group)
    use = bool(vote)
    if fn is None:
        how = f"unavailable: {LOAD_NOTES.get(cache_dir / 'kernels', '')}"
    elif own and not use:
        how += "; another TP rank keeps SDPA"
    if not use or fn is None:
        return None, f"decode attention on SDPA (C kernel {how if fn is None else 'not faster: ' + how})"
    return as_callable(fn), f"decode attention on the C kernel ({how})"
