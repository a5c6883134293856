"""A pure decode step on the bound C kernels (gpu_worker/bound_decode.py) against the same step through the per-call
wrappers: the same kernels with the same arguments, so logits and the KV written must be the same bits, at one row
and at several rows of unequal lengths, in fp32, bf16 and over the 4-bit gguf weights, with and without adapters.
Also: which steps take the bound path, and what it refuses. Skipped where no C compiler works."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.decode_attention import LOAD_NOTES, as_callable, load_decode_attention
from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

GREEDY = WorkerSampling(0.0, 1.0, -1, None)


@pytest.fixture(scope="module")
def fn(tmp_path_factory):
    from loom_helpers import kernel_or_skip

    return kernel_or_skip(load_decode_attention, LOAD_NOTES, tmp_path_factory.mktemp("kernels"), "C decode attention")


def _worker(fn, lora: bool = False, **kw):
    """A worker on the C decode attention over the paged cache (no mirror) and the C layer ops."""
    from loom_helpers import make_args
    from lora_helpers import six_adapter_worker

    from gpu_worker.worker import Worker

    w = six_adapter_worker(**kw) if lora else Worker(make_args(_model_path(), **kw))
    if w.model.layer_ops is None:
        pytest.skip("no C layer ops here")
    w.model.decode_attn, w.decode_mirror = as_callable(fn), None
    return w


def _model_path():
    from ipc.model_source import resolve_model_path

    return resolve_model_path(None)


def _decode_both_ways(w, lens: list[int], uids: list[str | None], steps: int = 3) -> int:
    """Prefill rows of ``lens`` tokens, then decode ``steps`` steps; each step runs bound, then again (same tokens,
    positions and slots) per call. Asserts equal logits and KV bits; returns how many steps took the bound path."""
    base = [600 * i for i in range(len(lens))]
    for i, n in enumerate(lens):
        ids = [(31 * i + 7 * j) % 40000 + 100 for j in range(n)]
        slots = list(range(base[i], base[i] + n))
        w.forward_logits(ForwardBatch(0, [BatchReq(f"r{i}", i, ids, 0, slots, uids[i], GREEDY)]))
    bound_steps = 0
    orig_bind, orig_layers = w.model._bind_decode, w.model._layers_bound

    def counting(*a):
        nonlocal bound_steps
        bound_steps += 1
        return orig_layers(*a)

    w.model._layers_bound = counting
    for k in range(steps):
        reqs = [
            BatchReq(f"r{i}", i, [900 + 13 * k + i], n + k, [base[i] + n + k], uids[i], GREEDY, k + 1)
            for i, n in enumerate(lens)
        ]
        out = {}
        for mode in ("bound", "calls"):
            w.model._bind_decode = orig_bind if mode == "bound" else (lambda *a: None)
            logits = w.forward_logits(ForwardBatch(k + 1, reqs))
            kv = [torch.stack([w.kv.k[layer][base[i] + n + k] for i, n in enumerate(lens)]) for layer in (0, 29)]
            out[mode] = (logits, kv)
        assert torch.equal(out["bound"][0], out["calls"][0]), f"step {k}: logits differ"
        for a, b in zip(out["bound"][1], out["calls"][1], strict=True):
            assert torch.equal(a, b), f"step {k}: the KV written differs"
        assert torch.isfinite(out["bound"][0]).all()
    w.model._bind_decode, w.model._layers_bound = orig_bind, orig_layers
    return bound_steps


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "gguf")])
def test_bound_decode_step_equals_the_per_call_step(fn, dtype, quantization):
    w = _worker(fn, dtype=dtype, quantization=quantization)
    assert _decode_both_ways(w, [37], [None]) == 3
    assert _decode_both_ways(w, [5, 70, 33], [None] * 3) == 3  # unequal lengths: one group, each row its length


def test_bound_decode_step_with_adapters_equals_the_per_call_step(fn):
    w = _worker(fn, lora=True, dtype="bfloat16")
    uids = [None, "uid-r8-all", "uid-r64-all", "uid-r8-pattern"]  # mixed ranks and targets, and the base model
    assert _decode_both_ways(w, [12, 40, 25, 60], uids) == 3


def test_only_pure_decode_steps_on_the_kernels_are_bound(fn):
    w = _worker(fn, dtype="float32")
    seen = []
    orig = w.model._bind_decode

    def spy(*a):
        seen.append(orig(*a) is not None)
        return None  # run per call: only which steps would bind is asked

    w.model._bind_decode = spy
    w.forward_logits(ForwardBatch(0, [BatchReq("a", 0, list(range(100, 120)), 0, list(range(20)), None, GREEDY)]))
    w.forward_logits(ForwardBatch(1, [BatchReq("a", 0, [7], 20, [20], None, GREEDY, 1)]))
    mixed = [
        BatchReq("a", 0, [8], 21, [21], None, GREEDY, 2),
        BatchReq("b", 1, list(range(200, 210)), 0, list(range(100, 110)), None, GREEDY),
    ]
    w.forward_logits(ForwardBatch(2, mixed))
    decode = BatchReq("a", 0, [9], 22, [22], None, GREEDY, 3)
    w.forward_logits(ForwardBatch(3, [decode]))
    w.model.decode_attn = None  # SDPA: per call
    w.forward_logits(ForwardBatch(4, [BatchReq("a", 0, [10], 23, [23], None, GREEDY, 4)]))
    assert seen == [False, True, False, True, False]


def test_a_bound_step_refuses_a_tensor_it_was_not_bound_for(fn):
    from gpu_worker.bound_decode import BoundDecode

    w = _worker(fn, dtype="float32")
    m = w.model
    x = torch.randn(2, 576)
    cos, sin = torch.ones(2, 64), torch.zeros(2, 64)
    index = torch.tensor([[0, 1, 2], [3, 4, 5]])
    b = BoundDecode(m.layer_ops, fn, x, (9, 3, 64), 1536, cos, sin, torch.tensor([2, 5]), index, None, w.kv, 0.125)
    norm = m.w["layers"][0]["input_norm"]
    with pytest.raises(ValueError, match="residual delta"):
        b.add_rms_norm(torch.randn(2, 576, dtype=torch.bfloat16), norm, 1e-5)  # another dtype
    with pytest.raises(ValueError, match="residual delta"):
        b.add_rms_norm(torch.randn(3, 576), norm, 1e-5)  # another row count
    with pytest.raises(ValueError, match="qkv"):
        b.rope_attend(0, torch.randn(2, 900))  # narrower than q | k | v
    with pytest.raises(ValueError, match="gate_up"):
        b.silu_mul(torch.randn(2, 3072).t().contiguous().t())  # column-strided
    with pytest.raises(ValueError, match="bound decode"):
        BoundDecode(m.layer_ops, fn, x, (9, 3, 64), 1536, cos, sin, torch.tensor([2, 5]), index.int(), None, w.kv, 1)
    h = b.add_rms_norm(None, norm, 1e-5)
    assert h.shape == (2, 576) and torch.isfinite(h).all()
