"""Scheduler adapter admission (slots per batch, pinned, fairness) and all-or-nothing LoRA ops, in-process."""

from __future__ import annotations

import itertools

import pytest
from lora_helpers import tiny_pool, write_adapter

from gpu_worker.lora_pool import LoraPoolError
from ipc.messages import (
    LoraLoadCmd,
    LoraOpAck,
    LoraUnloadCmd,
    SamplingParams,
    TokenizedReq,
    WorkerLoraLoad,
    WorkerLoraUnload,
)
from scheduler_proc.lora_ops import LoadedAdapter, LoraOps
from scheduler_proc.scheduler import Scheduler

_ids = itertools.count()


def make_sched(slots: int, starvation_steps: int = 64, max_running: int = 64) -> Scheduler:
    return Scheduler(
        max_running=max_running,
        kv_capacity=100_000,
        context_len=4096,
        eos_ids=[2],
        max_loras_per_batch=slots,
        starvation_steps=starvation_steps,
    )


def add(s: Scheduler, uid: str | None, new_tokens: int = 3) -> str:
    rid = f"r{next(_ids)}-{uid}"
    assert s.add(TokenizedReq(rid, [5, 6, 7], SamplingParams(max_new_tokens=new_tokens, temperature=0), uid)) == []
    return rid


def step(s: Scheduler) -> tuple[list, list[str]]:
    """Run one step with a dummy token (never EOS); return the plan's requests and the rids that finished."""
    fb = s.next_batch()
    assert fb is not None
    outs = s.on_result([9] * len(fb.reqs))
    return fb.reqs, [o.rid for o in outs if o.finished]


def adapters_of(reqs, pinned=frozenset()) -> tuple[set, set]:
    """(distinct adapters, distinct unpinned adapters) of a batch."""
    all_ = {r.lora_uid for r in reqs if r.lora_uid is not None}
    return all_, all_ - set(pinned)


def test_batches_never_hold_more_adapters_than_slots_and_everyone_runs():
    s = make_sched(slots=2)
    rids = [add(s, uid) for uid in ["a", "b", "c", None, "a", "d", "e", None, "f", "c", "b", "a"]]
    done: list[str] = []
    first = True
    for _ in range(100):
        if not s.has_work:
            break
        reqs, fin = step(s)
        distinct, _ = adapters_of(reqs)
        assert len(distinct) <= 2, distinct
        if first:  # arrival order: a and b take the two slots; base requests need none and join at once
            assert distinct == {"a", "b"}
            assert sum(r.lora_uid is None for r in reqs) == 2
            assert {r.lora_uid for r in s.waiting} == {"c", "d", "e", "f"}
            first = False
        done += fin
    assert sorted(done) == sorted(rids)


def test_adapters_count_their_rank_rows_not_whole_slots():
    """Two slots at rank 16 (32 rank rows) admit four rank-8 adapters at once, then one of rank 8 with one of
    rank 16; an adapter whose rows are unknown counts a whole slot."""
    s = Scheduler(
        max_running=64, kv_capacity=100_000, context_len=4096, eos_ids=[2], max_loras_per_batch=2, max_lora_rank=16
    )
    s.adapter_rows = {"a": 8, "b": 8, "c": 8, "d": 8, "e": 8, "big": 16, "big2": 16}
    for uid in ["a", "b", "c", "d", "e", "big", "big2", "x"]:
        add(s, uid, new_tokens=2)
    reqs, _ = step(s)
    assert adapters_of(reqs)[0] == {"a", "b", "c", "d"}
    seen = []
    while s.has_work:
        reqs, _ = step(s)
        distinct = adapters_of(reqs)[0]
        assert sum(s._rows(u) for u in distinct) <= 32, distinct
        seen.append(distinct)
    assert {"e", "big"} in seen  # 8 + 16 rows; big2 would make 40
    assert {"big2", "x"} in seen  # 16 + a whole slot (16)


