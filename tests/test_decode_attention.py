"""The C decode attention (gpu_worker/decode_attention.py, csrc/decode_attention.c) against float64 softmax
attention and PyTorch's SDPA: shapes with their own compiled version and the general one, every history length
around the 16-key groups and 64-key softmax blocks, the strides the decode mirror and the paged-cache gather make,
refusals, and its start-up choice. Skipped where no C compiler works (the reason is printed)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.decode_attention import (
    LOAD_NOTES,
    as_callable,
    choose_decode_attention,
    decode_attention,
    load_decode_attention,
    sdpa_decode,
    supports,
)


@pytest.fixture(scope="module")
def fn(tmp_path_factory):
    from loom_helpers import kernel_or_skip

    return kernel_or_skip(load_decode_attention, LOAD_NOTES, tmp_path_factory.mktemp("kernels"), "C decode attention")


def reference(q, k, v, lengths, scale) -> torch.Tensor:
    """float64 ``softmax(scale * q k^T) v`` per row over its first ``lengths[g]`` positions, query head h reading KV
    head ``h // (nq / nkv)``."""
    g, nq, d = q.shape
    rep = nq // k.shape[1]
    out = torch.empty(g, nq, d, dtype=torch.float64)
    for r in range(g):
        n = k.shape[2] if lengths is None else int(lengths[r])
        kk = k[r, :, :n].double().repeat_interleave(rep, 0)
        vv = v[r, :, :n].double().repeat_interleave(rep, 0)
        s = torch.einsum("hd,hjd->hj", q[r].double(), kk) * scale
        out[r] = torch.einsum("hj,hjd->hd", s.softmax(-1), vv)
    return out


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: sums in fp32 only; bf16: plus the output's rounding (2^-9 relative), and never worse than that."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    else:
        err = (got.double() - want).abs()
        assert bool((err <= want.abs() * 2.0**-8 + 1e-6).all()), float((err - want.abs() * 2.0**-8).max())


SHAPES = [  # (rows, q heads, kv heads, head_dim): SmolLM2 (9/3/64), Llama-3-8B-like (32/8/128), MHA, and the
    (3, 9, 3, 64),  # general version: 5 or 6 query heads per KV head, head_dim 96 or 256
    (2, 32, 8, 128),
    (2, 4, 4, 64),
    (2, 10, 2, 64),
    (2, 12, 2, 96),
    (1, 2, 1, 256),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "nq", "nkv", "d"), SHAPES)
def test_equals_float64_softmax_attention(fn, dtype, rows, nq, nkv, d):
    g = torch.Generator().manual_seed(rows * 1000 + nq * 10 + d)
    length = 150
    q = torch.randn(rows, nq, d, generator=g).to(dtype)
    k = (torch.randn(rows, nkv, length, d, generator=g) * 2).to(dtype)  # peaked softmax rows too
    v = torch.randn(rows, nkv, length, d, generator=g).to(dtype)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    lengths[0] = length
    scale = 1 / math.sqrt(d)
    got = decode_attention(fn, q, k, v, lengths, scale)
    assert got.dtype == dtype and got.shape == (rows, nq, d)
    want = reference(q, k, v, lengths, scale)
    check(got, want)
    sdpa = sdpa_decode(q, k, v, lengths, scale).double()  # and no further from the reference than SDPA, plus rounding
    assert float((got.double() - want).abs().max()) <= float((sdpa - want).abs().max()) + 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_length_around_key_groups_and_softmax_blocks(fn, dtype):
    g = torch.Generator().manual_seed(7)
    lens = [1, 2, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 200]
    length = max(lens)
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    k = torch.randn(len(lens), 3, length, 64, generator=g).to(dtype)
    v = torch.randn(len(lens), 3, length, 64, generator=g).to(dtype)
    lengths = torch.tensor(lens)
    check(decode_attention(fn, q, k, v, lengths, 0.125), reference(q, k, v, lengths, 0.125))
    # positions past a row's length are never read: NaN and inf there change nothing
    k2, v2 = k.clone(), v.clone()
    for r, n in enumerate(lens):
        k2[r, :, n:], v2[r, :, n:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(fn, q, k2, v2, lengths, 0.125), decode_attention(fn, q, k, v, lengths, 0.125))


