"""The few-row 4-bit GEMVs (csrc/int4_gemv.h: AVX-512 over 64-row packing, AVX2 + FMA over 32- or 64-row packing)
against float64 products with the weight dequantised in fp32, their dispatch inside Int4Linear (below the batch
kernel's threshold, up to the measured max_rows), and the start-up choice. A GEMV the CPU lacks is skipped with the
reason; the 32-row packing PyTorch writes on AVX2 CPUs is written by hand on others (gpu_worker.int4_batch.int4_layout).
"""

from __future__ import annotations

import pytest
import torch

import gpu_worker.int4_batch as ib
import gpu_worker.quant as quant
from gpu_worker import timing
from gpu_worker.int4_batch import BatchKernel, GemvKernel, batch_mm, choose_gemv_kernel, int4_layout, load_library
from gpu_worker.quant import int4_from_affine

# (entry point, packing block it reads)
ENTRIES = [("loom_int4_gemv512", 64), ("loom_int4_gemv_avx2_64", 64), ("loom_int4_gemv_avx2_32", 32)]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    built, note = load_library(ib.SOURCE, tmp_path_factory.mktemp("kernels"))
    if built is None:
        pytest.skip(f"no C compiler: {note}")
    return built


def _entry_or_skip(lib, name: str):
    fn = ib._entry(lib, name)
    if fn is None:
        pytest.skip(f"{name} is not built in on this CPU")
    return fn


