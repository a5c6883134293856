"""Sampling is numerically safe per row (issue 9.1): a value validation accepts never fails a step, extreme
values mean what the README says (temperature below 1e-5 is greedy, a top_p that keeps nothing keeps the top
token), a row the model gave NaN/+inf/only -inf logits fails alone, and no row's token depends on its
neighbours. Property tests run a fixed, bounded set of examples (``derandomize=True``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_worker.sampling import (
    FAILED_TOKEN,
    GREEDY_TEMPERATURE_EPS,
    SamplingError,
    filter_logits,
    logit_row_errors,
    sample,
    sample_rows,
)
from ipc.messages import GenerateReq, SamplingParams, StepResult, TokenizedReq, WorkerSampling
from tokenizer_proc.validate import BadRequest, validate_sampling

PROPERTY = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
F32_MAX = float(torch.finfo(torch.float32).max)
# the values of the issue and the edges around the documented epsilon
EDGE_TEMPERATURES = [0.0, -0.0, 5e-324, 1e-45, 1e-39, 1e-30, 9.99e-6, 1e-5, 1.0000001e-5, 1e-4, 0.01, 1.0, 100.0]
EDGE_TOP_P = [5e-324, 1e-300, 1e-45, 1e-8, 0.01, 0.5, 0.9999999999, 1.0]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def accepted(p: WorkerSampling, vocab: int) -> bool:
    """Whether the front door's validation accepts these values (the sampler must then never fail)."""
    sp = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)
    try:
        validate_sampling(GenerateReq(text="x", sampling_params=sp), context_len=4096, vocab_size=vocab)
    except BadRequest:
        return False
    return True


def solo(row: torch.Tensor, p: WorkerSampling, output_len: int) -> int:
    out = sample_rows(row[None], [p], [output_len], gen(12345))
    assert out.errors == {}, out.errors
    return out.tokens[0]


def reference_allows(row: torch.Tensor, p: WorkerSampling, tok: int) -> bool:
    """Whether ``tok`` has a positive probability under the documented rule, worked out from scratch in float64
    (a full sort, no shortcuts), tolerating fp32 rounding only at the top-p cut."""
    x = row.double()
    if 0 < p.top_k < x.shape[0]:
        kth = x.sort(descending=True).values[p.top_k - 1]
        if x[tok] < kth:
            return False
        x = torch.where(x >= kth, x, torch.tensor(float("-inf"), dtype=torch.float64))
    probs = ((x - x.max()) / p.temperature).softmax(0)
    if not probs[tok] > 0:
        return False
    before = float(probs[probs > probs[tok]].sum())  # the least mass any tie order puts before tok
    return before == 0.0 or before < p.top_p * (1 + 1e-5) + 1e-6


def is_greedy_value(p: WorkerSampling) -> bool:
    return p.temperature < GREEDY_TEMPERATURE_EPS or p.top_k == 1


