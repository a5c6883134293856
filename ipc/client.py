"""Python clients for a Loom cluster's ZMQ front door (a DEALER talking to the tokenizer's ROUTER).

``generate`` returns SGLang's shape: ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens",
"completion_tokens", "finish_reason"}}``; server errors raise :class:`LoomError` carrying the server's text.

Noticing a server that is gone: the DEALER sends a ZMTP heartbeat PING every 0.5 s (libzmq on the server's
ROUTER answers with a PONG by itself, whatever the server process is doing) and a socket monitor reports when
a connection's handshake succeeds and when it drops. A server killed outright drops the connection at once;
one that stops answering (frozen, or a dead network path) is dropped after 1.5 s without a PONG. Then:

- A wait fails with :class:`LoomError` kind ``unavailable``, naming the endpoint, once there has been no
  connection for ``connect_timeout_s`` (2.5 s): an endpoint where nothing listens fails within that time.
- Requests in flight when a connection drops are resubmitted (``retry``) or fail with ``unavailable`` at once.
  ``retry`` defaults to on for greedy (``temperature == 0``) and seeded requests, whose resubmission reproduces
  the same tokens, and off otherwise; set it per client or per call. A resubmitted request keeps its request id
  and goes out over a fresh connection as soon as the server is back; if the server does not come back within
  ``retry_window_s`` (30 s) of the drop, it fails with ``unavailable``. A resubmitted stream yields only chunks
  that extend what it already yielded, and raises ``server_error`` if the regenerated output diverges from it.
  A server never reached by this client gets no retry window: requests fail after ``connect_timeout_s``.

Every request gets exactly one terminal reply. A front door with ``--max-queued-requests`` requests queued
answers more with kind ``overloaded`` (retry later); a request frame over ``MAX_FRAME_BYTES`` (8 MiB) is refused
here with ``bad_request`` before it is sent. Replies that match no request in flight (a late chunk of an aborted
stream, the error for a frame of ``send_raw``) are skipped, never handed to another call, and so are the empty
frames the server sends to check that a client with requests in flight is still there. Closing a stream, at any
point (even before its first chunk), aborts its request on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ipc.codec import Codec, WireError
from ipc.messages import (
    AbortReq,
    AdminOut,
    ClientMsg,
    ErrorOut,
    GenerateOut,
    GenerateReq,
    HealthReq,
    ListLorasReq,
    LoadLoraReq,
    LoraListOut,
    ServerMsg,
    UnloadLoraReq,
)
from ipc.sockets import MAX_FRAME_BYTES

log = logging.getLogger("loom.client")
DEFAULT_ENDPOINT = "ipc:///tmp/loom.sock"
CONNECT_TIMEOUT_S = 2.5  # no connection for this long: the server is unavailable
ABORT_SETTLE_S = 5.0  # how long a reused rid waits for its aborted predecessor's final reply
RETRY_WINDOW_S = 30.0  # how long a resubmittable request waits for a lost server to come back
HEARTBEAT_IVL_MS = 500  # a ZMTP PING this often
HEARTBEAT_TIMEOUT_MS = 1500  # no traffic this long after a PING: the connection is dropped
HEARTBEAT_TTL_MS = 10_000  # the server may drop this client after this long without hearing from it
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_NUDGE = object()  # put in async request queues when the connection state changes: waiters re-check deadlines


class LoomError(RuntimeError):
    """The server refused or failed a request, or cannot be reached.

    ``kind``: bad_request | not_found | server_error | timeout | unavailable (no connection to the server) |
    overloaded (the server has ``--max-queued-requests`` requests queued: retry later).
    """

    def __init__(self, message: str, kind: str = "server_error", rid: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.rid = rid


def _request(
    text: str | None,
    input_ids: list[int] | None,
    messages: list[dict[str, str]] | None,
    sampling_params: dict[str, Any] | None,
    stream: bool,
    lora_path: str | None,
    rid: str | None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    allow_special_tokens_in_content: bool = False,
) -> GenerateReq:
    if rid == "":  # as the server refuses it; None picks a fresh id
        raise LoomError("rid must not be empty (pass None for a fresh one)", "bad_request")
    fields = {
        "text": text,
        "input_ids": input_ids,
        "messages": messages,
        "sampling_params": sampling_params or {},
        "stream": stream,
        "lora_path": lora_path,
        "rid": uuid.uuid4().hex if rid is None else rid,
        "return_logprob": return_logprob,
        "top_logprobs_num": top_logprobs_num,
        "allow_special_tokens_in_content": allow_special_tokens_in_content,
    }
    try:  # the whole request at once, so an error names the field's full path ($.sampling_params.top_k)
        return msgspec.convert(fields, GenerateReq)
    except msgspec.ValidationError as e:
        raise LoomError(f"invalid request: {e}", "bad_request") from None


def _result(msg: GenerateOut) -> dict[str, Any]:
    return {"text": msg.text, "output_ids": msg.output_ids, "meta_info": msgspec.to_builtins(msg.meta_info)}


class _Conn:
    """One DEALER connected to the endpoint, with heartbeats, and a monitor socket reporting its link events.

    ``io`` and ``events`` are blocking-API views of ``sock`` and ``mon`` (the sockets themselves in a sync
    context, shadows in an asyncio one) for non-blocking reads and sends from synchronous code.
    Raises zmq.ZMQError for a malformed endpoint (after closing what it opened).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # requests are never refused or dropped here: the caller bounds what it sends, and resubmitting every
        # request in flight after a lost connection must not fail at ZeroMQ's default high-water mark of 1,000
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
        self.mon = self.sock.get_monitor_socket(_LINK_EVENTS, addr=f"inproc://loom-client-{uuid.uuid4().hex}")
        shadowed = isinstance(self.sock, zmq.asyncio.Socket)
        self.io = zmq.Socket.shadow(self.sock.underlying) if shadowed else self.sock
        self.events = zmq.Socket.shadow(self.mon.underlying) if shadowed else self.mon
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    def close(self) -> None:
        """Stop the monitor and close both sockets (unsent messages are dropped)."""
        if not self.sock.closed:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
        self.mon.close()
        self.sock.close()


