"""Vocabulary-parallel LM head: row shares cover the vocabulary, and each kind of head's rows give the whole
head's logits for those rows, bit for bit."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.quant import Int4Linear, Int8Linear, quantize_int8_rows
from gpu_worker.vocab_parallel import ROW_ALIGN, head_rows, vocab_range


@pytest.mark.parametrize("vocab", [49152, 32000, 128256, 100, 64, 1])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_shares_tile_the_vocabulary(vocab, tp):
    ranges = [vocab_range(vocab, tp, r) for r in range(tp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    for (lo, hi), (lo2, _) in zip(ranges, ranges[1:], strict=False):
        assert hi == lo2 and lo <= hi
    assert all(lo % ROW_ALIGN == 0 for lo, _ in ranges if lo < vocab)


def _int4(n: int, k: int) -> Int4Linear:
    g = torch.Generator().manual_seed(n)
    q = torch.randint(0, 16, (n, k), generator=g)
    return Int4Linear(q, torch.rand(n, k // 32, generator=g) * 0.1, torch.rand(n, k // 32, generator=g))


@pytest.mark.parametrize("kind", ["dense", "int8", "int4"])
def test_rows_of_a_head_give_its_logits(kind):
    n, k, tp = 300, 64, 3  # 300 rows: the last share is not a multiple of 64 (and the 4-bit head is padded)
    if kind == "dense":
        head = torch.randn(n, k)
        x = torch.randn(5, k)
        full = x @ head.T
        mm = lambda w: x @ w.T  # noqa: E731
    elif kind == "int8":
        head = Int8Linear(*quantize_int8_rows(torch.randn(n, k)))
        x = torch.randn(5, k).bfloat16()
        full, mm = head.mm(x), lambda w: w.mm(x)  # noqa: E731
    else:
        head = _int4(n, k)
        x = torch.randn(5, k).bfloat16()
        full, mm = head.mm(x), lambda w: w.mm(x)  # noqa: E731
    joined = torch.cat([mm(head_rows(head, *vocab_range(n, tp, r))) for r in range(tp)], dim=1)
    assert torch.equal(joined, full)


def test_int4_head_refuses_a_cut_through_a_row_block():
    with pytest.raises(ValueError, match="multiples of 64"):
        head_rows(_int4(256, 64), 16, 128)
