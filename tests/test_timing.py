"""Start-up timings taken while other processes hold the cores (gpu_worker/timing.py): detected from the run-queue
delay, repeated, and an answer still timed under contention kept but measured again at the next fresh start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpu_worker import timing

pytestmark = pytest.mark.skipif(timing.run_queue_wait() is None, reason="this kernel reports no run-queue delay")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_timing_that_never_waits_for_a_core_is_alone():
    calls = []

    def measure():
        calls.append(1)
        time.sleep(0.1)  # a sleeping thread is not runnable: it waits for no core, however busy the machine
        return 3, "slept"

    assert timing.timed_alone(measure) == (3, "slept", False)
    assert len(calls) == 1


def test_a_timing_beside_busy_processes_is_repeated_and_marked(monkeypatch):
    monkeypatch.setattr(timing, "ATTEMPTS", 2)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.3)  # the hogs are running
        calls = []

        def measure():
            calls.append(1)
            _spin(0.3)
            return len(calls), "spun"

        answer, how, contended = timing.timed_alone(measure)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert contended and len(calls) == 2
    assert answer in (1, 2) and how.startswith("spun; timed while other processes held the cores")


def test_a_contended_answer_is_measured_again_at_a_fresh_start_only(monkeypatch, tmp_path):
    busy = [True]
    calls = []

    def fake_timed_alone(measure):
        answer, how = measure()
        return answer, how, busy[0]

    def measure():
        calls.append(1)
        return len(calls), f"attempt {len(calls)}"

    monkeypatch.setattr(timing, "timed_alone", fake_timed_alone)
    monkeypatch.setattr(timing, "remeasure_contended", False)  # a replacement TP group keeps the cluster's kernels
    assert timing.cached_choice(tmp_path, "c", "k", measure) == (1, "attempt 1")
    answer, how = timing.cached_choice(tmp_path, "c", "k", measure)
    assert answer == 1 and "measured earlier" in how and len(calls) == 1

    monkeypatch.setattr(timing, "remeasure_contended", True)  # a fresh start measures it again
    busy[0] = False
    assert timing.cached_choice(tmp_path, "c", "k", measure) == (2, "attempt 2")
    answer, how = timing.cached_choice(tmp_path, "c", "k", measure)  # timed alone this time: kept for good
    assert answer == 2 and "measured earlier" in how and len(calls) == 2


def test_storing_an_agreed_value_keeps_the_contended_mark(tmp_path):
    timing.store_choice(tmp_path, "c", "k", 8, "timed under load", contended=True)
    timing.store_choice(tmp_path, "c", "k", 16, "another TP rank needs 16 rows")  # TP ranks' agreed value
    (path,) = tmp_path.glob("c-*.json")
    assert json.loads(path.read_text()) == {"faster": 16, "how": "another TP rank needs 16 rows", "contended": True}
    timing.store_choice(tmp_path, "c", "k", 16, "measured alone", contended=False)
    assert json.loads(path.read_text())["contended"] is False