def _oversized_int(obj: object, path: str = "") -> str | None:
    """The dotted path of the first integer msgpack cannot hold in ``obj`` (a Struct, dict or list tree), or None."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return path if not -(2**63) <= obj < 2**64 else None
    if isinstance(obj, msgspec.Struct):
        items: Iterable[tuple[str, object]] = ((f, getattr(obj, f)) for f in obj.__struct_fields__)
    elif isinstance(obj, dict):
        items = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return None
    for key, value in items:
        found = _oversized_int(value, f"{path}.{key}" if path else key)
        if found:
            return found
    return None


def endpoint_problem(endpoint: object) -> str:
    """Why a client cannot reach a Loom server at ``endpoint`` ("" when it may): ZeroMQ itself takes a
    ``tcp://`` port past 65535 and ``inproc://`` (this process only), then waits on them as if the server were down."""
    if not isinstance(endpoint, str):
        return f"an endpoint is a string, not {type(endpoint).__name__}"
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme == "inproc":
        return "inproc:// reaches only sockets inside this process, never a Loom server"
    if sep and scheme == "tcp":
        port = rest.rpartition(":")[2]
        if port.isdigit() and not 0 < int(port) < 65536:
            return f"TCP port {port} is outside 1-65535"
    return ""


@dataclass
class _Flight:
    """A generate request sent and not yet finished, as the connection-loss handling sees it."""

    req: GenerateReq
    retry: bool
    explicit: bool  # retry was set by the caller or the client (not chosen from the sampling params)
    done: bool = False  # its final output or error has arrived: nothing to resubmit
    resumed: bool = False  # resubmitted at least once


