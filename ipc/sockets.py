"""ZMQ socket helpers shared by every process: creation with safe defaults, start-up reports."""

from __future__ import annotations

import os

import zmq

from ipc.codec import Codec
from ipc.messages import ControlMsg, ProcFailed, ProcReady

CONTROL_CODEC: Codec = Codec(ControlMsg)


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool, identity: bytes | None = None) -> zmq.Socket:
    """A socket with ``linger=0`` (closing never blocks on unsent data), bound or connected to ``endpoint``."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # sending to a peer that is gone raises EHOSTUNREACH instead of silently dropping
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
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