def test_plan_groups_each_adapter_contiguously():
    s = make_sched(slots=4)
    for uid in ["b", None, "a", "b", None, "a"]:
        add(s, uid)
    reqs, _ = step(s)
    order = [r.lora_uid for r in reqs]
    assert order == sorted(order, key=lambda u: u or "")


def test_pinned_adapters_hold_their_own_slots():
    """With P pinned adapters only ``max_loras_per_batch - P`` unpinned ones fit in a batch; pinned always fit."""
    s = make_sched(slots=3)
    s.pinned_uids = {"p"}
    for uid in ["a", "p", "b", "c", "p", None, "d"]:
        add(s, uid, new_tokens=2)
    seen_c = False
    for n in range(100):
        if not s.has_work:
            break
        reqs, _ = step(s)
        distinct, unpinned = adapters_of(reqs, s.pinned_uids)
        assert len(distinct) <= 3 and len(unpinned) <= 2, distinct
        if n == 0:  # a and b fill the unpinned slots; both p requests and the base one join too
            assert distinct == {"a", "b", "p"} and sum(r.lora_uid == "p" for r in reqs) == 2 and len(reqs) == 5
        seen_c |= "c" in distinct
    assert seen_c


def test_requests_for_running_adapters_join_without_new_slots():
    s = make_sched(slots=1)
    add(s, "a", new_tokens=5)
    step(s)
    add(s, "b")
    add(s, "a")
    reqs, _ = step(s)
    assert [r.lora_uid for r in reqs] == ["a", "a"]  # the new "a" joins; "b" waits for the slot
    assert [r.lora_uid for r in s.waiting] == ["b"]


def _rare_adapter_wait(starvation_steps: int, max_steps: int = 80) -> int | None:
    """Steps until a request for rare adapter ``c`` runs amid a never-ending stream for ``a`` and ``b``."""
    s = make_sched(slots=2, starvation_steps=starvation_steps)
    add(s, "a", new_tokens=4)
    add(s, "b", new_tokens=4)
    add(s, "c", new_tokens=4)
    for n in range(1, max_steps + 1):
        reqs, _ = step(s)
        assert len(adapters_of(reqs)[0]) <= 2
        if any(r.lora_uid == "c" for r in reqs):
            return n
        add(s, "a", new_tokens=4)
        add(s, "b", new_tokens=4)
    return None


def test_rare_adapter_is_not_starved():
    # without the fairness rule the stream for a and b would hold both slots forever
    assert _rare_adapter_wait(starvation_steps=10_000) is None
    # with it, c runs once it has waited starvation_steps and the running a/b requests (4 tokens) drain
    waited = _rare_adapter_wait(starvation_steps=8)
    assert waited is not None and waited <= 8 + 4 + 2, waited


def test_unloading_adapter_blocks_new_requests_and_waits_for_in_flight_ones():
    s = make_sched(slots=2)
    add(s, "a", new_tokens=2)
    step(s)
    s.block_adapter("a")  # what the loop does on LoraUnloadCmd
    outs = s.add(TokenizedReq("late", [5], SamplingParams(max_new_tokens=2), "a"))
    assert outs and outs[0].finished and "LoRA adapter a is being unloaded" in outs[0].error
    ops = LoraOps(tp_size=1)
    ops.start(LoraUnloadCmd(1, "a"))
    assert ops.ready_to_send(s.uses_adapter) == []  # the running request still uses it
    step(s)  # it finishes
    assert ops.ready_to_send(s.uses_adapter) == [WorkerLoraUnload(1, "a")]


