"""Failover logic without a cluster: requeue + re-prefill, TP group epochs and adapter restores, the front door's
view of a restart. The cluster drills are in ``test_failover_worker.py``."""

from __future__ import annotations

import pytest
from test_scheduler import make, req, step

from ipc.messages import LoraLoadCmd, LoraOpAck, StepResult, WorkerReady
from scheduler_proc.lora_ops import LoadedAdapter, LoraOps
from scheduler_proc.recovery import GroupRecovery

# ----------------------------------------------------------------------------- Scheduler: requeue and re-prefill


def test_requeued_requests_reprefill_prompt_plus_outputs_and_keep_their_order():
    s = make(max_running=4, kv=100)
    s.add(req("a", n_prompt=3, max_new=6))
    step(s, 21)
    s.add(req("b", n_prompt=2, max_new=6))
    step(s, {"a": 22, "b": 31})
    step(s, {"a": 23, "b": 32})
    s.add(req("c", n_prompt=2, max_new=2))  # waiting, not yet admitted
    fb = s.next_batch()  # a step goes out ... and its group dies before answering
    assert {r.rid for r in fb.reqs} == {"a", "b", "c"}
    assert s.requeue_running() == 2 + 1  # c was admitted by that plan too
    assert not s.running and [r.rid for r in s.waiting] == ["a", "b", "c"]
    assert s.kv.slots.num_free == 100 and s.kv.reserved == 0 and s.rows.num_free == 4
    fb, outs = step(s, {"a": 24, "b": 33, "c": 41})
    plan = {r.rid: r for r in fb.reqs}
    # prompt + every token produced so far, prefilled from position 0; output_len seeds the sampler as before
    assert plan["a"].input_ids == [10, 11, 12, 21, 22, 23] and plan["a"].prefix_len == 0
    assert plan["a"].output_len == 3 and plan["b"].input_ids == [10, 11, 31, 32] and plan["b"].output_len == 2
    assert plan["c"].input_ids == [10, 11] and plan["c"].output_len == 0
    assert outs["a"].new_ids == [24] and outs["a"].completion_tokens == 4
    fb, _ = step(s, 25)
    assert {r.rid: (r.input_ids, r.prefix_len) for r in fb.reqs}["a"] == ([24], 6)  # decode continues
    while s.has_work:
        step(s, 7)
    assert s.kv.slots.num_free == 100 and s.kv.reserved == 0 and s.rows.num_free == 4


def test_lost_adapter_fails_its_waiting_requests_and_later_ones_with_not_found():
    s = make()
    s.loaded_uids = {"u1", "u2"}
    s.add(_lora_req("x", "u1"))
    s.add(_lora_req("y", "u2"))
    msg = "Got LoRA adapter that has never been loaded: one\nAll loaded adapters: ['two']"
    outs = s.fail_adapter("u1", msg)
    assert [(o.rid, o.error, o.error_kind, o.finished) for o in outs] == [("x", msg, "not_found", True)]
    (late,) = s.add(_lora_req("z", "u1"))
    assert (late.error, late.error_kind) == (msg, "not_found")
    assert [r.rid for r in s.waiting] == ["y"]


def _lora_req(rid: str, uid: str):
    r = req(rid)
    r.lora_uid = uid
    return r


# ----------------------------------------------------------------------------- GroupRecovery


def _ready(rank: int, epoch: int, uids=()) -> WorkerReady:
    return WorkerReady(rank, f"inc{rank}", 1000, list(uids), epoch=epoch)


def _adapters(*names: str, pinned: str = "") -> dict[str, LoadedAdapter]:
    return {f"uid-{n}": LoadedAdapter(f"uid-{n}", n, f"/a/{n}", n == pinned, f"hash-{n}") for n in names}


def _ids():
    ids = iter(range(-10, -1000, -1))
    return lambda: next(ids)


def test_recovery_waits_for_every_rank_of_the_new_epoch_only():
    rec = GroupRecovery(tp_size=2)
    assert rec.serving and rec.is_current(1)
    assert rec.begin(2, "gpu_worker[1] died", "gpu_worker[1]")
    assert not rec.begin(2, "the same replacement, noticed twice") and not rec.begin(1, "old")
    assert not rec.serving and not rec.is_current(1) and rec.is_current(2)
    assert rec.on_ready(_ready(0, 1), {}, _ids()) == (False, [])  # a READY of the replaced group: ignored
    assert rec.on_ready(_ready(0, 2), {}, _ids()) == (False, [])
    assert rec.on_ready(_ready(1, 2), {}, _ids()) == (True, [])  # nothing to restore: serving at once
    assert rec.serving


def test_recovery_restores_missing_adapters_in_uid_order_under_the_same_uids():
    rec = GroupRecovery(tp_size=2)
    loaded = _adapters("zeta", "alpha", "mid", pinned="mid")
    rec.begin(2, "died")
    ids = _ids()
    rec.on_ready(_ready(1, 2), loaded, ids)
    complete, loads = rec.on_ready(_ready(0, 2), loaded, ids)
    assert not complete and rec.phase == "restoring"
    assert [m.uid for m in loads] == sorted(loaded)  # the same order on every rank
    assert all(m.content_hash == loaded[m.uid].content_hash and m.op_id < 0 for m in loads)
    assert [m.pinned for m in loads] == [False, True, False]
    outcome = None
    for m in loads:
        for rank in (0, 1):
            ok = not (m.uid == "uid-zeta" and rank == 1)
            outcome = rec.on_ack(LoraOpAck(m.op_id, rank, ok, "" if ok else "files changed", epoch=2), ids)
    assert outcome is not None and rec.serving
    assert outcome.restored == ["alpha", "mid"]
    assert [(x.uid, x.name, x.reason) for x in outcome.lost] == [("uid-zeta", "zeta", "rank 1: files changed")]
    assert [(m.uid, m.rollback) for m in outcome.rollback] == [("uid-zeta", True)]


