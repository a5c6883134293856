"""scripts/failover_drill.py end to end: ten TP=2 rounds with two adapters, every target, every phase and one hang;
every request finishes with the fault-free tokens, every kill is found in the log, and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loom_helpers import REPO, _cmdline, pid_alive
from lora_helpers import real_adapters

pytestmark = pytest.mark.slow

PHASES = ["idle", "prefill", "decode", "lora-load"]


@pytest.mark.timeout(420)
def test_drill_tp2_ten_rounds_every_request_exact(tmp_path):
    ad = real_adapters()
    log = tmp_path / "cluster.log"
    cmd = [sys.executable, str(REPO / "scripts" / "failover_drill.py"), "--rounds", "10", "--json"]
    cmd += ["--targets", "gpu_worker[0],gpu_worker[1]", "--phases", ",".join(PHASES)]
    cmd += ["--signals", "KILL*6,STOP,KILL*3", "--new-tokens", "8", "--log", str(log), "--"]
    cmd += ["--tp-size", "2", "--max-total-tokens", "2048", "--step-timeout", "3", "--enable-lora"]
    cmd += ["--lora-paths", f"a={ad['r8-all']}", f"b={ad['r32-qv']}"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=400, env=env)
    assert p.returncode == 0, f"{p.stderr[-6000:]}\n{log.read_text()[-4000:] if log.exists() else ''}"
    doc = json.loads(p.stdout)
    s, rounds = doc["summary"], doc["rounds"]

    # the plan: targets x phases cycled, one hang (round 7: gpu_worker[1] stopped while decoding)
    assert [(r["process"], r["phase"]) for r in rounds[:8]] == [
        (f"gpu_worker[{t}]", ph) for t in (0, 1) for ph in PHASES
    ]
    assert [r["signal"] for r in rounds] == ["KILL"] * 6 + ["STOP"] + ["KILL"] * 3

    # every request finished with exactly the fault-free tokens; nothing hung, nothing wrong
    assert s["ok"] and s["cluster_died"] is None, s
    assert s["requests"]["hung"] == 0 and s["requests"]["wrong"] == 0, s
    n_reqs = len(doc["config"]["workload"])
    assert n_reqs == 5  # a, b, two base, one seeded
    for r in rounds:
        assert r["counts"]["identical"] == n_reqs, r
        assert r["detected"] and r["detect_s"] is not None and r["detect_s"] >= -0.01, r
        assert r["first_token_s"] is not None and r["first_token_s"] > 0, r
        assert r["adapters_restored"] == ["a", "b"] and not r["adapters_lost"], r
        assert r["epoch_after"] == r["epoch_before"] + 1, r
    hang = rounds[6]
    assert "TP group epoch" in hang["detect_line"] and "is hung" in hang["detect_line"], hang
    assert hang["detect_s"] >= 3.0, hang  # the step timeout found it
    for r in rounds:
        if r["signal"] == "KILL":
            assert "restarting the TP group as epoch" in r["detect_line"] and r["detect_s"] < 3.0, r
        if r["phase"] == "lora-load":
            assert r["load"]["status"] == "ok" and r["load"]["unloaded"], r

    # the printed table went to stderr, one row per round, then the summary
    assert p.stderr.count("gpu_worker[") >= 10 and "result: PASS" in p.stderr, p.stderr

    # nothing left behind: no process, socket, config folder or temp folder; the log was kept where asked
    c = doc["cluster"]
    assert not (pid_alive(c["launcher_pid"]) and c["endpoint"] in _cmdline(c["launcher_pid"]))
    assert len(c["pids"]) >= 2 + 2 * 11  # scheduler, tokenizer and eleven TP groups of two
    for pid in map(int, c["pids"]):
        assert not (pid_alive(pid) and c["config_file"] in _cmdline(pid)), f"pid {pid} ({c['pids'][str(pid)]}) survived"
    assert not Path(c["config_file"]).parent.exists()
    assert not Path(c["endpoint"][len("ipc://") :]).exists()
    assert not Path(c["work_dir"]).exists()
    assert log.is_file() and "restarting the TP group as epoch 11" in log.read_text()