def test_load_is_all_or_nothing_and_names_failing_ranks():
    ops = LoraOps(tp_size=3)
    ops.start(LoraLoadCmd(5, "uid-x", "x", "/p", pinned=True))
    assert ops.ready_to_send(lambda _u: False) == [WorkerLoraLoad(5, "uid-x", "x", "/p", True)]
    assert ops.on_ack(LoraOpAck(5, 0, True)) == (None, [])
    assert ops.on_ack(LoraOpAck(5, 2, False, "LoRA adapter x: boom")) == (None, [])
    result, rollback = ops.on_ack(LoraOpAck(5, 1, False, "LoRA adapter x: bang"))
    assert not result.ok and result.error == "rank 1: LoRA adapter x: bang; rank 2: LoRA adapter x: boom"
    assert len(rollback) == 1 and rollback[0].uid == "uid-x" and rollback[0].rollback
    assert "uid-x" not in ops.pinned
    assert ops.on_ack(LoraOpAck(rollback[0].op_id, 0, True)) == (None, [])  # rollback acks are ignored
    ops.start(LoraLoadCmd(6, "uid-y", "y", "/q", pinned=True))
    ops.ready_to_send(lambda _u: False)
    for r in range(3):
        result, rollback = ops.on_ack(LoraOpAck(6, r, True))
    assert result.ok and rollback == [] and ops.pinned == {"uid-y": True}


def _pin_harness(tmp_path):
    """A scheduler with 2 slots running "a" (3 tokens) and "b" (5 tokens), and a tiny pool holding a, b, c."""
    s = make_sched(slots=2)
    pool = tiny_pool(slots=2, max_rank=4)  # each adapter (rank 4) takes a whole slot's rank rows
    for u in ("a", "b", "c", "p"):
        write_adapter(tmp_path / u, seed=ord(u))
    for u in ("a", "b", "c"):
        pool.load(u, u, str(tmp_path / u))
    add(s, "a", new_tokens=3)
    add(s, "b", new_tokens=5)
    return s, pool


def _pool_step(s, pool):
    """One step as the loop and every worker rank run it: plan, assign slots (may raise), apply tokens."""
    fb = s.next_batch()
    pool.assign([r.lora_uid for r in fb.reqs])
    s.on_result([9] * len(fb.reqs))
    return fb.reqs


def test_pinning_while_running_adapters_fill_the_slots_would_break_the_next_step(tmp_path):
    """Why a pinned load must wait: taking a slot now leaves the running batch without one."""
    s, pool = _pin_harness(tmp_path)
    _pool_step(s, pool)
    pool.load("p", "p", str(tmp_path / "p"), pinned=True)
    with pytest.raises(LoraPoolError, match=r"batch needs 2 adapters \(8 rank rows\) .*, 4 pinned"):
        _pool_step(s, pool)


def test_pinned_load_waits_until_running_adapters_fit(tmp_path):
    """The scheduler reserves the pinned adapter's slot at once (no new adapter takes it) and sends the load
    only when the running requests' adapters fit in the slots left; every step keeps working."""
    s, pool = _pin_harness(tmp_path)
    ops = LoraOps(tp_size=1)
    for u in ("a", "b", "c"):  # what every rank acked already (rows unknown: each counts a whole slot)
        ops.loaded[u] = LoadedAdapter(u, u, str(tmp_path / u), False, "hash")
    _pool_step(s, pool)
    ops.start(LoraLoadCmd(1, "p", "p", str(tmp_path / "p"), pinned=True))
    s.set_adapters(ops.state())  # as SchedulerLoop.on_front does
    add(s, "c")  # a third adapter must not sneak into the reserved slot
    sent_when_running = []
    for _ in range(20):
        for m in ops.ready_to_send(s.uses_adapter, s.can_pin):
            pool.load(m.uid, m.name, m.path, m.pinned)
            result, _ = ops.on_ack(LoraOpAck(m.op_id, 0, True))
            assert result.ok
            s.set_adapters(ops.state())
            sent_when_running.append(sorted(r.lora_uid for r in s.running.values()))
        if not s.has_work:
            break
        reqs = _pool_step(s, pool)  # never raises
        if s.reserved_pins:
            assert "c" not in {r.lora_uid for r in reqs}
    assert sent_when_running == [["b"]]  # sent once "a" finished
    assert pool.host["p"].pinned and "p" in pool.uid_slot and not s.has_work


