"""What the scheduler tells the front door about liveness and load (:class:`~ipc.messages.SchedulerBeat`).

No sockets here: :class:`RankLiveness` decides when the TP ranks are probed and which ones count as not
answering; :func:`batch_stats` and :func:`count_evictions` read the scheduler's state for ``/metrics``.

An idle rank sends nothing, so "answered recently" needs a probe: a :class:`~ipc.messages.WorkerPing`, which
every rank answers at once with a :class:`~ipc.messages.WorkerPong` and which changes nothing on it. A probe
is sent only while no step or LoRA command is outstanding (so it never waits behind real work, which has its own
timeouts); a rank that leaves one unanswered for ``PROBE_TIMEOUT_S`` counts as unresponsive until it answers,
and one that leaves it unanswered for ``--step-timeout`` (the limit of a step, and a probe is a step with no work)
is taken as hung and its TP group replaced before any request has to wait for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ipc.messages import WorkerPing

PROBE_INTERVAL_S = 1.0  # an idle TP group is probed this often
PROBE_TIMEOUT_S = 3.0  # a rank that leaves a probe unanswered this long counts as unresponsive
LOOP_STALL_S = 1.0  # a scheduler loop turn longer than this is the scheduler's own stall, not the ranks' silence
BEAT_INTERVAL_S = 1.0  # how often the scheduler sends SchedulerBeat to the front door
# a rank silent this long after a peer that had run steps of its TP group answered a new scheduler is stuck: ranks
# leave a step within a sampling pass of each other; what a rank does alone (a pinned adapter read from disk, a
# thread re-measure) takes well under this
PEER_SKEW_S = 5.0


class RankLiveness:
    """When each TP rank last answered, and the liveness probe in flight (one at a time)."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        now = time.monotonic()
        self.last_answer: dict[int, float] = dict.fromkeys(range(tp_size), now)
        self.probe_op: int | None = None  # op id of the probe in flight
        self.probe_sent = 0.0
        self.probe_answered: set[int] = set()
        self.last_probe = 0.0

    def reset(self) -> None:
        """A new TP group replaces the old one: forget the old group's probe (its answers are void)."""
        self.probe_op = None
        self.probe_answered = set()
        now = time.monotonic()
        self.last_answer = dict.fromkeys(range(self.tp_size), now)

    def answered(self, rank: int) -> None:
        """``rank`` sent something (a step result, an ack, READY)."""
        self.last_answer[rank] = time.monotonic()

    def owns(self, op_id: int) -> bool:
        """Whether ``op_id`` is the probe in flight (its acks go to :meth:`on_probe_ack`, nowhere else)."""
        return self.probe_op is not None and op_id == self.probe_op

    def on_probe_ack(self, rank: int) -> None:
        """``rank`` answered the probe; once every rank has, the next one may go."""
        self.answered(rank)
        self.probe_answered.add(rank)
        if len(self.probe_answered) >= self.tp_size:
            self.probe_op = None

    def probe(self, next_op_id: Callable[[], int], busy: bool) -> WorkerPing | None:
        """The probe to send to every rank now, or None (one is in flight, it is not time yet, or the ranks are
        ``busy`` with a step or a LoRA command, which is judged by its own timeout)."""
        now = time.monotonic()
        if busy or self.probe_op is not None or now - self.last_probe < PROBE_INTERVAL_S:
            return None
        self.probe_op, self.probe_sent, self.last_probe = next_op_id(), now, now
        self.probe_answered = set()
        return WorkerPing(self.probe_op)

    def unresponsive(self) -> dict[int, str]:
        """Ranks that left the probe unanswered past ``PROBE_TIMEOUT_S`` -> why."""
        if self.probe_op is None:
            return {}
        waited = time.monotonic() - self.probe_sent
        if waited < PROBE_TIMEOUT_S:
            return {}
        return {r: f"TP rank {r} has not answered a liveness probe for {waited:.1f} s" for r in self.unanswered()}

    def unanswered(self) -> list[int]:
        """Ranks that have not answered the probe in flight (none when no probe is in flight)."""
        if self.probe_op is None:
            return []
        return [r for r in range(self.tp_size) if r not in self.probe_answered]

    def discount(self, seconds: float) -> None:
        """Do not count ``seconds`` (> 0) against the probe in flight: the scheduler was not reading meanwhile."""
        if seconds > 0 and self.probe_op is not None:
            self.probe_sent += seconds

    def probe_waited(self) -> float:
        """Seconds the probe in flight has waited for its last answer (0.0 when none is in flight)."""
        return 0.0 if self.probe_op is None else time.monotonic() - self.probe_sent

    def silence(self) -> list[float]:
        """Seconds since each rank last answered, in rank order."""
        now = time.monotonic()
        return [round(now - self.last_answer.get(r, now), 3) for r in range(self.tp_size)]


