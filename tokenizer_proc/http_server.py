"""The front door's HTTP server: uvicorn (h11) inside the tokenizer process's own event loop (uvloop).

uvicorn parses HTTP/1.1 (keep-alive, chunked bodies, pipelining, header limits); Starlette routes
(:mod:`tokenizer_proc.http_app`). uvicorn's signal handling is off: the tokenizer process owns SIGTERM (a drain
or a restart by the launcher, see :mod:`tokenizer_proc.main`). :class:`Accounting` counts every HTTP request
once, at its end, with its real outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.http_app import build_app, route_paths
from tokenizer_proc.metrics import Metrics

log = logging.getLogger("tokenizer.http")
KEEPALIVE_TIMEOUT_S = 30  # idle time allowed between requests on one connection
SHUTDOWN_GRACE_S = 5.0  # at exit, responses in flight get this long to be written


class Accounting:
    """ASGI middleware: one ``loom_http_requests_total`` / duration sample per request, at its end.

    ``outcome`` is ``success`` (2xx/3xx), ``client_error`` (4xx), ``server_error`` (5xx), or
    ``client_disconnected`` (status 499) when the client left before the last byte of its response, streamed
    or not. While the front door drains, every response asks the client to close the connection.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: set[str], door: FrontDoor) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths
        self.door = door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app, watching what it receives and sends."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        state = {"status": 500, "complete": False, "gone": False}

        async def recv() -> Message:
            msg = await receive()
            if msg["type"] == "http.disconnect" and not state["complete"]:
                state["gone"] = True
            return msg

        async def snd(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                state["status"] = msg["status"]
                if self.door.health.draining is not None:
                    msg = {**msg, "headers": [*msg.get("headers", []), (b"connection", b"close")]}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False) and not state["gone"]:
                state["complete"] = True
            await send(msg)

        try:
            await self.app(scope, recv, snd)
        finally:
            # the route that matched (Starlette's router records it in the scope), so /v1/models/{model:path} is
            # one label whatever the model; a path no route matched is "unknown"
            path = getattr(scope.get("route"), "path", None)
            if path not in self.paths:
                path = scope["path"] if scope["path"] in self.paths else "unknown"
            status = int(state["status"])
            if not state["complete"]:
                status, outcome = 499, "client_disconnected"
            elif status >= 500:
                outcome = "server_error"
            elif status >= 400:
                outcome = "client_error"
            else:
                outcome = "success"
            self.metrics.http_request(path, status, outcome, time.monotonic() - started)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handlers (the tokenizer process owns SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """No-op: leave the process's signal handlers alone."""
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (raises OSError if the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


class HttpServer:
    """The HTTP API of one front door; :meth:`start` serves, :meth:`stop` ends it."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.sock: socket.socket | None = None
        self.server: _EmbeddedServer | None = None
        self.task: asyncio.Task | None = None

    @property
    def port(self) -> int:
        """The bound TCP port (useful after starting on port 0)."""
        assert self.sock is not None, "not started"
        return int(self.sock.getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` and serve until :meth:`stop` (raises OSError if the port is taken)."""
        app = build_app(self.door)
        wrapped = Accounting(app, self.door.metrics, route_paths(app), self.door)
        if log.getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        config = uvicorn.Config(
            wrapped,
            http="h11",
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_keep_alive=KEEPALIVE_TIMEOUT_S,
            server_header=False,
            headers=[("server", "loom")],
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
        )
        self.sock = bind(host, port)
        self.server = _EmbeddedServer(config)
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        log.info("HTTP API listening on http://%s:%d (uvicorn on %s)", host, self.port, loop)

    async def stop(self) -> None:
        """Stop listening, let the responses in flight be written (up to ``SHUTDOWN_GRACE_S``), close."""
        if self.server is None or self.task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), SHUTDOWN_GRACE_S + 2)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.server.force_exit = True
            self.task.cancel()
        except Exception:  # noqa: BLE001 - the process is exiting anyway
            log.warning("HTTP server stopped with an error", exc_info=True)


async def start_http(door: FrontDoor, host: str, port: int) -> HttpServer:
    """Serve the HTTP API for ``door`` on ``host:port``; ``await stop()`` on the result to end it."""
    server = HttpServer(door)
    await server.start(host, port)
    return server
