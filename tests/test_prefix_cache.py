"""The radix prefix cache and chunked prefill, driven through the Scheduler with fake worker tokens (no model).

Covers: structured keys (adapter uid, then tokens; never shared across adapters), reference-counted sharing,
LRU eviction under pressure with exact slot accounting after every step, adapter drop, the clear on a TP group
restart, the ``prefix_slots`` sent once, and chunk plans that carry the decodes.
"""

from __future__ import annotations

import random

import pytest

from ipc.messages import SamplingParams, TokenizedReq
from scheduler_proc.kv_allocator import SlotAllocator
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.scheduler import Scheduler

EOS = 2


def make(kv=1000, max_running=8, chunk=0, cache=True, context=None, max_prefill=0) -> Scheduler:
    return Scheduler(
        max_running=max_running,
        kv_capacity=kv,
        context_len=context or kv,
        eos_ids=[EOS],
        enable_prefix_cache=cache,
        chunked_prefill_size=chunk,
        max_prefill_tokens=max_prefill,
    )


def req(rid, ids, max_new=3, uid=None) -> TokenizedReq:
    return TokenizedReq(rid, list(ids), SamplingParams(max_new_tokens=max_new, temperature=0.0), lora_uid=uid)


def check_accounting(s: Scheduler) -> None:
    """free + cached + in use == pool size, and the reservation is covered by free slots."""
    cached = s.cache.cached_tokens if s.cache is not None else 0
    assert s.kv.slots.num_free + cached + s.kv_in_use() == s.kv.slots.capacity
    assert s.kv.slots.num_free >= s.kv.reserved >= 0


def step(s: Scheduler, tok: int = 7):
    fb = s.next_batch()
    assert fb is not None
    outs = s.on_result([tok] * len(fb.reqs))
    check_accounting(s)
    return fb, {o.rid: o for o in outs}


def run_all(s: Scheduler, tok: int = 7, limit: int = 10_000) -> list:
    plans = []
    while s.has_work and limit:
        plans.append(step(s, tok)[0])
        limit -= 1
    return plans


# ----------------------------------------------------------------------------- the tree alone


def test_tree_match_insert_split_and_lru_eviction():
    alloc = SlotAllocator(100)
    c = RadixCache(alloc)
    a = alloc.alloc(6)
    assert c.insert(c.root(None), [1, 2, 3, 4, 5, 6], a) == []
    n, node, slots = c.match(None, [1, 2, 3, 9], 10)
    assert (n, slots) == (3, a[:3])  # split mid-edge: the match ends on a node
    assert c.match(None, [1, 2, 3, 4, 5, 6], 5)[0] == 5  # the limit holds
    assert c.match("uid-a", [1, 2, 3], 3)[0] == 0  # another adapter's tree is empty
    b = alloc.alloc(2)
    assert c.insert(node, [9, 9], b) == []  # a sibling branch below [1 2 3]
    dup = alloc.alloc(3)
    assert c.insert(c.root(None), [1, 2, 3], dup) == dup  # already held: the caller frees its copies
    alloc.free(dup)
    assert c.cached_tokens == 8 and c.evictable_tokens == 8
    c.lock(node)
    assert c.evictable_tokens == 5
    freed = c.evict(3)  # [4 5] [6] (split by the limited match) are older than [9 9]
    assert freed == 3 and c.match(None, [1, 2, 3, 4], 4)[0] == 3
    c.unlock(node)
    assert c.evict(100) == 5 and c.cached_tokens == 0 and alloc.num_free == 100


def test_tree_drop_frees_unread_nodes_now_and_read_ones_at_unlock():
    alloc = SlotAllocator(50)
    c = RadixCache(alloc)
    c.insert(c.root("A"), [1, 2, 3, 4], alloc.alloc(4))
    alloc.free(c.insert(c.root("A"), [1, 2, 7, 8], alloc.alloc(4)))  # [1 2] already held
    n, node, _ = c.match("A", [1, 2, 3, 4], 4)
    c.lock(node)
    assert c.drop("A") == 2  # [7 8]: nobody reads it
    assert c.match("A", [1, 2, 3, 4], 4)[0] == 0  # never matched again
    assert c.cached_tokens == 4  # the read path stays until its reader lets go
    c.unlock(node)
    assert c.cached_tokens == 0 and alloc.num_free == 50


