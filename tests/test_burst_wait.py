"""An idle scheduler holds its first step while a burst is still arriving (scheduler_proc/burst_wait.py)."""

from __future__ import annotations

import pytest
from test_scheduler_front_restart import close, send

from ipc.config import Endpoints, ServerArgs
from ipc.messages import ForwardBatch, LoraLoadCmd, SamplingParams, TokenizedReq, WorkerLoraLoad
from scheduler_proc import main as sched_main
from scheduler_proc.burst_wait import BurstWait
from scheduler_proc.main import SchedulerLoop
from scheduler_proc.scheduler import Scheduler


def test_the_hold_ends_a_gap_after_the_last_arrival_and_never_past_the_cap():
    w = BurstWait(0.005, 0.05, 0.001)
    w.arrived(10.0, idle=True)
    assert w.hold_s(10.0) == pytest.approx(0.001)  # a lone request waits 1 ms for a second
    w.arrived(10.0008, idle=False)
    w.arrived(10.004, idle=False)  # a burst: the hold moves with it, a gap after the last arrival
    assert w.hold_s(10.006) == pytest.approx(0.003)
    assert w.hold_s(10.009) == 0.0
    for i in range(1, 20):  # arrivals that never pause: the cap ends the hold 50 ms after the first
        w.arrived(10.0 + 0.004 * i, idle=False)
    assert w.hold_s(10.049) == pytest.approx(0.001)
    assert w.hold_s(10.05) == 0.0


def test_a_new_burst_gets_its_own_cap_and_count_and_zero_means_no_hold():
    w = BurstWait(0.005, 0.05, 0.001)
    w.arrived(1.0, idle=True)
    w.arrived(1.0005, idle=False)
    w.arrived(2.0, idle=True)  # the server went idle in between: a new burst, of one request so far
    assert w.hold_s(2.0005) == pytest.approx(0.0005)
    w.arrived(2.0009, idle=False)
    assert w.hold_s(2.001) == pytest.approx(0.0049)
    assert BurstWait(0.002, 0.02, 0.01).lone_s == 0.002  # never longer than the gap
    off = BurstWait(0.0, 0.0, 0.001)
    off.arrived(1.0, idle=True)
    assert off.hold_s(1.0) == 0.0
    assert BurstWait(0.0, 0.0, 0.0).hold_s(0.0) == 0.0  # nothing arrived yet


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_loop(tmp_path, batch_wait_ms: float) -> tuple[SchedulerLoop, list, object]:
    """A scheduler loop with one rank, on sockets in ``tmp_path`` that nothing listens on, and the list of what
    it sends the workers."""
    import zmq

    ep = Endpoints(*(f"ipc://{tmp_path}/{n}" for n in ("front", "s", "t", "w", "c")), "", str(tmp_path))
    ctx = zmq.Context()
    args = ServerArgs(model_path="/nonexistent", endpoints=ep, batch_wait_ms=batch_wait_ms)
    loop = SchedulerLoop(args, ctx)
    loop.sched = Scheduler(max_running=8, kv_capacity=1000, context_len=512, eos_ids=[2])
    to_workers: list = []
    loop._broadcast = to_workers.append
    loop._to_front = lambda msg: None
    return loop, to_workers, ctx


def req(rid: str) -> TokenizedReq:
    return TokenizedReq(rid, [5, 6, 7], SamplingParams(max_new_tokens=4))


def steps(sent: list) -> list[list[str]]:
    return [[r.rid for r in m.reqs] for m in sent if isinstance(m, ForwardBatch)]


@pytest.fixture
def held(tmp_path, monkeypatch):
    """``held(batch_wait_ms)`` -> (loop, what it sent the workers, its clock); the sockets are closed after."""
    clock, made = Clock(), []
    monkeypatch.setattr(sched_main.time, "monotonic", clock)

    def make(batch_wait_ms: float) -> tuple[SchedulerLoop, list, Clock]:
        loop, sent, ctx = make_loop(tmp_path, batch_wait_ms)
        made.append(ctx)
        return loop, sent, clock

    yield make
    for ctx in made:
        close(ctx, tmp_path)


def test_an_idle_scheduler_starts_a_burst_in_one_step(held):
    loop, sent, clock = held(5)
    send(loop, req("a"))
    assert loop._start_step() == pytest.approx(0.001)  # the first arrival alone: wait 1 ms for a second
    clock.now += 0.0009
    send(loop, req("b"))  # a second within 1 ms: a burst, which waits until arrivals pause for 5 ms
    clock.now += 0.0021
    send(loop, req("c"))
    clock.now += 0.004  # 7 ms after the first, 4 after the last: still arriving
    assert loop._start_step() == pytest.approx(0.001) and steps(sent) == []
    clock.now += 0.001
    assert loop._start_step() == 0.0
    assert steps(sent) == [["a", "b", "c"]]
    # with a request running, a new arrival joins the next step without any hold
    loop.in_flight = False
    loop.sched.on_result([9, 9, 9], {}, {})
    send(loop, req("d"))
    loop._start_step()
    assert steps(sent)[-1] == ["a", "b", "c", "d"]


def test_a_lone_request_starts_a_millisecond_after_it_came(held):
    loop, sent, clock = held(5)
    send(loop, req("a"))
    clock.now += 0.001
    assert loop._start_step() == 0.0
    assert steps(sent) == [["a"]]


def test_batch_wait_zero_starts_the_first_arrival_at_once(held):
    loop, sent, _ = held(0)
    send(loop, req("a"))
    assert loop._start_step() == 0.0
    assert steps(sent) == [["a"]]


def test_lora_commands_and_refused_requests_do_not_wait_for_a_burst(held):
    """Found by a trial: a load sent during a hold went out only when the hold ended (9.9 s at
    --batch-wait-ms 1000), and a refused request kept a good one waiting as if a burst went on."""
    loop, sent, clock = held(5)
    send(loop, req("a"))
    send(loop, req("b"))
    send(loop, LoraLoadCmd(3, "u1", "x", "/p"))
    assert loop._start_step() > 0 and steps(sent) == []
    assert [m.uid for m in sent if isinstance(m, WorkerLoraLoad)] == ["u1"]
    clock.now += 0.0049
    send(loop, TokenizedReq("too-long", [5] * 600, SamplingParams(max_new_tokens=4)))  # past the context
    clock.now += 0.0001
    assert loop._start_step() == 0.0
    assert steps(sent) == [["a", "b"]]


def test_a_hold_within_the_poll_slack_starts_now(held):
    loop, sent, clock = held(5)
    send(loop, req("a"))
    clock.now += 0.0008  # 0.2 ms of the lone wait left: under one poll tick's slack
    assert loop._start_step() == 0.0
    assert steps(sent) == [["a"]]
