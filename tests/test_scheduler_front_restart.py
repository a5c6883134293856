"""The scheduler loop when a front door restarts with LoRA commands of the dead one still pending.

Found by a failover drill: ``kill -9`` of tokenizer_proc while it evicted adapters from the host tier. The new
front door rebuilt its registry from the scheduler's view (which still listed the adapters being evicted), then
the dead front door's evictions ran on the workers: the adapters stayed listed, and every request for them failed
with "not loaded on the workers" until someone unloaded and loaded them by hand.
"""

from __future__ import annotations

import zmq

from ipc.config import Endpoints, ServerArgs
from ipc.messages import (
    ClusterView,
    FrontDoorHello,
    LoraLoadCmd,
    LoraOpAck,
    LoraUnloadCmd,
    SamplingParams,
    TokenizedReq,
)
from scheduler_proc.lora_ops import LoadedAdapter
from scheduler_proc.main import SchedulerLoop
from scheduler_proc.scheduler import Scheduler


def make_loop(tmp_path) -> tuple[SchedulerLoop, list, list, zmq.Context]:
    """A scheduler loop on sockets in ``tmp_path`` (nothing listens), one adapter ``a`` loaded on one rank, and
    the messages it would send to the front door and the workers."""
    ep = Endpoints(*(f"ipc://{tmp_path}/{n}" for n in ("front", "s", "t", "w", "c")), "", str(tmp_path))
    ctx = zmq.Context()
    loop = SchedulerLoop(ServerArgs(model_path="/nonexistent", endpoints=ep, enable_lora=True), ctx)
    loop.sched = Scheduler(max_running=8, kv_capacity=1000, context_len=512, eos_ids=[2])
    loop.ops.loaded["ua"] = LoadedAdapter("ua", "a", "/p/a", False, "h")
    loop.sched.set_adapters(loop.ops.state())
    to_front: list = []
    to_workers: list = []
    loop._to_front = to_front.append
    loop._broadcast = to_workers.append
    return loop, to_front, to_workers, ctx


def close(ctx: zmq.Context, tmp_path) -> None:
    """Close every socket and remove the socket files the bound ones left."""
    ctx.destroy(0)
    for p in tmp_path.iterdir():
        if p.is_socket():
            p.unlink()


def send(loop: SchedulerLoop, msg: object) -> None:
    from ipc.codec import Codec
    from ipc.messages import ToSchedulerMsg

    assert loop.on_front(Codec(ToSchedulerMsg).encode(msg))


def test_an_eviction_not_yet_sent_is_cancelled_when_the_front_door_restarts(tmp_path):
    loop, to_front, _, ctx = make_loop(tmp_path)
    try:
        send(loop, FrontDoorHello("front-1"))
        send(loop, TokenizedReq("r1", [5, 6], SamplingParams(max_new_tokens=4), "ua"))
        send(loop, LoraUnloadCmd(7, "ua"))  # an eviction: waits until r1 no longer uses "a"
        assert loop.ops.ready_to_send(loop.sched.uses_adapter) == []
        blocked = loop.sched.add(TokenizedReq("r2", [5], SamplingParams(max_new_tokens=1), "ua"))
        assert blocked[0].error == "LoRA adapter a is being unloaded (uid ua)"
        to_front.clear()
        send(loop, FrontDoorHello("front-2"))  # the first front door died; its requests are dropped
        assert loop.ops.pending == {} and "ua" not in loop.sched.blocked_uids
        views = [m for m in to_front if isinstance(m, ClusterView)]
        assert [[x.uid for x in v.adapters] for v in views] == [["ua"]]
        # the new front door adopts "a" from that view, and its requests run
        assert loop.sched.add(TokenizedReq("r3", [5], SamplingParams(max_new_tokens=1), "ua")) == []
        assert loop.ops.ready_to_send(loop.sched.uses_adapter) == []  # nothing of the dead front door goes out
    finally:
        close(ctx, tmp_path)


def test_a_command_already_at_the_ranks_finishes_and_sends_a_fresh_view(tmp_path):
    loop, to_front, to_workers, ctx = make_loop(tmp_path)
    try:
        send(loop, FrontDoorHello("front-1"))
        send(loop, LoraUnloadCmd(8, "ua"))
        send(loop, LoraLoadCmd(9, "ub", "b", "/p/b"))
        sent = loop.ops.ready_to_send(loop.sched.uses_adapter)  # both go to the ranks at once
        assert [type(m).__name__ for m in sent] == ["WorkerLoraUnload", "WorkerLoraLoad"]
        to_front.clear()
        send(loop, FrontDoorHello("front-2"))
        assert set(loop.ops.pending) == {8, 9} and loop.orphan_ops == {8, 9}
        assert [[x.uid for x in m.adapters] for m in to_front if isinstance(m, ClusterView)] == [["ua"]]
        to_front.clear()
        loop.on_worker(loop.worker_in.encode(LoraOpAck(8, 0, True)))
        loop.on_worker(loop.worker_in.encode(LoraOpAck(9, 0, True, content_hash="hb", rows=8)))
        views = [[x.uid for x in m.adapters] for m in to_front if isinstance(m, ClusterView)]
        assert views == [[], ["ub"]]  # each change reaches the new front door, which restores or adopts
        assert loop.orphan_ops == set() and loop.ops.pending == {}
        assert not to_workers  # no rollback: both succeeded
    finally:
        close(ctx, tmp_path)


