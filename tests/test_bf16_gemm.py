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


def test_use_gemm_replaces_dense_bf16_linears_and_a_tied_head_by_a_copy(fn) -> None:
    from gpu_worker.bf16_gemm import Bf16GemmLinear, use_gemm

    g = torch.Generator().manual_seed(1)
    table = torch.randn(100, 64, generator=g).bfloat16()
    layer = {
        k: (torch.randn(n, 64, generator=g) * 0.05).bfloat16() for k, n in (("qkv", 96), ("o", 64), ("gate_up", 50))
    }
    layer["down"] = torch.randn(64, 25, generator=g).bfloat16()  # an odd K stays a dense tensor
    weights = {"embed": table, "lm_head": table, "layers": [dict(layer)]}
    assert use_gemm(weights, fn) == 4
    got = weights["layers"][0]
    assert all(isinstance(got[k], Bf16GemmLinear) for k in ("qkv", "o", "gate_up")) and got["down"] is layer["down"]
    assert isinstance(weights["lm_head"], Bf16GemmLinear) and weights["embed"] is table
    x = torch.randn(5, 64, generator=g).bfloat16()
    for k in ("qkv", "o", "gate_up"):
        torch.testing.assert_close(got[k].mm(x[:, :64]), (x.float() @ layer[k].float().T).bfloat16())
    torch.testing.assert_close(weights["lm_head"].mm(x.T.contiguous().T), (x.float() @ table.float().T).bfloat16())


@pytest.mark.slow
def test_a_bf16_model_on_the_kernel_is_as_close_to_fp32_as_on_onednn(fn) -> None:
    """Whole prefill steps of 16 random prompts in a bf16 worker, over Loom's GEMM and over oneDNN's packed GEMM
    (the same weights, swapped in place), against the fp32 worker: the same error on average (each prompt's differs
    either way: bf16 rounding propagates through 30 layers) and about as many argmax tokens equal to fp32's."""
    import random

    from lora_helpers import six_adapter_worker

    from gpu_worker.bf16_gemm import Bf16GemmLinear
    from gpu_worker.packed_linear import PackedLinear, _supported
    from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

    if not _supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 GEMM here to compare with")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(8, 40))] for _ in range(16)]
    sp = WorkerSampling(0.0, 1.0, -1, None)

    def run(worker) -> torch.Tensor:
        reqs, nxt = [], 0
        for k, ids in enumerate(prompts):
            reqs.append(BatchReq(f"r{k}", k, ids, 0, list(range(nxt, nxt + len(ids))), None, sp))
            nxt += len(ids)
        return worker.forward_logits(ForwardBatch(1, reqs)).float()

    kw = {"max_total_tokens": 1024, "max_running_requests": 32, "lora_backend": "torch"}
    ref = run(six_adapter_worker(dtype="float32", **kw))
    w = six_adapter_worker(dtype="bfloat16", **kw)
    lin = [(lw, k) for lw in w.model.w["layers"] for k in ("qkv", "o", "gate_up", "down")] + [(w.model.w, "lm_head")]

    def dense(v) -> torch.Tensor:  # the weight behind either linear: W^T = I @ W^T (exact, one product per value)
        return v if isinstance(v, torch.Tensor) else v.mm(torch.eye(v.in_features, dtype=torch.bfloat16)).T.contiguous()

    for d, k in lin:
        d[k] = PackedLinear(dense(d[k]))
    onednn = run(w)
    for d, k in lin:
        d[k] = Bf16GemmLinear(dense(d[k]), fn)
    loom = run(w)
    e_dnnl, e_loom = (onednn - ref).abs().mean(1), (loom - ref).abs().mean(1)
    assert float(e_loom.mean()) <= 1.2 * float(e_dnnl.mean()) + 0.01, (e_loom.mean(), e_dnnl.mean())
    agree = {name: int((t.argmax(1) == ref.argmax(1)).sum()) for name, t in (("loom", loom), ("onednn", onednn))}
    assert agree["loom"] >= agree["onednn"] - 1 and agree["loom"] >= len(prompts) - 2, agree


def test_a_mixed_batch_through_the_fused_gemm_and_lora_call_is_the_same_bits(fn) -> None:
    """A bf16 worker on Loom's GEMM and the cpu-sgmv LoRA kernel serves each projection with one kernel call
    (``SgmvStep.mm_add``: the GEMM's panels between the shrink's items). A prefill and two decode steps of rows
    under five adapters and the base model give the same logits, bit for bit, as the GEMM and the LoRA kernel called
    one after the other; and the one call really served them."""
    from lora_helpers import six_adapter_worker

    from gpu_worker.bf16_gemm import Bf16GemmLinear
    from gpu_worker.lora_kernel import SgmvStep
    from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

    w = six_adapter_worker(dtype="bfloat16", lora_backend="cpu-sgmv", max_total_tokens=1024)
    if w.lora.sgmv_gemm is None:
        pytest.skip("no fused entry here (the LoRA kernel built without it)")
    for lw in w.model.w["layers"]:
        for k in ("qkv", "o", "gate_up", "down"):
            v = lw[k]
            dense = v if isinstance(v, torch.Tensor) else v.mm(torch.eye(v.in_features, dtype=torch.bfloat16)).T
            lw[k] = Bf16GemmLinear(dense.contiguous(), fn)
    uids = [None, *sorted(w.lora.host_uids())][:6]
    sp = WorkerSampling(0.0, 1.0, -1, None)
    prompts = [[1, 504 + 7 * i, 3458, 282 + i, 9690][: 3 + i % 3] for i in range(12)]
    calls = []
    fused_mm_add = SgmvStep.mm_add

    def counted(self, *a):
        out = fused_mm_add(self, *a)
        calls.append(out is not None)
        return out

    def run() -> list[torch.Tensor]:
        logits, base = [], [64 * i for i in range(len(prompts))]
        reqs = [BatchReq(f"r{i}", i, p, 0, list(range(base[i], base[i] + len(p))), uids[i % len(uids)], sp)
                for i, p in enumerate(prompts)]  # fmt: skip
        logits.append(w.forward_logits(ForwardBatch(1, reqs)).float())
        for k in range(2):
            reqs = [BatchReq(f"r{i}", i, [1000 + k], len(p) + k, [base[i] + len(p) + k], uids[i % len(uids)], sp, k + 1)
                    for i, p in enumerate(prompts)]  # fmt: skip
            logits.append(w.forward_logits(ForwardBatch(k + 2, reqs)).float())
        return logits

    SgmvStep.mm_add = counted
    try:
        fused = run()
        assert calls and all(calls), "the fused call did not serve the projections"
        keep, w.lora.sgmv_gemm = w.lora.sgmv_gemm, None
        calls.clear()
        apart = run()
        assert not any(calls)
        w.lora.sgmv_gemm = keep
    finally:
        SgmvStep.mm_add = fused_mm_add
    for a, b in zip(fused, apart, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