def _weight(n: int, k: int, seed: int, block: int):
    """A random Int4Linear, its codes packed in ``block``-row blocks, and its weight ``[n, k]`` float64 as the kernels
    mean it: ``(q - 8) * scale + zero`` from the bf16 scales and zeros."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    lin = int4_from_affine(q, torch.rand(n, k // 32, generator=g) * 0.05, torch.randn(n, k // 32, generator=g) * 0.05)
    n_pad = lin.packed.shape[0]
    qp = torch.cat([q, torch.full((n_pad - n, k), 8)]) if n_pad > n else q
    packed = int4_layout(qp, block) if n_pad % block == 0 else None
    if block == ib.torch_int4_block() and packed is not None:
        assert torch.equal(packed, lin.packed)  # the hand-written layout is PyTorch's here
    sz = lin.scales_zeros.float()[:, :n]
    w = (q.float() - 8) * sz[:, :, 0].T.repeat_interleave(32, 1) + sz[:, :, 1].T.repeat_interleave(32, 1)
    return lin, packed, w.double()


@pytest.mark.parametrize(("name", "block"), ENTRIES)
@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 96), (960, 576), (576, 1536), (200, 64)])  # 200: 256 packed
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_products_equal_the_fp32_dequantised_weight(lib, name, block, n, k, rows):
    fn = _entry_or_skip(lib, name)
    lin, packed, w = _weight(n, k, seed=n + k + rows, block=block)
    if lin.packed.shape[0] % 64:  # 200 rows pack to 208: no whole 64-row blocks, refused by every C kernel
        with pytest.raises(ValueError, match="int4 batch kernel"):
            batch_mm(fn, torch.zeros(rows, k), lin.packed, lin.scales_zeros, n)
        return
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) * 4  # mixed magnitudes
    want = x.to(torch.bfloat16).double() @ w.T
    got = batch_mm(fn, x, packed, lin.scales_zeros, n)  # fp32 in and out
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # the group's scale and zero apply to fp32 sums of exact products: within fp32 summation of the exact result
    # (a weight rounded to bf16 would be off by ~2e-3 of the largest output)
    scale = float((x.to(torch.bfloat16).double().abs() @ w.abs().T).max())
    assert float((got.double() - want).abs().max()) <= 2e-6 * scale
    got16 = batch_mm(fn, x.to(torch.bfloat16), packed, lin.scales_zeros, n)  # bf16 out: its rounding only
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, got.to(torch.bfloat16))
    # a strided x (a column slice of a wider tensor) reads the same values
    wide = torch.cat([x, torch.randn(rows, 7, generator=g)], dim=1)[:, :k]
    assert torch.equal(batch_mm(fn, wide, packed, lin.scales_zeros, n), got)


def test_bad_shapes_are_refused(lib):
    fn = _entry_or_skip(lib, "loom_int4_gemv_avx2_32")
    lin, packed, _ = _weight(64, 64, seed=0, block=32)
    out = torch.empty(1, 64)
    x = torch.zeros(1, 64)
    # K not a multiple of 32, n_out over N_pad
    for k, n_out in ((48, 64), (64, 65)):
        rc = fn(
            1, 64, k, x.data_ptr(), 64, 0, out.data_ptr(), 64, 0, n_out, packed.data_ptr(), lin.scales_zeros.data_ptr()
        )
        assert rc == 1


def test_int4linear_takes_the_gemv_up_to_max_rows_and_the_batch_kernel_above(lib, monkeypatch):
    block = ib.torch_int4_block()
    if block == 0:
        pytest.skip("PyTorch packs 4-bit weights in a layout no C kernel reads here")
    name = (
        "loom_int4_gemv512" if block == 64 and ib._entry(lib, "loom_int4_gemv512") else f"loom_int4_gemv_avx2_{block}"
    )
    fn = _entry_or_skip(lib, name)
    lin, _, w = _weight(192, 128, seed=3, block=block)
    gemv_calls, batch_calls = [], []

    def counted(calls):
        def call(*args):
            calls.append(args[0])  # the row count
            return fn(*args)

        return call

    monkeypatch.setattr(quant, "GEMV_KERNEL", GemvKernel(counted(gemv_calls), 2, "test"))
    monkeypatch.setattr(quant, "BATCH_KERNEL", BatchKernel(counted(batch_calls), 6, "test"))
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 5, 6, 8):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        got = lin.mm(x)
        if 2 < rows < 6:
            assert torch.equal(got, lin.mm_torch(x))  # between the two: PyTorch's kernel, bit for bit
        torch.testing.assert_close(got, lin.mm_torch(x), rtol=8e-3, atol=1e-2)  # all mean the same weight
    assert gemv_calls == [1, 2] and batch_calls == [6, 8]
    # a row share cut at a multiple of 64 (the vocab-parallel head) equals those rows of the whole product
    x = torch.randn(1, 128, generator=g).to(torch.bfloat16)
    assert torch.equal(lin.out_rows(64, 192).mm(x), lin.mm(x)[:, 64:])
    # fp16 activations stay on PyTorch's kernel (the C kernels read fp32 or bf16)
    xh = torch.randn(1, 128, generator=g).to(torch.float16)
    calls_before = len(gemv_calls)
    lin.mm(xh)
    assert len(gemv_calls) == calls_before


def test_the_gemv_choice_is_measured_once_then_kept(tmp_path):
    first, how = choose_gemv_kernel(tmp_path)
    again, how2 = choose_gemv_kernel(tmp_path)
    assert "measured earlier" in how2 and "measured earlier" not in how
    assert (first is None) == (again is None)
    if first is not None:
        assert again is not None and first.max_rows == again.max_rows and first.max_rows in (1, 2, 4, 8)
        assert f"1-{first.max_rows} rows on the {first.isa} GEMV" in how2
        # the GEMV chosen computes the weight's products
        lin, _, w = _weight(128, 64, seed=1, block=ib.torch_int4_block())
        x = torch.randn(1, 64)
        want = x.to(torch.bfloat16).double() @ w.T
        got = batch_mm(first.fn, x, lin.packed, lin.scales_zeros, 128).double()
        assert float((got - want).abs().max()) <= 2e-6 * float((x.abs().double() @ w.abs().T).max())
    else:
        assert "PyTorch's kernel" in how


@pytest.mark.parametrize(("name", "block"), ENTRIES)
@pytest.mark.parametrize("k", [576, 96])  # 18 groups (summed in two halves) and 3 (one run)
def test_sums_depend_on_k_alone_not_on_the_cut_the_rows_or_the_threads(lib, name, block, k):
    """A 64-row cut of a weight (a TP shard, the vocab-parallel head), a narrower output and any thread count give
    every row the same fp32 sums as the whole weight: 576 rows are 9 blocks, a cut at 64 leaves 8."""
    fn = _entry_or_skip(lib, name)
    lin, packed, _ = _weight(576, k, seed=k, block=block)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    whole = batch_mm(fn, x, packed, lin.scales_zeros, 576)
    cut = lin.out_rows(64, 576)
    assert torch.equal(batch_mm(fn, x, packed[64:], cut.scales_zeros, 512), whole[:, 64:])
    assert torch.equal(batch_mm(fn, x, packed, lin.scales_zeros, 100), whole[:, :100])  # a partial last block
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(batch_mm(fn, x, packed, lin.scales_zeros, 576), whole)
    finally:
        torch.set_num_threads(threads)


def test_a_restart_reads_the_value_the_tp_ranks_agreed_on(tmp_path, monkeypatch):
    first, _ = choose_gemv_kernel(tmp_path)
    if first is None or first.max_rows < 2:
        pytest.skip("no GEMV that takes 2 rows or more on this machine")
    # another rank takes it up to 1 row (the ranks take the max of [-rows, contended, lacked])
    monkeypatch.setattr(timing, "_all_ranks_max", lambda values, group: [max(values[0], -1), *values[1:]])
    agreed, how = choose_gemv_kernel(tmp_path, group=object())
    assert agreed is not None and agreed.max_rows == 1 and "another TP rank takes it up to 1 rows" in how
    monkeypatch.undo()
    again, how2 = choose_gemv_kernel(tmp_path)  # the restart, alone: the file holds what the group used
    assert again is not None and again.max_rows == 1 and "measured earlier" in how2
