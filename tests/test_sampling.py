"""Sampling on rank 0: greedy, top-k/top-p masks, seeded reproducibility independent of batch composition."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.sampling import filter_logits, sample
from ipc.messages import WorkerSampling

V = 64


def logits_batch(b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * 3


def gen(seed: int = 123) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ws(temperature=1.0, top_p=1.0, top_k=-1, seed=None) -> WorkerSampling:
    return WorkerSampling(temperature, top_p, top_k, seed)


def test_greedy_is_argmax():
    x = logits_batch(5)
    out = sample(x, [ws(0.0)] * 5, [0] * 5, gen())
    assert out == x.argmax(-1).tolist()


def test_top_k_1_equals_greedy_at_any_temperature():
    x = logits_batch(6, seed=1)
    params = [
        ws(t, top_k=1, seed=s) for t, s in zip([0.5, 1.0, 2.0, 7.0, 50.0, 1.0], [None, 1, 2, 3, None, 5], strict=True)
    ]
    assert sample(x, params, [0, 1, 2, 3, 4, 5], gen()) == x.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    x = logits_batch(4, seed=2)
    for seed in range(10):
        assert sample(x, [ws(1.5, top_p=1e-6, seed=seed)] * 4, [seed] * 4, gen(seed)) == x.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible():
    x = logits_batch(3, seed=3)
    p = [ws(1.0, 0.9, 20, 42), ws(0.8, 1.0, -1, 7), ws(1.3, 0.5, 5, 2**62)]
    a = [sample(x, p, [4, 4, 4], gen(1)) for _ in range(3)]
    b = sample(x, p, [4, 4, 4], gen(999))  # the fallback generator is irrelevant to seeded rows
    assert a[0] == a[1] == a[2] == b


def test_seeded_row_independent_of_batch_composition_and_position():
    x = logits_batch(6, seed=4)
    target = x[2].clone()
    p = ws(1.0, 0.95, 30, seed=1234)
    alone = [sample(target[None], [p], [n], gen(0))[0] for n in range(8)]
    for n in range(8):
        others = [ws(1.0), ws(0.0), ws(2.0, seed=9), ws(0.7, 0.8, 10), ws(1.0, seed=1234), ws(0.0)]
        batch = torch.cat([x[:3], target[None], x[3:]])  # target at row 3, same seed also at row 5 (other logits)
        params = others[:3] + [p] + others[3:]
        lens = [n + 1, 0, 17, n, 3, 2, 5]
        assert sample(batch, params, lens, gen(n))[3] == alone[n]
    assert len(set(alone)) > 1  # the step (output_len) feeds the seed: not the same token every step


def test_unseeded_rows_use_the_fallback_generator():
    x = logits_batch(1, seed=5)
    p = [ws(5.0)]
    assert [sample(x, p, [0], gen(1))[0] for _ in range(3)] == [sample(x, p, [0], gen(1))[0]] * 3
    g = gen(2)
    draws = {sample(x, p, [0], g)[0] for _ in range(40)}
    assert len(draws) > 1  # the generator advances: not stuck on one token


def test_samples_stay_inside_top_k_and_top_p():
    x = logits_batch(1, seed=6)[0]
    top5 = set(torch.topk(x, 5).indices.tolist())
    probs = (x / 1.0).softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    n_nucleus = int((cum - probs[order] < 0.6).sum())
    nucleus = set(order[:n_nucleus].tolist())
    ks, ps = set(), set()
    for seed in range(300):
        ks.add(sample(x[None], [ws(1.0, top_k=5, seed=seed)], [0], gen())[0])
        ps.add(sample(x[None], [ws(1.0, top_p=0.6, seed=seed)], [0], gen())[0])
    assert ks <= top5 and len(ks) >= 3
    assert ps <= nucleus and len(ps) >= min(2, len(nucleus))


def test_sampling_frequencies_follow_the_tempered_distribution():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 0.8
    expected = (x[0] / temperature).softmax(-1)
    n = 3000
    draws = sample(x.expand(n, 4), [ws(temperature, seed=seed) for seed in range(n)], [0] * n, gen())
    counts = torch.bincount(torch.tensor(draws), minlength=4).float()
    freq = counts / n
    # 5 standard deviations of a binomial proportion
    tol = 5 * torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((freq - expected).abs() < tol), (freq, expected)


def test_filter_logits_top_k_masks_all_but_k():
    x = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0, 2.5])
    out = filter_logits(x, 3, 1.0)
    kept = torch.isfinite(out)
    assert kept.tolist() == [False, True, False, True, False, True]
    assert torch.equal(out[kept], x[kept])  # kept logits unchanged
    assert torch.all(out[~kept] == float("-inf"))


@pytest.mark.parametrize("k", [-1, 0, 6, 100])
def test_filter_logits_top_k_off_or_wide_keeps_everything(k):
    x = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0, 2.5])
    assert torch.equal(filter_logits(x, k, 1.0), x)


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.3, 1), (0.45, 1), (0.55, 2), (0.7, 2), (0.85, 3), (0.93, 4), (0.97, 5), (0.999, 6), (1.0, 6)]
)
def test_filter_logits_top_p_keeps_the_nucleus(top_p, kept):
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.04, 0.01])  # sorted: .5 .3 .1 .05 .04 .01
    x = probs.log()
    out = filter_logits(x, -1, top_p)
    n_kept = int(torch.isfinite(out).sum())
    if top_p == 1.0:
        assert torch.equal(out, x)
    else:
        assert n_kept == kept
        order = probs.argsort(descending=True)
        assert torch.isfinite(out[order[:kept]]).all()
        assert torch.equal(out[order[:kept]], x[order[:kept]])


def test_filter_logits_top_k_then_top_p_compose():
    x = torch.tensor([4.0, 3.9, 3.8, 0.0, -5.0])
    out = filter_logits(x, 2, 0.5)  # top-2 first, then the nucleus of the renormalised pair
    assert torch.isfinite(out).tolist() == [True, False, False, False, False]
    out = filter_logits(x, 2, 0.9)
    assert torch.isfinite(out).tolist() == [True, True, False, False, False]


def test_filter_logits_keeps_the_top_token_even_with_ties():
    x = torch.tensor([1.0, 1.0, 1.0, 1.0])
    out = filter_logits(x, 1, 1.0)
    assert int(torch.isfinite(out).sum()) >= 1
    out = filter_logits(x, -1, 0.1)
    assert int(torch.isfinite(out).sum()) == 1
    assert not math.isnan(float(out.max()))
