"""TP=2 and TP=3 clusters (real launch.py processes, gloo all-reduce) against transformers fp32 greedy tokens.

Each prompt runs solo, then all together (simultaneously and with staggered arrival). Decode steps cost ~0.2-0.5 s
of collectives here, so each request generates only a few tokens.
"""

from __future__ import annotations

import pytest
from loom_helpers import PROMPTS, decode_step_seconds, launch_cluster, max_overlap, run_concurrently
from loom_helpers import until_eos as cut

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
SHARDS = {
    2: {0: ([0, 6], [0, 2]), 1: ([6, 9], [2, 3])},  # uneven: 9 q / 3 kv heads split by KV-head group
    3: {0: ([0, 3], [0, 1]), 1: ([3, 6], [1, 2]), 2: ([6, 9], [2, 3])},
}


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def tp_cluster(request, tmp_path_factory, model_path):
    tp = request.param
    with launch_cluster(tmp_path_factory.mktemp(f"tp{tp}"), "--tp-size", str(tp), "--max-total-tokens", "2048") as h:
        yield h


def test_every_rank_reports_its_shard(tp_cluster):
    log = tp_cluster.log()
    assert f"(tp_size={tp_cluster.tp_size})" in log
    for rank, (q, kv) in SHARDS[tp_cluster.tp_size].items():
        line = next(x for x in log.splitlines() if f"gpu_worker[{rank}] ready" in x)
        assert f"'q_heads': {q}, 'kv_heads': {kv}" in line, line


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.name for p in PROMPTS])
def test_greedy_solo(tp_cluster, reference, prompt):
    with tp_cluster.client(timeout_s=120) as c:
        out = c.generate(**prompt.request_kwargs(), sampling_params=GREEDY)
    assert out["output_ids"] == cut(reference[prompt.name]["greedy"], NEW_TOKENS)
    assert out["meta_info"]["prompt_tokens"] == len(reference[prompt.name]["input_ids"])


@pytest.mark.parametrize("stagger_steps", [0.0, 1.2], ids=["together", "staggered"])
def test_greedy_all_prompts_batched(tp_cluster, reference, stagger_steps):
    """All prompts at once, or each arriving ~1.2 decode steps after the previous one (continuous batching)."""
    gap = stagger_steps * decode_step_seconds(tp_cluster.endpoint) if stagger_steps else 0.0
    jobs = [(gap * i, {**p.request_kwargs(), "sampling_params": GREEDY}) for i, p in enumerate(PROMPTS)]
    timed = run_concurrently(tp_cluster.endpoint, jobs)
    for p, t in zip(PROMPTS, timed, strict=True):
        assert t.result["output_ids"] == cut(reference[p.name]["greedy"], NEW_TOKENS), p.name
    assert max_overlap([(t.first, t.done) for t in timed]) >= 3  # they shared decode steps
