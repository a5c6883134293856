"""8-bit group-quantised linears on Loom's C kernels (gpu_worker/q8_linear.py, csrc/q8_linear.c): the GEMV and the
batch paths (AMX, AVX512-BF16 dot products; each where the CPU has it) against float64 products with the weight they
hold, against the two-4-bit-halves form they replace, TP row cuts, and the GGUF loader's choice for a Q8_0 LM head.
Skipped where no C compiler works."""

from __future__ import annotations

import pytest
import torch

import gpu_worker.quant as quant
from gpu_worker.int4_batch import ISAS, BatchKernel, load_int4_kernel
from gpu_worker.q8_linear import LOAD_NOTES, Q8Linear, load_q8
from gpu_worker.quant import int4_from_q8


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from loom_helpers import kernel_or_skip

    return kernel_or_skip(load_q8, LOAD_NOTES, tmp_path_factory.mktemp("kernels"), "8-bit C kernels")


@pytest.fixture(scope="module", params=list(ISAS))
def batch(request, tmp_path_factory):
    """The batch kernel of one ISA from 8 rows (the tests of an ISA this CPU lacks are skipped)."""
    fn = load_int4_kernel(tmp_path_factory.mktemp("kernels"), request.param)
    if fn is None:
        pytest.skip(f"no {request.param} here")
    return BatchKernel(fn, 8, request.param)


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4


def test_holds_q_times_the_bf16_scale_exactly(lib):
    q, d = weight(130, 96, 1)
    lin = Q8Linear(q, d, lib)
    want = q.float() * d.to(torch.bfloat16).float().repeat_interleave(32, dim=1)
    assert torch.equal(lin.dense(), want)
    assert lin.qp.shape == (3, 96, 64) and lin.d.shape == (3, 192) and lin.d.dtype == torch.bfloat16
    assert lin.nbytes == 3 * 96 * 64 + 3 * 192 * 2
    with pytest.raises(ValueError, match="groups of 32"):
        Q8Linear(q[:, :90], d[:, :2], lib)


@pytest.mark.parametrize(("n", "k"), [(200, 64), (960, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 40])
def test_products_equal_float64_on_both_paths(lib, batch, monkeypatch, n, k, rows):
    q, d = weight(n, k, n + k)
    lin = Q8Linear(q, d, lib)
    w = lin.dense().double()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    want = x.to(torch.bfloat16).double() @ w.T
    scale = float(want.abs().max())
    for kernel in (None, batch):  # the GEMV for every row count, then the batch path from 8 rows up
        monkeypatch.setattr(quant, "BATCH_KERNEL", kernel)
        got = lin.mm(x.to(torch.bfloat16).float())  # fp32 in and out
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        # GEMV: exact weights and fp32 sums; AMX: the weight in two bf16 parts is exact too (16 significant bits);
        # AVX512-BF16: exact codes, scales applied to fp32 group sums
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * scale)
        got16 = lin.mm(x.to(torch.bfloat16))  # bf16 out: its rounding only
        assert got16.dtype == torch.bfloat16
        torch.testing.assert_close(got16.double(), want, rtol=8e-3, atol=1e-3 * scale)
        wide = torch.cat([x, torch.randn(rows, 5, generator=g)], dim=1)[:, :k].to(torch.bfloat16)  # strided x
        assert torch.equal(lin.mm(wide), got16)
        # bf16 in, fp32 out (the LM head's logits): the fp32 sums, not rounded to bf16
        got32 = lin.mm(x.to(torch.bfloat16), out_dtype=torch.float32)
        assert got32.dtype == torch.float32
        torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=2e-6 * scale)


def test_agrees_with_the_two_4bit_halves_it_replaces(lib, monkeypatch):
    monkeypatch.setattr(quant, "BATCH_KERNEL", None)
    q, d = weight(256, 576, 5)
    x = torch.randn(2, 576).to(torch.bfloat16)
    halves = int4_from_q8(q, d).mm(x).double()  # PyTorch's 4-bit kernel, bf16 out
    got = Q8Linear(q, d, lib).mm(x).double()
    torch.testing.assert_close(got, halves, rtol=8e-3, atol=2e-3 * float(halves.abs().max()))


def test_row_cuts_reproduce_the_whole_weights_rows(lib, monkeypatch):
    monkeypatch.setattr(quant, "BATCH_KERNEL", None)
    q, d = weight(300, 64, 9)
    lin = Q8Linear(q, d, lib)
    x = torch.randn(3, 64)
    whole = lin.mm(x)
    for lo, hi in ((0, 128), (128, 256), (256, 300), (64, 300)):
        part = lin.out_rows(lo, hi)
        assert part.out_features == hi - lo
        assert torch.equal(part.mm(x), whole[:, lo:hi])
    with pytest.raises(ValueError, match="multiples of 64"):
        lin.out_rows(10, 128)
    with pytest.raises(ValueError, match="multiples of 64"):
        lin.out_rows(0, 100)


def test_gguf_q8_head_uses_it_and_falls_back_without_a_compiler(lib, monkeypatch):
    import numpy as np

    import gpu_worker.gguf_weights as gw
    import gpu_worker.q8_linear as q8

    q, d = weight(128, 64, 2)
    part = gw._Part("q8", q.numpy(), d.numpy().astype(np.float32))
    head = gw._head(part, torch.bfloat16, torch.device("cpu"))
    assert isinstance(head, Q8Linear)
    monkeypatch.setattr(q8, "load_q8", lambda cache_dir: None)  # no compiler: the 4-bit halves as before
    assert isinstance(gw._head(part, torch.bfloat16, torch.device("cpu")), quant.Int4Linear)