def test_zipf_traffic_rows_are_bounded_by_slots_not_by_concurrency():
    """bench/admission_sim.py's model: 32 requests in flight over 1,000 Zipf adapters name ~25 distinct ones,
    so 8 whole slots run far fewer than 32 rows while 32 slots run them all; 8 adapters always run all 32.
    Counted in rank rows, 8 slots hold more adapters of ranks 8-16, and at rank 64 all of them."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from admission_sim import simulate

    a = argparse.Namespace(
        requests=96, concurrency=32, new_tokens=16, prompt_tokens=8, zipf_alpha=1.0, starvation_steps=64,
        step_base_ms=24.0, step_row_ms=1.0, ranks="8,12,16",
    )  # fmt: skip
    _, rows_few, _ = simulate(a, 8, 8)
    _, rows_many8, in_flight = simulate(a, 1000, 8)
    _, rows_many32, _ = simulate(a, 1000, 32)
    assert rows_few == 32.0 and rows_many32 == 32.0
    assert in_flight > 16 and rows_many8 < 16, (rows_many8, in_flight)
    # rank rows: the same 8 slots at rank 16 hold more of these rank 8-16 adapters, at rank 64 all in flight
    _, rows_rank16, _ = simulate(a, 1000, 8, 16)
    _, rows_rank64, _ = simulate(a, 1000, 8, 64)
    assert rows_many8 < rows_rank16 < 32.0 and rows_rank64 == 32.0, (rows_many8, rows_rank16)


def test_the_scheduler_takes_the_adapter_state_whole_from_the_lora_ops():
    """set_adapters is the one way the loop changes the scheduler's adapter fields: an unload blocks its
    adapter's new requests until the unload is done or cancelled, and an adapter a restart lost is served again
    once it is loaded again."""
    s = make_sched(slots=2)
    ops = LoraOps(tp_size=1)
    ops.start(LoraLoadCmd(1, "uid-a", "a", "/a"))
    s.set_adapters(ops.state())
    assert s.loading_uids == {"uid-a"} and s.loaded_uids == set()
    ops.ready_to_send(lambda _u: False)
    assert ops.on_ack(LoraOpAck(1, 0, True, rows=8))[0].ok
    s.set_adapters(ops.state())
    assert s.loaded_uids == {"uid-a"} and s.adapter_rows == {"uid-a": 8} and s.adapter_names == {"uid-a": "a"}
    assert not s.add(TokenizedReq("r1", [5], SamplingParams(max_new_tokens=2), "uid-a"))  # admitted

    s.block_adapter("uid-a")  # an unload arrives while r1 runs
    ops.start(LoraUnloadCmd(2, "uid-a"))
    s.set_adapters(ops.state())  # any other change in between keeps it blocked: its unload is pending
    (out,) = s.add(TokenizedReq("r2", [5], SamplingParams(max_new_tokens=2), "uid-a"))
    assert out.finished and "LoRA adapter a is being unloaded" in out.error
    del ops.pending[2]  # cancelled before it was sent (a front door restart)
    s.unblock_adapter("uid-a")
    s.set_adapters(ops.state())
    assert not s.add(TokenizedReq("r3", [5], SamplingParams(max_new_tokens=2), "uid-a"))

    s.fail_adapter("uid-b", "LoRA adapter b has never been loaded")  # a restart could not restore b
    (out,) = s.add(TokenizedReq("r4", [5], SamplingParams(max_new_tokens=2), "uid-b"))
    assert "never been loaded" in out.error
    ops.start(LoraLoadCmd(3, "uid-b", "b", "/b"))
    ops.ready_to_send(lambda _u: False)
    assert ops.on_ack(LoraOpAck(3, 0, True))[0].ok
    s.set_adapters(ops.state())
    assert "uid-b" not in s.lost_uids and s.adapter_rows == {"uid-a": 8}  # b's rows unknown: a whole slot
    assert not s.add(TokenizedReq("r5", [5], SamplingParams(max_new_tokens=2), "uid-b"))