def test_stale_acks_do_not_count():
    rec = GroupRecovery(tp_size=1)
    loaded = _adapters("a")
    rec.begin(2, "died")
    _, (load,) = rec.on_ready(_ready(0, 2), loaded, _ids())
    assert rec.on_ack(LoraOpAck(load.op_id, 0, True, epoch=1), _ids()) is None
    assert rec.on_ack(LoraOpAck(load.op_id, 0, True, epoch=2), _ids()).restored == ["a"]


# ----------------------------------------------------------------------------- LoraOps: content hash


def test_a_load_whose_ranks_read_different_bytes_fails_and_rolls_back():
    ops = LoraOps(2)
    ops.start(LoraLoadCmd(1, "u", "a", "/p"))
    ops.on_ack(LoraOpAck(1, 0, True, content_hash="h1"))
    res, rollback = ops.on_ack(LoraOpAck(1, 1, True, content_hash="h2"))
    assert not res.ok and "changed while the ranks read them" in res.error and rollback[0].uid == "u"
    assert ops.loaded == {}
    ops.start(LoraLoadCmd(2, "u2", "b", "/q", pinned=True))
    ops.on_ack(LoraOpAck(2, 0, True, content_hash="h"))
    res, _ = ops.on_ack(LoraOpAck(2, 1, True, content_hash="h"))
    assert res.ok and res.content_hash == "h" and ops.loaded["u2"] == LoadedAdapter("u2", "b", "/q", True, "h")
    assert ops.pinned == {"u2": True}


def test_resend_all_voids_old_acks():
    ops = LoraOps(2)
    ops.start(LoraLoadCmd(1, "u", "a", "/p"))
    (m,) = ops.ready_to_send(lambda _u: False)
    ops.on_ack(LoraOpAck(1, 0, True, content_hash="h"))
    ops.resend_all()
    assert ops.overdue(0.0) is None
    (again,) = ops.ready_to_send(lambda _u: False)
    assert again.uid == m.uid and ops.pending[1].acks == {}
    assert ops.overdue(0.0) == 1


def test_step_result_and_ack_carry_the_epoch():
    assert StepResult(1, 0, []).epoch == 1 and LoraOpAck(1, 0, True, epoch=3).epoch == 3


# ----------------------------------------------------------------------------- worker pool: content hash


def test_pool_refuses_a_restore_whose_files_changed(tmp_path):
    from lora_helpers import ALL, TINY, tiny_pool, write_adapter

    from gpu_worker.lora_pool import LoraPoolError
    from ipc.lora_config import adapter_content_hash

    folder = write_adapter(tmp_path / "a", TINY, r=4, targets=ALL, seed=1)
    h = adapter_content_hash(folder, "a")
    pool = tiny_pool()
    assert pool.load("u", "a", str(folder)) == h
    pool2 = tiny_pool()
    write_adapter(folder, TINY, r=4, targets=ALL, seed=2)  # same name and path, other weights
    with pytest.raises(LoraPoolError, match="changed since it was first loaded"):
        pool2.load("u", "a", str(folder), expect_hash=h)
    assert pool2.host_uids() == []
    assert pool2.load("u", "a", str(folder), expect_hash=adapter_content_hash(folder, "a"))


# ----------------------------------------------------------------------------- front door


def test_front_door_health_metrics_and_registry_follow_cluster_events(model_path):
    from loom_helpers import make_args
    from prometheus_client.parser import text_string_to_metric_families

    from ipc.messages import ClusterEvent, LostAdapter
    from tokenizer_proc.front_door import FrontDoor
    from tokenizer_proc.metrics import FailoverCollector

    door = FrontDoor(make_args(model_path, enable_lora=True), lambda _m: None)
    door.registry.loaded.clear()
    for name, uid in (("a", "ua"), ("b", "ub")):
        door.registry.loaded[name] = _entry(name, uid)
        door.registry.refs[name] = (f"/x/{name}", False)
    ev = ClusterEvent("workers_restarting", "died", epoch=2, process="gpu_worker[1]", restarts={"gpu_worker[1]": 1})
    door.on_cluster_event(ev)
    assert "restarting" in door.health.unavailable
    lost = [LostAdapter("ub", "b", "folder gone")]
    door.on_cluster_event(ClusterEvent("workers_recovered", "ok", epoch=2, resumed=3, restored=["a"], lost=lost))
    assert door.health.unavailable is None
    assert sorted(door.registry.loaded) == ["a"] and "b" not in door.registry.refs
    with pytest.raises(Exception, match="never been loaded: b\nAll loaded adapters: \\['a'\\]"):
        door.registry.lookup("b")
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    reg.register(FailoverCollector(door.health))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("loom_process_restarts_total", (("process", "gpu_worker[1]"),))] == 1
    assert samples[("loom_requests_resumed_total", ())] == 3
    assert samples[("loom_lora_adapters_lost_total", ())] == 1


def _entry(name: str, uid: str):
    from tokenizer_proc.registry import Entry

    return Entry(name, uid, f"/x/{name}", 8, False)
