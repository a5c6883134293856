"""The failover drill's rounds: which process gets which signal at which phase, and one round from a healthy
cluster through the kill to every request checked against the reference.

Imported by ``failover_drill.py``, which puts the repository on ``sys.path``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from drill_cluster import (
    SERVICES,
    Cluster,
    ClusterDied,
    DrillError,
    LauncherDeath,
    Snapshot,
    call_admin,
    pid_alive,
    pid_state,
    scan_log,
    watch_launcher_death,
)
from drill_report import RoundResult
from drill_workload import (
    LOAD_PREFIX,
    STATUSES,
    KillInfo,
    LoadRecord,
    ReqRecord,
    ReqSpec,
    adapter_uids,
    build_workload,
    classify,
    drive,
    probe_never_loaded,
)

from ipc.client import LoomError

TARGET_GONE_S = 10.0  # a process sent a fatal signal must be gone this soon


@dataclass
class Plan:
    """What one round does."""

    round: int
    target: str
    signal: str
    phase: str


def expand(spec: str) -> list[str]:
    """``"A*2,B"`` -> ``["A", "A", "B"]``."""
    out: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, times = item.partition("*")
        out += [name.strip()] * (int(times) if times else 1)
    return out


def make_plans(n: int, targets: list[str], signals: list[str], phases: list[str], draw: str, seed: int) -> list[Plan]:
    """The rounds: lists cycle (phases fastest, then targets; signals on their own), or are drawn at random."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        if draw == "random":
            plans.append(Plan(i + 1, rng.choice(targets), rng.choice(signals), rng.choice(phases)))
        else:
            t = targets[(i // len(phases)) % len(targets)]
            plans.append(Plan(i + 1, t, signals[i % len(signals)], phases[i % len(phases)]))
    return plans


class Drill:
    """The rounds against one cluster (a fresh one after each launcher kill), and what they found."""

    def __init__(self, cluster: Cluster, a: argparse.Namespace, strict: bool, lora_root: str) -> None:
        self.c = cluster
        self.a = a
        self.strict = strict
        self.lora_root = lora_root
        self.hang_timeout: float = a.launch.hang_timeout
        self.rng = random.Random(a.seed)
        self.ref: dict[str, ReqRecord] = {}
        self.workload_all: list[ReqSpec] = []
        self.load_source = ""
        self.rounds: list[RoundResult] = []
        self.died: str | None = None
        self.error: str | None = None  # why the rounds stopped early (other than the cluster dying)
        self.cleanup_dirs: list[str] = []  # the copy of an adapter the lora-load phase loads
        self.death: LauncherDeath | None = None  # the current round's launcher kill

    def reference(self) -> None:
        """Run the workload once without a fault; every later round is compared with it."""
        self.c.wait_serving(self.a.recover_timeout)
        loras = adapter_uids(self.c.endpoint)
        self.workload_all = build_workload(list(loras), self.a.base_requests, self.a.new_tokens)
        recs, _ = asyncio.run(drive(self.c.endpoint, self.workload_all, self.a.request_timeout))
        bad = [f"{r.spec.label}: {r.error or 'no answer'}" for r in recs if not r.done]
        if bad:
            raise DrillError(f"the fault-free reference run failed: {'; '.join(bad)}")
        self.ref = {r.spec.label: r for r in recs}
        if "lora-load" in self.a.phase_list:
            src = sorted(call_admin(self.c.endpoint, lambda c: c.list_loras()), key=lambda x: x["name"])
            if not src:
                raise DrillError("phase lora-load needs an adapter to copy: pass --enable-lora --lora-paths ...")
            parent = tempfile.mkdtemp(prefix="loom-drill-adapter-", dir=self.lora_root or self.c.work)
            self.load_source = str(Path(parent) / "copy")
            shutil.copytree(src[0]["path"], self.load_source)
            self.cleanup_dirs.append(parent)

    def resolve(self, target: str, pids: dict[str, int]) -> tuple[str, int]:
        """The process name and pid that ``target`` means now."""
        if target == "random":
            target = f"gpu_worker[{self.rng.randrange(self.c.tp_size)}]"
        if target == "launcher":
            assert self.c.proc is not None
            return target, self.c.proc.pid
        if target not in pids:
            raise DrillError(f"no process {target} in the cluster (running: {sorted(pids)})")
        return target, pids[target]

    def run_round(self, plan: Plan) -> RoundResult:
        """One round: wait for a healthy cluster, run the workload with the kill, check everything."""
        pids = self.c.wait_serving(self.a.recover_timeout)
        name, pid = self.resolve(plan.target, pids)
        before = adapter_uids(self.c.endpoint)
        res = RoundResult(plan.round, plan.target, name, pid, plan.signal, plan.phase, self.c.epoch())
        if name in SERVICES:
            res.incarnation_before = self.c.children()[name][1]
        reqs = [s for s in self.workload_all if s.lora is None or s.lora in before]
        sig = signal.Signals[f"SIG{plan.signal}"]
        launcher = name == "launcher"
        snaps: list[Snapshot] = []
        self.death = None

        def fire() -> KillInfo:
            if launcher:
                snaps.append(self.c.snapshot())
            info = KillInfo(name, pid, plan.signal, time.time(), self.c.log_size(), mono=time.monotonic())
            if launcher:
                snaps[0].mono = info.mono
            try:
                os.kill(pid, sig)
            except OSError as e:
                info.ok, info.error = False, str(e)
            return info

        async def after(kill: KillInfo) -> None:
            """The launcher target: watch everything below it go, then start a fresh cluster at once (so
            requests the client resubmits can finish on it)."""
            self.death = death = await watch_launcher_death(self.c, snaps[0], kill.signal)
            if not death.survived:
                try:
                    death.restart_s = round(await self.c.astart(self.a.ready_timeout), 3)
                except DrillError as e:
                    death.restart_error = str(e)

        load = None
        if plan.phase == "lora-load":
            load = LoadRecord(f"{LOAD_PREFIX}{plan.round}", self.load_source)
        recs, kill = asyncio.run(
            drive(
                self.c.endpoint,
                reqs,
                self.a.request_timeout,
                plan.phase,
                fire,
                load,
                self.a.prefill_delay,
                self.a.load_delay,
                after if launcher else None,
            )
        )
        assert kill is not None
        res.kill_time = datetime.fromtimestamp(kill.wall).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        if not kill.ok:
            res.notes.append(f"kill failed: {kill.error}")
        if kill.late:
            res.notes.append("no streamed request reached the decode trigger: the kill came after the workload")
        try:
            self._settle(res, kill, before, load)
        except ClusterDied as e:
            self.died = str(e)
            res.notes.append(f"cluster died: {e}")
        except (DrillError, LoomError) as e:
            self.error = str(e)
            res.notes.append(f"cannot go on: {e}")
        self._score(res, recs, kill)
        if load is not None:
            res.load = asdict(load)
            if load.status == "hung":
                res.counts["hung"] += 1
                res.notes.append(f"load of {load.name} got no answer")
            elif load.status == "error":
                res.notes.append(f"load of {load.name} failed: {load.detail}")
            if load.in_flight_at_kill is False:
                res.notes.append("the load had finished before the kill")
            elif load.status == "ok":
                res.notes.append(f"load of {load.name} ok (in flight at the kill)")
        return res

    def _wait_target(self, res: RoundResult, kill: KillInfo) -> None:
        """Wait for the signalled process to go: at once for a fatal signal; for a stopped scheduler or
        tokenizer, until the launcher finds it silent (``--hang-timeout``) and kills it. A process still stopped
        then is continued (the hang was never detected)."""
        if kill.signal != "STOP":
            patience = TARGET_GONE_S
        elif kill.name in SERVICES:
            patience = self.hang_timeout + TARGET_GONE_S
        else:
            patience = 0.0  # a stopped rank is found by the scheduler's step timeout only while a step runs
        deadline = time.monotonic() + patience
        while kill.ok and pid_alive(kill.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_state(kill.pid) == "T":
            os.kill(kill.pid, signal.SIGCONT)
            res.notes.append(f"{kill.name} was still stopped after the round (hang never detected); sent SIGCONT")
        elif pid_alive(kill.pid) and kill.ok and kill.signal != "STOP":
            res.notes.append(f"{kill.name} survived SIG{kill.signal}")

    def _after_launcher(self, res: RoundResult, kill: KillInfo) -> None:
        """The launcher target: record what its death left (or that it survived the signal)."""
        d = self.death
        if d is None:
            raise DrillError("the launcher's death was never watched")
        res.launcher = asdict(d)
        if d.survived:
            note = d.summary()
            if pid_state(kill.pid) == "T":
                os.kill(kill.pid, signal.SIGCONT)
                note += "; sent SIGCONT"
            res.notes.append(note)
            return
        res.notes.append(d.summary())
        if d.restart_error:
            raise DrillError(f"the fresh cluster after the launcher's death did not start: {d.restart_error}")

    def _settle(self, res: RoundResult, kill: KillInfo, before: dict[str, str], load: LoadRecord | None) -> None:
        """After the requests: let the cluster recover, then compare the adapters with ``before``."""
        if kill.name == "launcher":
            self._after_launcher(res, kill)
        else:
            self._wait_target(res, kill)
        if not self.c.alive():
            raise self.c.died()
        self.c.wait_serving(self.a.recover_timeout)
        res.epoch_after = self.c.epoch()
        if kill.name in SERVICES:
            res.incarnation_after = self.c.children().get(kill.name, (0, None))[1]
        after = adapter_uids(self.c.endpoint)
        res.adapters_restored = sorted(n for n, u in before.items() if after.get(n) == u)
        res.adapters_uid_changed = sorted(n for n, u in before.items() if n in after and after[n] != u)
        res.adapters_lost = sorted(n for n in before if n not in after)
        res.adapters_lost_surfaced = [n for n in res.adapters_lost if probe_never_loaded(self.c.endpoint, n)]
        for n in res.adapters_uid_changed:
            res.notes.append(f"adapter {n} came back under a new uid")
        for n in sorted(set(res.adapters_lost) - set(res.adapters_lost_surfaced)):
            res.notes.append(f"adapter {n} is gone but a request for it did not fail with 'never been loaded'")
        if load is not None and load.status == "ok":
            if kill.name == "launcher" and res.launcher and not res.launcher["survived"]:
                return  # it went with the old cluster
            loaded = call_admin(self.c.endpoint, lambda c: c.list_loras())
            if not any(x["name"] == load.name for x in loaded):
                res.notes.append(f"{load.name} loaded ok but is not listed")
                return
            name = load.name
            try:
                call_admin(self.c.endpoint, lambda c: c.unload_lora_adapter(name), timeout_s=self.a.request_timeout)
                load.unloaded = True
            except LoomError as e:
                res.notes.append(f"unload of {load.name} failed: {e.kind}: {e}")

    def _score(self, res: RoundResult, recs: list[ReqRecord], kill: KillInfo) -> None:
        """Classify every request; detection and kill-to-first-token from the log (or, for the launcher, from
        its children's exits) and the chunk times."""
        since = kill.wall
        if kill.name == "launcher":
            d = res.launcher
            if d is not None and not d["survived"]:
                res.detected, res.detect_s, res.up_s = d["gone_s"] is not None, d["gone_s"], d["restart_s"]
                since = kill.wall + (d["gone_s"] or 0.0)  # later chunks come from the fresh cluster
                res.detect_line = f"launcher exited with code {d['exit']}; every process below it gone"
                if d["gone_s"] is None:
                    res.detect_line = f"launcher exited with code {d['exit']}; processes below it still running"
        else:
            facts = scan_log(self.c.log_since(kill.log_offset), kill.name)
            res.detect_line = facts.detect_line.strip()
            if facts.detect_wall is not None:
                res.detected = True
                res.detect_s = round(facts.detect_wall - kill.wall, 3)
            res.up_s, res.serving_again_s, res.resumed = facts.up_s, facts.serving_s, facts.resumed
            res.also_restarted = facts.also
            if facts.also:
                res.notes.append(f"also restarted: {', '.join(facts.also)}")
            # a chunk that left before the kill can still arrive just after it: count only chunks after detection
            since = max(kill.wall, facts.detect_wall or kill.wall)
        firsts = [t for r in recs for t, _, _ in r.chunks if t > since]
        res.first_token_s = round(min(firsts) - kill.wall, 3) if firsts else None
        res.counts = dict.fromkeys(STATUSES, 0)
        lost = set(res.adapters_lost)
        for r in recs:
            status, detail = classify(r, self.ref[r.spec.label], self.strict)
            if status == "error" and r.spec.lora in lost and r.error is not None and r.error.kind != "not_found":
                detail += " (its adapter was lost, but the error is not the never-been-loaded one)"
            res.counts[status] += 1
            res.requests.append({"label": r.spec.label, "stream": r.spec.stream, "status": status, "detail": detail})
            if status != "identical":
                res.notes.append(f"{r.spec.label}: {status} {detail}".strip())