# ----------------------------------------------------------------------------- scheduler + cache


def test_second_request_reuses_the_prompt_and_reports_cached_tokens():
    s = make()
    prompt = list(range(10, 40))
    s.add(req("a", prompt))
    run_all(s)
    assert s.cache.cached_tokens == 32  # prompt + 2 of 3 outputs (the last has no KV)
    s.add(req("b", prompt + [50, 51]))
    s.add(req("c", prompt))
    fb, outs = step(s)
    rows = {r.rid: r for r in fb.reqs}
    assert (rows["b"].prefix_len, rows["b"].input_ids) == (30, [50, 51])
    assert len(rows["b"].prefix_slots) == 30
    assert rows["c"].prefix_len == 29 and rows["c"].input_ids == [prompt[-1]]  # the last token is recomputed
    assert rows["b"].prefix_slots[:29] == rows["c"].prefix_slots
    assert outs["b"].cached_tokens == 30 and outs["c"].cached_tokens == 29
    fb, outs = step(s)
    assert all(r.prefix_slots == [] for r in fb.reqs)  # sent once
    assert outs["b"].cached_tokens == 30
    run_all(s)
    stats = s.cache_stats()
    assert stats["prompt_tokens_total"] == 30 + 32 + 30 and stats["cached_tokens_total"] == 59
    check_accounting(s)


def test_prefixes_never_cross_adapters():
    s = make()
    prompt = list(range(100, 140))
    for i, uid in enumerate(["uid-A", "uid-B", None, "uid-A2"]):
        s.add(req(f"r{i}", prompt, uid=uid))
        run_all(s)
    assert s.cached_tokens_total == 0
    s.add(req("again", prompt, uid="uid-B"))
    fb, outs = step(s)
    assert fb.reqs[0].prefix_len == 39 and outs["again"].cached_tokens == 39


def test_unload_drops_the_adapters_nodes_and_blocks_inserts():
    s = make()
    prompt = list(range(10, 30))
    s.add(req("a", prompt, max_new=4, uid="uid-A"))
    step(s)  # prefilled: the prompt is cached and locked by "a"
    assert s.cache.cached_tokens == 20
    s.block_adapter("uid-A")  # what the loop does on LoraUnloadCmd
    run_all(s)
    assert s.cache.cached_tokens == 0 and s.kv.slots.num_free == 1000
    s.blocked_uids.clear()
    s.add(req("b", prompt, uid="uid-A"))
    fb, _ = step(s)
    assert fb.reqs[0].prefix_len == 0


def test_group_restart_clears_the_tree_and_requeued_requests_prefill_from_scratch():
    s = make()
    prompt = list(range(10, 30))
    s.add(req("warm", prompt))
    run_all(s)
    s.add(req("a", prompt, max_new=5))
    fb, _ = step(s)
    assert fb.reqs[0].prefix_len == 19
    step(s)
    assert s.requeue_running() == 1
    assert s.cache.cached_tokens == 0 and s.kv.slots.num_free == 1000 and s.kv.reserved == 0
    fb, _ = step(s)
    (r,) = fb.reqs
    assert r.prefix_len == 0 and r.prefix_slots == [] and len(r.input_ids) == 22  # prompt + 2 produced
    run_all(s)
    check_accounting(s)


def test_a_request_never_waits_on_evictable_cache():
    s = make(kv=64)
    s.add(req("a", list(range(10, 50)), max_new=4))
    run_all(s)
    assert s.cache.cached_tokens == 43 and s.kv.slots.num_free == 21
    s.add(req("b", list(range(200, 250)), max_new=10))  # needs 60: only by evicting
    fb, _ = step(s)
    assert fb.reqs[0].rid == "b" and s.cache.evicted_tokens >= 39
    run_all(s)


