"""The continuous-batching Scheduler driven directly with fake worker tokens (no model, no sockets)."""

from __future__ import annotations

import pytest

from ipc.messages import SamplingParams, TokenizedReq
from scheduler_proc.scheduler import Scheduler

EOS = 2
# a toy detokenizer: token t is the character chr(ord('a') + t % 26)
ALPHA = "abcdefghijklmnopqrstuvwxyz"


def detok(ids):
    return "".join(ALPHA[t % 26] for t in ids)


def make(max_running=4, kv=1000, context=500, **kw) -> Scheduler:
    return Scheduler(
        max_running=max_running, kv_capacity=kv, context_len=context, eos_ids=[EOS], detokenize=detok, **kw
    )


def req(rid, n_prompt=5, max_new=4, **sp) -> TokenizedReq:
    sp.setdefault("temperature", 0.0)
    return TokenizedReq(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_new_tokens=max_new, **sp))


def step(s: Scheduler, tokens: dict[str, int] | int = 7):
    """Plan one step and answer it: every request gets ``tokens`` (or ``tokens[rid]``, default 7)."""
    fb = s.next_batch()
    assert fb is not None
    ids = [tokens.get(r.rid, 7) if isinstance(tokens, dict) else tokens for r in fb.reqs]
    return fb, {o.rid: o for o in s.on_result(ids)}


def assert_idle_and_clean(s: Scheduler, kv: int, max_running: int):
    assert not s.running and not s.waiting
    assert s.kv.slots.num_free == kv and s.kv.reserved == 0
    assert s.rows.num_free == max_running


def test_prefill_then_decode_plans():
    s = make()
    assert s.add(req("a", n_prompt=3, max_new=3)) == []
    fb, outs = step(s, 11)
    (r,) = fb.reqs
    assert (r.rid, r.input_ids, r.prefix_len, r.output_len) == ("a", [10, 11, 12], 0, 0)
    assert len(r.out_slots) == 3 and r.sampling.temperature == 0.0
    prefill_slots = list(r.out_slots)  # snapshot: the plan aliases the request's slot list (see report)
    assert outs["a"].new_ids == [11] and not outs["a"].finished
    assert (outs["a"].prompt_tokens, outs["a"].completion_tokens) == (3, 1)
    fb, outs = step(s, 12)
    (r2,) = fb.reqs
    assert (r2.input_ids, r2.prefix_len, r2.output_len, r2.req_idx) == ([11], 3, 1, r.req_idx)
    assert len(r2.out_slots) == 1 and r2.out_slots[0] not in prefill_slots
    fb, outs = step(s, 13)
    assert outs["a"].finished and outs["a"].finish_reason.type == "length"
    assert outs["a"].completion_tokens == 3
    assert s.next_batch() is None
    assert_idle_and_clean(s, 1000, 4)


def test_admission_bounded_by_max_running():
    s = make(max_running=2)
    for i in range(5):
        s.add(req(f"r{i}", max_new=2))
    fb, _ = step(s)
    assert [r.rid for r in fb.reqs] == ["r0", "r1"]
    assert len(s.waiting) == 3
    fb, outs = step(s)  # r0, r1 decode and finish (length 2); nobody admitted in the same step
    assert [r.rid for r in fb.reqs] == ["r0", "r1"] and all(o.finished for o in outs.values())
    fb, _ = step(s)
    assert [r.rid for r in fb.reqs] == ["r2", "r3"]
    assert len({r.req_idx for r in fb.reqs}) == 2


def test_admission_bounded_by_kv_reservation():
    s = make(kv=30, context=30)
    s.add(req("big", n_prompt=10, max_new=10))  # reserves 20
    s.add(req("next", n_prompt=6, max_new=6))  # needs 12 > 10 left: must wait
    s.add(req("small", n_prompt=4, max_new=5))  # needs 9: may overtake
    fb, _ = step(s)
    assert [r.rid for r in fb.reqs] == ["big", "small"]
    assert [r.rid for r in s.waiting] == ["next"]
    assert s.kv.slots.num_free - s.kv.reserved >= 0
    # while they run, "next" stays out; once "small" finishes (stop token), room for 12 appears? 30-20 = 10 < 12
    fb, outs = step(s, {"small": EOS})
    assert outs["small"].finished and [r.rid for r in s.waiting] == ["next"]
    fb, outs = step(s, {"big": EOS})
    assert outs["big"].finished
    fb, _ = step(s)
    assert [r.rid for r in fb.reqs] == ["next"]


