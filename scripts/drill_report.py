"""The failover drill's results: one record per round, the table row that shows it, and the summary."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from drill_workload import STATUSES


@dataclass
class RoundResult:
    """Everything measured in one round (the JSON output holds these as they are).

    ``detect_s``: signal -> the log line that shows the fault was found (``detect_line``); for the launcher,
    signal -> the last process below it gone. ``up_s``: the TP group's "is up in X s", a service's "is back
    (pid P) in X s", or for the launcher the fresh cluster's start -> "Loom ready:".
    """

    round: int
    target: str
    process: str
    pid: int
    signal: str
    phase: str
    epoch_before: int
    incarnation_before: int | None = None  # scheduler_proc / tokenizer_proc targets
    kill_time: str = ""  # local wall clock, like the log's timestamps
    epoch_after: int | None = None
    incarnation_after: int | None = None
    detected: bool = False
    detect_s: float | None = None
    detect_line: str = ""
    first_token_s: float | None = None
    up_s: float | None = None
    serving_again_s: float | None = None
    resumed: int | None = None
    also_restarted: list[str] = field(default_factory=list)  # other processes the launcher restarted meanwhile
    counts: dict[str, int] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    adapters_restored: list[str] = field(default_factory=list)
    adapters_lost: list[str] = field(default_factory=list)
    adapters_lost_surfaced: list[str] = field(default_factory=list)
    adapters_uid_changed: list[str] = field(default_factory=list)
    load: dict[str, Any] | None = None
    launcher: dict[str, Any] | None = None  # the launcher target: drill_cluster.LauncherDeath as a dict
    notes: list[str] = field(default_factory=list)


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


HEADER = (
    f"{'round':>5}  {'target':<14} {'signal':<6} {'phase':<9} {'detect':>7} {'up':>7} {'1st tok':>8} "
    f"{'ident':>5} {'error':>5} {'hung':>4} {'wrong':>5} {'div':>3}  {'adapters':<16} notes"
)


def row(r: RoundResult) -> str:
    """One table row."""
    c = r.counts
    target = r.process if r.target != "random" else f"{r.process}*"
    n = len(r.adapters_restored) + len(r.adapters_lost) + len(r.adapters_uid_changed)
    ad = f"{len(r.adapters_restored)}/{n} kept" + (f", {len(r.adapters_lost)} lost" if r.adapters_lost else "")
    if r.epoch_after is None:  # the cluster never came back: nothing to compare
        ad = "-"
    notes = "; ".join(n.replace("\n", " ") for n in r.notes)
    return (
        f"{r.round:>5}  {target:<14} {r.signal:<6} {r.phase:<9} {_fmt(r.detect_s):>7} {_fmt(r.up_s):>7} "
        f"{_fmt(r.first_token_s):>8} {c.get('identical', 0):>5} {c.get('error', 0):>5} {c.get('hung', 0):>4} "
        f"{c.get('wrong', 0):>5} {c.get('diverged', 0):>3}  {ad:<16} {notes}"
    ).rstrip()


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"median": statistics.median(xs) if xs else None, "worst": max(xs) if xs else None}


def summarize(rounds: list[RoundResult], died: str | None) -> dict[str, Any]:
    """Totals, median and worst detection / kill-to-first-token / up, the launcher checks, and the verdict."""
    totals = dict.fromkeys(STATUSES, 0)
    for r in rounds:
        for k, v in r.counts.items():
            totals[k] += v
    deaths = [r.launcher for r in rounds if r.launcher is not None and not r.launcher["survived"]]
    s: dict[str, Any] = {
        "rounds": len(rounds),
        "rounds_detected": sum(r.detected for r in rounds),
        "detect_s": _stats([r.detect_s for r in rounds if r.detect_s is not None]),
        "first_token_s": _stats([r.first_token_s for r in rounds if r.first_token_s is not None]),
        "up_s": _stats([r.up_s for r in rounds if r.up_s is not None]),
        "requests": totals,
        "adapters_restored": sum(len(r.adapters_restored) for r in rounds),
        "adapters_lost": sum(len(r.adapters_lost) for r in rounds),
        "adapters_lost_surfaced": sum(len(r.adapters_lost_surfaced) for r in rounds),
        "adapters_uid_changed": sum(len(r.adapters_uid_changed) for r in rounds),
        "launcher_killed": len(deaths),
        "launcher_clean": sum(d["clean"] for d in deaths),
        "children_gone_s": _stats([d["gone_s"] for d in deaths if d["gone_s"] is not None]),
        "fresh_cluster_s": _stats([d["restart_s"] for d in deaths if d["restart_s"] is not None]),
        "cluster_died": died,
    }
    s["ok"] = (
        totals["hung"] == 0 and totals["wrong"] == 0 and died is None and s["launcher_clean"] == s["launcher_killed"]
    )
    return s


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The summary as text."""
    d, f, u, t = s["detect_s"], s["first_token_s"], s["up_s"], s["requests"]
    lines = [
        f"rounds: {s['rounds']} ({s['rounds_detected']} detected)",
        f"detection: median {_fmt(d['median'], ' s')}, worst {_fmt(d['worst'], ' s')}; "
        f"kill -> first token: median {_fmt(f['median'], ' s')}, worst {_fmt(f['worst'], ' s')}; "
        f"up again: median {_fmt(u['median'], ' s')}, worst {_fmt(u['worst'], ' s')}",
        f"requests: {t['identical']} identical, {t['error']} failed with a clear error, {t['hung']} hung, "
        f"{t['wrong']} wrong, {t['diverged']} diverged (bf16/fp16 only)",
        f"adapters: {s['adapters_restored']} restored under the same uid, {s['adapters_lost']} lost "
        f"({s['adapters_lost_surfaced']} surfaced as never loaded), {s['adapters_uid_changed']} with a new uid",
    ]
    if s["launcher_killed"]:
        g, c = s["children_gone_s"], s["fresh_cluster_s"]
        lines.append(
            f"launcher: {s['launcher_killed']} killed, {s['launcher_clean']} clean (every child gone in time, "
            f"nothing left); children gone: worst {_fmt(g['worst'], ' s')}; fresh cluster ready: median "
            f"{_fmt(c['median'], ' s')}, worst {_fmt(c['worst'], ' s')}"
        )
    if s["cluster_died"]:
        lines.append(f"CLUSTER DIED: {s['cluster_died']}")
    lines.append("result: " + ("PASS" if s["ok"] else "FAIL"))
    return lines
