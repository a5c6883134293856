"""``gpu_worker.prefill_attention``: a long chunk after a cached prefix, attended in two unmasked parts merged by
their log-sum-exps, equals SDPA with the prefix-causal mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.prefill_attention import SPLIT_MIN_NEW, prefix_causal_attention, split_pays


def _masked_sdpa(q, k, v, prefix):
    new, total = q.shape[1], k.shape[1]
    mask = torch.ones(new, total, dtype=torch.bool).tril(prefix)[None, None]
    o = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=1 / math.sqrt(q.shape[-1]), enable_gqa=True
    )
    return o[0]


@pytest.mark.parametrize(
    ("nq", "nkv", "prefix", "new"), [(9, 3, 300, 200), (6, 2, 1, 130), (3, 1, 77, 64), (4, 4, 5, 300)]
)
def test_equals_the_masked_sdpa_in_fp32(nq, nkv, prefix, new):
    g = torch.Generator().manual_seed(nq * 1000 + prefix)
    q = torch.randn(nq, new, 64, generator=g)
    kv = torch.randn(2, prefix + new, nkv, 64, generator=g) * 2  # KV-cache layout [tokens, heads, d], transposed
    k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
    got = prefix_causal_attention(q, k, v, prefix, 1 / math.sqrt(64))
    want = _masked_sdpa(q, k, v, prefix)
    assert got.shape == want.shape == (nq, new, 64) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-5
    # a query attends to every prefix key: changing the last prefix key changes every row's output
    k2 = k.clone()
    k2[:, prefix - 1] += 1.0
    changed = (prefix_causal_attention(q, k2, v, prefix, 1 / math.sqrt(64)) - got).abs().amax(dim=(0, 2))
    assert bool((changed > 0).all())
    # and no query sees a later new key: changing the last key leaves every row but the last alone
    v2 = v.clone()
    v2[:, -1] += 1.0
    moved = (prefix_causal_attention(q, k, v2, prefix, 1 / math.sqrt(64)) - got).abs().amax(dim=(0, 2))
    assert bool((moved[:-1] == 0).all()) and moved[-1] > 0


def test_bf16_is_as_close_to_fp32_as_the_masked_sdpa_in_bf16():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(9 if i == 0 else 3, 600 if i == 0 else 900, 64, generator=g) for i in range(3))
    exact = _masked_sdpa(q, k, v, 300)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = prefix_causal_attention(qb, kb, vb, 300, 1 / math.sqrt(64))
    assert got.dtype == torch.bfloat16
    ours = (got.float() - exact).abs().mean().item()
    sdpa = (_masked_sdpa(qb, kb, vb, 300).float() - exact).abs().mean().item()
    assert ours <= 1.25 * sdpa + 1e-4, (ours, sdpa)


def test_split_only_where_it_pays():
    cpu = torch.device("cpu")
    assert split_pays(cpu, torch.float32, 2048, SPLIT_MIN_NEW)
    assert split_pays(cpu, torch.bfloat16, 1, 2048)
    assert not split_pays(cpu, torch.float32, 2048, SPLIT_MIN_NEW - 1)  # short chunks keep SDPA's mask
    assert not split_pays(cpu, torch.float32, 0, 4096)  # no prefix: causal SDPA already
    assert not split_pays(cpu, torch.float16, 2048, 2048)
    assert not split_pays(torch.device("cuda"), torch.float32, 2048, 2048)
