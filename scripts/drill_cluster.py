"""The failover drill's cluster: a ``launch.py`` it starts, watches through /proc and the log, and stops; and the
check that a killed launcher left nothing behind (children, socket folder, front socket, /dev/shm entries).

Imported by ``failover_drill.py``, which puts the repository on ``sys.path``. Linux only (/proc, prctl).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from ipc.client import LoomClient, LoomError
from ipc.proc import set_parent_death_signal

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")
SERVICES = ("scheduler_proc", "tokenizer_proc")  # restarted on their own by the launcher
SHM = Path("/dev/shm")
CHILDREN_GONE_LIMIT_S = 2.0  # a killed launcher's children must all have exited this soon (parent-death signals)
ORDERLY_STOP_LIMIT_S = 12.0  # SIGTERM / SIGINT: the launcher stops them itself (10 s grace, then SIGKILL)
ORDERLY = {"TERM", "INT"}
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
# signals whose default action does not end a process (a launcher sent one of these survives)
NON_FATAL = {"STOP", "TSTP", "TTIN", "TTOU", "CONT", "CHLD", "URG", "WINCH"}

_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
RESTART = re.compile(r"restarting the TP group as epoch (\d+)")
_HUNG = re.compile(r"TP group epoch (\d+) is hung")
_SERVICE_RESTART = re.compile(r"(\S+) exited with code .*; restarting it as incarnation (\d+)")
_SERVICE_HUNG = re.compile(r"(\S+) \(pid \d+\) sent no heartbeat for [\d.]+ s: hung")
_GROUP_UP = re.compile(r"TP group epoch \d+ is up in ([\d.]+) s")
_BACK = re.compile(r"(\S+) is back \(pid \d+\) in ([\d.]+) s")
_SERVING = re.compile(
    r"TP group epoch (\d+) serving again: (\d+) requests resumed, adapters restored \[(.*?)\], lost \[(.*?)\] "
    r"\(([\d.]+) s\)"
)
_STOPPING = re.compile(r"exited with code .*; stopping the cluster|failed \d+ times within|received; shutting down")
_WORKER_DETECT = (RESTART, _HUNG, _SERVICE_RESTART, _STOPPING)


class DrillError(RuntimeError):
    """The drill cannot go on (the cluster did not start, or its reference run failed)."""


class ClusterDied(RuntimeError):
    """The launcher exited: the cluster is gone."""


# ----------------------------------------------------------------------------- processes (Linux /proc)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def pid_state(pid: int) -> str | None:
    """The process state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...) or None if there is none."""
    f = _stat_fields(pid)
    return f[0] if f else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    return pid_state(pid) not in (None, "Z")


def cmdline(pid: int) -> list[str]:
    """The argument vector of ``pid`` (empty if it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def parents() -> dict[int, int]:
    """``{pid: ppid}`` of every process now."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (f := _stat_fields(int(d.name))):
            out[int(d.name)] = int(f[1])
    return out


def children_of(ppid: int) -> list[int]:
    """Direct children of ``ppid``."""
    return [p for p, pp in parents().items() if pp == ppid]


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, their children, ...)."""
    kids: dict[int, list[int]] = {}
    for p, pp in parents().items():
        kids.setdefault(pp, []).append(p)
    out, todo = [], list(kids.get(root, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def become_subreaper() -> None:
    """Make this process a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), as ``docker --init``'s init is:
    orphans below it re-parent to it instead of to pid 1, and it must reap them."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (``prctl(PR_GET_CHILD_SUBREAPER)``)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    flag = ctypes.c_int(0)
    return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value != 0


def reap_orphans(keep: set[int]) -> dict[int, int]:
    """Reap this process's zombie children except ``keep`` (the Popen objects that reap their own); returns
    ``{pid: exit code}`` (negative: killed by that signal) of those reaped. Only a subreaper gets children it
    did not start."""
    reaped = {}
    for pid in children_of(os.getpid()):
        if pid in keep or pid_state(pid) != "Z":
            continue
        with contextlib.suppress(ChildProcessError):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got == pid:
                reaped[pid] = os.waitstatus_to_exitcode(status)
    return reaped


def shm_entries() -> set[str]:
    """Names in /dev/shm now."""
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def shm_held_by_others(names: set[str], ours: set[int]) -> set[str]:
    """Those of ``names`` that a live process outside ``ours`` has open or mapped (another program's)."""
    if not names:
        return set()
    paths = {str(SHM / n): n for n in names}
    held = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in ours:
            continue
        with contextlib.suppress(OSError):
            for fd in (d / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if (target := os.readlink(fd)) in paths:
                        held.add(paths[target])
        with contextlib.suppress(OSError):
            for line in (d / "maps").read_text().splitlines():
                if "/dev/shm/" in line and (target := line.split(maxsplit=5)[-1]) in paths:
                    held.add(paths[target])
    return held


def describe_exit(code: int | None) -> str:
    """``"1"`` for an exit code, ``"-9 (SIGKILL)"`` for a death by signal 9, ``"running"`` for None."""
    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)


# ----------------------------------------------------------------------------- the cluster log


def log_time(line: str) -> float | None:
    """Wall-clock seconds of a log line's ``%(asctime)s`` prefix (local time, ms), or None."""
    m = _TS.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class LogFacts:
    """What the cluster log says happened after a kill."""

    detect_line: str = ""
    detect_wall: float | None = None
    up_s: float | None = None  # "TP group epoch N is up in X s", or "NAME is back (pid P) in X s" for a service
    serving_s: float | None = None  # scheduler: "... serving again ... (X s)"
    resumed: int | None = None
    restored_log: str = ""
    lost_log: str = ""
    stopping_line: str = ""
    also: list[str] = field(default_factory=list)  # other processes restarted meanwhile ("TP group", a service)


def scan_log(text: str, process: str = "") -> LogFacts:
    """The detection, up-again, serving-again and cluster-stopping lines in ``text`` for a kill of ``process``.

    A TP rank (``gpu_worker[N]``, or no process given): the first TP group restart, TP group hung, service
    restart or cluster-stopping line, and "TP group epoch N is up". A service (``scheduler_proc``,
    ``tokenizer_proc``): the first line naming it among "NAME (pid P) sent no heartbeat ...: hung" and "NAME exited
    with code ...; restarting it as incarnation N", and "NAME is back (pid P) in X s"; restarts of other processes
    meanwhile are listed in ``also``.
    """
    f = LogFacts()
    service = process in SERVICES
    for line in text.splitlines():
        found = False
        if service:
            m = _SERVICE_HUNG.search(line) or _SERVICE_RESTART.search(line)
            if m is not None and m.group(1) == process:
                found = True
            elif m is not None and _SERVICE_RESTART.search(line) and m.group(1) not in f.also:
                f.also.append(m.group(1))
            elif (RESTART.search(line) or _HUNG.search(line)) and "TP group" not in f.also:
                f.also.append("TP group")
            if f.up_s is None and (b := _BACK.search(line)) and b.group(1) == process:
                f.up_s = float(b.group(2))
        else:
            found = any(p.search(line) for p in _WORKER_DETECT)
            if f.up_s is None and (m := _GROUP_UP.search(line)):
                f.up_s = float(m.group(1))
        if not f.detect_line and (found or _STOPPING.search(line)):
            f.detect_line, f.detect_wall = line, log_time(line)
        if f.serving_s is None and (m := _SERVING.search(line)):
            f.resumed, f.restored_log, f.lost_log = int(m.group(2)), m.group(3), m.group(4)
            f.serving_s = float(m.group(5))
        if not f.stopping_line and _STOPPING.search(line):
            f.stopping_line = line
    return f


def services_restarting(text: str) -> list[str]:
    """Services whose last restart line in ``text`` has no "is back" line after it yet."""
    back: dict[str, bool] = {}
    for line in text.splitlines():
        if m := _SERVICE_RESTART.search(line):
            back[m.group(1)] = False
        elif m := _BACK.search(line):
            back[m.group(1)] = True
    return sorted(n for n, ok in back.items() if not ok)


# ----------------------------------------------------------------------------- the drill's own admin calls


def call_admin(endpoint: str, fn: Callable[[LoomClient], T], patience_s: float = 30.0, timeout_s: float = 60.0) -> T:
    """``fn(client)`` on a fresh LoomClient, again while the front door is ``unavailable`` (down or restarting)
    for up to ``patience_s``; other LoomErrors, and ``unavailable`` after that, are raised."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            with LoomClient(endpoint, timeout_s=timeout_s) as c:
                return fn(c)
        except LoomError as e:
            if e.kind != "unavailable" or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


# ----------------------------------------------------------------------------- the cluster


def _launcher_preexec() -> None:
    """In the launcher before exec: its own session, and SIGTERM (a clean stop) if the drill dies."""
    os.setsid()
    set_parent_death_signal()


@dataclass
class Snapshot:
    """The cluster just before its launcher is signalled: every process below it, its folders and sockets."""

    launcher: int
    pids: dict[int, str]  # pid -> name
    socket_dir: str
    front: str
    shm_baseline: set[str]  # /dev/shm when this cluster started
    mono: float = 0.0  # time.monotonic() just before the signal


class Cluster:
    """A ``launch.py`` started by the drill: its own session, a private endpoint, its log in a file.

    After its launcher is killed, :meth:`start` (or :meth:`astart`) starts a fresh one with the same flags and
    endpoint (a new *generation*); the log file goes on (epochs are read from the current generation's part).
    """

    def __init__(self, flags: list[str], tp_size: int, work: Path, log_path: Path) -> None:
        self.flags = flags
        self.tp_size = tp_size
        self.work = work
        self.endpoint = f"ipc://{work}/front.sock"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.generation = 0
        self.log_start = 0  # where the current generation's part of the log begins
        self.config_file = ""
        self.config_files: list[str] = []
        self.launchers: list[int] = []
        self.shm_baseline: set[str] = set()
        self.seen: dict[int, tuple[str, str]] = {}  # every child pid ever seen -> (name, its config file)
        self.spawned_at = 0.0
        self.reaped: dict[int, int] = {}  # orphans the drill reaped as a subreaper -> exit code

    # -------------------------------------------------------------- start / stop
    def _spawn(self) -> None:
        """Start launch.py (appending to the log after the first generation)."""
        self.generation += 1
        self.config_file = ""
        self.shm_baseline = shm_entries()
        cmd = [sys.executable, str(REPO / "launch.py"), "--zmq-endpoint", self.endpoint, *self.flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb" if self.generation == 1 else "ab") as logf:
            if self.generation > 1:
                logf.write(f"---- failover drill: fresh cluster (generation {self.generation}) ----\n".encode())
                logf.flush()
            self.log_start = logf.tell()
            self.proc = subprocess.Popen(
                cmd, cwd=str(REPO), stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=_launcher_preexec
            )
        self.launchers.append(self.proc.pid)
        self.spawned_at = time.monotonic()

    def _ready(self, timeout_s: float) -> bool:
        """Whether the launcher printed "Loom ready:"; raises DrillError if it exited or ``timeout_s`` passed."""
        assert self.proc is not None
        self.children()
        if "Loom ready:" in self.log_since(self.log_start):
            self.children()
            return True
        if self.proc.poll() is not None:
            raise DrillError(f"launch.py exited with code {self.proc.returncode} before it was ready")
        if time.monotonic() - self.spawned_at > timeout_s:
            raise DrillError(f"launch.py did not print 'Loom ready:' within {timeout_s:g} s")
        return False

    def start(self, ready_timeout_s: float) -> None:
        """Start launch.py and wait for "Loom ready:". Raises DrillError if it fails."""
        self._spawn()
        while not self._ready(ready_timeout_s):
            time.sleep(0.2)

    async def astart(self, ready_timeout_s: float) -> float:
        """:meth:`start` without blocking the event loop (requests in flight keep being served); returns the
        seconds it took."""
        self._spawn()
        while not self._ready(ready_timeout_s):
            await asyncio.sleep(0.2)
        return time.monotonic() - self.spawned_at

    def stop(self) -> None:
        """Stop the cluster (SIGINT, then SIGKILL for stragglers) and remove its sockets and config folders."""
        for pid in self._ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a process left stopped would hold up the launcher's shutdown
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while self._ours() and time.monotonic() < deadline:  # children stop on their own once the launcher is gone
            self.reap()
            time.sleep(0.1)
        for pid in self._ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        self.reap()
        for cf in self.config_files:
            shutil.rmtree(Path(cf).parent, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.endpoint[len("ipc://") :])

    def _ours(self) -> list[int]:
        """Child pids seen so far that still run their cluster's config (never a reused pid)."""
        return [p for p, (_, cf) in self.seen.items() if pid_alive(p) and cf in cmdline(p)]

    def reap(self) -> None:
        """Reap orphans re-parented to the drill (when it is a subreaper), never the current launcher (its
        Popen reaps it); their exit codes go to :attr:`reaped`."""
        self.reaped.update(reap_orphans({self.proc.pid} if self.proc is not None else set()))

    # -------------------------------------------------------------- state
    def alive(self) -> bool:
        """Whether the launcher still runs."""
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        """The cluster log so far (every generation)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        """Bytes in the cluster log now (where a later :meth:`log_since` starts)."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        """The cluster log from byte ``offset`` on."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def epoch(self) -> int:
        """The TP group epoch the current launcher last started (1 until its first restart)."""
        return max((int(m.group(1)) for m in RESTART.finditer(self.log_since(self.log_start))), default=1)

    def children(self) -> dict[str, tuple[int, int]]:
        """``{name: (pid, number)}`` of the launcher's children now: worker names ``gpu_worker[N]`` with their
        TP group epoch, ``scheduler_proc`` / ``tokenizer_proc`` with their incarnation."""
        out: dict[str, tuple[int, int]] = {}
        if self.proc is None:
            return out
        for pid in children_of(self.proc.pid):
            cmd = cmdline(pid)
            if "--config-file" not in cmd:
                continue
            cf = cmd[cmd.index("--config-file") + 1]
            if cf != self.config_file:
                self.config_file = cf
                self.config_files.append(cf)
            if "gpu_worker.main" in cmd:
                name = f"gpu_worker[{cmd[cmd.index('--rank') + 1]}]"
                number = int(cmd[cmd.index("--epoch") + 1]) if "--epoch" in cmd else 0
            else:
                name = next((m.split(".")[0] for m in cmd if m.endswith("_proc.main")), f"pid{pid}")
                number = int(cmd[cmd.index("--incarnation") + 1]) if "--incarnation" in cmd else 1
            if name in out and out[name][1] >= number:
                continue
            out[name] = (pid, number)
            self.seen[pid] = (name, cf)
        return out

    def workers_ready(self) -> dict[str, int] | None:
        """Worker pids of the current epoch if every rank runs (none stopped), else None."""
        epoch = self.epoch()
        kids = self.children()
        out = {}
        for r in range(self.tp_size):
            pid, e = kids.get(f"gpu_worker[{r}]", (0, -1))
            if e != epoch or pid_state(pid) not in ("R", "S", "D"):
                return None
            out[f"gpu_worker[{r}]"] = pid
        return out

    def died(self) -> ClusterDied:
        """A ClusterDied naming the launcher's exit code and the log line that says why."""
        code = self.proc.poll() if self.proc else None
        how = f"was killed by {signal.Signals(-code).name}" if code and code < 0 else f"exited with code {code}"
        why = scan_log(self.log_since(self.log_start)).stopping_line or "no reason in the log"
        return ClusterDied(f"launch.py {how}: {why.strip()}")

    def wait_serving(self, timeout_s: float) -> dict[str, int]:
        """Wait until every rank of the current epoch runs, no service is stopped or waiting to be back from a
        restart, and health says ok; returns ``{name: pid}`` of every child. Raises ClusterDied if the launcher
        exits, DrillError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        why = ""
        while True:
            if not self.alive():
                raise self.died()
            workers = self.workers_ready()
            kids = {n: p for n, (p, _) in self.children().items()}
            pending = services_restarting(self.log_since(self.log_start))
            stopped = sorted(n for n in SERVICES if n in kids and pid_state(kids[n]) == "T")
            if workers is None:
                why = "not every rank of the current TP group epoch is running"
            elif pending or stopped or not all(n in kids for n in SERVICES):
                why = f"restarted but not back yet: {pending}" if pending else f"stopped or missing: {stopped}"
            else:
                try:
                    with LoomClient(self.endpoint, timeout_s=5) as c:
                        c.health()
                    return {**kids, **workers}
                except LoomError as e:  # the front door is down or restarting, or the TP group is
                    why = f"health: {e}"
            if time.monotonic() > deadline:
                raise DrillError(f"the cluster did not become healthy within {timeout_s:g} s ({why})")
            time.sleep(0.2)

    # -------------------------------------------------------------- the launcher's death
    def snapshot(self) -> Snapshot:
        """Every process below the launcher, the socket folder and the front socket (before signalling it)."""
        assert self.proc is not None
        self.children()
        names = {p: n for p, (n, _) in self.seen.items()}
        pids = {p: names.get(p, " ".join(cmdline(p)[:3])[:60] or f"pid{p}") for p in descendants(self.proc.pid)}
        sock_dir = str(Path(self.config_file).parent) if self.config_file else ""
        return Snapshot(self.proc.pid, pids, sock_dir, self.endpoint[len("ipc://") :], set(self.shm_baseline))


@dataclass
class LauncherDeath:
    """What a signalled launcher did and left: its exit, how fast every process below it followed, and
    anything left behind; then how long the fresh cluster took to start."""

    signal: str
    exit: str = ""  # describe_exit() of the launcher ("running" if it survived the signal)
    survived: bool = False
    children: dict[str, str] = field(default_factory=dict)  # pid -> name, every process below the launcher
    exits: dict[str, str] = field(default_factory=dict)  # pid -> describe_exit(), of those the drill reaped
    gone_s: float | None = None  # signal -> the last of them gone (None: some were still running at the end)
    limit_s: float = CHILDREN_GONE_LIMIT_S  # ORDERLY_STOP_LIMIT_S for SIGTERM / SIGINT (the launcher's own stop)
    left: list[str] = field(default_factory=list)  # "name (pid P)" still running after limit_s
    socket_dir: str = ""
    socket_dir_left: bool = False
    front_left: bool = False
    shm_left: list[str] = field(default_factory=list)
    clean: bool = False
    restart_s: float | None = None  # the fresh cluster: start -> "Loom ready:"
    restart_error: str = ""

    def summary(self) -> str:
        """One phrase for the table's notes, e.g. "children gone in 0.41 s, nothing left"."""
        if self.survived:
            return f"launcher survived SIG{self.signal} (the cluster kept serving)"
        n = len(self.children)
        head = f"{n} children gone in {self.gone_s:.2f} s" if self.gone_s is not None else f"{n} children"
        if self.signal in ORDERLY:
            head += " (the launcher's own stop)"
        bad = []
        if self.gone_s is not None and self.gone_s > self.limit_s:
            bad.append(f"slower than {self.limit_s:g} s")
        if self.left:
            bad.append(f"still running after {self.limit_s:g} s: {', '.join(self.left)}")
        if self.socket_dir_left:
            bad.append(f"socket folder {self.socket_dir} left")
        if self.front_left:
            bad.append("front socket file left")
        if self.shm_left:
            bad.append(f"/dev/shm left: {', '.join(self.shm_left)}")
        if bad and self.exits:
            bad.append("exits: " + ", ".join(f"{self.children[p]} {e}" for p, e in sorted(self.exits.items())))
        return f"{head}, " + ("; ".join(bad) if bad else "nothing left")


async def watch_launcher_death(cluster: Cluster, snap: Snapshot, sig: str) -> LauncherDeath:
    """After the launcher got ``sig``: wait (polling every 10 ms, reaping orphans) until it and every process
    below it are gone, then check the socket folder, the front socket and /dev/shm. Every process must be gone
    within 2 s (their parent-death signals), or 12 s after SIGTERM / SIGINT (the launcher stops them itself, with
    a 10 s grace). A launcher still running after 1 s (a stop or ignored signal) or that limit + 8 s counts as
    having survived the signal."""
    assert cluster.proc is not None
    d = LauncherDeath(sig, children={str(p): n for p, n in snap.pids.items()}, socket_dir=snap.socket_dir)
    d.limit_s = ORDERLY_STOP_LIMIT_S if sig in ORDERLY else CHILDREN_GONE_LIMIT_S
    patience = 1.0 if sig in NON_FATAL else d.limit_s + 8.0
    while True:
        cluster.reap()
        now = time.monotonic() - snap.mono
        code = cluster.proc.poll()
        alive = [p for p in snap.pids if pid_alive(p)]
        if now > d.limit_s and not d.left:  # recorded once, at the limit
            d.left = [f"{snap.pids[p]} (pid {p})" for p in alive]
        if not alive and d.gone_s is None:
            d.gone_s = round(now, 3)
        if (code is not None and not alive) or now > patience:
            break
        await asyncio.sleep(0.01)
    d.exit = describe_exit(code)
    # a subreaper gets every orphan's exit status: wait for the last ones (a process counts as gone once its
    # main thread is a zombie, but cannot be reaped before its other threads are gone too)
    until = time.monotonic() + (1.0 if is_subreaper() else 0.0)
    while True:
        cluster.reap()
        if all(p in cluster.reaped for p in snap.pids) or time.monotonic() > until:
            break
        await asyncio.sleep(0.01)
    d.exits = {str(p): describe_exit(cluster.reaped[p]) for p in snap.pids if p in cluster.reaped}
    if code is None:
        d.survived = True
        return d
    if alive:  # still running at the end of the patience: not gone at all
        d.gone_s = None
    d.socket_dir_left = bool(snap.socket_dir) and Path(snap.socket_dir).exists()
    d.front_left = Path(snap.front).exists()
    new = shm_entries() - snap.shm_baseline
    d.shm_left = sorted(new - shm_held_by_others(new, set(snap.pids)))
    d.clean = (
        d.gone_s is not None
        and d.gone_s <= d.limit_s
        and not (d.left or d.socket_dir_left or d.front_left or d.shm_left)
    )
    # clear what is left so the fresh cluster can start (it was recorded above)
    for p in alive:
        if pid_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    if d.socket_dir_left:
        shutil.rmtree(snap.socket_dir, ignore_errors=True)
    if d.front_left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(snap.front)
    return d