class _Delivered:
    """What one stream already yielded; once resubmitted, it admits only chunks that extend that."""

    def __init__(self, endpoint: str, rid: str) -> None:
        self.endpoint = endpoint
        self.rid = rid
        self.ids: list[int] = []
        self.text = ""

    def admit(self, msg: GenerateOut, resumed: bool) -> bool:
        """Whether to yield ``msg``. Raises LoomError (server_error) if a resumed output diverged."""
        if resumed:
            ids = msg.output_ids
            n = min(len(ids), len(self.ids))
            if ids[:n] != self.ids[:n] or (msg.finished and len(ids) < len(self.ids)):
                raise self._diverged()
            if not msg.finished:
                if len(ids) <= len(self.ids) or len(msg.text) <= len(self.text):
                    return False  # regenerated output the caller has already seen
                if not msg.text.startswith(self.text):
                    raise self._diverged()
        self.ids = list(msg.output_ids)
        self.text = msg.text
        return True

    def _diverged(self) -> LoomError:
        return LoomError(
            f"request {self.rid!r} was resubmitted after the connection to {self.endpoint} was lost, and the "
            f"resumed output diverged from the {len(self.ids)} tokens already delivered",
            "server_error",
            self.rid,
        )


class _ClientBase:
    """Connection state, in-flight requests and their resubmission: what both clients share."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        timeout_s: float,
        retry: bool | None,
        connect_timeout_s: float,
        retry_window_s: float,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retry = retry
        self.connect_timeout_s = connect_timeout_s
        self.retry_window_s = retry_window_s
        self.out: Codec = Codec(ClientMsg)
        self.inc: Codec = Codec(ServerMsg)
        self._flights: dict[str, _Flight] = {}
        self._up = False  # a connection with a completed handshake exists
        self._ever_up = False
        self._down_since = time.monotonic()
        self._epoch = 0  # bumped each time the socket is replaced after a lost connection
        problem = endpoint_problem(endpoint)
        if not problem:
            try:
                self._conn = _Conn(ctx, endpoint)
            except zmq.ZMQError as e:
                problem = e.strerror
        if problem:
            ctx.term()
            raise LoomError(
                f"cannot use endpoint {endpoint!r}: {problem} (expected tcp://HOST:PORT or ipc:///PATH)",
                kind="bad_request",
            )

    @property
    def sock(self) -> zmq.Socket:
        """The DEALER socket of the current connection (replaced after a connection is lost)."""
        return self._conn.sock

    def _encode(self, msg: Any) -> bytes:
        """``msg`` as a frame. Raises LoomError (bad_request) over ``MAX_FRAME_BYTES``, which the server's socket
        would refuse by closing the connection, or for text UTF-8 cannot encode (a lone surrogate)."""
        try:
            frame = self.out.encode(msg)
        except UnicodeEncodeError as e:
            bad = e.object[e.start : e.end] if isinstance(e.object, str) else ""
            raise LoomError(
                f"the request holds text that is not valid Unicode: a lone surrogate "
                f"({', '.join(f'U+{ord(c):04X}' for c in bad)} at position {e.start}), which UTF-8 cannot encode",
                "bad_request",
                getattr(msg, "rid", "") or "",
            ) from None
        except OverflowError:  # msgpack holds integers in -2**63 .. 2**64 - 1
            where = _oversized_int(msg) or "a field"
            raise LoomError(
                f"{where} is an integer outside -2**63 .. 2**64 - 1, which no request field can hold",
                "bad_request",
                getattr(msg, "rid", "") or "",
            ) from None
        if len(frame) > MAX_FRAME_BYTES:
            raise LoomError(
                f"the request is {len(frame)} bytes; the server takes at most {MAX_FRAME_BYTES} bytes per request",
                "bad_request",
                getattr(msg, "rid", "") or "",
            )
        return frame

    def _known(self, msg: Any) -> bool:
        """Whether ``msg`` belongs to a request in flight; others are logged and skipped."""
        rid = getattr(msg, "rid", None)
        if rid in self._flights:
            return True
        if isinstance(msg, ErrorOut):
            log.warning("skipping an error that names no request in flight (rid %r): %s", rid, msg.message)
        return False

    def _start(self, req: GenerateReq, retry: bool | None) -> _Flight:
        choice = self.retry if retry is None else retry
        if choice is None:
            sp = req.sampling_params
            flight = _Flight(req, sp.temperature == 0 or sp.seed is not None, explicit=False)
        else:
            flight = _Flight(req, bool(choice), explicit=True)
        self._flights[req.rid] = flight
        return flight

    def _deadline(self, retry: bool) -> float:
        """When a wait must give up for want of a connection (inf while connected)."""
        if self._up:
            return math.inf
        patience = self.retry_window_s if retry and self._ever_up else self.connect_timeout_s
        return self._down_since + patience

    def _gone(self, rid: str = "", retry: bool = False) -> LoomError:
        why = f"no connection for {time.monotonic() - self._down_since:.1f} s"
        if not self._ever_up:
            why += " (never reached)"
        elif retry:
            why += f" (request {rid!r} was waiting to be resubmitted)"
        return LoomError(f"Loom server at {self.endpoint} is unavailable: {why}", "unavailable", rid)

    def _mark(self, msg: Any) -> Any:
        """Note a request's final output or error (a later connection loss must not resubmit it)."""
        flight = self._flights.get(getattr(msg, "rid", ""))
        if flight is not None and (isinstance(msg, ErrorOut) or (isinstance(msg, GenerateOut) and msg.finished)):
            flight.done = True
        return msg

    def _drain(self) -> list[Any]:
        """Every message already received on the current socket (unreadable frames are dropped)."""
        out: list[Any] = []
        while True:
            try:
                frame = self._conn.io.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if not frame:  # a liveness probe
                continue
            try:
                out.append(self._mark(self.inc.decode(frame)))
            except WireError:
                continue

    def _poll_link(self) -> tuple[bool, list[Any]]:
        """Apply the monitor's queued events: (whether the link state changed, messages to deliver).

        After a lost connection the messages are those the old socket still held, then a LoomError
        (``unavailable``) for each request in flight that is not resubmitted.
        """
        changed = False
        while True:
            try:
                frames = self._conn.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return changed, []
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up = self._ever_up = changed = True
            elif event == zmq.EVENT_DISCONNECTED and self._up:  # (a failed handshake was never up)
                return True, self._reconnect()

    def _retire(self, conn: _Conn) -> None:
        """Close a replaced connection."""
        conn.close()

    def _reconnect(self) -> list[Any]:
        """The connection dropped: a fresh socket (the old one's queue may hold requests never delivered),
        resubmit retryable requests on it, fail the others."""
        out = self._drain()
        old = self._conn
        self._conn = _Conn(self.ctx, self.endpoint)
        self._retire(old)
        self._epoch += 1
        self._up = False
        self._down_since = time.monotonic()
        for rid, f in self._flights.items():
            if f.done:
                continue
            if f.retry:
                self._conn.io.send(self.out.encode(f.req), zmq.NOBLOCK)  # queued (no HWM) until the server is back
                f.resumed = True
                continue
            f.done = True
            why = (
                "retry is off for it"
                if f.explicit
                else "it samples with temperature > 0 and no seed, so a rerun would differ; pass retry=True to "
                "resubmit anyway"
            )
            msg = f"Loom server at {self.endpoint} is unavailable: the connection was lost while request {rid!r} "
            out.append(LoomError(f"{msg}was running (not resubmitted: {why})", "unavailable", rid))
        return out


