"""The front door's HTTP API: a small HTTP/1.1 server on ``asyncio.start_server`` (no web framework).

It runs in the tokenizer process's event loop and drives the same :class:`FrontDoor` as the ZMQ ROUTER.
Endpoints use SGLang's names:

- ``GET /health``, ``GET /get_model_info``, ``GET /metrics`` (Prometheus text)
- ``POST /generate``: JSON body with the fields of :class:`ipc.messages.GenerateReq`; ``"stream": true``
  answers ``text/event-stream`` with one ``data: {json}`` event per (cumulative) chunk and ``data: [DONE]``
- ``POST /load_lora_adapter``, ``POST /unload_lora_adapter``, ``GET /list_loras``

Errors are JSON ``{"error": {"message": ..., "kind": ...}}``: 400 (bad_request: bad JSON, an unknown field,
a value out of range), 404 (not_found: unknown path or adapter), 405 (wrong method), 500 (server_error); and for
broken HTTP 400, 408, 411 (chunked request bodies: send Content-Length), 413 (body over 8 MiB), 414, 417, 431,
505, after which the connection is closed. Connections stay open between requests (HTTP/1.1 keep-alive).
A generation is aborted as soon as its client disconnects (EOF on the socket, so a client that half-closes
its sending side after the request counts as gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import re
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from ipc.messages import (
    AdminOut,
    ErrorOut,
    GenerateOut,
    GenerateReq,
    LoadLoraReq,
    ServerMsg,
    UnloadLoraReq,
)
from tokenizer_proc.front_door import ClusterHealth, FrontDoor
from tokenizer_proc.registry import AdapterRefused, UnknownAdapter

log = logging.getLogger("tokenizer.http")

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_REQUEST_LINE_BYTES = 8 * 1024
MAX_HEADER_LINE_BYTES = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
KEEPALIVE_TIMEOUT_S = 75.0  # idle time allowed between requests on one connection
HEADER_TIMEOUT_S = 30.0  # once a request has started, its head must arrive within this
BODY_TIMEOUT_S = 60.0
READ_CHUNK = 64 * 1024
PIPELINE_CAP = MAX_BODY_BYTES  # bytes we buffer from a client while its previous request runs

KIND_STATUS = {"bad_request": 400, "not_found": 404, "overloaded": 503, "server_error": 500}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_JSON = "application/json"
_DONE = b"data: [DONE]\n\n"


class HttpError(Exception):
    """A request the server answers with ``status`` and a JSON error; ``close`` drops the connection after."""

    def __init__(
        self, status: int, message: str, *, close: bool = False, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.headers = headers or {}


class ClientGone(Exception):
    """The client closed the connection (or went silent past a timeout); nothing more can be sent."""


@dataclass
class Request:
    """One parsed HTTP request (header names lower-cased, body complete)."""

    method: str
    path: str
    version: tuple[int, int]
    headers: dict[str, str]
    body: bytes = b""
    keep_alive: bool = True
    started: float = field(default_factory=time.monotonic)


@dataclass
class Response:
    """A complete (non-streaming) response."""

    status: int
    body: bytes
    content_type: str = _JSON
    headers: dict[str, str] = field(default_factory=dict)


def json_response(status: int, obj: Any) -> Response:
    """``obj`` encoded as JSON with ``status``."""
    return Response(status, msgspec.json.encode(obj))


def error_body(message: str, kind: str) -> dict[str, Any]:
    """The JSON shape of every error: ``{"error": {"message": ..., "kind": ...}}``."""
    return {"error": {"message": message, "kind": kind}}


def status_kind(status: int) -> str:
    """The error ``kind`` reported for an HTTP status (4xx -> bad_request, 404 -> not_found, 5xx)."""
    if status == 404:
        return "not_found"
    return "server_error" if status >= 500 else "bad_request"


def result_dict(msg: GenerateOut) -> dict[str, Any]:
    """A generation result in SGLang's shape (as ``ipc.client`` returns it)."""
    return {"text": msg.text, "output_ids": msg.output_ids, "meta_info": msgspec.to_builtins(msg.meta_info)}


def decode_body(body: bytes, typ: type) -> Any:
    """Decode a JSON request body into ``typ``; HttpError 400 naming the problem (unknown field, bad type)."""
    if not body.strip():
        raise HttpError(400, "request body is empty: expected a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:  # a subclass of DecodeError: test it first
        raise HttpError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"request body is not valid JSON: {e}") from None


