#!/usr/bin/env python
"""Failover drills: start a Loom cluster, keep a mixed load running, kill a process, check every request.

    python scripts/failover_drill.py --rounds 10 --targets 'gpu_worker[0],gpu_worker[1]' --signals KILL \\
        --phases idle,prefill,decode,lora-load --new-tokens 12 -- \\
        --tp-size 2 --enable-lora --lora-paths a=/path/to/adapter b=/path/to/other --step-timeout 3
    python scripts/failover_drill.py --rounds 6 --targets scheduler_proc,tokenizer_proc,launcher \\
        --signals KILL,STOP --phases decode,prefill --subreaper -- --hang-timeout 3

Everything after ``--`` is passed to ``launch.py`` as is (the drill adds its own private ``--zmq-endpoint``,
and ``--crash-loop-deaths ROUNDS+1`` unless you pass that flag, so its own kills never count as a crash loop).

First the drill runs the workload once without a fault: the reference. The workload is one greedy request per
adapter that ``list_loras`` shows, ``--base-requests`` greedy base-model requests and one seeded sampled request
(temperature 0.8, seed 7), every one with ``ignore_eos`` and ``--new-tokens`` tokens, half of them streamed.
Then each round

1. waits until the cluster is healthy: every rank of the current TP group runs, no scheduler / tokenizer is
   stopped or restarting, and health answers (the drill's own calls wait out a front door that is down),
2. connects its client (a one-token request: a long-lived client is connected before a fault, and one that
   never reached the server fails at once instead of resubmitting), then sends the workload and sends
   ``--signals`` to ``--targets`` at a ``--phases`` moment: ``idle`` (kill first, then submit), ``prefill``
   (submit, then kill at once), ``decode`` (kill once a streamed request has 3 chunks) or ``lora-load`` (a copy
   of an adapter is loaded under a new name concurrently with the workload, and the kill lands while the load
   is in flight; the load must succeed or fail with a clear error, and is unloaded afterwards),
3. checks every request against the reference: ``identical``, ``error`` (failed with a clear LoomError, such as
   ``not_found`` "never been loaded" for an adapter a restart lost, or ``unavailable`` for a lost connection),
   ``hung`` (no answer within ``--request-timeout``) or ``wrong`` (other tokens, or a stream whose chunks are not
   each a prefix of the next), and whether the adapters kept their uids (restored) or were lost (then a request
   for one must fail with the never-been-loaded error).

Targets, and how the drill finds the fault (``detect``: signal -> that moment) and the recovery (``up``):

  gpu_worker[N]   a TP rank (``random``: a rank drawn with the seeded RNG). detect: the launcher's "...; restarting
                  the TP group as epoch N" or, for STOP, the scheduler's "TP group epoch N is hung" (after
                  ``--step-timeout``, found only while a step runs: pass a small one, e.g. 3, through).
                  up: "TP group epoch N is up in X s".
  scheduler_proc  restarted by the launcher; ZMQ clients resubmit greedy and seeded requests, so every request
  tokenizer_proc  is expected identical (``unavailable`` counts as a clear error). detect: "NAME exited with
                  code ...; restarting it as incarnation N" or, for STOP, "NAME (pid P) sent no heartbeat for X s:
                  hung" (after ``--hang-timeout``, 10 s by default: pass e.g. 3 through). up: "NAME is back (pid
                  P) in X s". Other processes restarted meanwhile are noted ("also restarted: ...").
  launcher        the launcher itself. detect: until every process below it (listed just before the signal) has
                  exited, which must be within 2 s (12 s for TERM / INT, which the launcher handles by stopping them
                  itself); then its socket folder (the /tmp/loom-* folder holding config.json) and the front socket
                  file must be gone and no new /dev/shm entry may exist (one not held by another program); the row
                  says e.g. "3 children gone in 0.41 s, nothing left", and a round that fails this check fails the
                  drill. Then the drill starts a fresh cluster (same flags, same endpoint; the reference stays
                  valid). up: until it printed "Loom ready:". Requests in flight fail with a clear error
                  (``unavailable``, or "server shutting down" from the dying front door), or finish on the fresh
                  cluster when the client resubmits them there (then identical); never hung or wrong. A signal the
                  launcher survives (STOP, ...) is noted, the cluster keeps serving and the launcher is continued
                  after the round. ``--subreaper``: the drill makes itself a child subreaper (as ``docker --init``
                  is), so the orphans re-parent to it, and reaps them.

Signals: KILL, TERM, SEGV, STOP (a hang), or any other signal name. Lists cycle (phases fastest, then targets,
so every target meets every phase; signals cycle on their own) or, with ``--draw random``, are drawn with
``--seed``; ``NAME*N`` repeats an entry (``--signals 'KILL*9,STOP'``: one hang every ten rounds).

bf16 / fp16: greedy output can depend on the batch's composition, and a resumed request is re-prefilled in a
different batch, so with ``--dtype bfloat16`` or ``float16`` a request whose tokens differ from the reference
counts as ``diverged`` (reported, not a failure); with ``float32`` or ``auto`` and ``--quantization none`` it
counts as ``wrong``. Quantised weights (``--quantization`` ``auto``, the default, serves the embedded GGUF's blocks
with bf16 activations; ``int8``, ``gguf``) are judged like bf16.

Prints one row per round and a summary (``--json``: one JSON object instead, the table goes to stderr). Exits 1
if any request hung or was wrong, a killed launcher left something behind, or the cluster died (a crash loop, or
a target whose death stops it), 2 for bad flags. Nothing is left behind: no process, socket file or temp folder
(the cluster log only with ``--log``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO, Path(__file__).resolve().parent):  # ipc, launch; the drill_* modules
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# drill_cluster: processes, the log, the cluster and a killed launcher's leftovers; drill_workload: the requests
# and the fault at a phase; drill_rounds: the plan and one round; drill_report: the row and the summary
from drill_cluster import SERVICES, Cluster, ClusterDied, DrillError, become_subreaper  # noqa: E402
from drill_report import HEADER, row, summarize, summary_lines  # noqa: E402
from drill_rounds import Drill, expand, make_plans  # noqa: E402
from drill_workload import DECODE_CHUNKS, PHASES  # noqa: E402

from ipc.client import LoomError  # noqa: E402

TARGETS = (*SERVICES, "launcher")
STRICT_DTYPES = ("float32", "auto")


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The drill's own flags (``launch.py`` flags go after ``--``)."""
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] -- [launch.py flags]",
    )
    a = p.add_argument
    a("--rounds", type=int, default=10)
    a("--targets", default="gpu_worker[0]", help="comma list: gpu_worker[N], random, " + ", ".join(TARGETS))
    a("--signals", default="KILL", help="comma list of signal names: KILL, TERM, SEGV, STOP (a hang), ...")
    a("--phases", default=",".join(PHASES), help="comma list of " + ", ".join(PHASES))
    a("--draw", choices=["cycle", "random"], default="cycle", help="cycle through the lists or draw with --seed")
    a("--seed", type=int, default=0, help="seed of the random draws (--draw random, target 'random')")
    a("--new-tokens", type=int, default=12, help="tokens per request (ignore_eos), at least 4")
    a("--base-requests", type=int, default=2, help="greedy base-model requests per round")
    a("--request-timeout", type=float, default=120.0, help="a request without an answer this long is hung")
    a("--recover-timeout", type=float, default=180.0, help="seconds to wait for a healthy cluster between rounds")
    a("--ready-timeout", type=float, default=300.0, help="seconds to wait for the cluster to start")
    a("--prefill-delay", type=float, default=0.0, help="prefill phase: seconds between submitting and the kill")
    a("--load-delay", type=float, default=0.02, help="lora-load phase: seconds between sending the load and the kill")
    a("--log", default="", help="write the cluster log to this file and keep it (default: a temp file, removed)")
    a("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    a(
        "--subreaper",
        action="store_true",
        help="make the drill a child subreaper (prctl PR_SET_CHILD_SUBREAPER), as docker --init is, and reap the "
        "orphans a killed launcher leaves",
    )
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The drill's own arguments and the ``launch.py`` flags after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace, flags: list[str]) -> argparse.Namespace:
    """Validate the drill's flags and parse the launch flags; exits 2 (argparse) on a mistake."""
    import launch

    if any(f == "--zmq-endpoint" or f.startswith("--zmq-endpoint=") for f in flags):
        p.error("the drill chooses its own --zmq-endpoint; do not pass one")
    try:
        ns = launch.build_parser().parse_args(flags)
    except SystemExit:
        p.error("the launch.py flags after -- are not valid (see above)")
    a.targets_list, a.signal_list, a.phase_list = expand(a.targets), expand(a.signals), expand(a.phases)
    if not (a.targets_list and a.signal_list and a.phase_list):
        p.error("--targets, --signals and --phases need at least one entry each")
    for t in a.targets_list:
        m = re.fullmatch(r"gpu_worker\[(\d+)\]", t)
        if m is None and t not in ("random", *TARGETS):
            p.error(f"unknown target {t!r}: use gpu_worker[N], random, " + ", ".join(TARGETS))
        if m is not None and int(m.group(1)) >= ns.tp_size:
            p.error(f"target {t} does not exist at --tp-size {ns.tp_size}")
    for s in a.signal_list:
        if f"SIG{s}" not in signal.Signals.__members__:
            p.error(f"unknown signal {s!r} (use names without SIG: KILL, TERM, SEGV, STOP, ...)")
    for ph in a.phase_list:
        if ph not in PHASES:
            p.error(f"unknown phase {ph!r}: use " + ", ".join(PHASES))
    if "lora-load" in a.phase_list and not (ns.enable_lora and ns.lora_paths):
        p.error("phase lora-load needs --enable-lora and at least one --lora-paths adapter after --")
    if a.new_tokens < DECODE_CHUNKS + 1:
        p.error(f"--new-tokens must be at least {DECODE_CHUNKS + 1} (the decode phase kills after {DECODE_CHUNKS})")
    if a.rounds < 1 or a.base_requests < 0:
        p.error("--rounds must be at least 1 and --base-requests at least 0")
    if a.subreaper and not sys.platform.startswith("linux"):
        p.error("--subreaper needs Linux")
    a.launch = ns
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the drill; 0 when nothing hung or was wrong, every killed launcher left nothing behind and the cluster
    survived, else 1 (2: bad flags)."""
    own, flags = split_argv(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = check_args(p, p.parse_args(own), flags)
    ns = a.launch
    if not any(f.startswith("--crash-loop-deaths") for f in flags):
        flags = [*flags, "--crash-loop-deaths", str(a.rounds + 1)]
    strict = ns.dtype in STRICT_DTYPES and ns.quantization == "none"
    out = sys.stderr if a.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    if a.subreaper:
        become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="loom-drill-"))
    log_path = Path(a.log).resolve() if a.log else work / "cluster.log"
    cluster = Cluster(flags, ns.tp_size, work, log_path)
    drill = Drill(cluster, a, strict, ns.lora_root)
    plans = make_plans(a.rounds, a.targets_list, a.signal_list, a.phase_list, a.draw, a.seed)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    error = ""
    try:
        t0 = time.monotonic()
        cluster.start(a.ready_timeout)
        drill.reference()
        say(
            f"Loom failover drill: {a.rounds} rounds, tp_size={ns.tp_size}, dtype={ns.dtype} "
            f"({'tokens must match exactly' if strict else 'mismatches count as diverged'}), "
            f"{len(drill.workload_all)} requests x {a.new_tokens} tokens per round; cluster ready and reference "
            f"done in {time.monotonic() - t0:.1f} s{'; the drill is a child subreaper' if a.subreaper else ''}; "
            f"log: {log_path}"
        )
        say(HEADER)
        for plan in plans:
            r = drill.run_round(plan)
            drill.rounds.append(r)
            say(row(r))
            if drill.died or drill.error:
                break
        error = drill.error or ""
    except (DrillError, ClusterDied, LoomError) as e:
        error = str(e)
        if isinstance(e, ClusterDied):
            drill.died = error
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        tail = cluster.log().splitlines()[-40:]
        cluster.stop()
        for d in drill.cleanup_dirs:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    s = summarize(drill.rounds, drill.died)
    if error:
        s["ok"] = False
        s["error"] = error
    for line in summary_lines(s):
        say(line)
    if error and error != drill.died:
        say(f"error: {error}")
    if not s["ok"]:
        say("last lines of the cluster log:\n  " + "\n  ".join(tail))
    if a.json:
        doc = {
            "config": {
                "rounds": a.rounds,
                "targets": a.targets_list,
                "signals": a.signal_list,
                "phases": a.phase_list,
                "draw": a.draw,
                "seed": a.seed,
                "new_tokens": a.new_tokens,
                "tp_size": ns.tp_size,
                "subreaper": a.subreaper,
                "dtype": ns.dtype,
                "strict": strict,
                "launch_flags": flags,
                "workload": [{"label": w.label, "stream": w.stream, "lora": w.lora} for w in drill.workload_all],
            },
            "cluster": {
                "launcher_pid": cluster.proc.pid if cluster.proc else None,
                "launcher_pids": cluster.launchers,
                "generations": cluster.generation,
                "pids": {str(pid): name for pid, (name, _) in cluster.seen.items()},
                "config_file": cluster.config_file,
                "config_files": cluster.config_files,
                "endpoint": cluster.endpoint,
                "work_dir": str(work),
                "log": str(log_path) if a.log else None,
            },
            "rounds": [asdict(r) for r in drill.rounds],
            "summary": s,
        }
        print(json.dumps(doc, indent=2), flush=True)
    return 0 if s["ok"] else 1


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