def test_a_long_history_and_large_scores_stay_exact(fn):
    """1,500 positions (many softmax blocks, the running maximum rising late) with scores up to ~100."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 64, generator=g) * 3
    k = torch.randn(2, 3, 1500, 64, generator=g) * 3
    k[:, :, 1400] *= 2  # a late, much larger score: every earlier block is rescaled
    v = torch.randn(2, 3, 1500, 64, generator=g)
    check(decode_attention(fn, q, k, v, None, 0.125), reference(q, k, v, None, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_histories_split_into_chunks_are_exact_and_batch_invariant(fn, dtype):
    """Over 512 keys a row is attended in equal chunks merged afterwards: exact at the split points, in place on a
    paged cache as over a gather, never reading past a row's length, and each row's output the same bits alone as
    in any batch (the split depends on its own length only)."""
    g = torch.Generator().manual_seed(13)
    lens = [512, 513, 700, 1024, 1025, 1537, 3]
    length, slots = max(lens), 4000
    kc = (torch.randn(slots, 3, 64, generator=g) * 2).to(dtype)
    vc = torch.randn(slots, 3, 64, generator=g).to(dtype)
    index = torch.stack([torch.randperm(slots, generator=g)[:length] for _ in lens])
    lengths = torch.tensor(lens)
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    got = decode_attention(fn, q, kc, vc, lengths, 0.125, index)
    kd, vd = kc[index].transpose(1, 2), vc[index].transpose(1, 2)
    assert torch.equal(got, decode_attention(fn, q, kd, vd, lengths, 0.125))
    check(got, reference(q, kd, vd, lengths, 0.125))
    for r in range(len(lens)):
        alone = decode_attention(fn, q[r : r + 1], kc, vc, lengths[r : r + 1], 0.125, index[r : r + 1])
        assert torch.equal(alone[0], got[r]), r
    kp, vp = kd.clone(), vd.clone()
    for r, n in enumerate(lens):
        kp[r, :, n:], vp[r, :, n:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(fn, q, kp, vp, lengths, 0.125), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mirror_and_gather_layouts_read_the_same_values(fn, dtype):
    """The decode mirror's view ``[rows, kv, len_cap, d][:, :, :L]`` and the paged-cache gather's transposed view
    ``[rows, L, kv, d].transpose(1, 2)``, with q a head slice of the fused q|k tensor: bit-identical results."""
    g = torch.Generator().manual_seed(11)
    rows, length = 4, 77
    k = torch.randn(rows, 3, length, 64, generator=g).to(dtype)
    v = torch.randn(rows, 3, length, 64, generator=g).to(dtype)
    qk = torch.randn(rows, 12, 64, generator=g).to(dtype)
    q = qk[:, :9]  # strided: row stride 12 heads
    lengths = torch.tensor([77, 5, 64, 33])
    base = decode_attention(fn, q.contiguous(), k.contiguous(), v.contiguous(), lengths, 0.125)
    mk = torch.zeros(rows + 2, 3, 128, 64, dtype=dtype)
    mv = torch.zeros(rows + 2, 3, 128, 64, dtype=dtype)
    mk[:rows, :, :length], mv[:rows, :, :length] = k, v
    assert torch.equal(decode_attention(fn, q, mk[:rows, :, :length], mv[:rows, :, :length], lengths, 0.125), base)
    gk, gv = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    assert gk.stride(2) == 3 * 64  # positions 3 heads apart, as index_select(...).view(...).transpose(1, 2) gives
    assert torch.equal(decode_attention(fn, q, gk, gv, lengths, 0.125), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_a_paged_cache_in_place_through_the_slot_table(fn, dtype):
    """Rows' positions scattered over a paged cache ``[slots, kv, d]``: the same as gathering them first."""
    g = torch.Generator().manual_seed(5)
    rows, length, slots = 3, 70, 400
    kc = torch.randn(slots, 3, 64, generator=g).to(dtype)
    vc = torch.randn(slots, 3, 64, generator=g).to(dtype)
    index = torch.stack([torch.randperm(slots, generator=g)[:length] for _ in range(rows)])
    lengths = torch.tensor([70, 1, 33])
    q = torch.randn(rows, 9, 64, generator=g).to(dtype)
    got = decode_attention(fn, q, kc, vc, lengths, 0.125, index)
    kd = kc[index].transpose(1, 2)  # [rows, kv, L, d]
    vd = vc[index].transpose(1, 2)
    assert torch.equal(got, decode_attention(fn, q, kd, vd, lengths, 0.125))
    check(got, reference(q, kd, vd, lengths, 0.125))
    bad = index.clone()
    bad[1, 5] = slots  # past the cache: refused before any read
    with pytest.raises(ValueError, match="cache rows"):
        decode_attention(fn, q, kc, vc, lengths, 0.125, bad)


