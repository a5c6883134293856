"""Quantised weights without the model: GGUF block decoding against ``gguf``'s own dequantiser, the 4- and 8-bit
kernels against dense products on the same weights, and the errors a bad split or source gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu_worker.gguf_weights import _Part
from gpu_worker.quant import (
    Int8Linear,
    QuantizationError,
    decode_q4_blocks,
    decode_q8_0_blocks,
    int4_from_affine,
    int4_from_q8,
    quantize_int8_rows,
)
from ipc.model_source import ModelSourceError, gguf_source


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """fp32 values that bf16 holds exactly (so a kernel's bf16 scales represent the weight without rounding)."""
    return t.to(torch.bfloat16).float()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_decode_like_gguf(kind):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    q, scale, zero = decode_q4_blocks(raw, kind)
    assert q.dtype == np.uint8 and q.shape == (48, 96) and int(q.max()) <= 15
    mine = (q.astype(np.float32).reshape(48, 3, 32) * scale[:, :, None] + zero[:, :, None]).reshape(48, 96)
    np.testing.assert_allclose(mine, dequantize(raw, GGMLQuantizationType[kind]), rtol=1e-6, atol=1e-7)


def test_q8_0_blocks_decode_like_gguf():
    w = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    q, d = decode_q8_0_blocks(raw)
    assert q.dtype == np.int8
    mine = (q.astype(np.float32).reshape(16, 2, 32) * d[:, :, None]).reshape(16, 64)
    np.testing.assert_array_equal(mine, dequantize(raw, GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("rows", [64, 40])  # 40: not a multiple of the kernel's 16, so rows are padded
def test_int4_kernel_matches_dense_product_of_the_same_weights(rows):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (rows, 128), generator=g)
    scale = _bf16_exact(torch.rand(rows, 4, generator=g) * 0.02 + 0.001)
    zero = _bf16_exact(-8 * scale + torch.randn(rows, 4, generator=g) * 0.002)  # zero + 8*scale stays exact
    zero = _bf16_exact(zero + 8 * scale) - 8 * scale
    lin = int4_from_affine(q, scale, zero)
    w = (q.float().view(rows, 4, 32) * scale[:, :, None] + zero[:, :, None]).view(rows, 128)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    want = x.float() @ w.T
    got = lin.mm(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, rows)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-3)  # bf16 output rounding only
    got32 = lin.mm(x.float())  # an fp32 caller gets fp32 back
    assert got32.dtype == torch.float32


def test_q8_weights_split_into_two_4bit_halves_are_exact():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (32, 64), generator=g).to(torch.int8)
    d = _bf16_exact(torch.rand(32, 2, generator=g) * 0.01 + 1e-4)
    lin = int4_from_q8(q, d)
    assert lin.in_features == 64 and lin.out_features == 32 and lin.dup_input
    w = (q.float().view(32, 2, 32) * d[:, :, None]).view(32, 64)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(lin.mm(x).float(), x.float() @ w.T, rtol=2e-2, atol=2e-3)


def test_int8_rows_round_trip_and_kernel():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 96, generator=g)
    w[3] = 0.0  # a row of zeros must not divide by zero
    q, s = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and s.shape == (48,) and torch.equal(s, _bf16_exact(s))
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())
    lin = Int8Linear(q, s)
    x = torch.randn(4, 96, generator=g).to(torch.bfloat16)
    want = x.float() @ (q.float() * s[:, None]).T
    torch.testing.assert_close(lin.mm(x).float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lin.rows(torch.tensor([0, 5]), torch.float32), q[[0, 5]].float() * s[[0, 5], None])


def test_tp_split_through_a_block_is_refused_by_name():
    p = _Part("q4", np.zeros((4, 128), np.uint8), np.ones((4, 4), np.float32), np.zeros((4, 4), np.float32))
    assert p.cols(32, 96, "blk.0.ffn_down.weight").q.shape == (4, 64)
    with pytest.raises(QuantizationError, match=r"blk\.0\.ffn_down\.weight.*block edges"):
        p.cols(16, 80, "blk.0.ffn_down.weight")


def test_gguf_mode_needs_a_gguf_source(tmp_path):
    with pytest.raises(ModelSourceError, match="not converted from a GGUF.*--quantization int8"):
        gguf_source(tmp_path)
    (tmp_path / "loom_source.json").write_text('{"gguf": "/nonexistent/model.gguf"}')
    with pytest.raises(ModelSourceError, match="no longer exists"):
        gguf_source(tmp_path)


def test_auto_quantization_serves_gguf_blocks_only_for_a_gguf_model_on_cpu(tmp_path):
    from ipc.model_source import effective_quantization

    assert effective_quantization("auto", tmp_path, "cpu") == "none"  # not converted from a GGUF
    (tmp_path / "loom_source.json").write_text('{"gguf": "/x.gguf"}')
    assert effective_quantization("auto", tmp_path, "cpu") == "gguf"
    assert effective_quantization("auto", tmp_path, "cuda") == "none"
    for explicit in ("none", "int8", "gguf"):
        assert effective_quantization(explicit, tmp_path, "cpu") == explicit


def test_start_up_measurement_compares_the_two_paths():
    from gpu_worker.quant import int4_beats_dense

    faster, t4, td = int4_beats_dense(torch.float32, matrices=2)
    assert isinstance(faster, bool) and t4 > 0 and td > 0 and faster == (t4 < td)


def test_the_machine_choice_is_measured_once_then_kept(tmp_path):
    from gpu_worker.quant import cached_int4_choice

    first = cached_int4_choice(torch.float32, tmp_path)
    (f,) = tmp_path.glob("int4-vs-dense-*.json")
    again = cached_int4_choice(torch.float32, tmp_path)
    assert again[0] == first[0] and "measured earlier" in again[1] and str(f) in again[1]


def test_gguf_servability_is_checked_before_start(tmp_path, model_path):
    from gpu_worker.gguf_check import gguf_unservable

    for tp in (1, 2, 3):  # SmolLM2's o/down splits fall on 32-weight block edges at every TP size it allows
        assert gguf_unservable(model_path, tp) is None
    assert "not converted from a GGUF" in gguf_unservable(tmp_path, 1)
