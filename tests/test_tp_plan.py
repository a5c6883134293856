"""Shard plans: uneven KV-head-group split (9 q / 3 kv heads), FFN split, refusal of impossible TP sizes."""

from __future__ import annotations

import pytest

from gpu_worker.tp_plan import make_shard_plan


def plans(nq, nkv, ffn, tp):
    return [make_shard_plan(nq, nkv, ffn, tp, r) for r in range(tp)]


def test_smollm2_tp2_is_uneven_by_kv_group():
    p0, p1 = plans(9, 3, 1536, 2)
    assert (p0.q_heads, p0.kv_heads) == ((0, 6), (0, 2))
    assert (p1.q_heads, p1.kv_heads) == ((6, 9), (2, 3))
    assert (p0.num_q_heads, p0.num_kv_heads, p1.num_q_heads, p1.num_kv_heads) == (6, 2, 3, 1)
    assert p0.ffn == (0, 768) and p1.ffn == (768, 1536)
    assert (p0.rank, p0.tp_size, p1.rank) == (0, 2, 1)


def test_smollm2_tp3_one_kv_head_each():
    ps = plans(9, 3, 1536, 3)
    assert [p.kv_heads for p in ps] == [(0, 1), (1, 2), (2, 3)]
    assert [p.q_heads for p in ps] == [(0, 3), (3, 6), (6, 9)]
    assert [p.ffn for p in ps] == [(0, 512), (512, 1024), (1024, 1536)]


def test_tp1_owns_everything():
    (p,) = plans(9, 3, 1536, 1)
    assert p.q_heads == (0, 9) and p.kv_heads == (0, 3) and p.ffn == (0, 1536)


def test_uneven_ffn_split_gives_first_ranks_the_extra():
    assert [p.ffn for p in plans(9, 3, 1537, 2)] == [(0, 769), (769, 1537)]
    assert [p.ffn for p in plans(9, 3, 1538, 3)] == [(0, 513), (513, 1026), (1026, 1538)]


@pytest.mark.parametrize(
    ("nq", "nkv", "ffn"), [(9, 3, 1536), (32, 8, 11008), (12, 4, 100), (8, 8, 64), (15, 5, 77), (4, 1, 10)]
)
def test_shards_tile_heads_and_ffn_exactly(nq, nkv, ffn):
    for tp in range(1, nkv + 1):
        ps = plans(nq, nkv, ffn, tp)
        for key in ("q_heads", "kv_heads", "ffn"):
            ranges = [getattr(p, key) for p in ps]
            assert ranges[0][0] == 0 and ranges[-1][1] == {"q_heads": nq, "kv_heads": nkv, "ffn": ffn}[key]
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), (key, tp, ranges)
        group = nq // nkv
        for p in ps:
            assert p.num_kv_heads >= 1
            # a rank's query heads are exactly those that read its KV heads (no cross-rank K/V)
            assert p.q_heads == (p.kv_heads[0] * group, p.kv_heads[1] * group)
            assert max(x.num_kv_heads for x in ps) - min(x.num_kv_heads for x in ps) <= 1


@pytest.mark.parametrize("tp", [4, 5, 9])
def test_tp_larger_than_kv_heads_is_refused(tp):
    with pytest.raises(ValueError, match=rf"--tp-size {tp} exceeds the model's 3 KV heads"):
        make_shard_plan(9, 3, 1536, tp, 0)


@pytest.mark.parametrize(("tp", "rank"), [(0, 0), (2, 2), (2, -1), (-1, 0)])
def test_bad_rank_or_size_is_refused(tp, rank):
    with pytest.raises(ValueError, match="bad TP rank"):
        make_shard_plan(9, 3, 1536, tp, rank)


def test_the_ffn_splits_evenly_when_kv_heads_do_not():
    """SmolLM2 at TP=2: rank 0 holds 6+2 heads, rank 1 3+1; the MLP still halves (the all-reduce between attention
    and MLP is a barrier, so extra FFN columns on rank 1 could not offset its shorter attention)."""
    plans = [make_shard_plan(9, 3, 1536, 2, r) for r in range(2)]
    assert [p.ffn for p in plans] == [(0, 768), (768, 1536)] and all(p.ffn[0] % 64 == 0 for p in plans)
