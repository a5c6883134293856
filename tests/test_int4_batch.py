"""The batched 4-bit C kernels (gpu_worker/int4_batch.py, csrc/int4_batch.c: AMX, AVX512-BF16 dot products, AVX2
fp32 FMAs) against float64 products with the weight dequantised in fp32 (as PyTorch's 4-bit kernel means it), their
dispatch inside Int4Linear, and the start-up choice. Each ISA's tests are skipped where the CPU lacks it (the reason is
printed); Int4Linear then keeps PyTorch's kernel."""

from __future__ import annotations

import pytest
import torch

import gpu_worker.quant as quant
from gpu_worker.int4_batch import (
    ISAS,
    LOAD_NOTES,
    BatchKernel,
    batch_mm,
    choose_batch_kernel,
    load_int4_batch,
    load_int4_kernel,
)
from gpu_worker.quant import Int4Linear, int4_from_affine, int4_from_q8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module", params=list(ISAS))
def isa(request):
    return request.param


@pytest.fixture(scope="module")
def fn(folder, isa):
    from loom_helpers import kernel_or_skip

    return kernel_or_skip(lambda f: load_int4_kernel(f, isa), LOAD_NOTES, folder, f"{isa} 4-bit kernel")


def _weight(n: int, k: int, seed: int) -> tuple[Int4Linear, torch.Tensor]:
    """A random Int4Linear and its weight ``[n, k]`` as both kernels mean it: ``(q - 8) * scale + zero`` in fp32 from
    the bf16 scales and zeros."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    lin = int4_from_affine(q, torch.rand(n, k // 32, generator=g) * 0.05, torch.randn(n, k // 32, generator=g) * 0.05)
    sz = lin.scales_zeros.float()[:, :n]  # [G, n, 2]
    w = (q.float() - 8) * sz[:, :, 0].T.repeat_interleave(32, 1) + sz[:, :, 1].T.repeat_interleave(32, 1)
    return lin, w.double()


@pytest.mark.parametrize(("n", "k"), [(64, 32), (128, 96), (960, 576), (200, 64)])  # 200: 208 packed rows
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_products_equal_the_fp32_dequantised_weight(fn, n, k, rows):
    lin, w = _weight(n, k, seed=n + k + rows)
    if lin.packed.shape[0] % 64:
        with pytest.raises(ValueError, match="int4 batch kernel"):
            batch_mm(fn, torch.zeros(rows, k), lin.packed, lin.scales_zeros, n)
        return
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    want = x.to(torch.bfloat16).double() @ w.T
    got = batch_mm(fn, x, lin.packed, lin.scales_zeros, n)  # fp32 in and out
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # AMX: the weight enters as two bf16 parts (16 bits of it); AVX512-BF16: the codes are exact and the scales
    # apply to group sums; AVX2-FMA: the fp32-dequantised weight itself; all sum in fp32. A weight rounded to bf16
    # once would be off by ~2e-3 of the largest output, so this bound also shows none rounds the weight
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * float(want.abs().max()))
    got16 = batch_mm(fn, x.to(torch.bfloat16), lin.packed, lin.scales_zeros, n)  # bf16 out: its rounding only
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.double(), want, rtol=8e-3, atol=1e-3 * float(want.abs().max()))
    # a strided x (a column slice of a wider tensor) reads the same values
    wide = torch.cat([x, torch.randn(rows, 7, generator=g)], dim=1)[:, :k]
    assert torch.equal(batch_mm(fn, wide, lin.packed, lin.scales_zeros, n), got)


def test_int4linear_takes_the_kernel_from_min_rows(fn, isa, monkeypatch):
    lin, w = _weight(192, 128, seed=3)
    calls = []

    def counted(*args):
        calls.append(args[0])  # the row count
        return fn(*args)

    monkeypatch.setattr(quant, "BATCH_KERNEL", BatchKernel(counted, 4, isa))
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        assert torch.equal(lin.mm(x), lin.mm_torch(x))  # below the threshold: PyTorch's kernel, bit for bit
    assert calls == []
    x = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    assert torch.equal(lin.mm(x), batch_mm(fn, x, lin.packed, lin.scales_zeros, 192)) and calls == [6]
    torch.testing.assert_close(lin.mm(x), lin.mm_torch(x), rtol=8e-3, atol=1e-2)  # both mean the same weight
    # a row share cut at a multiple of 64 (the vocab-parallel head) equals those rows of the whole product
    part = lin.out_rows(64, 192)
    assert torch.equal(part.mm(x), lin.mm(x)[:, 64:])
    # the Q8_0 head (two 4-bit halves, input fed twice, bf16-exact scales) through the kernel: exact weights
    gq = torch.Generator().manual_seed(5)
    q8 = torch.randint(-128, 128, (128, 64), generator=gq).to(torch.int8)
    d = (torch.rand(128, 2, generator=gq) * 0.01 + 1e-4).to(torch.bfloat16).float()
    head = int4_from_q8(q8, d)
    xh = torch.randn(8, 64, generator=gq)
    dense = (q8.float().view(128, 2, 32) * d[:, :, None]).view(128, 64)
    exact = xh.to(torch.bfloat16).double() @ dense.double().T
    got = head.mm(xh).double()
    assert (got - exact).abs().max() <= 1e-5 * (xh.abs().double() @ dense.abs().double().T).max()
    assert calls[-1] == 8  # it did go through the C kernel


def test_rows_off_the_64_grid_keep_pytorchs_kernel(fn, isa, monkeypatch):
    lin, _ = _weight(80, 64, seed=4)  # packed to 80 rows: the C kernels need whole 64-row blocks
    monkeypatch.setattr(quant, "BATCH_KERNEL", BatchKernel(fn, 1, isa))
    x = torch.randn(20, 64).to(torch.bfloat16)
    assert torch.equal(lin.mm(x), lin.mm_torch(x))


def test_the_threshold_is_measured_once_then_kept(tmp_path):
    first, how = choose_batch_kernel(tmp_path)
    again, how2 = choose_batch_kernel(tmp_path)
    assert "measured earlier" in how2 and "measured earlier" not in how
    assert (first is None) == (again is None)
    if first is not None:
        assert again is not None and first.min_rows == again.min_rows and first.min_rows in (2, 4, 8, 16, 32)
        assert f"batches of {first.min_rows}+ rows" in how2
        best = load_int4_batch(tmp_path / "kernels")  # the first ISA of ISAS this CPU runs
        assert best is not None and first.isa == best[1] and f"on the {first.isa} kernel" in how2


def test_pytorchs_packing_block_is_probed_and_64_row_kernels_refuse_32(tmp_path, monkeypatch):
    import gpu_worker.int4_batch as ib

    block = ib.torch_int4_block()  # what PyTorch does on this CPU; the products tests above read it
    assert block in (32, 64), ib.capability()
    if ib.load_library(ib.SOURCE, tmp_path)[0] is None:
        pytest.skip(f"no C compiler: {ib.load_library(ib.SOURCE, tmp_path)[1]}")
    monkeypatch.setattr(ib, "torch_int4_block", lambda: 32)  # PyTorch at AVX2 capability, e.g. on an AVX-512 CPU
    for isa in ("AMX", "AVX512-BF16"):
        assert ib.load_int4_kernel.__wrapped__(tmp_path, isa) is None
        assert (
            ib.LOAD_NOTES[tmp_path]
            == f"PyTorch packs 4-bit weights in 32-row blocks here, which the {isa} kernel does not read"
        )


@pytest.mark.parametrize("block", [32, 64])
def test_fma_kernel_reads_either_packing_block(tmp_path, block):
    """The AVX2 kernel on both of PyTorch's layouts (this CPU packs one of them; the other is written by hand), so
    the 64-row variant an AVX-512 CPU without BF16 would take is tested here too."""
    import gpu_worker.int4_batch as ib

    lib, note = ib.load_library(ib.SOURCE, tmp_path)
    if lib is None:
        pytest.skip(note)
    fn = ib.load_int4_kernel.__wrapped__(tmp_path, "AVX2-FMA")
    if fn is None:
        pytest.skip(ib.LOAD_NOTES[tmp_path])
    fn = getattr(lib, f"loom_int4_fma{block}")
    fn.argtypes, fn.restype = ib._ARGTYPES, ib.ctypes.c_int
    q = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(block))
    lin = int4_from_affine(q, torch.rand(192, 3) * 0.05, torch.randn(192, 3) * 0.05)
    packed = ib.int4_layout(q, block)
    if block == ib.torch_int4_block():
        assert torch.equal(packed, lin.packed)  # the hand-written layout is PyTorch's
    sz = lin.scales_zeros.float()
    w = (q.float() - 8) * sz[:, :, 0].T.repeat_interleave(32, 1) + sz[:, :, 1].T.repeat_interleave(32, 1)
    x = torch.randn(13, 96)
    got = batch_mm(fn, x, packed, lin.scales_zeros, 192)
    want = x.to(torch.bfloat16).double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * float(want.abs().max()))


def test_a_packing_no_kernel_reads_refuses_every_kernel(tmp_path):
    """PyTorch's DEFAULT capability packs adjacent rows into a byte: a 32-row probe alone would take it for the AVX2
    layout. Run in a child process with ATEN_CPU_CAPABILITY=default, the probe finds no known layout and every
    kernel is refused, so 4-bit batches stay on PyTorch's kernel."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; from pathlib import Path; import gpu_worker.int4_batch as ib; "
        "print(ib.capability(), ib.torch_int4_block(), ib.load_int4_batch(Path(sys.argv[1])) is None, "
        "ib.LOAD_NOTES.get(Path(sys.argv[1]), ''))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120, cwd=root
    )
    assert out.returncode == 0, out.stderr[-2000:]
    cap, block, none, note = out.stdout.strip().split(" ", 3)
    assert cap == "DEFAULT" and block == "0" and none == "True", out.stdout
    assert "no C compiler" in note or "layout Loom does not know" in note or "has neither" in note, note


def test_a_library_that_does_not_build_is_reported_once_not_per_isa(tmp_path, monkeypatch, caplog):
    """Every ISA's kernel lives in the one library: its failure used to be logged once per ISA tried."""
    import logging

    import gpu_worker.int4_batch as ib

    monkeypatch.setattr(ib, "load_library", lambda source, cache_dir: (None, "no C compiler (cc not found)"))
    with caplog.at_level(logging.INFO, logger=ib.log.name):
        assert all(ib.load_int4_kernel(tmp_path, isa) is None for isa in ib.ISAS)
    lines = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert lines == ["4-bit batch kernels unavailable: no C compiler (cc not found)"]
    assert ib.LOAD_NOTES[tmp_path] == "no C compiler (cc not found)"
