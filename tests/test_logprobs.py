"""Logprobs from rank 0 (in-process Worker + Scheduler, fp32) against transformers' fp32 log-softmax."""

from __future__ import annotations

import pytest
import torch
from loom_helpers import DECODE_STEPS, PROMPTS, make_args, run_engine

from gpu_worker.logprobs import row_logprobs
from ipc.messages import SamplingParams, TokenizedReq

pytestmark = pytest.mark.slow

ATOL = 1e-3


@pytest.fixture(scope="module")
def worker(model_path):
    from gpu_worker.worker import Worker

    return Worker(make_args(model_path))


def _sched():
    from scheduler_proc.scheduler import Scheduler

    return Scheduler(max_running=16, kv_capacity=2048, context_len=2048, eos_ids=[2])


def _collect(outs):
    ids, lps, tops = [], [], []
    for o in outs:
        ids += o.new_ids
        lps += o.new_token_logprobs or []
        tops += o.new_top_logprobs or []
    return ids, lps, tops


def test_greedy_logprobs_match_transformers(worker, reference, prompts_ids):
    """Every token's logprob (and the top 5) at the prefill step and the kept decode steps, all prompts at once."""
    n = max(DECODE_STEPS) + 1
    reqs = [
        TokenizedReq(
            p.name,
            prompts_ids[p.name],
            SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
            return_logprob=True,
            top_logprobs_num=5,
        )
        for p in PROMPTS
    ]
    outs = run_engine(worker, _sched(), {0: reqs})
    checked = 0
    for p in PROMPTS:
        ref = reference[p.name]
        ids, lps, tops = _collect(outs[p.name])
        assert len(lps) == len(ids) == n and len(tops) == n
        assert [t for _, t in lps] == ids
        for k, logits in [(0, ref["logits"]), *ref["step_logits"].items()]:
            if k >= len(ref["greedy"]) or ids[k] != ref["greedy"][k]:
                continue  # past the reference's own end of sequence
            want = torch.log_softmax(logits.float(), -1)
            assert abs(lps[k][0] - want[ids[k]].item()) < ATOL, (p.name, k)
            v, i = want.topk(5)
            assert [t for _, t in tops[k]] == i.tolist(), (p.name, k)
            assert max(abs(a - b) for (a, _), b in zip(tops[k], v.tolist(), strict=True)) < ATOL
            assert tops[k][0][1] == ids[k]  # greedy picks the most likely token
            checked += 1
    assert checked >= 2 * len(PROMPTS)


def test_sampled_tokens_report_untempered_logprobs_and_no_logprobs_unless_asked(worker, reference, prompts_ids):
    name = PROMPTS[0].name
    sp = SamplingParams(max_new_tokens=1, temperature=1.7, top_p=0.9, seed=3)
    asked = TokenizedReq("a", prompts_ids[name], sp, return_logprob=True)
    quiet = TokenizedReq("q", prompts_ids[name], sp)
    outs = run_engine(worker, _sched(), {0: [asked, quiet]})
    ids, lps, tops = _collect(outs["a"])
    want = torch.log_softmax(reference[name]["logits"].float(), -1)
    assert len(lps) == 1 and tops == [] and abs(lps[0][0] - want[ids[0]].item()) < ATOL
    assert all(o.new_token_logprobs is None and o.new_top_logprobs is None for o in outs["q"])


def test_row_logprobs_skips_failed_rows_and_caps_top():
    logits = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0], [5.0, 0.0, 0.0]])
    out = row_logprobs(logits, [2, -1, 0], [2, 3, -1])
    assert set(out) == {0}
    assert out[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())
    assert [t for _, t in out[0].top] == [2, 1]
