"""Loom's bf16 GEMM kernel (gpu_worker/csrc/bf16_gemm.c) against an fp32 product of the same bf16 values."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.bf16_gemm import PANEL, bf16_gemm, load_gemm, pack_weight
from ipc.model_source import cache_root


@pytest.fixture(scope="module")
def fn():
    f = load_gemm(cache_root() / "kernels")
    if f is None:
        pytest.skip("no C compiler here: the bf16 GEMM cannot be built")
    try:
        bf16_gemm(f, torch.zeros(1, 2, dtype=torch.bfloat16), pack_weight(torch.zeros(1, 2, dtype=torch.bfloat16)), 1)
    except RuntimeError as e:
        pytest.skip(str(e))
    return f


# row counts through every tail of the 8-row blocks; widths with a partial last panel and a partial 16-column store
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 13, 64, 70])
@pytest.mark.parametrize("n,k", [(1, 2), (50, 576), (960, 576), (320, 1536), (PANEL * 3 + 17, 64)])
def test_products_match_fp32_up_to_the_bf16_rounding_of_the_output(fn, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    got = bf16_gemm(fn, x, pack_weight(w), n)
    want = x.float() @ w.float().T
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # fp32 sums in another order, then one rounding to bf16 (8 bits of mantissa)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3 * float(want.abs().max()))


def test_strided_rows_of_x_are_read_in_place(fn) -> None:
    big = torch.randn(9, 300).bfloat16()
    x = big[:, 20:148]  # rows 300 elements apart
    w = (torch.randn(96, 128) * 0.05).bfloat16()
    torch.testing.assert_close(bf16_gemm(fn, x, pack_weight(w), 96), (x.float() @ w.float().T).bfloat16())


def test_bad_shapes_and_dtypes_are_refused(fn) -> None:
    with pytest.raises(ValueError, match="even K"):
        pack_weight(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        pack_weight(torch.zeros(4, 4))
    wp = pack_weight(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        bf16_gemm(fn, torch.zeros(2, 6, dtype=torch.bfloat16), wp, 4)
    with pytest.raises(ValueError, match="does not fit"):
        bf16_gemm(fn, torch.zeros(2, 8), wp, 4)