def test_a_worker_on_the_kernel_keeps_no_mirror_and_checks_slot_tables(model_path, monkeypatch, fn):
    from loom_helpers import make_args

    import gpu_worker.decode_attention as da
    from gpu_worker.worker import Worker, WorkerError
    from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

    monkeypatch.setattr(da, "choose_decode_attention", lambda *a, **k: (as_callable(fn), "C kernel (test)"))
    w = Worker(make_args(model_path, max_total_tokens=512))
    assert w.model.decode_attn is not None and w.decode_mirror is None
    greedy = WorkerSampling(0.0, 1.0, -1, None)
    w.forward_logits(ForwardBatch(1, [BatchReq("a", 0, [5, 6, 7], 0, [0, 1, 2], None, greedy)]))
    out = w.forward_logits(ForwardBatch(2, [BatchReq("a", 0, [8], 3, [3], None, greedy, 1)]))
    assert torch.isfinite(out).all()
    w.kv.req_to_token[0, 1] = w.kv.null_slot + 5  # a corrupt table entry is refused, never read
    with pytest.raises(WorkerError, match="leave the cache"):
        w.forward_logits(ForwardBatch(3, [BatchReq("a", 0, [9], 4, [4], None, greedy, 2)]))


def test_refuses_what_it_does_not_take(fn):
    q, k = torch.randn(1, 9, 64), torch.randn(1, 3, 10, 64)
    with pytest.raises(ValueError, match="refused lengths"):
        decode_attention(fn, q, k, k, torch.tensor([0]), 0.125)
    with pytest.raises(ValueError, match="refused lengths"):
        decode_attention(fn, q, k, k, torch.tensor([11]), 0.125)
    with pytest.raises(ValueError, match="C decode attention"):
        decode_attention(fn, torch.randn(1, 9, 40), torch.randn(1, 3, 10, 40), torch.randn(1, 3, 10, 40), None, 0.1)
    with pytest.raises(ValueError, match="C decode attention"):  # q and k of different dtypes
        decode_attention(fn, q.to(torch.bfloat16), k, k, None, 0.125)
    with pytest.raises(ValueError, match="C decode attention"):  # 8 query heads over 3 KV heads
        decode_attention(fn, torch.randn(1, 8, 64), k, k, None, 0.125)
    assert not supports(torch.randn(1, 9, 48).to(torch.bfloat16), torch.randn(1, 3, 4, 48).to(torch.bfloat16))
    assert supports(torch.randn(1, 9, 48), torch.randn(1, 3, 4, 48))  # fp32 takes multiples of 16


def test_start_up_choice_is_measured_once_and_cached(tmp_path, monkeypatch):
    import gpu_worker.decode_attention as da

    calls = []
    real = da._faster_than_sdpa

    def counting(f):
        calls.append(1)
        return real(f)

    monkeypatch.setattr(da, "_faster_than_sdpa", counting)
    first, how = choose_decode_attention(tmp_path)
    if da.load_decode_attention(tmp_path / "kernels") is None:
        assert first is None and "unavailable" in how
        return
    assert len(calls) == 1 and ("C kernel" in how)
    again, how2 = choose_decode_attention(tmp_path)
    assert len(calls) == 1 and "measured earlier" in how2
    assert (first is None) == (again is None)
    if first is not None:  # the chosen callable is the kernel
        q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 20, 64)
        lengths = torch.tensor([20, 7])
        check(first(q, k, k, lengths, 0.125), reference(q, k, k, lengths, 0.125))


def test_as_callable_is_what_the_model_calls(fn):
    q, k = torch.randn(1, 9, 64), torch.randn(1, 3, 9, 64)
    assert torch.equal(as_callable(fn)(q, k, k, None, 0.125), decode_attention(fn, q, k, k, None, 0.125))