def test_eviction_under_pressure_200_requests_over_20_prefixes():
    """Pool smaller than the working set: slots balance after every step and every request finishes."""
    rng = random.Random(0)
    prefixes = [[1000 + 50 * p + i for i in range(40)] for p in range(20)]  # 20 x 40 = 800 > 300-slot pool
    s = make(kv=300, max_running=6, chunk=32)
    arrivals = []
    for i in range(200):
        p = rng.randrange(20)
        tail = [rng.randrange(3, 900) for _ in range(rng.randrange(1, 8))]
        arrivals.append(req(f"r{i}", prefixes[p] + tail, max_new=rng.randrange(1, 6), uid=[None, "u1"][p % 2]))
    finished: set[str] = set()
    steps = 0
    while arrivals or s.has_work:
        for _ in range(3):
            if arrivals:
                assert s.add(arrivals.pop(0)) == []  # nothing that fits is refused
        fb = s.next_batch()
        assert fb is not None
        toks = [EOS if (steps + k) % 11 == 0 else 7 for k in range(len(fb.reqs))]
        for o in s.on_result(toks):
            assert o.error is None
            if o.finished:
                finished.add(o.rid)
        check_accounting(s)
        steps += 1
    assert len(finished) == 200
    assert s.cached_tokens_total > 0 and s.cache.evicted_tokens > 0
    assert s.kv.slots.num_free + s.cache.cached_tokens == 300 and s.kv.reserved == 0
    assert s.cache.evict(10_000) and s.kv.slots.num_free == 300


def test_requests_sharing_a_prefill_in_progress_wait_for_it():
    s = make(chunk=64)
    system = list(range(300, 400))
    for i in range(4):
        s.add(req(f"r{i}", system + [10 + i, 20 + i]))
    fb, _ = step(s)
    assert [r.rid for r in fb.reqs] == ["r0"] and len(fb.reqs[0].input_ids) == 64
    fb, _ = step(s)
    assert [r.rid for r in fb.reqs] == ["r0"]  # its last chunk; the others still wait
    fb, outs = step(s)
    got = {r.rid: r for r in fb.reqs}
    assert set(got) == {"r0", "r1", "r2", "r3"}
    assert all(got[f"r{i}"].prefix_len == 100 for i in (1, 2, 3))
    assert outs["r1"].cached_tokens == 100


def test_a_burst_repeating_a_short_start_computes_it_once():
    """Eight prompts opening with the same 6 uncached tokens, arriving together: the other seven wait a step
    and reuse the first one's KV (42 tokens saved), where a pair of such prompts (6 tokens) both compute it."""
    s = make(max_running=16)
    start = [300, 301, 302, 303, 304, 305]
    for i in range(8):
        s.add(req(f"r{i}", start + [10 + i, 20 + i]))
    s.add(req("other", [400, 401, 402]))  # shares nothing: not held back
    s.add(req("lora", start + [9, 9], uid="u1"))  # the same tokens under an adapter: its KV is another's
    fb, _ = step(s)
    assert [r.rid for r in fb.reqs] == ["r0", "other", "lora"]
    fb, outs = step(s)
    got = {r.rid: r for r in fb.reqs}
    assert {f"r{i}" for i in range(1, 8)} <= set(got)
    assert all(got[f"r{i}"].prefix_len == 6 and len(got[f"r{i}"].input_ids) == 2 for i in range(1, 8))
    assert outs["r1"].cached_tokens == 6
    run_all(s)
    check_accounting(s)
    pair = make()
    for i in range(2):
        pair.add(req(f"p{i}", [500, 501, 502, 503, 504, 505, 30 + i]))
    assert [r.rid for r in step(pair)[0].reqs] == ["p0", "p1"]


# ----------------------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("cache", [False, True])
def test_long_prompt_is_chunked_while_decodes_go_on(cache):
    s = make(chunk=16, cache=cache)
    s.add(req("short", [5, 6, 7], max_new=10))
    step(s)
    s.add(req("long", list(range(100, 150)), max_new=2))
    kinds = []
    for _ in range(4):
        fb, outs = step(s)
        rows = {r.rid: r for r in fb.reqs}
        assert rows["short"].input_ids == [7] and len(rows["short"].input_ids) == 1  # the decode goes on
        kinds.append((rows["long"].prefix_len, len(rows["long"].input_ids)))
        assert sum(len(r.input_ids) for r in fb.reqs if r.rid != "short") <= 16
        assert ("long" in outs) == (kinds[-1][0] + kinds[-1][1] == 50)
    assert kinds == [(0, 16), (16, 16), (32, 16), (48, 2)]
    assert rows["long"].sampling.temperature == 0.0
    run_all(s)
    check_accounting(s)