def test_requests_queued_for_an_adapter_whose_load_fails_end_with_the_never_loaded_error(tmp_path):
    """A request that reaches the scheduler while its adapter is loading waits for the load; if the load fails on
    a rank (found by a storm trial: nothing ended such a request, which waited for ever), it ends with the
    never-loaded error naming the adapter and the loaded ones, as a failed restore's requests do."""
    from ipc.messages import BatchTokenOut

    loop, to_front, _, ctx = make_loop(tmp_path)
    try:
        send(loop, FrontDoorHello("front-1"))
        send(loop, LoraLoadCmd(9, "ub", "b", "/p/b"))
        loop.ops.ready_to_send(loop.sched.uses_adapter)
        loop.sched.set_adapters(loop.ops.state())
        assert loop.sched.add(TokenizedReq("r1", [5, 6], SamplingParams(max_new_tokens=4), "ub")) == []
        to_front.clear()
        loop.on_worker(loop.worker_in.encode(LoraOpAck(9, 0, False, error="adapter_model.safetensors: truncated")))
        outs = [o for m in to_front if isinstance(m, BatchTokenOut) for o in m.items]
        assert [(o.rid, o.finished, o.error_kind) for o in outs] == [("r1", True, "not_found")]
        assert "never been loaded: b" in outs[0].error and "['a']" in outs[0].error
        assert not loop.sched.waiting
    finally:
        close(ctx, tmp_path)


def test_a_rank_stuck_in_a_split_step_is_replaced_within_the_peer_skew_not_the_step_timeout(tmp_path, monkeypatch):
    """A scheduler that died between its two sends of one step leaves rank 0 in that step's first all-reduce for
    ever, while rank 1 (which never got it) answers the next scheduler's hello having run steps: the next
    scheduler asks the launcher for a new group after PEER_SKEW_S, not --step-timeout (20 s). A rank that answers
    without having run steps (a group still starting) does not shorten the wait."""
    import threading
    import time

    from ipc.codec import Codec
    from ipc.messages import FromWorkerMsg, SchedulerHello, ToWorkerMsg, WorkerReady
    from ipc.sockets import CONTROL_CODEC
    from scheduler_proc import health

    monkeypatch.setattr(health, "PEER_SKEW_S", 0.6)
    for steps, asked in ((7, True), (0, False)):
        sub = tmp_path / f"steps{steps}"
        sub.mkdir()
        ep = Endpoints(*(f"ipc://{sub}/{n}" for n in ("front", "s", "t", "w", "c")), "", str(sub))
        ctx = zmq.Context()
        try:
            launcher = ctx.socket(zmq.PULL)
            launcher.bind(ep.control)
            args = ServerArgs(model_path="/nonexistent", endpoints=ep, tp_size=2, step_timeout_s=20, ready_timeout_s=2)
            loop = SchedulerLoop(args, ctx)
            ranks = []
            for r in (0, 1):  # rank 0 is connected but stuck: it never reads
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.IDENTITY, f"rank-{r}".encode())
                d.connect(ep.workers)
                ranks.append(d)
            errors: list[BaseException] = []

            def run(loop: SchedulerLoop = loop, errors: list = errors) -> None:
                try:
                    loop.wait_for_workers()
                except BaseException as e:  # noqa: BLE001 - the ready timeout ends the wait
                    errors.append(e)

            t0 = time.monotonic()
            th = threading.Thread(target=run)
            th.start()
            hello = Codec(ToWorkerMsg).decode(ranks[1].recv()) if ranks[1].poll(3000) else None
            assert isinstance(hello, SchedulerHello)
            ranks[1].send(Codec(FromWorkerMsg).encode(WorkerReady(1, "inc1", 1000, epoch=1, steps=steps)))
            restart_at = None
            while th.is_alive() or launcher.poll(0):
                if launcher.poll(100):
                    msg = CONTROL_CODEC.decode(launcher.recv())
                    if type(msg).__name__ == "RestartWorkers" and restart_at is None:
                        restart_at = time.monotonic() - t0
            th.join()
            assert errors and isinstance(errors[0], TimeoutError), errors  # rank 0 never answered
            if asked:
                assert restart_at is not None and 0.6 < restart_at < 1.9, restart_at
            else:
                assert restart_at is None, restart_at
        finally:
            ctx.destroy(0)
