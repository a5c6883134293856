"""Logprobs of sampled tokens on TP rank 0, from the very logits the tokens were sampled from.

Values are the fp32 log-softmax of the raw logits, before temperature, top-k or top-p (what SGLang's
``return_logprob`` and OpenAI's ``logprobs`` report), so a greedy token's logprob equals
``torch.log_softmax(logits.float(), -1)[token]`` of a reference model on the same weights.
"""

from __future__ import annotations

import torch

from ipc.messages import RowLogprobs

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; the front door refuses more


def row_logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int]) -> dict[int, RowLogprobs]:
    """Logprobs for the rows that asked for them.

    Args:
        logits: ``[B, V]`` fp32 last-token logits in plan order.
        tokens: ``B`` sampled token ids (a failed row's ``-1`` gets no entry).
        wanted: ``B`` values: ``-1`` no logprobs, ``0`` the sampled token's only, ``k > 0`` also the ``k`` most
            likely tokens (capped at :data:`MAX_TOP_LOGPROBS`).

    Returns:
        plan row -> :class:`RowLogprobs`, only for rows with ``wanted >= 0`` and a valid token.
    """
    rows = [b for b, k in enumerate(wanted) if k >= 0 and tokens[b] >= 0]
    if not rows:
        return {}
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, torch.tensor([[tokens[b]] for b in rows], device=logits.device))[:, 0].tolist()
    k_max = min(max(wanted[b] for b in rows), MAX_TOP_LOGPROBS)
    top_v: list[list[float]] = [[] for _ in rows]
    top_i: list[list[int]] = [[] for _ in rows]
    if k_max > 0:
        v, i = lp.topk(k_max, dim=-1)
        top_v, top_i = v.tolist(), i.tolist()
    out: dict[int, RowLogprobs] = {}
    for j, b in enumerate(rows):
        k = min(wanted[b], MAX_TOP_LOGPROBS)
        out[b] = RowLogprobs(chosen[j], list(zip(top_v[j][:k], top_i[j][:k], strict=True)))
    return out
