"""scripts/failover_drill.py end to end: six TP=2 rounds with two adapters (every phase on rank 0, then a kill and
a hang on rank 1; CI's ``drills`` step runs the full-size drills);
and six TP=1 rounds that kill or hang the scheduler and the front door and kill the launcher itself (the drill a
child subreaper, as docker --init is). Every request finishes with the fault-free tokens (or, when the launcher
dies, with a clear error), every fault is found, a killed launcher's children are gone within 2 s and leave no
socket folder, front socket or /dev/shm entry, and nothing is left behind."""

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

PHASES = ["idle", "decode", "prefill", "lora-load"]
DRILL = REPO / "scripts" / "failover_drill.py"


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.mark.timeout(420)
def test_drill_tp2_six_rounds_every_request_exact(tmp_path):
    ad = real_adapters()
    log = tmp_path / "cluster.log"
    cmd = [sys.executable, str(DRILL), "--rounds", "6", "--json"]
    cmd += ["--targets", "gpu_worker[0],gpu_worker[1]", "--phases", ",".join(PHASES)]
    cmd += ["--signals", "KILL*5,STOP", "--new-tokens", "8", "--log", str(log), "--"]
    cmd += [
        "--tp-size",
        "2",
        "--max-total-tokens",
        "2048",
        "--step-timeout",
        "3",
        "--enable-lora",
        "--quantization",
        "none",
    ]
    cmd += ["--lora-paths", f"a={ad['r8-all']}", f"b={ad['r32-qv']}"]
    p = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=400, env=env())
    assert p.returncode == 0, f"{p.stderr[-6000:]}\n{log.read_text()[-4000:] if log.exists() else ''}"
    doc = json.loads(p.stdout)
    s, rounds = doc["summary"], doc["rounds"]

    # the plan: targets x phases cycled, every phase on gpu_worker[0], then gpu_worker[1] killed while idle and,
    # the one hang, stopped while decoding (round 6)
    assert [(r["process"], r["phase"]) for r in rounds] == [
        *(("gpu_worker[0]", ph) for ph in PHASES),
        ("gpu_worker[1]", "idle"),
        ("gpu_worker[1]", "decode"),
    ]
    assert [r["signal"] for r in rounds] == ["KILL"] * 5 + ["STOP"]

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
    hang = rounds[5]
    assert "TP group epoch" in hang["detect_line"] and "is hung" in hang["detect_line"], hang
    assert hang["detect_s"] >= 3.0, hang  # the step timeout found it
    for r in rounds:
        if r["signal"] == "KILL":
            assert "restarting the TP group as epoch" in r["detect_line"] and r["detect_s"] < 3.0, r
        if r["phase"] == "lora-load":
            assert r["load"]["status"] == "ok" and r["load"]["unloaded"], r

    # the printed table went to stderr, one row per round, then the summary
    assert p.stderr.count("gpu_worker[") >= 6 and "result: PASS" in p.stderr, p.stderr

    # nothing left behind: no process, socket, config folder or temp folder; the log was kept where asked
    c = doc["cluster"]
    assert not (pid_alive(c["launcher_pid"]) and c["endpoint"] in _cmdline(c["launcher_pid"]))
    assert len(c["pids"]) >= 2 + 2 * 7  # scheduler, tokenizer and seven TP groups of two
    for pid in map(int, c["pids"]):
        assert not (pid_alive(pid) and c["config_file"] in _cmdline(pid)), f"pid {pid} ({c['pids'][str(pid)]}) survived"
    assert not Path(c["config_file"]).parent.exists()
    assert not Path(c["endpoint"][len("ipc://") :]).exists()
    assert not Path(c["work_dir"]).exists()
    assert log.is_file() and "restarting the TP group as epoch 7" in log.read_text()


SERVICE_PLAN = [
    ("scheduler_proc", "STOP", "decode"),
    ("scheduler_proc", "KILL", "prefill"),
    ("tokenizer_proc", "STOP", "decode"),
    ("tokenizer_proc", "KILL", "prefill"),
    ("launcher", "KILL", "decode"),
    ("launcher", "KILL", "prefill"),
]
HANG_TIMEOUT_S = 3.0