@st.composite
def logit_row(draw, vocab: int) -> torch.Tensor:
    """Real-looking fp32 logits with extremes: huge or tiny scales, -inf entries (never all), ties at the top,
    values near the fp32 maximum, subnormals."""
    g = gen(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 3.0, 30.0, 1e4, 1e30, 1e38]))
    row = torch.randn(vocab, generator=g) * scale + draw(st.sampled_from([0.0, -50.0, 1e6, -1e30]))
    row = row.clamp(-F32_MAX, F32_MAX)
    extras = draw(st.sets(st.sampled_from(["neg_inf", "tie", "max", "min", "subnormal"]), max_size=5))
    idx = torch.randperm(vocab, generator=g)
    if "neg_inf" in extras:
        row[idx[: draw(st.integers(1, vocab - 1))]] = float("-inf")
    if "tie" in extras:
        row[idx[-1]] = row.max()
    if "max" in extras:
        row[idx[-2 % vocab]] = F32_MAX
    if "min" in extras:
        row[idx[0]] = -F32_MAX
    if "subnormal" in extras:
        row[idx[vocab // 2]] = 1e-40
    return row.float()


@st.composite
def valid_params(draw, vocab: int) -> WorkerSampling:
    """Sampling values the front door accepts, biased towards the edges."""
    t = draw(st.one_of(st.sampled_from(EDGE_TEMPERATURES), st.floats(0.0, 100.0)))
    p = draw(st.one_of(st.sampled_from(EDGE_TOP_P), st.floats(0.0, 1.0, exclude_min=True)))
    k = draw(st.one_of(st.just(-1), st.integers(1, vocab), st.sampled_from([1, vocab])))
    seed = draw(st.one_of(st.none(), st.integers(0, 2**63 - 1)))
    return WorkerSampling(t, p, k, seed)


@st.composite
def mixed_batch(draw):
    """Greedy rows and random valid rows in one batch: ``(logits [B, V], params, output_lens)``."""
    vocab = draw(st.sampled_from([2, 3, 17, 64, 301]))
    n = draw(st.integers(1, 8))
    rows = [draw(logit_row(vocab)) for _ in range(n)]
    params = [
        draw(st.one_of(st.just(WorkerSampling(0.0, 1.0, -1, None)), valid_params(vocab)))  # greedy neighbours
        for _ in range(n)
    ]
    lens = [draw(st.integers(0, 10_000)) for _ in range(n)]
    return torch.stack(rows), params, lens


@PROPERTY
@given(mixed_batch())
def test_valid_values_never_fail_and_rows_match_their_solo_runs(batch):
    logits, params, lens = batch
    vocab = logits.shape[1]
    assert all(accepted(p, vocab) for p in params)
    out = sample_rows(logits, params, lens, gen(7))
    assert out.errors == {}
    assert len(out.tokens) == len(params) and all(0 <= t < vocab for t in out.tokens)
    for b, (p, tok) in enumerate(zip(params, out.tokens, strict=True)):
        row = logits[b]
        assert math.isfinite(float(row[tok])), f"row {b} sampled a token of probability 0"
        if 0 < p.top_k < vocab:
            assert row[tok] >= torch.topk(row, p.top_k).values[-1], f"row {b} sampled outside its top-k"
        if is_greedy_value(p):
            assert tok == int(row.argmax()), f"greedy row {b} is not its argmax"
        else:
            assert reference_allows(row, p, tok), f"row {b} sampled token {tok}, outside what {p} allows"
        if is_greedy_value(p) or p.seed is not None:  # reproducible rows: identical to their solo runs
            assert tok == solo(row, p, lens[b]), f"row {b} differs from its solo run"


@PROPERTY
@given(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 70),
    st.one_of(st.none(), st.integers(-5, 2**64)),
)
def test_whatever_validation_accepts_samples(temperature, top_p, top_k, seed):
    """Any float the client may send: validation refuses it naming the field, or every row samples fine."""
    p = WorkerSampling(temperature, top_p, top_k, seed)
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    try:
        validate_sampling(GenerateReq(text="x", sampling_params=sp), context_len=4096, vocab_size=64)
    except BadRequest as e:
        assert any(f"{f}=" in str(e) for f in ("temperature", "top_p", "top_k", "seed"))
        return
    logits = torch.randn(4, 64, generator=gen(3)) * 10
    greedy = WorkerSampling(0.0, 1.0, -1, None)
    out = sample_rows(logits, [greedy, greedy, p, greedy], [0, 1, 2, 3], gen(1))
    assert out.errors == {}
    assert [out.tokens[i] for i in (0, 1, 3)] == [int(logits[i].argmax()) for i in (0, 1, 3)]


@PROPERTY
@given(mixed_batch(), st.data())
def test_a_row_with_broken_logits_fails_alone(batch, data):
    logits, params, lens = batch
    n, vocab = logits.shape
    kinds = {
        "nan_row": lambda r: r.fill_(float("nan")),
        "one_nan": lambda r: r.__setitem__(vocab // 2, float("nan")),
        "pos_inf": lambda r: r.__setitem__(0, float("inf")),
        "all_neg_inf": lambda r: r.fill_(float("-inf")),
        "inf_and_neg_inf": lambda r: r.__setitem__(slice(0, 2), torch.tensor([float("inf"), float("-inf")])[:vocab]),
    }
    bad = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    broken = logits.clone()
    for b in bad:
        kinds[data.draw(st.sampled_from(sorted(kinds)))](broken[b])
    out = sample_rows(broken, params, lens, gen(7))
    assert sorted(out.errors) == bad
    assert all(out.tokens[b] == FAILED_TOKEN for b in bad)
    for b in range(n):
        p = params[b]
        if b not in bad and (is_greedy_value(p) or p.seed is not None):
            assert out.tokens[b] == solo(logits[b], p, lens[b])
    with pytest.raises(SamplingError, match=f"row {bad[0]}: "):
        sample(broken, params, lens, gen(7))


def test_the_issue_values_next_to_four_greedy_streams():
    logits = torch.randn(5, 49152, generator=gen(9)) * 4
    greedy = WorkerSampling(0.0, 1.0, -1, None)
    for extra in (
        WorkerSampling(1e-39, 1.0, -1, None),
        WorkerSampling(5e-324, 1.0, -1, 3),
        WorkerSampling(1.0, 1e-300, -1, None),
        WorkerSampling(1.0, 5e-324, -1, 11),
    ):
        assert accepted(extra, 49152)
        out = sample_rows(logits, [greedy] * 4 + [extra], [5, 6, 7, 8, 0], gen(0))
        assert out.errors == {}
        assert out.tokens == logits.argmax(-1).tolist()  # the neighbours are untouched; the newcomer is greedy too


def test_temperature_epsilon_boundary():
    tie = torch.tensor([[3.0, 3.0, -1.0]])
    below = {
        sample(tie, [WorkerSampling(GREEDY_TEMPERATURE_EPS * 0.999, 1.0, -1, s)], [0], gen())[0] for s in range(40)
    }
    at = {sample(tie, [WorkerSampling(GREEDY_TEMPERATURE_EPS, 1.0, -1, s)], [0], gen())[0] for s in range(40)}
    assert below == {0}  # greedy: the first of the tied maxima, as argmax
    assert at == {0, 1}  # at the epsilon it samples, and only among the tied top tokens


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-45, 1e-9])
def test_a_top_p_that_keeps_nothing_keeps_the_top_token(top_p):
    x = torch.tensor([0.1, 2.0, -3.0, 1.9, float("-inf")])
    out = filter_logits(x, -1, top_p)
    assert torch.isfinite(out).tolist() == [False, True, False, False, False]
    assert sample(x[None], [WorkerSampling(1.0, top_p, -1, 4)], [0], gen())[0] == 1


