"""TP=2 and TP=3 logits from real gloo ranks (torch.multiprocessing), each a Worker on its shard, vs transformers.

Prefill logits one prompt at a time, then all prompts prefilled in one batch and decoded together with
transformers' greedy tokens fed back (teacher forcing): every logit within 1e-3 of transformers fp32.
"""

from __future__ import annotations

import pytest
from loom_helpers import PROMPTS, tp_logits

pytestmark = pytest.mark.slow

ATOL = 1e-3
STEPS = (0, 1, 7)  # 0 = batched prefill
NAMES = [p.name for p in PROMPTS]


@pytest.mark.parametrize("world", [2, 3], ids=["tp2", "tp3"])
def test_tp_logits_match_transformers(world, model_path, reference, prompts_ids, tmp_path):
    ids = [prompts_ids[n] for n in NAMES]
    forced = [reference[n]["greedy"] for n in NAMES]
    out = tp_logits(model_path, ids, forced, STEPS, world, tmp_path)
    for i, n in enumerate(NAMES):
        diff = (out["solo"][i] - reference[n]["logits"]).abs().max().item()
        assert diff < ATOL, (n, "solo prefill", diff)
        diff = (out["steps"][0][i] - reference[n]["logits"]).abs().max().item()
        assert diff < ATOL, (n, "batched prefill", diff)
        for k in STEPS[1:]:
            if k in reference[n]["step_logits"]:
                diff = (out["steps"][k][i] - reference[n]["step_logits"][k]).abs().max().item()
                assert diff < ATOL, (n, f"decode step {k}", diff)
