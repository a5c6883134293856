"""ZMQ socket helpers shared by every process: creation with safe defaults, start-up reports."""

from __future__ import annotations

import os
import time

import zmq

from ipc.codec import Codec
from ipc.messages import ControlMsg, Heartbeat, ProcFailed, ProcReady

CONTROL_CODEC: Codec = Codec(ControlMsg)


# The largest frame a client may send to the front door (ZMQ_MAXMSGSIZE on its ROUTER; the clients refuse a
# bigger request before sending it). The same bound as an HTTP body. A frame over it never reaches Python: libzmq
# reads the size header and closes that connection. The longest prompt SmolLM2 can take (8,191 tokens of at most
# 81 characters, 4 UTF-8 bytes each) is 2.7 MB.
MAX_FRAME_BYTES = 8 * 2**20

# Between processes no socket drops: a queue whose producer bounds what it sends (the front door bounds its
# requests by --max-queued-requests, the scheduler sends one message per step) has no high-water mark, so a
# paused or restarting peer never makes a message vanish at ZeroMQ's default of 1,000.
UNBOUNDED = 0


def make_socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    options: dict[int, int] | None = None,
) -> zmq.Socket:
    """A socket with ``linger=0`` (closing never blocks on unsent data), bound or connected to ``endpoint``.

    ``options`` are set before binding or connecting (high-water marks only apply to pipes made after them).
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # sending to a peer that is gone raises EHOSTUNREACH instead of silently dropping
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    for opt, value in (options or {}).items():
        sock.setsockopt(opt, value)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def report_to_launcher(ctx: zmq.Context, control: str, msg: ProcReady | ProcFailed) -> None:
    """Send one READY/FAILED report to the launcher's control socket (best effort, 5 s at most)."""
    sock = make_socket(ctx, zmq.PUSH, control, bind=False)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    try:
        sock.send(CONTROL_CODEC.encode(msg))
    except zmq.ZMQError:
        pass
    finally:
        sock.setsockopt(zmq.LINGER, 2000)  # let the report leave before the socket goes
        sock.close()


def ready(ctx: zmq.Context, control: str, name: str, **facts: object) -> None:
    """Tell the launcher process ``name`` is up, with ``facts`` for its log."""
    report_to_launcher(ctx, control, ProcReady(name=name, pid=os.getpid(), facts=dict(facts)))


def failed(ctx: zmq.Context, control: str, name: str, error: str) -> None:
    """Tell the launcher process ``name`` could not start and why."""
    report_to_launcher(ctx, control, ProcFailed(name=name, pid=os.getpid(), error=error))


HEARTBEAT_INTERVAL_S = 1.0


class HeartbeatSender:
    """Sends :class:`Heartbeat` to the launcher at most every ``HEARTBEAT_INTERVAL_S``; call :meth:`beat`
    from the process's main loop (a hung loop stops beating, and the launcher restarts the process)."""

    def __init__(self, ctx: zmq.Context, control: str, name: str) -> None:
        self.sock = make_socket(ctx, zmq.PUSH, control, bind=False)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.frame = CONTROL_CODEC.encode(Heartbeat(name, os.getpid()))
        self.last = 0.0

    def beat(self) -> None:
        """Send a heartbeat if the last one is older than the interval (never blocks)."""
        now = time.monotonic()
        if now - self.last >= HEARTBEAT_INTERVAL_S:
            self.last = now
            try:
                self.sock.send(self.frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        """Close the socket."""
        self.sock.close(0)
