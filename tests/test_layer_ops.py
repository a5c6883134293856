"""The fused C layer ops (gpu_worker/layer_ops.py, csrc/layer_ops.c) against the PyTorch code they replace in
gpu_worker/model.py: in bf16 the same bits (RMSNorm may differ by one bf16 step in a few elements: its fp32 sum of
squares runs in another order), in fp32 within an ulp or two; and a model step with them against one without.
Skipped where no C compiler works (the reason is printed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.layer_ops import LOAD_NOTES, LayerOps, layer_ops, load_layer_ops
from gpu_worker.model import rms_norm


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> LayerOps:
    d = tmp_path_factory.mktemp("cache")
    o, how = layer_ops(d)
    if o is None:
        pytest.skip(f"no C layer ops here: {LOAD_NOTES[d / 'kernels']}")
    assert "in C" in how
    return o


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair of bf16 values is (same sign assumed where nonzero)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 runs on several threads
def test_add_rms_norm_matches_the_pytorch_code(ops, dtype, rows):
    x = (torch.randn(rows, 576, generator=GEN) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=GEN).to(dtype)
    w = (torch.rand(576, generator=GEN) + 0.5).to(dtype)
    want_x = x + delta
    want = rms_norm(want_x, w, 1e-5)
    got_x = x.clone()
    got = ops.add_rms_norm(got_x, delta, w, 1e-5)
    assert torch.equal(got_x, want_x)  # the residual add is exact, in place
    if dtype == torch.bfloat16:
        apart = ulps_apart(got, want)
        assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    alone = x.clone()  # no delta: the norm only, x untouched
    torch.testing.assert_close(ops.add_rms_norm(alone, None, w, 1e-5).float(), rms_norm(x, w, 1e-5).float(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)  # fmt: skip
    assert torch.equal(alone, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "t"), [((9, 3, 64), 5), ((4, 2, 128), 3), ((9, 3, 64), 600)])
def test_rope_store_matches_the_pytorch_code_and_writes_the_cache(ops, dtype, heads, t):
    nq, nkv, d = heads
    width = (nq + 2 * nkv) * d
    wide = torch.randn(t, width + 16, generator=GEN).to(dtype)
    qkv = wide[:, :width]  # a row stride wider than the row, as a padded matmul output gives
    pad = wide[:, width:].clone()
    pos = torch.randint(0, 4000, (t,), generator=GEN)
    inv = 1.0 / (100000 ** (torch.arange(0, d, 2).float() / d))
    fr = pos.float()[:, None] * inv[None]
    cos = torch.cat((fr, fr), -1).cos().to(dtype)
    sin = torch.cat((-fr.sin(), fr.sin()), -1).to(dtype)
    qk = qkv[:, : (nq + nkv) * d].reshape(t, nq + nkv, d)
    want = qk * cos[:, None] + qk.roll(d // 2, dims=-1) * sin[:, None]
    v = qkv[:, (nq + nkv) * d :].reshape(t, nkv, d).clone()
    kc = torch.zeros(t + 3, nkv, d, dtype=dtype)
    vc = torch.zeros(t + 3, nkv, d, dtype=dtype)
    slots = torch.randperm(t + 3, generator=GEN)[:t]
    ops.rope_store(qkv, heads, cos, sin, kc, vc, slots)
    got = qkv[:, : (nq + nkv) * d].reshape(t, nq + nkv, d)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # both products and the sum rounded to bf16, as PyTorch's bf16 ops
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(kc[slots], got[:, nq:]) and torch.equal(vc[slots], v)
    untouched = torch.ones(t + 3, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()
    assert torch.equal(wide[:, width:], pad)  # nothing past the row is written


def test_rope_store_leaves_the_padding_columns_and_can_skip_the_cache(ops):
    t, heads = 2, (9, 3, 64)
    wide = torch.randn(t, 960 + 16, generator=GEN)
    pad = wide[:, 960:].clone()
    cos, sin = torch.ones(t, 64), torch.zeros(t, 64)  # position 0: rotary is the identity
    before = wide[:, :960].clone()
    ops.rope_store(wide[:, :960], heads, cos, sin, None, None, None)
    assert torch.equal(wide[:, :960], before) and torch.equal(wide[:, 960:], pad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_matches_the_pytorch_code(ops, dtype, rows):
    gu = (torch.randn(rows, 2 * 1536, generator=GEN) * 6).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, -88.9, 0.0])  # exp overflow and underflow on either side
    want = F.silu(gu[:, :1536]) * gu[:, 1536:]
    got = ops.silu_mul(gu, 1536)
    if dtype == torch.bfloat16:
        apart = ulps_apart(got, want)
        assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
    assert torch.isfinite(got).all()


def test_refuses_what_it_does_not_take(ops):
    with pytest.raises(ValueError, match="add_rms_norm"):
        ops.add_rms_norm(torch.zeros(2, 40), None, torch.ones(40), 1e-5)  # 40 is not a multiple of 16
    with pytest.raises(ValueError, match="add_rms_norm"):
        ops.add_rms_norm(torch.zeros(2, 64), None, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="rope_store"):
        ops.rope_store(torch.zeros(1, 48 * 5), (3, 1, 48), torch.ones(1, 48), torch.ones(1, 48), None, None, None)
    with pytest.raises(ValueError, match="silu_mul"):
        ops.silu_mul(torch.zeros(1, 64), 40)
    assert not LayerOps.takes(torch.zeros(1, 64, dtype=torch.float16), 64)
    assert not LayerOps.takes(torch.zeros(1, 40), 40)


def test_load_is_cached_per_folder(tmp_path):
    first = load_layer_ops(tmp_path)
    assert load_layer_ops(tmp_path) is first


def test_a_model_step_with_and_without_the_ops(ops, model_path):
    """fp32: logits within 1e-4 of the PyTorch ops, prefill and decode (the transformers parity tests run with the
    ops on, as the worker starts by default)."""
    from loom_helpers import make_args

    from gpu_worker.worker import Worker
    from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

    greedy = WorkerSampling(0.0, 1.0, -1, None)
    w = Worker(make_args(model_path))
    ids = [[(37 * i + 11 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((23, 61))]
    runs = {}
    for name, o in (("c", ops), ("torch", None)):
        w.model.layer_ops = o
        plan = [
            BatchReq(f"r{i}", i, x, 0, list(range(100 * i, 100 * i + len(x))), None, greedy) for i, x in enumerate(ids)
        ]
        out = [w.forward_logits(ForwardBatch(1, plan))]
        for k in range(2):
            reqs = [BatchReq(f"r{i}", i, [500 + k], len(x) + k, [100 * i + len(x) + k], None, greedy, k + 1)
                    for i, x in enumerate(ids)]  # fmt: skip
            out.append(w.forward_logits(ForwardBatch(k + 2, reqs)))
        runs[name] = out
    for a, b in zip(runs["c"], runs["torch"], strict=True):
        assert (a - b).abs().max().item() < 1e-4


def test_an_fp16_worker_keeps_pytorchs_ops_and_sdpa(model_path, caplog):
    """The C kernels take fp32/bf16 activations: an fp16 worker uses neither, and its log says so."""
    import logging

    from loom_helpers import make_args

    from gpu_worker.worker import Worker

    with caplog.at_level(logging.INFO, logger="gpu_worker"):
        w = Worker(make_args(model_path, dtype="float16"))
    assert w.model.decode_attn is None and w.model.layer_ops is None
    assert "decode attention on SDPA, layer ops on PyTorch (torch.float16 activations)" in caplog.text
