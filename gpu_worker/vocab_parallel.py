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

from gpu_worker.q8_linear import Q8Linear
from gpu_worker.quant import Int4Linear, Int8Linear

ROW_ALIGN = 64  # row boundaries fall on multiples of this, where a 4-bit head can be cut (Int4Linear.out_rows)


def vocab_range(vocab: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the head that ``rank`` owns: equal shares rounded up to :data:`ROW_ALIGN` (the last
    rank takes what is left, possibly nothing for a tiny vocabulary)."""
    share = -(-vocab // tp_size)
    share = -(-share // ROW_ALIGN) * ROW_ALIGN
    lo = min(rank * share, vocab)
    return lo, min(lo + share, vocab)


Head = torch.Tensor | Int4Linear | Int8Linear | Q8Linear


def head_rows(w: Head, lo: int, hi: int) -> Head:
    """Rows ``[lo, hi)`` of an LM head, sharing its values (views; a 4- or 8-bit head copies only its scales).

    Raises:
        ValueError (QuantizationError for 4 bits): a 4- or 8-bit head cut at a row that is not a multiple of
            :data:`ROW_ALIGN`.
    """
    return w[lo:hi] if isinstance(w, torch.Tensor) else w.out_rows(lo, hi)