@pytest.mark.timeout(240)
def test_drill_tp1_services_and_launcher(tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    log = tmp_path / "cluster.log"
    cmd = [sys.executable, str(DRILL), "--rounds", "6", "--json", "--subreaper", "--new-tokens", "6"]
    cmd += ["--targets", "scheduler_proc,tokenizer_proc,launcher", "--phases", "decode,prefill"]
    cmd += ["--signals", "STOP,KILL,STOP,KILL,KILL,KILL", "--log", str(log), "--"]
    cmd += ["--max-total-tokens", "1024", "--hang-timeout", str(HANG_TIMEOUT_S), "--quantization", "none"]
    p = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=220, env=env())
    assert p.returncode == 0, f"{p.stderr[-6000:]}\n{log.read_text()[-4000:] if log.exists() else ''}"
    doc = json.loads(p.stdout)
    s, rounds = doc["summary"], doc["rounds"]
    assert [(r["process"], r["signal"], r["phase"]) for r in rounds] == SERVICE_PLAN
    assert s["ok"] and s["cluster_died"] is None, s
    assert s["requests"]["hung"] == 0 and s["requests"]["wrong"] == 0, s
    n_reqs = len(doc["config"]["workload"])
    assert n_reqs == 3  # two base, one seeded

    # a restarted scheduler or front door: found in the log, back, and every request exactly as without a fault
    for r in rounds[:4]:
        name = r["process"]
        assert r["counts"]["identical"] == n_reqs, r
        assert r["detected"] and r["up_s"] is not None and r["first_token_s"] is not None, r
        assert r["incarnation_after"] == r["incarnation_before"] + 1, r
        assert r["epoch_after"] == r["epoch_before"] == 1 and not r["also_restarted"], r
        if r["signal"] == "STOP":  # heartbeats once a second: silent for the hang timeout, found within 0.2 s
            assert f"{name} (pid {r['pid']}) sent no heartbeat for" in r["detect_line"], r
            assert HANG_TIMEOUT_S - 1.6 <= r["detect_s"] <= HANG_TIMEOUT_S + 2.0, r
        else:
            assert f"{name} exited with code -9 (SIGKILL); restarting it as incarnation" in r["detect_line"], r
            assert r["detect_s"] < 1.5, r

    # a killed launcher: every process below it gone within 2 s (re-parented to the drill, which reaped them),
    # nothing left behind, and a fresh cluster; requests in flight finished there or failed with a clear error
    for r in rounds[4:]:
        d = r["launcher"]
        hint = "(a socket folder or front socket left: see ipc.proc.launcher_gone)"
        assert d is not None and d["clean"] and not d["survived"], f"{r['notes']} {hint}\n{d}"
        assert d["exit"] == "-9 (SIGKILL)" and d["gone_s"] < 2.0, d
        assert sorted(d["children"].values()) == ["gpu_worker[0]", "scheduler_proc", "tokenizer_proc"], d
        assert set(d["exits"]) == set(d["children"]), d  # the drill reaped every one: it was their subreaper
        assert not (d["left"] or d["socket_dir_left"] or d["front_left"] or d["shm_left"]), d
        assert d["restart_s"] is not None and r["up_s"] == d["restart_s"] and r["epoch_after"] == 1, r
        assert r["detected"] and r["detect_s"] == d["gone_s"], r
        assert any("children gone in" in n and n.endswith("nothing left") for n in r["notes"]), r
        for q in r["requests"]:
            ok = q["status"] == "identical" or (
                q["status"] == "error"
                and (q["detail"].startswith("unavailable:") or q["detail"] == "server_error: server shutting down")
            )
            assert ok, r
    assert s["launcher_killed"] == 2 and s["launcher_clean"] == 2, s
    assert "nothing left" in p.stderr and "result: PASS" in p.stderr, p.stderr

    # nothing left behind by any of the three clusters
    c = doc["cluster"]
    assert c["generations"] == 3 and len(c["config_files"]) == 3 and len(c["launcher_pids"]) == 3, c
    for pid in c["launcher_pids"]:
        assert not (pid_alive(pid) and c["endpoint"] in _cmdline(pid)), f"launcher {pid} survived"
    for pid in map(int, c["pids"]):
        cmd = _cmdline(pid)
        assert not (pid_alive(pid) and any(cf in cmd for cf in c["config_files"])), f"{c['pids'][str(pid)]} survived"
    for cf in c["config_files"]:
        assert not Path(cf).parent.exists(), cf
    assert not Path(c["endpoint"][len("ipc://") :]).exists()
    assert not Path(c["work_dir"]).exists()
    assert not (set(os.listdir("/dev/shm")) - shm_before)
    text = log.read_text()
    assert text.count("sent no heartbeat for") == 2 and text.count(" is back (pid ") == 4, text[-4000:]
    assert "---- failover drill: fresh cluster (generation 3) ----" in text