class HttpSink:
    """Delivers one HTTP request's replies from :class:`FrontDoor` to its handler.

    Chunks are cumulative, so the sink keeps only the newest message: a slow reader skips intermediate chunks
    instead of queueing them without bound. A terminal message (an error or the finished result) is never
    replaced. ``send`` returns False once the client has disconnected, which makes FrontDoor abort.
    """

    def __init__(self) -> None:
        self._msg: ServerMsg | None = None
        self._terminal = False
        self._gone = False
        self._ready = asyncio.Event()

    @property
    def pending(self) -> ServerMsg | None:
        """The message not yet taken by :meth:`get` (None if there is none)."""
        return self._msg

    @property
    def gone(self) -> bool:
        """Whether the client has disconnected."""
        return self._gone

    def send(self, msg: ServerMsg) -> bool:
        """Hold ``msg`` for the handler; False if the client is gone."""
        if self._gone:
            return False
        if not self._terminal:
            self._msg = msg
            self._terminal = isinstance(msg, ErrorOut) or (isinstance(msg, GenerateOut) and msg.finished)
            self._ready.set()
        return True

    def client_gone(self) -> None:
        """Mark the client disconnected and wake the handler."""
        self._gone = True
        self._ready.set()

    async def get(self) -> ServerMsg | None:
        """The newest undelivered message, or None once the client is gone."""
        await self._ready.wait()
        if self._gone:
            return None
        self._ready.clear()
        msg, self._msg = self._msg, None
        return msg


class Connection:
    """One client connection: a byte buffer over the stream reader, and response writing."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.eof = False
        self.peer = writer.get_extra_info("peername")
        self.farewell: Callable[[], bytes] | None = None  # bytes to send if the server shuts down mid-request

    async def _more(self) -> None:
        try:
            data = await self.reader.read(READ_CHUNK)
        except (ConnectionError, OSError):
            data = b""
        if data:
            self.buf += data
        else:
            self.eof = True

    async def read_line(self, limit: int, too_long: HttpError) -> bytes:
        """One line without its CRLF (or bare LF). Raises ``too_long`` past ``limit`` bytes, ClientGone at EOF."""
        start = 0
        while True:
            i = self.buf.find(b"\n", start)
            if i >= 0:
                if i > limit:
                    raise too_long
                line = bytes(self.buf[:i])
                del self.buf[: i + 1]
                return line[:-1] if line.endswith(b"\r") else line
            if len(self.buf) > limit:
                raise too_long
            if self.eof:
                raise ClientGone()
            start = len(self.buf)
            await self._more()

    async def read_exactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes (ClientGone if the connection ends first)."""
        while len(self.buf) < n:
            if self.eof:
                raise ClientGone()
            await self._more()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def wait_first_byte(self) -> None:
        """Wait until the next request starts (ClientGone at EOF)."""
        while not self.buf:
            if self.eof:
                raise ClientGone()
            await self._more()

    async def wait_disconnect(self) -> None:
        """Return when the client closes the connection; bytes it sends meanwhile are kept for the next request.

        Past PIPELINE_CAP buffered bytes it stops reading and never returns (the caller cancels it).
        """
        while not self.eof:
            if len(self.buf) >= PIPELINE_CAP:
                await asyncio.Event().wait()
            await self._more()

    async def write(self, data: bytes) -> None:
        """Send ``data``; ClientGone if the connection is closed."""
        if self.writer.transport.is_closing():
            raise ClientGone()
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            raise ClientGone() from None

    async def send_head(self, status: int, headers: dict[str, str]) -> None:
        """Write the status line and ``headers`` (plus Date and Server); the body follows separately."""
        await self.write(head_bytes(status, headers))

    async def send_response(self, resp: Response, keep_alive: bool) -> None:
        """Write a complete response with Content-Length."""
        await self.write(response_bytes(resp, keep_alive))

    def close(self) -> None:
        """Close the transport (idempotent)."""
        self.writer.close()

    def shut_down(self) -> None:
        """Server shutdown: write ``farewell()`` (if set) without waiting, then close the connection."""
        data = self.farewell() if self.farewell is not None else b""
        if data and not self.writer.transport.is_closing():
            with contextlib.suppress(Exception):
                self.writer.write(data)  # the transport flushes it before it closes
        self.close()


