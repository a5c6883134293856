"""How long an idle scheduler holds its first step so that a burst of requests starts in one step.

A client that sends many requests at once (``asyncio.gather`` of 64 chats) does not deliver them at once: the
client and the front door each spend ~0.2-0.3 ms of Python per request, so on the 2-core CPU 64 requests reach
the scheduler over 12-28 ms, with gaps of up to ~4-7 ms where a process lost its core for a time slice. An idle
scheduler that starts a step on the first arrival prefills it alone; the rest then join a running batch under
the chunked-prefill rule (a few per step when they no longer outnumber the streams), so a burst trickles in
over up to ten steps and ends in a tail of few-row steps. Within a run, the requests prefilled in that first
step also leave their common prompt start (a shared tag, say) cached for the rest, which favours traffic for
one model over traffic spread over adapters, whose prefixes are cached per adapter.

So while nothing is running, the first step waits for a burst: ``lone_s`` after a first request, and once a
second one has come, until no request has arrived for ``gap_s`` (at most ``cap_s`` after the first one). A lone
request on an idle server waits ``lone_s`` (1 ms: a 1-token chat answered in 14.7 ms with no wait took 19.1 ms
with a 5 ms one); a server with requests running never waits. The same idea as Ray Serve's
``batch_wait_timeout_s`` and Triton's dynamic-batching ``max_queue_delay``, limited here to an idle server,
where no running stream is delayed by it.
"""

from __future__ import annotations

CAP_GAPS = 10  # the first step waits at most this many gaps after a burst's first request
LONE_WAIT_S = 0.001  # ... and only this long for a second request after a first


class BurstWait:
    """The hold before an idle scheduler's first step (seconds on one monotonic clock).

    Args:
        gap_s: once two requests have come, start when no other has arrived for this long (0: never hold).
        cap_s: never hold longer than this after the burst's first request (at least ``gap_s``).
        lone_s: how long a first request waits for a second (at most ``gap_s``).
    """

    def __init__(self, gap_s: float, cap_s: float, lone_s: float) -> None:
        self.gap_s = max(0.0, gap_s)
        self.cap_s = max(self.gap_s, cap_s)
        self.lone_s = min(max(0.0, lone_s), self.gap_s)
        self._first = self._last = float("-inf")
        self._count = 0

    @classmethod
    def for_gap(cls, gap_s: float) -> BurstWait:
        """The server's hold for ``--batch-wait-ms`` = ``gap_s`` * 1000: capped at ``CAP_GAPS`` gaps, 1 ms alone."""
        return cls(gap_s, CAP_GAPS * gap_s, LONE_WAIT_S)

    def arrived(self, now: float, idle: bool) -> None:
        """A request arrived at ``now``; ``idle``: none was running or waiting before it (a new burst)."""
        if idle:
            self._first, self._count = now, 0
        self._last = now
        self._count += 1

    def hold_s(self, now: float) -> float:
        """Seconds the first step should still wait (0: start now). Only meaningful while nothing is running."""
        if self.gap_s <= 0:
            return 0.0
        gap = self.lone_s if self._count <= 1 else self.gap_s
        return max(0.0, min(self._last + gap, self._first + self.cap_s) - now)