def test_logit_row_errors_reads_only_what_is_really_wrong():
    x = torch.zeros(5, 8)
    x[0] = F32_MAX  # the row's sum overflows, but every value is finite: fine
    x[1, 3] = float("-inf")  # a masked token: fine
    x[2, 1] = float("nan")
    x[3] = float("-inf")
    x[4, 0] = float("inf")
    errors = logit_row_errors(x)
    assert sorted(errors) == [2, 3, 4]
    assert "1 NaN and 0 +inf of 8 values" in errors[2]
    assert "-inf" in errors[3] and "1 +inf" in errors[4]
    out = sample_rows(x, [WorkerSampling(1.0, 0.9, 3, 1)] * 5, [0] * 5, gen())
    assert sorted(out.errors) == [2, 3, 4] and out.tokens[2:] == [FAILED_TOKEN] * 3


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", float("nan"), "temperature=nan is not a number"),
        ("temperature", float("inf"), "temperature=inf is not finite"),
        ("temperature", float("-inf"), "temperature=-inf is not finite"),
        ("top_p", float("nan"), "top_p=nan is not a number"),
        ("top_p", float("inf"), "top_p=inf is not finite"),
        ("top_p", 0.0, "top_p=0.0 must be in (0, 1]"),
        ("temperature", 100.5, "temperature=100.5 must be in [0, 100]"),
    ],
)
def test_validation_names_non_finite_values(field, value, needle):
    with pytest.raises(BadRequest) as e:
        validate_sampling(GenerateReq(text="x", sampling_params=SamplingParams(**{field: value})), 4096, 64)
    assert needle in str(e.value)


def test_out_of_range_params_that_skip_validation_fail_their_row_only():
    x = torch.randn(3, 16, generator=gen(2))
    bad = [WorkerSampling(float("nan"), 1.0, -1, None), WorkerSampling(1.0, float("nan"), -1, None)]
    for p in bad:
        out = sample_rows(
            x, [WorkerSampling(0.0, 1.0, -1, None), p, WorkerSampling(0.0, 1.0, -1, None)], [0] * 3, gen()
        )
        assert list(out.errors) == [1] and "sampling_params." in out.errors[1]
        assert [out.tokens[0], out.tokens[2]] == [int(x[0].argmax()), int(x[2].argmax())]


