"""Process plumbing shared by every Loom process: config hand-off, signals, parent-death watch."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import msgspec

from ipc.config import ServerArgs

# the launcher that started this process (set by child_setup): once the parent differs (re-parented to init or
# to a subreaper such as `docker --init`), the launcher is dead
_launcher_pid: int | None = None


def launcher_gone() -> bool:
    """Whether the launcher that started this process has died (or is dying).

    The parent pid alone is not enough: Linux sends the parent-death signal when the launcher's *thread* that
    started us exits, and may first re-parent us to another of its threads (ZeroMQ's), so ``getppid()`` can
    still name a launcher that is already a zombie or exiting.
    """
    if _launcher_pid is None:
        return False
    if os.getppid() != _launcher_pid:
        return True
    try:
        with open(f"/proc/{_launcher_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & 0x4)  # state; flags & PF_EXITING


class StopRequested(BaseException):
    """Raised in the main loop when SIGTERM arrives (a BaseException so ``except Exception`` never eats it)."""


_stopping = False


def _raise_stop(signum: int, _frame: object) -> None:
    # one-shot: a second SIGTERM (the launcher's, after a ShutdownCmd already began the shutdown) must not
    # interrupt the cleanup with a traceback
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise StopRequested(signal.Signals(signum).name)


def child_setup(name: str) -> tuple[ServerArgs, argparse.Namespace]:
    """Common start of a child process: parse ``--config-file``, set logging and signal handlers.

    SIGTERM raises :class:`StopRequested` (the launcher's way to stop us); SIGINT is ignored because the
    launcher, not the terminal, decides when children stop. On Linux the child also asks the kernel for
    SIGTERM if the launcher dies, so a killed launcher never leaves orphans.
    """
    global _launcher_pid
    _launcher_pid = os.getppid()
    p = argparse.ArgumentParser(prog=name)
    p.add_argument("--config-file", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--epoch", type=int, default=1, help="TP group epoch (gpu_worker; +1 at every group restart)")
    p.add_argument("--dist-init", default="", help="torch.distributed rendezvous of this epoch (gpu_worker)")
    p.add_argument("--incarnation", type=int, default=1, help="1 at the first start, +1 at every restart")
    p.add_argument("--restarts", default="{}", help="JSON: the launcher's restart count per process")
    ns = p.parse_args()
    with open(ns.config_file, "rb") as f:
        args = msgspec.json.decode(f.read(), type=ServerArgs)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {name}{'' if name != 'gpu_worker' else ns.rank} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal()
    return args, ns


STOP_MARKER = "stopping"  # written into the socket folder by the launcher before it stops the cluster


def cluster_stopping(args: ServerArgs) -> bool:
    """Whether the whole cluster is going away (the launcher is stopping it, or is dead), as opposed to this
    process alone being stopped (the launcher will restart it)."""
    return launcher_gone() or os.path.exists(os.path.join(args.endpoints.socket_dir, STOP_MARKER))


def begin_cleanup(args: ServerArgs) -> None:
    """Start of a child's shutdown: ignore further SIGTERMs (the launcher may send one while we are already
    stopping, e.g. after a ShutdownCmd) and, if the launcher is gone (killed with SIGKILL), remove the
    socket folder and the front socket file it can no longer remove itself."""
    global _stopping
    _stopping = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if launcher_gone():
        import shutil

        shutil.rmtree(args.endpoints.socket_dir, ignore_errors=True)
        front = args.endpoints.front
        if front.startswith("ipc://"):
            try:
                os.unlink(front[len("ipc://") :])
            except OSError:
                pass


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` when the parent (the launcher) dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = _launcher_pid if _launcher_pid is not None else os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # parent already gone before prctl took effect
            os.kill(os.getpid(), sig)
    except OSError:
        pass
