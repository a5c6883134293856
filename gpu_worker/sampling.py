"""Next-token sampling on TP rank 0: greedy, temperature, top-k, top-p, per-request seeds.

Every row is sampled on its own, from its own logits, so no request's values can change or fail another's:

- ``temperature`` below :data:`GREEDY_TEMPERATURE_EPS` (including 0) and ``top_k == 1`` take the argmax.
- Top-k reads the raw logits; tempering is then ``(logits - max) / temperature`` in fp32: every value is ``<= 0``
  and the top token's is exactly 0, so the softmax never overflows, never divides by zero and sums to >= 1.
- ``top_p`` keeps a token while the probability mass before it is below ``top_p``; the top token is always kept,
  so a ``top_p`` too small for any token but the first (1e-300, 5e-324) means greedy, never an empty distribution.
- A row the model gave NaN or +inf logits, or only ``-inf``, fails alone: :func:`sample_rows` reports an error
  for that row and samples the others as if it were not there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ipc.messages import WorkerSampling

# Temperatures below this are greedy. fp32 logits resolve differences of about 1e-6 relative (a logit near 10 has
# a ulp of 1e-6), and the logits themselves move by more than that with the batch's matmul order. At T = 1e-5
# two tokens whose logits differ by 1e-3 already have a probability ratio of e**-100, so a smaller temperature
# can only choose between tokens that fp32 cannot tell apart; a tiny T would also turn ordinary logit
# differences into overflows (1e-39 is subnormal in fp32, 5e-324 rounds to 0). vLLM's greedy bound is 1e-5 too.
GREEDY_TEMPERATURE_EPS = 1e-5
FAILED_TOKEN = -1  # the token reported for a row that could not be sampled


class SamplingError(RuntimeError):
    """One or more rows could not be sampled (raised by :func:`sample`; :func:`sample_rows` reports them per row)."""


@dataclass(frozen=True)
class SampledBatch:
    """The outcome of one step's sampling.

    ``tokens`` has one id per row in plan order, :data:`FAILED_TOKEN` for a failed row; ``errors`` maps each
    failed row's index to why it failed (a sentence meant for the request's client).
    """

    tokens: list[int]
    errors: dict[int, str] = field(default_factory=dict)


def _seeded_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    # Seed from (seed, tokens generated so far) so a seeded request samples the same tokens whatever else is
    # in its batch and whichever step it is scheduled in.
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


def is_greedy(p: WorkerSampling) -> bool:
    """Whether ``p`` picks the argmax: temperature below :data:`GREEDY_TEMPERATURE_EPS` or ``top_k == 1``."""
    return p.temperature < GREEDY_TEMPERATURE_EPS or p.top_k == 1


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p nucleus of ``probs [N]`` (fp32, any order, summing to about 1): ``(probs, positions)`` of the kept
    tokens, most likely first. A token is kept while the mass before it is below ``top_p``; the first always
    (its mass before is 0, and ``max(1, ...)`` keeps it even for a ``top_p`` that underflows or a NaN row).

    Looks at the 64, then 4096 most likely tokens before sorting all N: a nucleus is usually a few dozen tokens
    of a 49152-token vocabulary, and partial sorts cost a fraction of a full one (measured on this CPU: 0.2 ms
    for 64, 2.7 ms for 4096, 13 ms for a full sort of 49152), so the worst case adds 3 ms to a full sort.
    """
    n = probs.shape[-1]
    for m in (64, 4096, n):
        if 2 * m >= n:  # a partial sort this wide costs as much as a full one
            m = n
        top, pos = torch.sort(probs, descending=True) if m == n else torch.topk(probs, m)
        top64 = top.double()  # fp32 running sums drift by ~1e-6 over thousands of tokens, moving a 0.999 cut
        before = torch.cumsum(top64, 0) - top64  # mass before each (non-decreasing, as the running sum is)
        kept = max(1, int((before < top_p).sum()))
        if kept < m or m == n:
            return top[:kept], pos[:kept]
    raise AssertionError("unreachable: the last pass sorts everything")


def _kept(
    logits: torch.Tensor, top_k: int, top_p: float, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens of ``logits [V]`` (fp32, a finite max) that survive top-k, then top-p at ``temperature``.

    Top-k reads the logits themselves (tempering is monotone, and this way no rounding can merge two logits
    into a tie); then ``(x - max) / temperature`` is ``<= 0``, never NaN, and exactly 0 for the top token, so
    the softmax cannot overflow and sums to at least 1 before it normalises.

    Returns:
        ``(probs, ids)``: the kept tokens' probabilities (renormalised over what top-k kept, not over what top-p
        kept) and their vocabulary ids, or ``(probs [V], None)`` when every token is kept.
    """
    v = logits.shape[-1]
    ids: torch.Tensor | None = None
    if 0 < top_k < v:
        kth = torch.topk(logits, top_k).values[-1]
        ids = (logits >= kth).nonzero().flatten()  # ties with the k-th are kept
        logits = logits[ids]
    probs = ((logits - logits.max()) / temperature).softmax(-1)
    if top_p >= 1.0:
        return probs, ids
    probs, pos = _nucleus(probs, top_p)
    return probs, pos if ids is None else ids[pos]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus, keeping the top token always.

    The same rule :func:`sample_rows` samples from (both use ``_kept``).

    Args:
        logits: ``[V]`` fp32, already tempered; ``-inf`` entries are allowed, NaN is not.
        top_k: keep the ``top_k`` largest (ties with the k-th are kept too); ``<= 0`` or ``>= V`` is off.
        top_p: keep the most likely tokens while the mass before each is below ``top_p`` (computed after
            top-k, on the renormalised distribution); ``>= 1`` is off. A ``top_p`` so small that no token's
            preceding mass is below it keeps just the top token.

    Returns:
        ``[V]`` fp32, the kept logits unchanged and the others ``-inf``.
    """
    _, ids = _kept(logits, top_k, top_p)
    if ids is None:
        return logits
    out = torch.full_like(logits, float("-inf"))
    out[ids] = logits[ids]
    return out