class LoomClient(_ClientBase):
    """Blocking client. One DEALER socket; not thread-safe (use one client per thread).

    Args:
        endpoint: the cluster's front address (``launch.py`` prints it).
        timeout_s: longest wait for any reply before :class:`LoomError` (kind ``timeout``).
        retry: resubmit requests in flight when the connection drops (None: only greedy and seeded ones).
        connect_timeout_s: without a connection this long, waits fail with kind ``unavailable``.
        retry_window_s: how long resubmitted requests wait for a lost server to come back.

    Raises LoomError (``bad_request``) for a malformed endpoint.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 600.0,
        *,
        retry: bool | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        super().__init__(zmq.Context(), endpoint, timeout_s, retry, connect_timeout_s, retry_window_s)
        self.timeout_ms = max(1, round(timeout_s * 1000))
        self._stash: dict[str, list[Any]] = {}
        self._inbox: deque[Any] = deque()  # read off the socket, not yet handed to a waiter
        # rid -> (connection epoch, deadline) of an aborted request whose final reply has not been read: its late
        # replies are dropped, and a new request reusing the rid first waits for that final reply
        self._aborted: dict[str, tuple[int, float]] = {}

    def close(self) -> None:
        """Close the socket (requests still running on the server are aborted when their replies bounce)."""
        self._conn.close()
        self.ctx.term()

    def __enter__(self) -> LoomClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refresh(self) -> None:
        """Apply connection events seen so far (before sending, so a new request is never counted as lost)."""
        self._inbox.extend(self._poll_link()[1])

    def send_raw(self, frame: bytes) -> None:
        """Send raw bytes as one message (for testing how the server treats garbage)."""
        self._refresh()
        self.sock.send(frame)

    def recv(self) -> Any:
        """Next server message. Raises LoomError: ``timeout`` after ``timeout_s`` without one, ``unavailable``
        when there is no connection (or it dropped while waiting)."""
        epoch = self._epoch
        while True:
            msg = self._recv(None, epoch)
            if not isinstance(msg, LoomError):
                return msg
            self._stash.setdefault(msg.rid, []).append(msg)  # a request's failure, for its own waiter

    def _recv(self, flight: _Flight | None, epoch: int) -> Any:
        """Next message while waiting for ``flight`` (or, with None, for a reply to what was sent at ``epoch``)."""
        start = time.monotonic()
        while True:
            if self._inbox:
                return self._inbox.popleft()
            if flight is None and epoch != self._epoch:
                raise LoomError(
                    f"Loom server at {self.endpoint} is unavailable: the connection was lost before it replied",
                    "unavailable",
                )
            now = time.monotonic()
            t_end = start + self.timeout_s
            retry = flight is not None and flight.retry
            l_end = self._deadline(retry)
            if now >= min(t_end, l_end):
                rid = flight.req.rid if flight is not None else ""
                if l_end <= t_end:
                    raise self._gone(rid, retry)
                raise LoomError(f"no reply from the server in {self.timeout_s:g} s", "timeout", rid)
            conn = self._conn
            poller = zmq.Poller()
            poller.register(conn.sock, zmq.POLLIN)
            poller.register(conn.mon, zmq.POLLIN)
            ready = dict(poller.poll(max(1, math.ceil((min(t_end, l_end) - now) * 1000))))
            if conn.mon in ready:
                self._refresh()
                continue
            if conn.sock in ready:
                msg = self._read(conn)
                if msg is not None:
                    return msg

    def _read(self, conn: _Conn) -> Any:
        """One message waiting on ``conn`` (None: nothing after all, or a liveness probe), marked."""
        try:
            frame = conn.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._mark(self.inc.decode(frame)) if frame else None

    def _next_for(self, flight: _Flight) -> Any:
        rid = flight.req.rid
        stash = self._stash.get(rid)
        if stash:
            return stash.pop(0)
        while True:
            msg = self._recv(flight, self._epoch)
            if getattr(msg, "rid", None) == rid:
                return msg
            if self._late_of_aborted(msg):
                continue
            if self._known(msg):  # another request's, for its own waiter
                self._stash.setdefault(msg.rid, []).append(msg)

    def _end(self, flight: _Flight) -> None:
        rid = flight.req.rid
        if self._flights.get(rid) is flight:
            del self._flights[rid]
        if not self._stash.get(rid):
            self._stash.pop(rid, None)

    def generate(
        self,
        text: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        stream: bool = False,
        lora_path: str | None = None,
        rid: str | None = None,
        retry: bool | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        allow_special_tokens_in_content: bool = False,
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Generate from exactly one of ``text``, ``input_ids`` or chat ``messages``.

        With ``return_logprob`` the result's ``meta_info`` carries ``output_token_logprobs`` (``[logprob,
        token_id]`` per generated token) and, with ``top_logprobs_num`` = k in 1..20, ``output_top_logprobs``
        (the k most likely ``[logprob, token_id]`` at each position). ``allow_special_tokens_in_content`` (chat
        only, trusted callers): special-token text in a message's content becomes control tokens (README: Request
        fields). ``rid`` None picks a fresh id; "" is refused.

        Returns the result dict, or (``stream=True``) an iterator of cumulative result dicts; closing the
        iterator early aborts the request. ``retry`` overrides the client's choice of resubmitting this
        request if the connection drops (default: greedy and seeded requests only). Raises LoomError with the
        server's message on failure, kind ``timeout`` without a reply for ``timeout_s``, ``unavailable`` when
        the server cannot be reached, ``server_error`` when a resumed stream diverged.
        """
        req = _request(
            text,
            input_ids,
            messages,
            sampling_params,
            stream,
            lora_path,
            rid,
            return_logprob,
            top_logprobs_num,
            allow_special_tokens_in_content,
        )
        frame = self._encode(req)
        self._refresh()
        if req.rid in self._aborted:
            self._settle(req.rid)
        flight = self._start(req, retry)
        self.sock.send(frame)
        if stream:
            return _SyncStream(self, flight)
        return self._final(flight)

    def _final(self, flight: _Flight) -> dict[str, Any]:
        try:
            while True:
                msg = self._next_for(flight)
                if isinstance(msg, LoomError):
                    raise msg
                if isinstance(msg, ErrorOut):
                    raise LoomError(msg.message, msg.kind, msg.rid)
                if isinstance(msg, GenerateOut) and msg.finished:
                    return _result(msg)
        finally:
            self._end(flight)

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` (sent by this client). Its replies still on the way are dropped, and a later
        request that reuses ``rid`` waits (up to ``ABORT_SETTLE_S``) for the aborted one's final reply first."""
        self._flights.pop(rid, None)
        self._stash.pop(rid, None)
        self._aborted[rid] = (self._epoch, time.monotonic() + ABORT_SETTLE_S)
        self.sock.send(self.out.encode(AbortReq(rid)))

    def _known(self, msg: Any) -> bool:
        if self._late_of_aborted(msg):
            return False
        return super()._known(msg)

    def _late_of_aborted(self, msg: Any) -> bool:
        """Whether ``msg`` is a reply of an aborted request (to drop); its final reply ends the wait for it."""
        rid = getattr(msg, "rid", None)
        if rid not in self._aborted or rid in self._flights:
            return False
        if isinstance(msg, ErrorOut) or (isinstance(msg, GenerateOut) and msg.finished):
            del self._aborted[rid]
        return True

    def _settle(self, rid: str) -> None:
        """Before ``rid`` is reused: read until its aborted request's final reply arrived (others are stashed for
        their waiters), the connection was replaced (the old request is gone with it) or the wait ran out."""
        while rid in self._aborted:
            epoch, end = self._aborted[rid]
            if epoch != self._epoch or time.monotonic() >= end:
                del self._aborted[rid]
                return
            if self._inbox:
                msg = self._inbox.popleft()
            else:
                self._refresh()
                msg = self._read(self._conn) if self._conn.sock.poll(20) else None
                if msg is None:
                    continue
            if not self._late_of_aborted(msg) and self._known(msg):
                self._stash.setdefault(msg.rid, []).append(msg)

    def _next_chunk(self, flight: _Flight, delivered: _Delivered) -> tuple[dict[str, Any] | None, bool]:
        """The next chunk of a stream to yield (None: skip it) and whether the stream has ended."""
        msg = self._next_for(flight)
        if isinstance(msg, LoomError):
            raise msg
        if isinstance(msg, ErrorOut):
            raise LoomError(msg.message, msg.kind, msg.rid)
        admit = delivered.admit(msg, flight.resumed)
        return (_result(msg) if admit else None), msg.finished

    def _admin(self, msg: Any) -> Any:
        self._refresh()
        epoch = self._epoch
        self.sock.send(self.out.encode(msg))
        while True:
            reply = self._recv(None, epoch)
            if isinstance(reply, (AdminOut, LoraListOut)):
                return reply
            if self._known(reply):  # a generate request's, for its own waiter
                self._stash.setdefault(reply.rid, []).append(reply)

    def _admin_ok(self, msg: Any) -> dict[str, Any]:
        reply = self._admin(msg)
        if not reply.ok:
            raise LoomError(reply.message, reply.kind or "bad_request")
        return {"message": reply.message, **reply.info}

    def health(self) -> dict[str, Any]:
        """``{"message": "ok", "running": N}`` when the front door answers; LoomError (``unavailable``,
        ``timeout``) otherwise."""
        return self._admin_ok(HealthReq())

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Load a PEFT adapter folder on every rank; raises LoomError naming what was wrong."""
        return self._admin_ok(LoadLoraReq(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload an adapter (running requests that use it finish first); raises LoomError on failure."""
        return self._admin_ok(UnloadLoraReq(lora_name))

    def list_loras(self) -> list[dict[str, Any]]:
        """Loaded adapters: name, uid, path, rank, pinned and ``slots`` ({"rank N": slot}); LoomError if the
        server cannot be reached or could not list them (the front door answers an error then)."""
        reply = self._admin(ListLorasReq())
        if isinstance(reply, AdminOut):
            raise LoomError(reply.message, reply.kind or "server_error")
        return [msgspec.to_builtins(a) for a in reply.adapters]


class _SyncStream:
    """The iterator :meth:`LoomClient.generate` returns for ``stream=True``: cumulative result dicts.

    The request is already running when this is returned; ``close()`` (also on ``with`` exit, ``break`` out of a
    ``for`` loop once the iterator is dropped, or garbage collection) aborts it if it has not finished, also
    before the first chunk was read.
    """

    def __init__(self, client: LoomClient, flight: _Flight) -> None:
        self._client = client
        self._flight = flight
        self._delivered = _Delivered(client.endpoint, flight.req.rid)
        self._done = False

    def __iter__(self) -> _SyncStream:
        return self

    def __next__(self) -> dict[str, Any]:
        while not self._done:
            try:
                chunk, finished = self._client._next_chunk(self._flight, self._delivered)
            except BaseException:
                # an error reply ended the request; a timeout, a diverged resume or an interrupt did not
                self._finish(ended=self._flight.done)
                raise
            if finished:
                self._finish(ended=True)
            if chunk is not None:
                return chunk
        raise StopIteration

    def _finish(self, ended: bool) -> None:
        if self._done:
            return
        self._done = True
        self._client._end(self._flight)
        if not ended and not self._client.sock.closed:
            self._client.abort(self._flight.req.rid)

    def close(self) -> None:
        """Stop reading; the request is aborted on the server unless it already finished."""
        self._finish(ended=False)

    def __enter__(self) -> _SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - best effort at garbage collection (the socket may be gone)
            pass


class AsyncLoomClient(_ClientBase):
    """asyncio client: many concurrent ``generate`` calls share one DEALER socket.

    A ``rid`` must be unique among this client's requests in flight (a duplicate is refused with
    :class:`LoomError` kind ``bad_request``). Use ``async with AsyncLoomClient(...) as c:`` to close it.
    ``retry``, ``connect_timeout_s`` and ``retry_window_s`` are as for :class:`LoomClient`.
    Raises LoomError (``bad_request``) for a malformed endpoint.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 600.0,
        *,
        retry: bool | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        super().__init__(zmq.asyncio.Context(), endpoint, timeout_s, retry, connect_timeout_s, retry_window_s)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None  # set when the reader must move to a new connection

    def _dispatch(self, msgs: list[Any]) -> None:
        for msg in msgs:
            q = self._queues.get(getattr(msg, "rid", ""))
            if q is not None:
                q.put_nowait(msg)
            elif isinstance(msg, ErrorOut):
                log.warning("skipping an error that names no request in flight (rid %r): %s", msg.rid, msg.message)

    def _check_link(self) -> None:
        """Apply connection events; wake every waiter when the state changed so it re-checks its deadline."""
        changed, out = self._poll_link()
        self._dispatch(out)
        if changed:
            for q in self._queues.values():
                q.put_nowait(_NUDGE)

    def _retire(self, conn: _Conn) -> None:
        conn.close()  # cancels the reader's poll on it ...
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)  # ... and this makes sure the reader moves on to the new one

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn = self._conn
            self._wake = loop.create_future()
            poller = zmq.asyncio.Poller()
            poller.register(conn.sock, zmq.POLLIN)
            poller.register(conn.mon, zmq.POLLIN)
            polled = asyncio.ensure_future(poller.poll())
            try:
                await asyncio.wait({polled, self._wake}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                polled.cancel()
            if conn is self._conn:
                self._check_link()
            if conn is self._conn:
                self._dispatch(self._drain())

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())

    async def generate_stream(
        self, text: str | None = None, *, _stream: bool = True, **kw: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Like :meth:`LoomClient.generate` with ``stream=True``; yields cumulative result dicts.

        Raises LoomError: the server's error, ``bad_request`` for a rid already running on this client,
        ``timeout``, ``unavailable``, or ``server_error`` when a resumed stream diverged.
        """
        self._ensure_reader()
        req = _request(
            text,
            kw.get("input_ids"),
            kw.get("messages"),
            kw.get("sampling_params"),
            _stream,
            kw.get("lora_path"),
            kw.get("rid"),
            kw.get("return_logprob", False),
            kw.get("top_logprobs_num", 0),
            kw.get("allow_special_tokens_in_content", False),
        )
        rid = req.rid
        if rid in self._queues:  # would steal the running request's replies: refuse before sending
            raise LoomError(f"request id {rid!r} is already running on this client", "bad_request", rid)
        frame = self._encode(req)
        self._check_link()
        flight = self._start(req, kw.get("retry"))
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        delivered = _Delivered(self.endpoint, rid)
        done = sent = False
        try:
            await self.sock.send(frame)
            sent = True
            last = time.monotonic()
            while not done:
                now = time.monotonic()
                t_end = last + self.timeout_s
                l_end = self._deadline(flight.retry)
                if now >= min(t_end, l_end):
                    if l_end <= t_end:
                        raise self._gone(rid, flight.retry)
                    raise LoomError(f"no reply from the server in {self.timeout_s:g} s", "timeout", rid)
                try:
                    msg = await asyncio.wait_for(q.get(), min(t_end, l_end) - now)
                except asyncio.TimeoutError:
                    continue
                if msg is _NUDGE:
                    continue
                last = time.monotonic()
                if isinstance(msg, LoomError):
                    done = True
                    raise msg
                if isinstance(msg, ErrorOut):
                    done = True
                    raise LoomError(msg.message, msg.kind, msg.rid)
                admit = delivered.admit(msg, flight.resumed)
                done = msg.finished
                if admit:
                    yield _result(msg)
        finally:
            if self._queues.get(rid) is q:
                del self._queues[rid]
            if self._flights.get(rid) is flight:
                del self._flights[rid]
            if sent and not done and not self._conn.sock.closed:
                # not awaited: this runs when the caller closes or cancels the stream, and must not be
                # cancelled in turn (the socket has no high-water mark, so the send never waits)
                with contextlib.suppress(zmq.ZMQError):
                    self._conn.io.send(self.out.encode(AbortReq(rid)), zmq.NOBLOCK)

    async def generate(self, text: str | None = None, **kw: Any) -> dict[str, Any]:
        """Like :meth:`LoomClient.generate` (non-streaming: one reply at the end); safe to run many at once.

        Raises LoomError as :meth:`generate_stream` does.
        """
        last = None
        async for chunk in self.generate_stream(text, _stream=False, **kw):
            last = chunk
        assert last is not None
        return last

    async def __aenter__(self) -> AsyncLoomClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the reader and close the socket."""
        if self._reader is not None:
            self._reader.cancel()
        self._conn.close()
        self.ctx.term()