def test_reservation_means_running_requests_never_run_out():
    s = make(max_running=8, kv=40, context=40)
    for i in range(8):
        s.add(req(f"r{i}", n_prompt=3, max_new=7))  # 10 tokens each: 4 fit
    for _ in range(30):
        if not s.has_work:
            break
        step(s)
        assert s.kv.slots.num_free >= s.kv.reserved >= 0
        assert len(s.running) <= 4
    assert_idle_and_clean(s, 40, 8)


def test_finish_on_eos():
    s = make()
    s.add(req("a", max_new=10))
    step(s)
    _, outs = step(s, EOS)
    o = outs["a"]
    assert o.finished and o.finish_reason.type == "stop" and o.finish_reason.matched == EOS
    assert o.new_ids == [EOS] and o.error is None
    assert_idle_and_clean(s, 1000, 4)


def test_finish_on_eos_in_first_token():
    s = make()
    s.add(req("a", max_new=10))
    _, outs = step(s, EOS)
    assert outs["a"].finished and outs["a"].completion_tokens == 1
    assert_idle_and_clean(s, 1000, 4)


def test_ignore_eos_keeps_generating_to_length():
    s = make()
    s.add(req("a", max_new=3, ignore_eos=True))
    for i in range(2):
        _, outs = step(s, EOS)
        assert not outs["a"].finished, i
    _, outs = step(s, EOS)
    assert outs["a"].finished and outs["a"].finish_reason.type == "length"


def test_ignore_eos_still_honours_stop_token_ids():
    s = make()
    s.add(req("a", max_new=5, ignore_eos=True, stop_token_ids=[9]))
    _, outs = step(s, EOS)
    assert not outs["a"].finished
    _, outs = step(s, 9)
    assert outs["a"].finished and outs["a"].finish_reason.matched == 9


def test_finish_on_stop_token_ids():
    s = make()
    s.add(req("a", max_new=10, stop_token_ids=[30, 31]))
    step(s, 5)
    _, outs = step(s, 31)
    assert outs["a"].finished
    assert outs["a"].finish_reason.type == "stop" and outs["a"].finish_reason.matched == 31


@pytest.mark.parametrize("stop", ["hel", ["zz", "ll"]])
def test_finish_on_stop_string_spanning_tokens(stop):
    s = make()
    s.add(req("a", max_new=20, stop=stop))
    # h e l l o = 7 4 11 11 14
    seq = [7, 4, 11, 11, 14]
    steps_taken = 0
    for t in seq:
        _, outs = step(s, t)
        steps_taken += 1
        if outs["a"].finished:
            break
    assert steps_taken == (3 if stop == "hel" else 4)
    assert outs["a"].finish_reason.type == "stop"
    assert outs["a"].finish_reason.matched == ("hel" if stop == "hel" else "ll")
    assert_idle_and_clean(s, 1000, 4)


def test_length_reason_for_max_new_tokens_one():
    s = make()
    s.add(req("a", max_new=1))
    _, outs = step(s, 5)
    assert outs["a"].finished and outs["a"].finish_reason.type == "length"


def test_abort_waiting_request():
    s = make(max_running=1)
    s.add(req("run", max_new=5))
    s.add(req("wait", max_new=5))
    step(s)
    outs = s.abort("wait", "bye")
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason.type == "abort"
    assert outs[0].finish_reason.message == "bye"
    assert not s.waiting


def test_abort_running_request_frees_kv_at_once():
    s = make(kv=100, context=100)
    s.add(req("a", n_prompt=10, max_new=20))
    step(s)
    assert s.kv.slots.num_free == 90 and s.kv.reserved == 20  # prompt + max_new reserved, prompt taken
    outs = s.abort("a")
    assert outs[0].finished and outs[0].finish_reason.type == "abort" and outs[0].completion_tokens == 1
    assert_idle_and_clean(s, 100, 4)
    assert s.next_batch() is None


