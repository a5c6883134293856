"""Start-up kernel choices (gpu_worker/timing.py): a timing taken while the cores were taken is detected from the
run-queue delay and repeated; the answer the TP ranks agree on is kept for later starts unless a rank's timing
was contended, and recorded for the cluster, whose replacement TP groups run exactly the kernels it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpu_worker import timing

pytestmark = pytest.mark.skipif(timing.run_queue_waits() is None, reason="this kernel reports no run-queue delay")

HOG = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass"  # ends on its own


@pytest.fixture(autouse=True)
def _real_limit(monkeypatch):
    monkeypatch.setattr(timing, "WAIT_SHARE", 0.2)  # conftest lifts it for every other test


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
    cpu = min(os.sched_getaffinity(0))
    mask = os.sched_getaffinity(0)
    hogs: list[subprocess.Popen] = []
    try:
        os.sched_setaffinity(0, {cpu})  # this test and its hogs share one core, whatever the machine's size
        for _ in range(3):
            hogs.append(
                subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
            )
        time.sleep(0.3)  # the hogs are running
        calls = []

        def measure():
            calls.append(1)
            _spin(0.3)
            return len(calls), "spun"

        answer, how, contended = timing.timed_alone(measure)
    finally:
        os.sched_setaffinity(0, mask)
        for h in hogs:
            h.kill()
            h.wait()
    assert contended and len(calls) == 2
    assert answer in (1, 2) and how.startswith("spun; timed while the cores were taken")


def _fake(monkeypatch, contended: list[bool], others: list[int] | None = None):
    """timed_alone reporting ``contended[0]``; the other TP ranks' votes ``others`` (max of [±answer, contended,
    lacked the kernel])."""

    def fake_timed_alone(measure):
        answer, how = measure()
        return answer, how, contended[0]

    monkeypatch.setattr(timing, "timed_alone", fake_timed_alone)
    if others is not None:
        monkeypatch.setattr(
            timing, "_all_ranks_max", lambda values, group: [max(v, o) for v, o in zip(values, others, strict=True)]
        )


def _counting():
    calls: list[int] = []

    def measure():
        calls.append(1)
        return 4 + len(calls), f"attempt {len(calls)}"

    return calls, measure


def test_an_answer_timed_alone_is_kept_and_read_back(monkeypatch, tmp_path):
    _fake(monkeypatch, [False])
    calls, measure = _counting()
    assert timing.agreed_choice(tmp_path, "c", "k", measure) == (5, "attempt 1", 5)
    agreed, how, own = timing.agreed_choice(tmp_path, "c", "k", measure)
    assert (agreed, own) == (5, 5) and "attempt 1, measured earlier" in how and len(calls) == 1


def test_a_contended_answer_is_used_but_not_kept(monkeypatch, tmp_path):
    _fake(monkeypatch, [True])
    calls, measure = _counting()
    agreed, how, _ = timing.agreed_choice(tmp_path, "c", "k", measure)
    assert agreed == 5 and "not kept for later starts" in how
    assert not list(tmp_path.glob("c-*.json"))
    assert timing.agreed_choice(tmp_path, "c", "k", measure)[0] == 6 and len(calls) == 2  # the next start measures


def test_a_rank_alone_keeps_nothing_when_another_ranks_timing_was_contended(monkeypatch, tmp_path):
    _fake(monkeypatch, [False], others=[0, 1, 0])  # the other rank found the kernel never faster, under contention
    calls, measure = _counting()
    agreed, how, own = timing.agreed_choice(tmp_path, "c", "k", measure, group=object(), highest=True)
    assert (agreed, own) == (5, 5) and "a TP rank's timing was contended" in how
    assert not list(tmp_path.glob("c-*.json"))


def test_the_agreed_answer_is_kept_not_this_ranks_own(monkeypatch, tmp_path):
    _fake(monkeypatch, [False], others=[-2, 0, 0])  # lowest wins: another rank says 2
    calls, measure = _counting()
    assert timing.agreed_choice(tmp_path, "c", "k", measure, group=object()) == (2, "attempt 1", 5)
    (path,) = tmp_path.glob("c-*.json")
    kept = json.loads(path.read_text())
    assert kept["faster"] == 2 and kept["how"] == "attempt 1 (this rank's answer, 5; the TP ranks agreed on 2)"
    monkeypatch.undo()
    _fake(monkeypatch, [False])
    agreed, how, _ = timing.agreed_choice(tmp_path, "c", "k", measure)  # a later start alone reads the group's
    assert agreed == 2 and "measured earlier" in how and len(calls) == 1


def test_a_replacement_group_runs_what_the_cluster_ran(monkeypatch, tmp_path):
    machine, cluster = tmp_path / "machine", tmp_path / "cluster"
    monkeypatch.setattr(timing, "cluster_record", cluster)
    _fake(monkeypatch, [True])  # the first group timed under contention: its answer is not kept machine-wide
    calls, measure = _counting()
    assert timing.agreed_choice(machine, "c", "k", measure)[0] == 5
    assert not machine.exists()
    timing.store_choice(machine, "c", "k", 9, "another cluster, measured alone since")
    monkeypatch.setattr(timing, "replacement", True)  # a TP group replacing a failed one reads the cluster's
    agreed, how, _ = timing.agreed_choice(machine, "c", "k", measure)
    assert agreed == 5 and "as the TP group this one replaces ran" in how and len(calls) == 1
    monkeypatch.setattr(timing, "replacement", False)  # a fresh cluster reads the machine's
    assert timing.agreed_choice(machine, "c", "k", measure)[0] == 9


def test_a_rank_without_the_kernel_votes_and_keeps_nothing(monkeypatch, tmp_path):
    _fake(monkeypatch, [False], others=[-3, 0, 0])
    assert timing.agreed_choice(tmp_path, "c", "k", None, group=object(), lacking=0) == (0, "", 0)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_vote_that_a_rank_without_the_kernel_decided_is_not_kept_machine_wide(monkeypatch, tmp_path):
    machine, cluster = tmp_path / "machine", tmp_path / "cluster"
    monkeypatch.setattr(timing, "cluster_record", cluster)
    _fake(monkeypatch, [False], others=[0, 0, 1])  # the other rank has no kernel: it votes 0
    calls, measure = _counting()
    agreed, _, own = timing.agreed_choice(machine, "c", "k", measure, group=object())
    assert (agreed, own) == (0, 5)
    assert not machine.exists()  # a later start with the kernel on every rank measures again
    (rec,) = cluster.glob("c-*.json")  # but a replacement group runs what this group ran
    assert json.loads(rec.read_text())["faster"] == 0


def test_a_timing_that_raises_votes_as_lacking(monkeypatch, tmp_path, caplog):
    def broken():
        raise RuntimeError("oneDNN said no")

    agreed, how, own = timing.agreed_choice(tmp_path, "c", "k", broken, lacking=7)
    assert (agreed, own) == (7, 7) and "the timing failed: RuntimeError: oneDNN said no" in how
    assert "c: the start-up timing failed" in caplog.text
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_older_encodings_are_normalised_before_the_vote(monkeypatch, tmp_path):
    _fake(monkeypatch, [False])
    timing.store_choice(tmp_path, "c", "k", 0, "an older file's never")
    calls, measure = _counting()
    agreed, _, own = timing.agreed_choice(tmp_path, "c", "k", measure, highest=True, normalize=lambda v: v or 99)
    assert (agreed, own) == (99, 99) and not calls


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    path = timing._choice_path(tmp_path, "c", "k")
    path.mkdir(parents=True)  # the file's name is taken by a folder: the rename fails
    assert timing.store_choice(tmp_path, "c", "k", 1, "x") is False
    assert [q.name for q in tmp_path.iterdir()] == [path.name]


def test_damaged_and_older_files_are_handled(monkeypatch, tmp_path):
    _fake(monkeypatch, [False])
    calls, measure = _counting()
    path = timing._choice_path(tmp_path, "c", "k")
    tmp_path.mkdir(exist_ok=True)
    path.write_text('{"faster": "yes"')  # damaged: measured again
    assert timing.agreed_choice(tmp_path, "c", "k", measure)[0] == 5
    path.write_text(json.dumps({"faster": 2**63, "how": "too big for the ranks' int64 vote"}))  # damaged too
    assert timing.agreed_choice(tmp_path, "c", "k", measure)[0] == 6
    path.write_text(json.dumps({"faster": 7, "how": "an older file", "contended": True}))  # extra keys are read past
    assert timing.agreed_choice(tmp_path, "c", "k", measure)[0] == 7 and len(calls) == 2
