"""PackedLinear (oneDNN blocked-layout bf16/fp16 weights): same products as the plain path, chosen by measurement."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.packed_linear import PackedLinear, _supported, pack_linears, packing_pays
from gpu_worker.quant import quantize_int8_rows

needs_onednn_bf16 = pytest.mark.skipif(
    not _supported(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 GEMM on this CPU"
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130])
def test_packed_matches_plain_product(rows, dtype):
    if not _supported(dtype, torch.device("cpu")):
        pytest.skip(f"no oneDNN {dtype} GEMM on this CPU")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    got = PackedLinear(w).mm(x)
    want = x.float() @ w.float().T
    assert got.dtype == dtype and got.shape == (rows, 200)
    # output rounding only (both accumulate in fp32)
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=1e-2)


@needs_onednn_bf16
def test_packed_takes_a_strided_view():
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(5, 64).bfloat16()[:, :32]  # a column slice, as the model's split activations are
    torch.testing.assert_close(PackedLinear(w).mm(x).float(), (x.float() @ w.float().T), atol=0.05, rtol=1e-2)


def test_packing_is_refused_where_it_cannot_work():
    pays, how = packing_pays(torch.randn(64, 32))  # fp32: plain path kept, exact as before
    assert not pays and "not used" in how
    if torch.cuda.is_available():
        assert not packing_pays(torch.randn(64, 32, device="cuda").bfloat16())[0]


@needs_onednn_bf16
def test_packing_pays_reports_both_timings():
    pays, how = packing_pays(torch.randn(256, 128).bfloat16(), rows=(1, 8))
    assert isinstance(pays, bool)
    assert "1 rows: plain" in how and "8 rows: plain" in how and "packed" in how


@needs_onednn_bf16
def test_pack_linears_leaves_quantised_and_other_weights_alone():
    q, s = quantize_int8_rows(torch.randn(16, 32))
    from gpu_worker.quant import Int8Linear

    int8 = Int8Linear(q, s)
    layers = [{"qkv": torch.randn(48, 32).bfloat16(), "o": int8, "input_norm": torch.ones(32).bfloat16()}]
    table = torch.randn(10, 32).bfloat16()
    tied = {"layers": layers, "embed": table, "lm_head": table}
    assert pack_linears(tied) == 2
    assert isinstance(layers[0]["qkv"], PackedLinear)
    assert layers[0]["o"] is int8 and isinstance(layers[0]["input_norm"], torch.Tensor)
    # a tied head is packed as a copy: the embedding lookup keeps the plain table
    assert isinstance(tied["lm_head"], PackedLinear) and tied["embed"] is table
    quantised_head = {"layers": [], "embed": table, "lm_head": int8}
    assert pack_linears(quantised_head) == 0 and quantised_head["lm_head"] is int8
