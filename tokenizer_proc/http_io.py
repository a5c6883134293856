"""HTTP plumbing shared by the native and the OpenAI endpoints: request bodies, JSON and SSE responses, and
:class:`Generation`, which runs one HTTP call's requests through the :class:`~tokenizer_proc.front_door.FrontDoor`
while it watches the client.

A generation is aborted as soon as its client disconnects (uvicorn reports ``http.disconnect``; a client that
half-closes its sending side counts as gone). Replies are cumulative, so each request's sink keeps only the
newest one: a slow reader skips intermediate chunks instead of queueing them without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ipc.messages import ErrorOut, GenerateOut, GenerateReq, ServerMsg

log = logging.getLogger("tokenizer.http")

MAX_BODY_BYTES = 8 * 1024 * 1024
JSON = "application/json"
SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
DONE_EVENT = b"data: [DONE]\n\n"
KIND_STATUS = {"bad_request": 400, "not_found": 404, "overloaded": 503, "unavailable": 503, "server_error": 500}


class HttpError(Exception):
    """Answer the request with ``status`` and this message (in the endpoint family's error shape)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, headers: dict | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param  # the offending field (OpenAI's ``param``), when known
        self.headers = headers or {}
        self.kind = kind  # Loom's error kind when the status alone does not say it (503: overloaded)


class Door(Protocol):
    """What :class:`Generation` needs of the front door."""

    async def generate(self, req: GenerateReq, sink: Any) -> None:
        """Validate and submit ``req``; replies go to ``sink``."""
        ...

    def abort_sink(self, sink: Any, reason: str) -> int:
        """Abort every request of ``sink``."""
        ...


Endpoint = Callable[[Request], Awaitable[Response]]
# (status, message, param, headers, kind): kind "" = the status's own
ErrorMaker = Callable[[int, str, "str | None", "dict[str, str] | None", str], Response]


def guarded(to_error: ErrorMaker) -> Callable[[Endpoint], Endpoint]:
    """Answer an endpoint's :class:`HttpError` with ``to_error(status, message, param, headers, kind)`` (its family's
    error shape); a bug answers 500 and the server stays up."""

    def wrap(fn: Endpoint) -> Endpoint:
        @functools.wraps(fn)
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except HttpError as e:
                return to_error(e.status, e.message, e.param, e.headers, e.kind)
            except ClientDisconnect:  # the client left while its body was read: no bug, nobody to answer
                log.info("HTTP %s %s: the client disconnected before its body arrived", request.method,
                         request.url.path)  # fmt: skip
                return disconnected_response()
            except Exception as e:  # noqa: BLE001 - a handler bug answers 500; the server stays up
                log.exception("HTTP %s %s failed", request.method, request.url.path)
                return to_error(500, f"internal error: {type(e).__name__}: {e}", None, None, "")

        return endpoint

    return wrap


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    """``obj`` (builtins or msgspec Structs) encoded as JSON."""
    return Response(msgspec.json.encode(obj), status, headers, media_type=JSON)


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def read_body(request: Request) -> bytes:
    """The request body, at most ``MAX_BODY_BYTES`` (HttpError 413 beyond, checked on Content-Length first)."""
    close = {"connection": "close"}  # the rest of the body is never read: the connection cannot be reused
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise HttpError(413, f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}", headers=close)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise HttpError(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes", headers=close)
    return bytes(body)


def decode_body(body: bytes, typ: type) -> Any:
    """Decode a JSON body into ``typ``: HttpError 400 naming the problem (bad JSON, an unknown field, a bad
    type, with the path of the offending field)."""
    if not body.strip():
        raise HttpError(400, "request body is empty: expected a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:  # a subclass of DecodeError: test it first
        raise HttpError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"request body is not valid JSON: {e}") from None


class HttpSink:
    """Delivers one request's replies from the front door to its HTTP call.

    Keeps only the newest message (chunks are cumulative); a terminal message (an error or the finished
    result) is never replaced. ``send`` returns False once the client is gone, which makes the front door abort.
    """

    def __init__(self, wake: asyncio.Event) -> None:
        self._wake = wake
        self._msg: ServerMsg | None = None
        self.terminal = False  # the terminal message arrived
        self.gone = False

    @property
    def pending(self) -> ServerMsg | None:
        """The message not yet taken (None if there is none)."""
        return self._msg

    def send(self, msg: ServerMsg) -> bool:
        """Hold ``msg`` for the call; False if the client is gone."""
        if self.gone:
            return False
        if not self.terminal:
            self._msg = msg
            self.terminal = isinstance(msg, ErrorOut) or (isinstance(msg, GenerateOut) and msg.finished)
            self._wake.set()
        return True

    def take(self) -> ServerMsg | None:
        """The newest message not yet taken (None if there is none)."""
        msg, self._msg = self._msg, None
        return msg