def test_a_burst_with_no_stream_running_is_prefilled_in_one_step():
    """Chunks protect running streams; with none running, --max-prefill-tokens bounds the step instead."""
    s = make(chunk=16, cache=False, max_prefill=120)
    for i in range(4):
        s.add(req(f"p{i}", list(range(100 + 40 * i, 130 + 40 * i)), max_new=3))  # 4 x 30 tokens
    fb, outs = step(s)
    assert [len(r.input_ids) for r in fb.reqs] == [30, 30, 30, 30] and len(outs) == 4  # one step, no chunks
    s.add(req("late", list(range(500, 540)), max_new=2))  # 40 tokens while four streams decode: chunked again
    fb, _ = step(s)
    assert sum(len(r.input_ids) for r in fb.reqs if r.rid == "late") == 16
    run_all(s)
    # an idle server with one long prompt takes it max_prefill tokens at a time
    s.add(req("long", list(range(1000, 1300)), max_new=1))
    assert [len(step(s)[0].reqs[0].input_ids) for _ in range(3)] == [120, 120, 60]
    check_accounting(s)


def test_a_burst_behind_few_streams_gets_a_larger_chunk():
    """Waiting requests that outnumber the decoding streams k to 1 get k chunks' worth of tokens in a step (at
    most --max-prefill-tokens): 64 requests arriving while one streams used to start 64 tokens a step."""
    s = make(chunk=16, cache=False, max_prefill=200, max_running=16)
    s.add(req("stream", [5, 6, 7], max_new=50))
    step(s)
    for i in range(8):
        s.add(req(f"b{i}", list(range(100 + 20 * i, 120 + 20 * i)), max_new=3))  # 8 x 20 tokens
    fb, _ = step(s)  # 8 waiting, 1 decoding: 16 x 8 = 128 tokens
    burst = [r for r in fb.reqs if r.rid != "stream"]
    assert sum(len(r.input_ids) for r in burst) == 128 and len(burst) == 7
    fb, _ = step(s)  # one waiting (b7), seven streams: a chunk again
    assert sum(len(r.input_ids) for r in fb.reqs if r.rid in ("b6", "b7")) == 16
    s.add(req("late", list(range(900, 940)), max_new=2))
    for _ in range(4):
        fb, _ = step(s)
        assert sum(len(r.input_ids) for r in fb.reqs if r.rid == "late") <= 16  # one waiting, many streams
    run_all(s)
    check_accounting(s)
    # random bursts and lengths (waiting-to-decoding ratios that are no whole number): no step plans an empty
    # chunk (a fractional budget left after one prefilling request gave the next a 0-token row)
    rng = random.Random(1)
    s = make(chunk=16, cache=False, max_prefill=200, max_running=16, kv=4000)
    n = 0
    for _ in range(300):
        for _ in range(rng.choice([0, 0, 0, 1, 5, 9])):
            s.add(
                req(f"r{n}", [rng.randrange(3, 900) for _ in range(rng.randrange(1, 70))], max_new=rng.randrange(1, 9))
            )
            n += 1
        if s.has_work:
            fb, _ = step(s)
            assert all(r.input_ids for r in fb.reqs), [(r.rid, len(r.input_ids)) for r in fb.reqs]
    run_all(s)
    check_accounting(s)


def test_chunk_rows_do_not_sample_with_the_requests_params():
    s = make(chunk=8, cache=False)
    s.add(
        TokenizedReq(
            "t",
            list(range(20)),
            SamplingParams(max_new_tokens=2, temperature=0.9, seed=3),
            return_logprob=True,
        )
    )
    fb, outs = step(s)
    assert fb.reqs[0].sampling.temperature == 0.0 and fb.reqs[0].logprobs == -1 and outs == {}
    step(s)
    fb, outs = step(s)
    assert fb.reqs[0].sampling.temperature == 0.9 and fb.reqs[0].logprobs == 0 and outs["t"].new_ids == [7]


def test_abort_mid_prefill_frees_everything():
    s = make(chunk=8)
    s.add(req("x", list(range(40)), max_new=4))
    step(s)
    step(s)
    assert s.cache.cached_tokens == 16  # chunks enter the cache as they are written
    s.abort("x")
    check_accounting(s)
    assert s.cache.evictable_tokens == 16 and s.kv.reserved == 0
