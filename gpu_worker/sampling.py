"""Next-token sampling on TP rank 0: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from ipc.messages import WorkerSampling


def _seeded_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    # Seed from (seed, tokens generated so far) so a seeded request samples the same tokens whatever else is
    # in its batch and whichever step it is scheduled in.
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and the top-p nucleus. ``logits`` is ``[V]`` fp32, already tempered."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token while the mass before it is < top_p (the top token is always kept)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, params: list[WorkerSampling], output_lens: list[int], fallback: torch.Generator
) -> list[int]:
    """Pick one token per row of ``logits [B, V]`` (fp32).

    Rows with ``temperature == 0`` take the argmax; others sample from the tempered, top-k/top-p filtered
    distribution with a generator seeded from ``(seed, output_len)`` or, without a seed, ``fallback``.
    """
    out = logits.argmax(-1).tolist()
    for b, p in enumerate(params):
        if p.temperature <= 0.0 or p.top_k == 1:
            continue
        row = filter_logits(logits[b] / p.temperature, p.top_k, p.top_p)
        gen = fallback if p.seed is None else _seeded_generator(p.seed, output_lens[b], logits.device)
        out[b] = int(torch.multinomial(row.softmax(-1), 1, generator=gen).item())
    return out
