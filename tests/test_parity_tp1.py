"""TP=1 in-process: Loom's Worker + Scheduler against transformers fp32 on the real SmolLM2 checkpoint.

Prefill logits (solo and batched) and teacher-forced decode logits within 1e-3; greedy tokens identical for each
prompt run solo, all at once in one batch, and with staggered arrival (continuous batching).
"""

from __future__ import annotations

import pytest
import torch
from loom_helpers import DECODE_STEPS, PROMPTS, make_args, output_ids, prefill_batch, run_engine, teacher_forced_logits
from loom_helpers import until_eos as cut

from ipc.messages import SamplingParams, TokenizedReq

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
ATOL = 1e-3
NAMES = [p.name for p in PROMPTS]


@pytest.fixture(scope="module")
def worker(model_path):
    from gpu_worker.worker import Worker

    return Worker(make_args(model_path))


def scheduler():
    from scheduler_proc.scheduler import Scheduler

    return Scheduler(max_running=16, kv_capacity=2048, context_len=2048, eos_ids=[2])


def tokenized(name, prompts_ids, max_new=NEW_TOKENS):
    return TokenizedReq(name, prompts_ids[name], SamplingParams(max_new_tokens=max_new, temperature=0.0))


def expected(reference, name, n=NEW_TOKENS):
    return cut(reference[name]["greedy"], n)


def test_worker_shard_is_the_whole_model(worker):
    assert worker.plan.q_heads == (0, 9) and worker.plan.kv_heads == (0, 3)
    assert worker.dtype == torch.float32


def test_prefill_logits_match_transformers(worker, reference, prompts_ids):
    ids = [prompts_ids[n] for n in NAMES]
    ref = torch.stack([reference[n]["logits"] for n in NAMES])
    solo = torch.stack([worker.forward_logits(prefill_batch([x]))[0] for x in ids])
    batched = worker.forward_logits(prefill_batch(ids))
    assert solo.dtype == torch.float32 and solo.shape == (len(NAMES), 49152)
    for i, n in enumerate(NAMES):
        assert (solo[i] - ref[i]).abs().max().item() < ATOL, n
        assert (batched[i] - ref[i]).abs().max().item() < ATOL, n
        assert solo[i].argmax() == reference[n]["greedy"][0]


def test_decode_logits_match_transformers(worker, reference, prompts_ids):
    """All prompts decode together (mixed lengths) fed transformers' tokens; logits at steps 1, 7, 15, 23."""
    ids = [prompts_ids[n] for n in NAMES]
    forced = [reference[n]["greedy"] for n in NAMES]
    got = teacher_forced_logits(worker, ids, forced, DECODE_STEPS)
    checked = 0
    for k in DECODE_STEPS:
        for i, n in enumerate(NAMES):
            if k in reference[n]["step_logits"]:
                diff = (got[k][i] - reference[n]["step_logits"][k]).abs().max().item()
                assert diff < ATOL, (n, k, diff)
                checked += 1
    assert checked >= 3 * len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_solo(worker, reference, prompts_ids, name):
    outs = run_engine(worker, scheduler(), {0: [tokenized(name, prompts_ids)]})
    got = output_ids(outs[name])
    assert got == expected(reference, name)
    fin = outs[name][-1]
    assert fin.finished and fin.finish_reason.type == ("stop" if got[-1] == 2 else "length")


def test_greedy_all_at_once_in_one_batch(worker, reference, prompts_ids):
    outs = run_engine(worker, scheduler(), {0: [tokenized(n, prompts_ids) for n in NAMES]})
    assert len(outs["__plans__"][0].reqs) == len(NAMES)  # one prefill step for everyone
    for n in NAMES:
        assert output_ids(outs[n]) == expected(reference, n), n


def test_greedy_staggered_arrival(worker, reference, prompts_ids):
    """Requests join while others decode: prefill and decode rows share steps; tokens must not change."""
    arrivals = {0: [tokenized(NAMES[0], prompts_ids)], 1: [tokenized(NAMES[1], prompts_ids)]}
    arrivals[3] = [tokenized(NAMES[2], prompts_ids), tokenized(NAMES[3], prompts_ids)]
    arrivals[6] = [tokenized(NAMES[4], prompts_ids)]
    arrivals[10] = [tokenized(NAMES[5], prompts_ids)]
    outs = run_engine(worker, scheduler(), arrivals)
    for n in NAMES:
        assert output_ids(outs[n]) == expected(reference, n), n
    mixed = [fb for fb in outs["__plans__"] if {r.prefix_len == 0 for r in fb.reqs} == {True, False}]
    assert len(mixed) >= 3  # steps that carried a prefill alongside decodes


def test_kv_slot_reuse_does_not_leak_between_requests(worker, reference, prompts_ids):
    """A tiny KV pool forces later requests into slots freed by earlier ones; outputs stay exact."""
    from scheduler_proc.scheduler import Scheduler

    long_name = max(NAMES, key=lambda n: len(prompts_ids[n]))
    need = len(prompts_ids[long_name]) + 8
    s = Scheduler(max_running=16, kv_capacity=need, context_len=need, eos_ids=[2])
    order = [long_name] + [n for n in NAMES if n != long_name][:2] + [long_name]
    arrivals = {
        0: [
            TokenizedReq(f"{i}-{n}", prompts_ids[n], SamplingParams(max_new_tokens=8, temperature=0.0))
            for i, n in enumerate(order)
        ]
    }
    outs = run_engine(worker, s, arrivals)
    for i, n in enumerate(order):
        assert output_ids(outs[f"{i}-{n}"]) == expected(reference, n, 8), n
    assert s.kv.slots.num_free == need and s.kv.reserved == 0
