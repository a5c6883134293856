"""Vocabulary-parallel LM head: each TP rank multiplies only its rows of the head, one all-reduce joins them.

A replicated head makes every rank read the whole ``[vocab, hidden]`` table each step (SmolLM2: 28 M of its
135 M parameters, a fifth of a step's GEMM work repeated on every rank). Split by vocabulary rows
(Megatron-LM's vocab-parallel output layer), each rank writes its logits into its columns of a zero
``[B, vocab]`` tensor and one sum over ranks concatenates them exactly (``x + 0 == x``), so every rank holds the
same logits as the replicated head computed. The embedding lookup keeps the whole table (a tied head is a view of
it, never a copy).
"""

from __future__ import annotations

import torch

from gpu_worker.quant import Int4Linear, Int8Linear

# row boundaries fall on multiples of this: the 4-bit CPU kernel's packed layout interleaves rows in blocks
# (a cut at a multiple of 64 rows reproduces the whole head's products bit for bit, measured; 16 does not)
ROW_ALIGN = 64


def vocab_range(vocab: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the head that ``rank`` owns: equal shares rounded up to :data:`ROW_ALIGN` (the last
    rank takes what is left, possibly nothing for a tiny vocabulary)."""
    share = -(-vocab // tp_size)
    share = -(-share // ROW_ALIGN) * ROW_ALIGN
    lo = min(rank * share, vocab)
    return lo, min(lo + share, vocab)


def head_rows(w: torch.Tensor | Int4Linear | Int8Linear, lo: int, hi: int) -> torch.Tensor | Int4Linear | Int8Linear:
    """Rows ``[lo, hi)`` of an LM head, without copying its values (views of the same storage).

    Raises:
        ValueError: a 4-bit head cut at a row that is not a multiple of :data:`ROW_ALIGN`, or an unknown kind.
    """
    if isinstance(w, torch.Tensor):
        return w[lo:hi]
    if isinstance(w, Int8Linear):
        part = Int8Linear.__new__(Int8Linear)
        part.q, part.scales = w.q[lo:hi], w.scales[lo:hi]
        part.out_features, part.in_features = hi - lo, w.in_features
        return part
    if isinstance(w, Int4Linear):
        if lo % ROW_ALIGN or (hi % ROW_ALIGN and hi != w.out_features):
            raise ValueError(f"a 4-bit LM head can only be cut at multiples of {ROW_ALIGN} rows, not [{lo}, {hi})")
        part = Int4Linear.__new__(Int4Linear)
        pad_hi = hi if hi != w.out_features else w.packed.shape[0]  # the last share keeps the kernel's row padding
        part.packed = w.packed[lo:pad_hi]
        part.scales_zeros = w.scales_zeros[:, lo:pad_hi].contiguous()
        part.out_features, part.in_features, part.dup_input = hi - lo, w.in_features, w.dup_input
        return part
    raise ValueError(f"cannot split an LM head of type {type(w).__name__} by vocabulary rows")