def head_bytes(status: int, headers: dict[str, str]) -> bytes:
    """Status line and headers (plus Date and Server) of a response, ending with the blank line."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Date: {email.utils.formatdate(usegmt=True)}"]
    lines.append("Server: loom")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def response_bytes(resp: Response, keep_alive: bool) -> bytes:
    """A complete response with Content-Length."""
    headers = {
        "Content-Type": resp.content_type,
        "Content-Length": str(len(resp.body)),
        "Connection": "keep-alive" if keep_alive else "close",
        **resp.headers,
    }
    return head_bytes(resp.status, headers) + resp.body


def error_response(status: int, message: str, kind: str | None = None) -> Response:
    """The JSON error response ``{"error": {"message", "kind"}}``."""
    return json_response(status, error_body(message, kind or status_kind(status)))


async def read_head(conn: Connection) -> Request:
    """Parse one request line and its headers (the body is left unread).

    Raises HttpError (answered, then the connection closes if ``close``) or ClientGone.
    """
    line = b""
    for _ in range(4):  # RFC 9112 2.2: ignore a few empty lines before the request line
        line = await conn.read_line(MAX_REQUEST_LINE_BYTES, HttpError(414, "request line too long", close=True))
        if line:
            break
    parts = line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]:
        raise HttpError(400, f"malformed request line {line[:100]!r}", close=True)
    method_b, target_b, version_b = parts
    m = _VERSION.fullmatch(version_b)
    if m is None:
        raise HttpError(400, f"malformed HTTP version {version_b[:20]!r}", close=True)
    version = (int(m.group(1)), int(m.group(2)))
    if version[0] != 1:
        raise HttpError(505, f"HTTP/{version[0]}.{version[1]} is not supported; use HTTP/1.1", close=True)
    try:
        target = target_b.decode("ascii")
    except UnicodeDecodeError:
        raise HttpError(400, "request target must be ASCII (percent-encode it)", close=True) from None
    if target.startswith("/"):
        path = target.split("?", 1)[0]
    elif target.startswith(("http://", "https://")):
        path = urlsplit(target).path or "/"
    else:
        raise HttpError(400, f"malformed request target {target[:100]!r}", close=True)

    headers: dict[str, str] = {}
    total = 0
    while True:
        hl = await conn.read_line(MAX_HEADER_LINE_BYTES, HttpError(431, "header line too long", close=True))
        if not hl:
            break
        total += len(hl)
        if total > MAX_HEADER_BYTES or len(headers) >= MAX_HEADERS:
            raise HttpError(431, "request headers too large", close=True)
        if hl[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete header line folding is not supported", close=True)
        name_b, sep, value_b = hl.partition(b":")
        if not sep or not _TOKEN.fullmatch(name_b):
            raise HttpError(400, f"malformed header line {hl[:100]!r}", close=True)
        name = name_b.decode("ascii").lower()
        value = value_b.strip(b" \t").decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "close" not in tokens if version >= (1, 1) else "keep-alive" in tokens
    return Request(method_b.decode("ascii"), path, version, headers, b"", keep_alive)


async def read_body(conn: Connection, req: Request) -> None:
    """Read ``req``'s Content-Length body into ``req.body``; HttpError for chunked, bad or oversized bodies."""
    h = req.headers
    if "transfer-encoding" in h:
        raise HttpError(
            411, "chunked (Transfer-Encoding) request bodies are not supported: send Content-Length", close=True
        )
    length = 0
    if "content-length" in h:
        values = {v.strip() for v in h["content-length"].split(",")}
        v = values.pop()
        if values or not v.isascii() or not v.isdigit():
            raise HttpError(400, f"invalid Content-Length {h['content-length']!r}", close=True)
        length = int(v)
        if length > MAX_BODY_BYTES:
            raise HttpError(413, f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}", close=True)
    expect = h.get("expect", "").lower()
    if expect and expect != "100-continue":
        raise HttpError(417, f"unsupported Expect: {h['expect']!r}", close=True)
    if not length:
        return
    if expect == "100-continue" and not conn.buf:
        await conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    try:
        req.body = await asyncio.wait_for(conn.read_exactly(length), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise HttpError(408, f"request body not received within {BODY_TIMEOUT_S:.0f} s", close=True) from None


@dataclass
class Streamed:
    """A handler wrote its own (streamed) response; ``reusable``: the connection may serve another request."""

    reusable: bool


Handler = Callable[[Request, Connection], Awaitable["Response | Streamed"]]


class FailoverCollector:
    """Prometheus counters of the front door's :class:`ClusterHealth` (restarts, resumed requests, lost
    adapters), read at scrape time."""

    def __init__(self, health: ClusterHealth) -> None:
        self.health = health

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        """Yield the three counter families."""
        restarts = CounterMetricFamily(
            "loom_process_restarts", "Processes restarted by the launcher after a death or hang", labels=["process"]
        )
        for proc, n in sorted(self.health.restarts.items()):
            restarts.add_metric([proc], n)
        yield restarts
        yield CounterMetricFamily(
            "loom_requests_resumed", "Running requests re-admitted after a TP group restart", value=self.health.resumed
        )
        yield CounterMetricFamily(
            "loom_lora_adapters_lost",
            "Adapters a restart could not restore (folder gone, files changed or invalid)",
            value=self.health.adapters_lost,
        )


class HttpApi:
    """Routes HTTP requests to a :class:`FrontDoor`; one asyncio task per connection.

    Use :func:`start_http` to create and start it; :meth:`close` stops it.
    """

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.server: asyncio.AbstractServer | None = None
        self.closing = False
        self._conns: dict[asyncio.Task, Connection] = {}
        self.routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self.health},
            "/get_model_info": {"GET": self.model_info},
            "/generate": {"POST": self.generate},
            "/load_lora_adapter": {"POST": self.load_lora},
            "/unload_lora_adapter": {"POST": self.unload_lora},
            "/list_loras": {"GET": self.list_loras},
            "/metrics": {"GET": self.metrics},
        }
        self.registry = CollectorRegistry()
        self.m_requests = Counter(
            "loom_http_requests", "HTTP requests answered", ["path", "status"], registry=self.registry
        )
        self.m_e2e = Histogram(
            "loom_generate_e2e_seconds",
            "End-to-end latency of /generate requests (arrival to last byte)",
            ["stream"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250),
            registry=self.registry,
        )
        self.m_running = Gauge(
            "loom_running_requests", "Requests the front door is waiting on (HTTP and ZMQ)", registry=self.registry
        )
        self.m_running.set_function(lambda: len(door.pending))
        self.registry.register(FailoverCollector(door.health))

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        """The bound TCP port (useful after starting on port 0)."""
        assert self.server is not None and self.server.sockets, "not started"
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (raises OSError if the port is taken)."""
        self.server = await asyncio.start_server(self._on_connect, host, port, reuse_address=True)
        log.info("HTTP API listening on http://%s:%d", host, self.port)

    def close(self) -> None:
        """Stop listening and close every connection.

        Synchronous (the process is exiting): a request in flight gets its error written without waiting, a 503
        or the error FrontDoor.fail_all delivered, or for a stream an error event and ``[DONE]``.
        """
        self.closing = True
        if self.server is not None:
            self.server.close()
        for task, conn in list(self._conns.items()):
            conn.shut_down()
            task.cancel()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        conn = Connection(reader, writer)
        if task is not None:
            self._conns[task] = conn
        try:
            await self._serve(conn)
        except ClientGone:
            pass
        except asyncio.CancelledError:
            # close() at shutdown. End normally: Python 3.11's start_server callback calls task.exception()
            # on the finished task, which raises (and logs a traceback) when the task ended cancelled.
            pass
        except Exception:  # noqa: BLE001 - one broken connection must never take the server down
            log.error("HTTP connection %s failed: %s", conn.peer, traceback.format_exc())
        finally:
            if task is not None:
                self._conns.pop(task, None)
            conn.close()

    async def _serve(self, conn: Connection) -> None:
        first = True
        while not self.closing:
            try:  # idle wait for the next request, then a bounded wait for its head
                await asyncio.wait_for(conn.wait_first_byte(), HEADER_TIMEOUT_S if first else KEEPALIVE_TIMEOUT_S)
            except asyncio.TimeoutError:
                return
            first = False
            req: Request | None = None
            try:
                try:
                    req = await asyncio.wait_for(read_head(conn), HEADER_TIMEOUT_S)
                except asyncio.TimeoutError:
                    raise HttpError(
                        408, f"request head not received within {HEADER_TIMEOUT_S:.0f} s", close=True
                    ) from None
                await read_body(conn, req)
            except HttpError as e:
                await self._send_error(conn, e, self._label(req.path if req else ""))
                return
            if not await self._dispatch(req, conn):
                return

    def _label(self, path: str) -> str:
        """Metric label for ``path``: known routes by name, everything else as ``unknown`` (bounded)."""
        return path if path in self.routes else "unknown"

    async def _send_error(self, conn: Connection, e: HttpError, path: str, keep_alive: bool = False) -> None:
        resp = error_response(e.status, e.message)
        resp.headers.update(e.headers)
        self.m_requests.labels(path, str(e.status)).inc()
        await conn.send_response(resp, keep_alive and not e.close)

    async def _dispatch(self, req: Request, conn: Connection) -> bool:
        """Answer ``req``; True if the connection stays open for another request."""
        route = self.routes.get(req.path)
        label = self._label(req.path)
        keep = req.keep_alive and not self.closing
        try:
            if route is None:
                raise HttpError(404, f"no such endpoint: {req.path}")
            handler = route.get(req.method)
            if handler is None:
                allow = ", ".join(sorted(route))
                raise HttpError(
                    405, f"{req.method} is not allowed on {req.path}; use {allow}", headers={"Allow": allow}
                )
            resp = await handler(req, conn)
        except HttpError as e:
            await self._send_error(conn, e, label, keep)
            return keep and not e.close
        except ClientGone:
            return False
        except Exception as e:  # noqa: BLE001 - a handler bug answers 500; the server stays up
            log.error("HTTP %s %s failed: %s", req.method, req.path, traceback.format_exc())
            await self._send_error(conn, HttpError(500, f"internal error: {type(e).__name__}: {e}"), label, keep)
            return keep
        if isinstance(resp, Streamed):
            return keep and resp.reusable
        self.m_requests.labels(label, str(resp.status)).inc()
        await conn.send_response(resp, keep)
        log.debug("%s %s -> %d", req.method, req.path, resp.status)
        return keep

    # ------------------------------------------------------------------ endpoints
    async def health(self, req: Request, conn: Connection) -> Response:
        """``GET /health``: 200 ``{"status": "ok"}`` while the cluster can serve; 503 ``{"status":
        "unavailable", "reason"}`` while the TP group restarts (requests sent meanwhile wait in the queue)."""
        down = self.door.health.unavailable
        if down is not None:
            return json_response(503, {"status": "unavailable", "reason": down})
        return json_response(200, {"status": "ok"})

    async def model_info(self, req: Request, conn: Connection) -> Response:
        """``GET /get_model_info``: the served checkpoint and its limits."""
        args = self.door.args
        return json_response(
            200,
            {
                "model_path": args.model_path,
                "tokenizer_path": args.model_path,
                "is_generation": True,
                "context_length": self.door.context_len,
                "vocab_size": self.door.vocab_size,
                "enable_lora": args.enable_lora,
            },
        )

    async def metrics(self, req: Request, conn: Connection) -> Response:
        """``GET /metrics``: Prometheus text format."""
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    async def list_loras(self, req: Request, conn: Connection) -> Response:
        """``GET /list_loras``: ``{"adapters": [{name, uid, path, rank, pinned, slots}, ...]}``."""
        try:
            out = await self.door.list_adapters()
        except RuntimeError as e:  # the scheduler did not answer
            raise HttpError(500, str(e)) from None
        return json_response(200, {"adapters": msgspec.to_builtins(out.adapters)})

    async def load_lora(self, req: Request, conn: Connection) -> Response:
        """``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"?}``."""
        body: LoadLoraReq = decode_body(req.body, LoadLoraReq)
        return await self._admin(self.door.load_adapter(body.lora_name, body.lora_path, body.pinned))

    async def unload_lora(self, req: Request, conn: Connection) -> Response:
        """``POST /unload_lora_adapter {"lora_name"}``."""
        body: UnloadLoraReq = decode_body(req.body, UnloadLoraReq)
        return await self._admin(self.door.unload_adapter(body.lora_name))

    async def _admin(self, op: Awaitable[AdminOut]) -> Response:
        try:
            out = await op
        except AdapterRefused as e:
            raise HttpError(400, str(e)) from None
        except UnknownAdapter as e:
            raise HttpError(404, str(e)) from None
        except RuntimeError as e:
            raise HttpError(500, str(e)) from None
        if not out.ok:
            raise HttpError(400, out.message)
        return json_response(200, {"success": True, "message": out.message, **out.info})

    async def generate(self, req: Request, conn: Connection) -> Response | Streamed:
        """``POST /generate``: one result, or (``"stream": true``) server-sent events of cumulative chunks."""
        greq: GenerateReq = decode_body(req.body, GenerateReq)
        sink = HttpSink()

        async def watch() -> None:
            await conn.wait_disconnect()
            sink.client_gone()

        def farewell() -> bytes:
            msg = sink.pending
            if isinstance(msg, ErrorOut):
                return response_bytes(error_response(KIND_STATUS.get(msg.kind, 500), msg.message, msg.kind), False)
            return response_bytes(error_response(503, "server shutting down"), False)

        conn.farewell = farewell
        watcher = asyncio.ensure_future(watch())
        done = False
        try:
            await self.door.generate(greq, sink)
            while True:
                msg = await sink.get()
                if msg is None:
                    raise ClientGone()
                if isinstance(msg, ErrorOut):  # before any chunk went out: a plain error response
                    done = True
                    raise HttpError(KIND_STATUS.get(msg.kind, 500), msg.message)
                if greq.stream or (isinstance(msg, GenerateOut) and msg.finished):
                    break
            if not greq.stream:
                done = True
                self.m_e2e.labels("false").observe(time.monotonic() - req.started)
                return json_response(200, result_dict(msg))
            done = await self._stream(req, conn, sink, msg)
            self.m_e2e.labels("true").observe(time.monotonic() - req.started)
            return Streamed(reusable=done and req.version >= (1, 1))
        finally:
            conn.farewell = None
            watcher.cancel()
            await asyncio.wait({watcher})  # it must stop reading before the next request is parsed
            if not done:
                sink.client_gone()
                try:
                    self.door.abort_sink(sink, "client disconnected")
                except Exception:  # noqa: BLE001 - e.g. the scheduler socket is gone at shutdown
                    log.warning("abort after disconnect failed: %s", traceback.format_exc())

    async def _stream(self, req: Request, conn: Connection, sink: HttpSink, first: ServerMsg) -> bool:
        """Write the SSE response starting with ``first``; True once the request has ended (result or error)."""
        chunked = req.version >= (1, 1)
        headers = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        headers.update({"Transfer-Encoding": "chunked"} if chunked else {})
        headers["Connection"] = "keep-alive" if chunked and req.keep_alive and not self.closing else "close"
        self.m_requests.labels(req.path, "200").inc()

        def frame(data: bytes) -> bytes:
            return b"%X\r\n%s\r\n" % (len(data), data) if chunked else data

        def error_event(message: str, kind: str) -> bytes:
            return frame(b"data: " + msgspec.json.encode(error_body(message, kind)) + b"\n\n")

        def farewell() -> bytes:
            msg = sink.pending
            err = (msg.message, msg.kind) if isinstance(msg, ErrorOut) else ("server shutting down", "server_error")
            return error_event(*err) + frame(_DONE) + (b"0\r\n\r\n" if chunked else b"")

        conn.farewell = farewell
        await conn.send_head(200, headers)

        msg: ServerMsg | None = first
        finished = False
        while not finished:
            if msg is None:
                return False
            if isinstance(msg, ErrorOut):
                await conn.write(error_event(msg.message, msg.kind))
                finished = True
            elif isinstance(msg, GenerateOut):
                await conn.write(frame(b"data: " + msgspec.json.encode(result_dict(msg)) + b"\n\n"))
                finished = msg.finished
            if not finished:
                msg = await sink.get()
        conn.farewell = None  # from here on the response is complete once these bytes are buffered
        await conn.write(frame(_DONE) + (b"0\r\n\r\n" if chunked else b""))
        return True


async def start_http(door: FrontDoor, host: str, port: int) -> HttpApi:
    """Serve the HTTP API for ``door`` on ``host:port``; call ``.close()`` on the result to stop it."""
    api = HttpApi(door)
    await api.start(host, port)
    return api