# ----------------------------------------------------------------------------- through the Worker and Scheduler

NEEDS_ROW_ERRORS = pytest.mark.skipif(
    "row_errors" not in StepResult.__struct_fields__,
    reason="needs StepResult.row_errors and Scheduler.on_result(next_ids, row_errors) (issue 9.1 report)",
)


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory):
    from lora_helpers import make_tiny_checkpoint, server_args

    from gpu_worker.worker import Worker

    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-sampling") / "model")
    return Worker(server_args(model_dir, dtype="float32", max_total_tokens=512))


def _engine(worker, arrivals, poison: str | None = None, poison_step: int = 2):
    """Run ``arrivals`` through a fresh Scheduler and ``worker``; the logits row of ``poison`` turn NaN at
    ``poison_step`` of its output (as a broken forward would make them)."""
    from loom_helpers import run_engine

    from scheduler_proc.scheduler import Scheduler

    real = worker.forward_logits

    def forward_logits(fb):
        logits = real(fb).clone()  # an inference tensor: clone before writing
        for i, r in enumerate(fb.reqs):
            if r.rid == poison and r.output_len == poison_step:
                logits[i] = float("nan")
        return logits

    worker.forward_logits = forward_logits
    try:
        sched = Scheduler(max_running=8, kv_capacity=512, context_len=256, eos_ids=[-1])
        return run_engine(worker, sched, arrivals)
    finally:
        del worker.forward_logits


@NEEDS_ROW_ERRORS
def test_one_bad_request_never_fails_its_neighbours(tiny_worker):
    from loom_helpers import output_ids

    g = torch.Generator().manual_seed(5)
    prompts = {f"g{i}": torch.randint(3, 256, (4 + i,), generator=g).tolist() for i in range(4)}
    sp = {f"g{i}": SamplingParams(max_new_tokens=8, temperature=0.0) for i in range(4)}
    prompts |= {"tiny-t": [7, 8, 9], "tiny-p": [9, 8, 7], "seeded": [5, 6], "nan": [4, 4, 4]}
    sp["tiny-t"] = SamplingParams(max_new_tokens=6, temperature=1e-39)
    sp["tiny-p"] = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-300, seed=2)
    sp["seeded"] = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=40, seed=77)
    sp["nan"] = SamplingParams(max_new_tokens=6, temperature=0.7, seed=1)

    def tok(rid):
        return TokenizedReq(rid, prompts[rid], sp[rid])

    solo = {rid: output_ids(_engine(tiny_worker, {0: [tok(rid)]})[rid]) for rid in prompts if rid != "nan"}
    mixed = _engine(
        tiny_worker,
        {0: [tok(f"g{i}") for i in range(4)], 2: [tok(r) for r in ("tiny-t", "tiny-p", "nan")], 3: [tok("seeded")]},
        poison="nan",
    )
    for rid, want in solo.items():
        assert output_ids(mixed[rid]) == want, rid
        assert mixed[rid][-1].error is None and mixed[rid][-1].finish_reason.type == "length"
    last = mixed["nan"][-1]
    assert last.finished and last.error_kind == "server_error" and len(output_ids(mixed["nan"])) == 2
    assert last.error.startswith("rank 0: the model's logits for this request are not finite")


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("top_p", [0.2, 0.9, 0.999])
def test_nucleus_of_a_large_vocabulary_matches_a_full_sort(scale, top_p):
    """The nucleus is found by partial sorts (64, then 4096 tokens, then all): its size must be a full sort's."""
    x = torch.randn(49152, generator=gen(int(scale * 10))) * scale
    probs = x.double().softmax(0).sort(descending=True).values
    want = int(((probs.cumsum(0) - probs) < top_p).sum())
    got = int(torch.isfinite(filter_logits(x, -1, top_p)).sum())
    # fp32's softmax sums to 1 +- 2e-6, which moves a 0.999 cut over a tail of 1e-7 tokens by a few of them
    assert abs(got - want) <= max(1, want // 1000), (got, want)