def test_abort_while_step_in_flight_drops_its_token():
    s = make(kv=100, context=100)
    s.add(req("a", max_new=5))
    s.add(req("b", max_new=5))
    step(s)
    fb = s.next_batch()
    assert {r.rid for r in fb.reqs} == {"a", "b"}
    s.abort("a")
    outs = s.on_result([3, 3])
    assert [o.rid for o in outs] == ["b"]
    assert s.kv.slots.num_free == 100 - len(s.running["b"].slots)


def test_abort_unknown_rid_is_ignored():
    s = make()
    assert s.abort("nope") == []


def test_refusals_of_requests_that_can_never_fit():
    s = make(kv=50, context=40)
    cases = {
        "ctx": req("ctx", n_prompt=30, max_new=11),  # 41 > context 40
        "kv": None,
        "empty": TokenizedReq("empty", [], SamplingParams(max_new_tokens=1)),
    }
    out = s.add(cases["ctx"])
    assert out and out[0].finished and "exceeds the context length 40" in out[0].error
    assert out[0].finish_reason.type == "abort" and out[0].prompt_tokens == 30
    s2 = make(kv=20, context=100)
    out = s2.add(req("kv", n_prompt=15, max_new=6))
    assert out and "exceeds the whole KV pool (20)" in out[0].error
    out = s.add(cases["empty"])
    assert out and out[0].error == "the prompt is empty"
    assert not s.waiting and not s2.waiting
    # exactly at the limits is fine
    assert s.add(req("edge", n_prompt=30, max_new=10)) == []
    assert s2.add(req("edge", n_prompt=14, max_new=6)) == []


def test_duplicate_rid_is_refused():
    s = make()
    assert s.add(req("a")) == []
    out = s.add(req("a"))
    assert out and "already in use" in out[0].error
    step(s)
    out = s.add(req("a"))
    assert out and "already in use" in out[0].error


def test_fail_in_flight_ends_every_request_of_the_step():
    s = make(kv=100, context=100)
    s.add(req("a"))
    s.add(req("b"))
    s.next_batch()
    outs = s.fail_in_flight("rank 1: boom")
    assert {o.rid for o in outs} == {"a", "b"}
    assert all(o.finished and o.error == "rank 1: boom" for o in outs)
    assert_idle_and_clean(s, 100, 4)


def test_worker_returning_wrong_token_count_is_an_error():
    s = make()
    s.add(req("a"))
    s.next_batch()
    with pytest.raises(RuntimeError, match="returned 2 tokens for 1 requests"):
        s.on_result([1, 2])


def test_continuous_batching_mixes_prefill_and_decode():
    s = make()
    s.add(req("a", max_new=5))
    step(s)
    s.add(req("b", n_prompt=4, max_new=5))
    fb, _ = step(s)
    kinds = {r.rid: (len(r.input_ids), r.prefix_len) for r in fb.reqs}
    assert kinds == {"a": (1, 5), "b": (4, 0)}
    # every KV slot in flight is distinct
    slots = [x for r in s.running.values() for x in r.slots]
    assert len(slots) == len(set(slots))


def test_starving_request_is_not_overtaken():
    s = make(max_running=8, kv=30, context=30, starvation_steps=2)
    s.add(req("hog", n_prompt=10, max_new=10))  # reserves 20
    s.add(req("big", n_prompt=10, max_new=10))  # needs 20: waits
    step(s)
    step(s)
    step(s)  # "big" has now waited >= 2 steps
    s.add(req("tiny", n_prompt=2, max_new=2))  # would fit, but must not overtake the starving request
    fb, _ = step(s)
    assert "tiny" not in {r.rid for r in fb.reqs}
    assert [r.rid for r in s.waiting] == ["big", "tiny"]


def test_seeded_sampling_params_reach_the_plan():
    s = make()
    s.add(req("a", temperature=0.7, top_p=0.9, top_k=5, seed=11))
    fb = s.next_batch()
    w = fb.reqs[0].sampling
    assert (w.temperature, w.top_p, w.top_k, w.seed) == (0.7, 0.9, 5, 11)
