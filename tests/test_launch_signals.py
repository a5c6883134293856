"""launch.main's shutdown path under signals, with a stand-in cluster: a second SIGTERM (``timeout`` and a
process-group kill each send one) may arrive anywhere after the first, and the launcher must still stop the
cluster and return its code rather than die on an uncaught exception."""

from __future__ import annotations

import signal

import pytest

import launch


class FakeCluster:
    """Stands in for launch.Cluster: up at once; supervise raises the first signal; records the rest."""

    def __init__(self, args) -> None:
        self.calls: list[str] = []
        FakeCluster.last = self

    def start(self) -> None:
        self.calls.append("start")

    def wait_ready(self) -> None:
        self.calls.append("ready")

    def supervise(self) -> None:
        raise launch._Stop(signal.SIGTERM)

    def drain(self, timeout_s: float) -> None:
        self.calls.append("drain")

    def stop(self) -> None:
        self.calls.append("stop")


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch, "Cluster", FakeCluster)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def test_sigterm_drains_then_stops(fake):
    assert launch.main([]) == 0
    assert FakeCluster.last.calls == ["start", "ready", "drain", "stop"]


@pytest.mark.parametrize("where", ["log line", "drain"])
def test_a_second_sigterm_during_the_drain_stops_at_once_and_cleanly(fake, monkeypatch, where):
    """The second signal lands in the log line announcing the drain (where it once escaped as a traceback) or in
    the drain itself: no exception leaves main, the cluster is stopped, the exit code is 0."""
    if where == "log line":
        info = launch.log.info

        def interrupted(msg, *a, **k):
            if str(msg).startswith("SIGTERM received; draining"):
                raise launch._Stop(signal.SIGTERM)
            return info(msg, *a, **k)

        monkeypatch.setattr(launch.log, "info", interrupted)
    else:

        def drain(self, timeout_s):
            self.calls.append("drain")
            raise launch._Stop(signal.SIGTERM)

        monkeypatch.setattr(FakeCluster, "drain", drain)
    assert launch.main([]) == 0
    assert FakeCluster.last.calls[-1] == "stop"