class FirstReady:
    """When each TP group epoch's first rank said READY, for telling a stuck rank from a slow start.

    A rank silent for ``--step-timeout`` after another rank of its own epoch answered is taken as stuck (e.g. in
    a collective that a dead scheduler's last plan started on only some ranks). The clock is per epoch: a
    replacement group's clock starts at its own first READY, not at an older group's (which once made every
    replacement count as hung the moment one of its ranks was up, until the launcher gave up).

    A rank that answers having run steps in its epoch proves every rank of the epoch started (a step's
    collectives need them all), so a rank still silent then is not loading: it is inside a step, which ranks run
    in lockstep and so leave within moments of each other, or stuck in one its peers never got. It counts as stuck
    after ``PEER_SKEW_S``, not the whole ``--step-timeout`` (20 s by default).
    """

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.ran: dict[int, float] = {}  # epoch -> when a rank that had run steps in it first answered

    def seen(self, epoch: int, now: float, steps: int = 0) -> None:
        """A rank of ``epoch`` said READY at ``now`` (monotonic seconds), having run ``steps`` steps in it."""
        self.first.setdefault(epoch, now)
        if steps > 0:
            self.ran.setdefault(epoch, now)

    def stuck(self, epoch: int, now: float, step_timeout_s: float) -> bool:
        """Whether ranks of ``epoch`` still silent at ``now`` count as stuck (see the class)."""
        if epoch in self.ran and now - self.ran[epoch] > min(step_timeout_s, PEER_SKEW_S):
            return True
        return self.waited(epoch, now) > step_timeout_s

    def waited(self, epoch: int, now: float) -> float:
        """Seconds since ``epoch``'s first READY (0 before any, which starts its clock now)."""
        return now - self.first.setdefault(epoch, now)


def batch_stats(sched: Any) -> dict[str, Any]:
    """Running / waiting requests, KV use and the adapters they need, read from a ``Scheduler``.

    Returns the keyword arguments of :class:`~ipc.messages.SchedulerBeat` that describe the batch (empty
    before the scheduler exists).
    """
    if sched is None:
        return {}
    running = list(sched.running.values())
    waiting = list(sched.waiting)
    kv = sched.kv
    capacity = kv.slots.capacity
    return {
        "running": len(running),
        "waiting": len(waiting),
        # prefix-cache slots no running request reads are free for admission (evicted on demand): not "used"
        "kv_used_tokens": max(0, capacity - kv.slots.num_free + kv.reserved - _evictable(sched)),
        "kv_capacity_tokens": capacity,
        "running_lora_uids": sorted({r.lora_uid for r in running if r.lora_uid is not None}),
        "waiting_lora_uids": sorted({r.lora_uid for r in waiting if r.lora_uid is not None}),
        "max_batch_loras": min(sched.max_running, sched.lora_rows_total // sched.slot_size),
    }


def _evictable(sched: Any) -> int:
    cache = getattr(sched, "cache", None)
    return 0 if cache is None else int(cache.evictable_tokens)


def count_evictions(before: dict[str, int], after: dict[str, int]) -> int:
    """Adapters that lost their slot to another adapter between two uid -> slot tables (an unload that leaves
    the slot empty is not an eviction)."""
    held = {slot: uid for uid, slot in before.items()}
    now = {slot: uid for uid, slot in after.items()}
    return sum(1 for slot, uid in held.items() if now.get(slot) not in (None, uid))
