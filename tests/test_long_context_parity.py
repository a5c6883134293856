"""Decode attention over long and very unequal histories, and a step mixing prefill with decodes, against
transformers fp32 logits on the real checkpoint (TP=1, in-process).

A 1,300-token prompt decodes in the same steps as two short chats, so the worker's length grouping makes
separate decode groups (one long, one short); logits must match the reference within 1e-3 either way, with decode
attention on the C kernel (reading the paged cache in place) and on SDPA.
"""

from __future__ import annotations

import pytest
import torch
from loom_helpers import make_args

from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

pytestmark = pytest.mark.slow

ATOL = 1e-3
STEPS = 3
GREEDY = WorkerSampling(0.0, 1.0, -1, None)


@pytest.fixture(scope="module")
def cases(model_path, prompts_ids):
    """Three prompts (long, short, short) with transformers' greedy tokens and raw logits per position."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    shorts = sorted(prompts_ids.values(), key=len)[:2]
    long = (shorts[0] + shorts[1]) * (1300 // (len(shorts[0]) + len(shorts[1])) + 1)
    prompts = [long[:1300], shorts[0], shorts[1]]
    out = []
    with torch.inference_mode():
        for ids in prompts:
            g = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=STEPS + 1,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
            out.append((ids, g.sequences[0, len(ids) :].tolist(), [x[0].float() for x in g.logits]))
    return out


@pytest.fixture(scope="module")
def worker(model_path):
    from gpu_worker.worker import Worker

    return Worker(make_args(model_path, max_total_tokens=4096, context_length=2048))


@pytest.mark.parametrize("attention", ["c-kernel", "sdpa"])
def test_unequal_histories_decode_in_groups_and_match(worker, cases, monkeypatch, attention, tmp_path_factory):
    if attention == "sdpa":
        monkeypatch.setattr(worker.model, "decode_attn", None)
    else:  # the C decode attention whatever the start-up timing chose (gpu_worker/decode_attention.py)
        from gpu_worker.decode_attention import LOAD_NOTES, as_callable, load_decode_attention

        d = tmp_path_factory.mktemp("kernels")
        fn = load_decode_attention(d)
        if fn is None:
            pytest.skip(f"no C decode attention here: {LOAD_NOTES[d]}")
        monkeypatch.setattr(worker.model, "decode_attn", as_callable(fn))
        monkeypatch.setattr(worker, "decode_mirror", None)  # read in place from the paged cache
    groups_seen = []
    real = worker._decode_groups

    def spy(fb, rows, tok):
        groups = real(fb, rows, tok)
        groups_seen.append([g.length for g in groups])
        return groups

    monkeypatch.setattr(worker, "_decode_groups", spy)
    bases = [0, 1400, 1600]
    plan = [
        BatchReq(f"r{i}", i, ids, 0, list(range(b, b + len(ids))), None, GREEDY)
        for i, ((ids, _, _), b) in enumerate(zip(cases, bases, strict=True))
    ]
    logits = worker.forward_logits(ForwardBatch(1, plan))
    for i, (_, _, ref) in enumerate(cases):
        assert (logits[i] - ref[0]).abs().max().item() < ATOL, ("prefill", i)
    for k in range(1, STEPS + 1):
        reqs = []
        for i, (ids, toks, _) in enumerate(cases):
            pos = len(ids) + k - 1
            reqs.append(BatchReq(f"r{i}", i, [toks[k - 1]], pos, [bases[i] + pos], None, GREEDY, k))
        logits = worker.forward_logits(ForwardBatch(k + 1, reqs))
        for i, (_, _, ref) in enumerate(cases):
            diff = (logits[i] - ref[k]).abs().max().item()
            assert diff < ATOL, ("decode", i, k, diff)
    # SDPA: the long row apart from the short ones; the C kernel reads each row's own length: one group
    per_step = 2 if attention == "sdpa" else 1
    assert groups_seen[0] == [] and all(len(g) == per_step for g in groups_seen[1:]), groups_seen


def test_prefill_in_the_same_step_as_decodes(worker, cases):
    """Step 1 prefills the long prompt and one short; step 2 decodes both while prefilling the other short."""
    (l_ids, l_toks, l_ref), (a_ids, a_toks, a_ref), (b_ids, _, b_ref) = cases
    bases = [0, 1400, 1600]
    step1 = [
        BatchReq("l", 0, l_ids, 0, list(range(0, len(l_ids))), None, GREEDY),
        BatchReq("a", 1, a_ids, 0, list(range(1400, 1400 + len(a_ids))), None, GREEDY),
    ]
    worker.forward_logits(ForwardBatch(1, step1))
    step2 = [
        BatchReq("b", 2, b_ids, 0, list(range(bases[2], bases[2] + len(b_ids))), None, GREEDY),
        BatchReq("l", 0, [l_toks[0]], len(l_ids), [len(l_ids)], None, GREEDY, 1),
        BatchReq("a", 1, [a_toks[0]], len(a_ids), [1400 + len(a_ids)], None, GREEDY, 1),
    ]
    logits = worker.forward_logits(ForwardBatch(2, step2))
    assert (logits[0] - b_ref[0]).abs().max().item() < ATOL
    assert (logits[1] - l_ref[1]).abs().max().item() < ATOL
    assert (logits[2] - a_ref[1]).abs().max().item() < ATOL


def test_a_long_chunk_after_a_cached_prefix_matches(worker, cases, monkeypatch):
    """The 1,300-token prompt prefilled as 200 tokens, then 1,100 more after them (as chunked prefill or a
    prefix-cache hit sends it): the second chunk is attended in two unmasked parts merged by their log-sum-exps
    (``gpu_worker.prefill_attention``), and its last logits match transformers' within 1e-3."""
    import gpu_worker.model as model

    (ids, _, ref), split = cases[0], []
    real = model.prefix_causal_attention

    def spy(q, k, v, prefix, scale):
        split.append((q.shape[1], prefix))
        return real(q, k, v, prefix, scale)

    monkeypatch.setattr(model, "prefix_causal_attention", spy)
    worker.forward_logits(ForwardBatch(1, [BatchReq("c", 0, ids[:200], 0, list(range(200)), None, GREEDY)]))
    rest = BatchReq("c", 0, ids[200:], 200, list(range(200, len(ids))), None, GREEDY)
    logits = worker.forward_logits(ForwardBatch(2, [rest]))
    assert split == [(len(ids) - 200, 200)] * worker.cfg.num_layers
    assert (logits[0] - ref[0]).abs().max().item() < ATOL