class Generation:
    """The requests of one HTTP call (one, or several for OpenAI's ``n`` and prompt lists), their sinks, and a
    watch on the client: every request still running when the call ends (the client left, or an error) is
    aborted."""

    def __init__(self, door: Door, receive: Receive) -> None:
        self.door = door
        self.receive = receive
        self.wake = asyncio.Event()
        self.sinks: list[HttpSink] = []
        self.client_gone = False
        self._watch: asyncio.Task | None = None

    async def submit(self, reqs: Sequence[GenerateReq]) -> None:
        """Hand every request to the front door (validation errors arrive on its sink as ``ErrorOut``), then
        start watching the client (the body has been read by now)."""
        for req in reqs:
            sink = HttpSink(self.wake)
            self.sinks.append(sink)
            await self.door.generate(req, sink)
        self._watch = asyncio.ensure_future(self._watch_client())

    async def _watch_client(self) -> None:
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                self.client_gone = True
                self.wake.set()
                return

    @property
    def finished(self) -> bool:
        """Whether every request got its terminal message."""
        return all(s.terminal and s.pending is None for s in self.sinks)

    def first_error(self) -> ErrorOut | None:
        """An error that arrived for any request and is not taken yet (validation errors come at once)."""
        for s in self.sinks:
            if isinstance(s.pending, ErrorOut):
                return s.pending
        return None

    async def updates(self) -> list[tuple[int, ServerMsg]] | None:
        """Wait for news: ``[(request index, newest message)]``, or None once the client has disconnected."""
        while True:
            if self.client_gone:
                return None
            self.wake.clear()  # before taking: a message sent after this sets it again
            out = [(i, m) for i, s in enumerate(self.sinks) if (m := s.take()) is not None]
            if out:
                return out
            await self.wake.wait()

    async def results(self) -> list[ServerMsg] | None:
        """Wait until every request ended: the final message of each (a result or an error), or None once the
        client has disconnected. Returns as soon as one request fails."""
        final: dict[int, ServerMsg] = {}
        while len(final) < len(self.sinks):
            news = await self.updates()
            if news is None:
                return None
            for i, msg in news:
                if isinstance(msg, ErrorOut):
                    return [msg]
                if isinstance(msg, GenerateOut) and msg.finished:
                    final[i] = msg
        return [final[i] for i in range(len(self.sinks))]

    def close(self) -> None:
        """Stop watching the client and abort every request that has not ended."""
        if self._watch is not None:
            self._watch.cancel()
        for s in self.sinks:
            if not s.terminal:
                s.gone = True
                try:
                    self.door.abort_sink(s, "client disconnected")
                except Exception:  # noqa: BLE001 - e.g. the scheduler socket is gone at shutdown
                    log.warning("abort after the HTTP call ended failed", exc_info=True)


class Streamed(Response):
    """A response an endpoint writes itself: ``run(send)`` sends ``http.response.start`` and the body."""

    def __init__(self, run: Callable[[Send], Awaitable[None]], on_exit: Callable[[], None]) -> None:
        self._run = run
        self._on_exit = on_exit  # always called at the end (e.g. Generation.close)
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the endpoint's writer, then its exit hook."""
        try:
            await self._run(send)
        finally:
            self._on_exit()


async def send_start(send: Send, status: int, headers: dict[str, str]) -> None:
    """``http.response.start`` with ``headers``."""
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})


async def send_body(send: Send, data: bytes, more: bool = True) -> None:
    """One piece of the body (``more=False`` ends the response)."""
    await send({"type": "http.response.body", "body": data, "more_body": more})


def disconnected_response() -> Response:
    """What an endpoint returns for a client that already left (nothing reaches it; counted as 499)."""
    return Response(status_code=499)


@contextlib.contextmanager
def closing_on_error(gen: Generation) -> Any:
    """Close ``gen`` if the endpoint fails before handing it to a :class:`Streamed` response."""
    try:
        yield gen
    except BaseException:
        gen.close()
        raise
