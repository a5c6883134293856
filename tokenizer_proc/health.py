"""What the front door knows of the cluster's health: the reason it cannot serve now (None = it can), the
scheduler's last heartbeat, and the failover counters ``/metrics`` shows.

``/health`` is 200 only while the scheduler has sent something within ``silence_limit_s`` (it beats every
second) and its last :class:`~ipc.messages.SchedulerBeat` names no TP rank that left a liveness probe
unanswered; and neither a TP group restart, a fatal error, a drain (SIGTERM) nor this front door's own restart is
under way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ipc.messages import SchedulerBeat

SCHEDULER_SILENCE_S = 3.0  # a scheduler silent this long (it beats every second) makes /health 503


@dataclass
class ClusterHealth:
    """The cluster as the front door sees it; ``problem()`` says why it cannot serve (None: it can)."""

    unavailable: str | None = None  # a TP group restart or a fatal error, from the scheduler's ClusterEvents
    draining: str | None = None  # set on SIGTERM: no new requests are admitted
    restarting: str | None = None  # this front door is stopping and the launcher starts another
    restarts: dict[str, int] = field(default_factory=dict)  # process -> restarts
    resumed: int = 0  # running requests re-admitted after a TP group restart
    adapters_lost: int = 0  # adapters a restart could not restore
    silence_limit_s: float = SCHEDULER_SILENCE_S
    last_heard: float = field(default_factory=time.monotonic)  # when the scheduler last sent anything
    beat: SchedulerBeat | None = None  # the newest heartbeat
    beat_wall_time: float = 0.0  # time.time() when it arrived (vllm:lora_requests_info's value)
    evictions_before: int = 0  # slot evictions counted by schedulers before the current incarnation
    _restored: tuple[int, str | None, int] | None = None  # a previous front door's count (restore_evictions)

    def merge_restarts(self, counts: dict[str, int]) -> None:
        """Take the launcher's restart counts (from whichever process forwards them; never go back)."""
        for proc, n in counts.items():
            self.restarts[proc] = max(n, self.restarts.get(proc, 0))

    def heard_from_scheduler(self) -> None:
        """Any message from the scheduler shows its loop runs."""
        self.last_heard = time.monotonic()

    def restore_evictions(self, total: int, incarnation: str | None, current: int) -> None:
        """A previous front door's slot-eviction ``total``, of which ``current`` were the then scheduler's
        (``incarnation``): the first heartbeat tells whether that scheduler still runs (its count goes on) or
        not (all of ``total`` is history)."""
        self._restored = (total, incarnation, current)

    def on_beat(self, beat: SchedulerBeat) -> None:
        """Keep the newest heartbeat; a new scheduler incarnation starts counting evictions from zero again."""
        if self.beat is None and self._restored is not None:
            total, incarnation, current = self._restored
            self.evictions_before = total - current if beat.incarnation == incarnation else total
            self._restored = None
        if self.beat is not None and self.beat.incarnation != beat.incarnation:
            self.evictions_before += self.beat.slot_evictions
        self.beat = beat
        self.beat_wall_time = time.time()
        self.heard_from_scheduler()

    @property
    def slot_evictions(self) -> int:
        """Adapters evicted from a slot since the cluster started (across scheduler and front door restarts).
        Before a restarted front door's first heartbeat it is the previous front door's total, which the first
        heartbeat can only raise: /health may say 200 before that beat, and a scrape then must not see a reset."""
        if self.beat is None:
            return self._restored[0] if self._restored is not None else self.evictions_before
        return self.evictions_before + self.beat.slot_evictions

    def problem(self) -> str | None:
        """Why the cluster cannot serve now, or None when the scheduler and every TP rank answered recently."""
        if self.draining is not None:
            return self.draining
        if self.restarting is not None:
            return self.restarting
        if self.unavailable is not None:
            return self.unavailable
        silent = time.monotonic() - self.last_heard
        if silent > self.silence_limit_s:
            return f"the scheduler has sent no heartbeat for {silent:.1f} s"
        if self.beat is not None and self.beat.unresponsive:
            return "; ".join(why for _, why in sorted(self.beat.unresponsive.items()))
        return None