def logit_row_errors(logits: torch.Tensor, row_max: torch.Tensor | None = None) -> dict[int, str]:
    """Rows of ``logits [B, V]`` that cannot be sampled: any NaN or +inf, or no finite value at all.

    ``row_max [B]`` (``logits.max(-1).values``, computed here when not given) finds them in the pass the argmax
    needs anyway: ``max`` propagates NaN, is +inf when any value is, and -inf only when every value is. Only those
    rows are inspected element by element. ``-inf`` entries next to finite ones are fine (zero probability).

    Returns:
        ``{row: reason}`` for the bad rows only.
    """
    errors: dict[int, str] = {}
    if logits.numel() == 0:
        return errors
    if row_max is None:
        row_max = logits.max(-1).values
    for b in (~torch.isfinite(row_max)).nonzero().flatten().tolist():
        row = logits[b]
        n_nan, n_inf = int(torch.isnan(row).sum()), int(torch.isposinf(row).sum())
        if n_nan or n_inf:
            errors[b] = (
                f"the model's logits for this request are not finite ({n_nan} NaN and {n_inf} +inf of "
                f"{row.shape[-1]} values), so no token can be chosen"
            )
        else:
            errors[b] = f"every one of the model's {row.shape[-1]} logits for this request is -inf"
    return errors


def sampling_param_error(p: WorkerSampling) -> str | None:
    """Why ``p`` cannot be sampled (a value validation should have refused), or None if it is usable."""
    if not (math.isfinite(p.temperature) and p.temperature >= 0.0):
        return f"temperature={p.temperature} is not a finite number >= 0"
    if not 0.0 < p.top_p <= 1.0:  # also refuses NaN
        return f"top_p={p.top_p} is not in (0, 1]"
    return None


def _sample_row(row: torch.Tensor, p: WorkerSampling, gen: torch.Generator) -> int:
    """Sample one token from ``row [V]`` (a finite max) with ``p`` (temperature >= the greedy epsilon).

    Draws one uniform number from ``gen`` and inverts the cumulative distribution of the kept tokens (cheaper
    than ``torch.multinomial`` over the vocabulary, and the same distribution).
    """
    # T >= 1e-5 and a finite max: (x - max) / T is finite or -inf, never NaN (see _kept)
    weights, ids = _kept(row.float(), p.top_k, p.top_p, p.temperature)
    cdf = weights.double().cumsum(0)
    u = torch.rand(1, generator=gen, device=gen.device, dtype=torch.float64).to(cdf.device) * cdf[-1]
    i = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[0] - 1)
    return int((i if ids is None else ids[i]).item())


def sample_rows(
    logits: torch.Tensor, params: list[WorkerSampling], output_lens: list[int], fallback: torch.Generator
) -> SampledBatch:
    """Pick one token per row of ``logits [B, V]`` (fp32), each row independently of the others.

    Greedy rows (:func:`is_greedy`) take the argmax; others sample from the tempered, top-k/top-p filtered
    distribution with a generator seeded from ``(seed, output_len)`` or, without a seed, ``fallback`` (on the
    logits' device). A row's token depends only on its own logits, params and ``output_len`` (and, unseeded,
    on ``fallback``'s state), never on its neighbours.

    Args:
        logits: ``[B, V]`` fp32 last-token logits in plan order.
        params: ``B`` rows' sampling values.
        output_lens: ``B`` counts of tokens each request has produced so far (feeds the per-request seed).
        fallback: the generator of unseeded rows, advanced by each of them in row order.

    Returns:
        :class:`SampledBatch`: ``tokens [B]`` and ``errors`` for rows whose logits hold NaN/+inf or only -inf,
        whose params are out of range, or whose sampling raised; those rows get :data:`FAILED_TOKEN`.

    Raises:
        ValueError: only when ``params`` or ``output_lens`` do not have ``B`` entries (a caller's bug); a row that
            cannot be sampled is reported in ``errors``, never raised.
    """
    if len(params) != logits.shape[0] or len(output_lens) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows but {len(params)} params and {len(output_lens)} output lens")
    row_max, argmax = logits.max(-1)  # one pass: the greedy tokens and the rows' health
    tokens = argmax.tolist()
    errors = logit_row_errors(logits, row_max)
    for b, p in enumerate(params):
        if b in errors:
            continue
        bad = sampling_param_error(p)
        if bad is not None:
            errors[b] = f"sampling_params.{bad}"
            continue
        if is_greedy(p):
            continue
        gen = fallback if p.seed is None else _seeded_generator(p.seed, output_lens[b], logits.device)
        try:
            tokens[b] = _sample_row(logits[b], p, gen)
        except RuntimeError as e:  # defensive: the maths above should make this unreachable
            errors[b] = f"sampling failed: {e}"
    for b in errors:
        tokens[b] = FAILED_TOKEN
    return SampledBatch(tokens, errors)


def sample(
    logits: torch.Tensor, params: list[WorkerSampling], output_lens: list[int], fallback: torch.Generator
) -> list[int]:
    """:func:`sample_rows`' tokens ``[B]`` for a batch where every row must succeed.

    Raises:
        SamplingError: naming every failed row and why.
    """
    out = sample_rows(logits, params, output_lens, fallback)
    if out.errors:
        raise SamplingError("; ".join(f"row {b}: {why}" for b, why in sorted(out.errors.items())))
    return out.tokens
