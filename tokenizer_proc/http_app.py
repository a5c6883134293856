"""The front door's HTTP routes (a Starlette app): SGLang's native endpoints here, the OpenAI ones in
:mod:`tokenizer_proc.openai_routes`.

- ``GET /health``: 200 ``{"status": "ok"}`` while the scheduler and every TP rank answered recently, else 503
  ``{"status": "unavailable", "reason"}``; ``GET /health_generate``: the same after a one-token generation
- ``GET /get_model_info``, ``GET /metrics`` (Prometheus text), ``GET /list_loras``
- ``POST /generate``: a JSON :class:`ipc.messages.GenerateReq`; ``"stream": true`` answers
  ``text/event-stream`` with one ``data: {json}`` event per (cumulative) chunk, then ``data: [DONE]``
- ``POST /load_lora_adapter``, ``POST /unload_lora_adapter``

Native errors are JSON ``{"error": {"message", "kind"}}``: 400 (bad_request: bad JSON, an unknown field, a value
out of range), 404 (not_found: unknown path or adapter), 405 (wrong method, with ``Allow``), 413 (body over
8 MiB), 500 (server_error), 503 (overloaded, or unavailable while draining). Paths under ``/v1/`` answer in
OpenAI's error shape instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Send

from ipc.messages import AdminOut, ErrorOut, GenerateOut, GenerateReq, LoadLoraReq, SamplingParams, UnloadLoraReq
from tokenizer_proc import openai_routes
from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.http_io import (
    DONE_EVENT,
    KIND_STATUS,
    SSE_HEADERS,
    Generation,
    HttpError,
    HttpSink,
    Streamed,
    closing_on_error,
    decode_body,
    disconnected_response,
    guarded,
    json_response,
    read_body,
    send_body,
    send_start,
    sse_event,
)
from tokenizer_proc.metrics import CONTENT_TYPE
from tokenizer_proc.registry import AdapterRefused, ServerStopping, UnknownAdapter

log = logging.getLogger("tokenizer.http")
HEALTH_GENERATE_TIMEOUT_S = 20.0


def error_body(message: str, kind: str) -> dict[str, Any]:
    """The native error shape: ``{"error": {"message": ..., "kind": ...}}``."""
    return {"error": {"message": message, "kind": kind}}


def status_kind(status: int) -> str:
    """The native error ``kind`` of an HTTP status."""
    if status == 404:
        return "not_found"
    if status == 503:
        return "unavailable"
    return "server_error" if status >= 500 else "bad_request"


def native_error(status: int, message: str, kind: str | None = None, headers: dict | None = None) -> Response:
    """A native JSON error response."""
    return json_response(status, error_body(message, kind or status_kind(status)), headers)


def result_dict(msg: GenerateOut) -> dict[str, Any]:
    """A generation result in SGLang's shape (as ``ipc.client`` returns it)."""
    return {"text": msg.text, "output_ids": msg.output_ids, "meta_info": msgspec.to_builtins(msg.meta_info)}


def native_error_response(status: int, message: str, param: str | None, headers: dict | None, kind: str) -> Response:
    """:func:`native_error` with :data:`~tokenizer_proc.http_io.ErrorMaker`'s signature."""
    return native_error(status, message, kind or None, headers)


class NativeRoutes:
    """SGLang's endpoints over a :class:`FrontDoor`."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door

    def routes(self) -> list[Route]:
        """The Starlette routes (GET routes answer HEAD too, without a body)."""
        g = guarded(native_error_response)
        return [
            Route("/health", g(self.health), methods=["GET"]),
            Route("/health_generate", g(self.health_generate), methods=["GET"]),
            Route("/get_model_info", g(self.model_info), methods=["GET"]),
            Route("/metrics", g(self.metrics), methods=["GET"]),
            Route("/generate", g(self.generate), methods=["POST"]),
            Route("/load_lora_adapter", g(self.load_lora), methods=["POST"]),
            Route("/unload_lora_adapter", g(self.unload_lora), methods=["POST"]),
            Route("/list_loras", g(self.list_loras), methods=["GET"]),
        ]

    # ------------------------------------------------------------------ health and info
    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 while the scheduler and every TP rank answered recently (a heartbeat, not a
        generation); 503 with the reason otherwise (a rank silent, a TP group restarting, draining)."""
        problem = self.door.health.problem()
        if problem is not None:
            return json_response(503, {"status": "unavailable", "reason": problem})
        return json_response(200, {"status": "ok"})

    async def health_generate(self, request: Request) -> Response:
        """``GET /health_generate``: ``/health``, then a one-token generation (503 if it fails or takes over
        ``HEALTH_GENERATE_TIMEOUT_S``)."""
        problem = self.door.health.problem()
        if problem is not None:
            return json_response(503, {"status": "unavailable", "reason": problem})
        started = time.monotonic()
        wake = asyncio.Event()
        sink = HttpSink(wake)
        req = GenerateReq(text="ping", sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        await self.door.generate(req, sink)

        async def ended() -> None:
            while not sink.terminal:
                wake.clear()
                await wake.wait()

        try:
            await asyncio.wait_for(ended(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        msg = sink.take()
        if isinstance(msg, GenerateOut) and msg.finished:
            return json_response(200, {"status": "ok", "seconds": round(time.monotonic() - started, 3)})
        sink.gone = True
        self.door.abort_sink(sink, "health check timed out")
        why = msg.message if isinstance(msg, ErrorOut) else f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s"
        return json_response(503, {"status": "unavailable", "reason": f"one-token generation failed: {why}"})

    async def model_info(self, request: Request) -> Response:
        """``GET /get_model_info``: the served checkpoint and its limits."""
        args = self.door.args
        info = {
            "model_path": args.model_path,
            "tokenizer_path": args.model_path,
            "is_generation": True,
            "context_length": self.door.context_len,
            "vocab_size": self.door.vocab_size,
            "enable_lora": args.enable_lora,
        }
        return json_response(200, info)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text format."""
        return Response(self.door.metrics.exposition(), 200, media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ LoRA administration
    async def list_loras(self, request: Request) -> Response:
        """``GET /list_loras``: ``{"adapters": [{name, uid, path, rank, pinned, slots}, ...]}``."""
        try:
            out = await self.door.list_adapters()
        except RuntimeError as e:  # the scheduler did not answer
            raise HttpError(500, str(e)) from None
        return json_response(200, {"adapters": out.adapters})

    async def load_lora(self, request: Request) -> Response:
        """``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"?}``."""
        body: LoadLoraReq = decode_body(await read_body(request), LoadLoraReq)
        return await self._admin(self.door.load_adapter(body.lora_name, body.lora_path, body.pinned))

    async def unload_lora(self, request: Request) -> Response:
        """``POST /unload_lora_adapter {"lora_name"}``."""
        body: UnloadLoraReq = decode_body(await read_body(request), UnloadLoraReq)
        return await self._admin(self.door.unload_adapter(body.lora_name))

    async def _admin(self, op: Awaitable[AdminOut]) -> Response:
        try:
            out = await op
        except AdapterRefused as e:
            raise HttpError(400, str(e)) from None
        except UnknownAdapter as e:
            raise HttpError(404, str(e)) from None
        except ServerStopping as e:  # draining or stopping, as generation requests are told then
            raise HttpError(503, str(e)) from None
        except RuntimeError as e:
            raise HttpError(500, str(e)) from None
        if not out.ok:
            raise HttpError(400, out.message)
        return json_response(200, {"success": True, "message": out.message, **out.info})

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request) -> Response:
        """``POST /generate``: one result, or (``"stream": true``) server-sent events of cumulative chunks.

        An error before the first chunk is a plain JSON error with its status; one after it is an error event
        followed by ``[DONE]``.
        """
        greq: GenerateReq = decode_body(await read_body(request), GenerateReq)
        gen = Generation(self.door, request.receive)
        with closing_on_error(gen):
            await gen.submit([greq])
            news = await gen.updates()
            if news is None:
                gen.close()
                return disconnected_response()
            msg = news[0][1]
            if isinstance(msg, ErrorOut):
                gen.close()
                return native_error(KIND_STATUS.get(msg.kind, 500), msg.message, msg.kind)
            if not greq.stream:
                results = await gen.results() if not (isinstance(msg, GenerateOut) and msg.finished) else [msg]
                gen.close()
                if results is None:
                    return disconnected_response()
                final = results[0]
                if isinstance(final, ErrorOut):
                    return native_error(KIND_STATUS.get(final.kind, 500), final.message, final.kind)
                assert isinstance(final, GenerateOut)
                return json_response(200, result_dict(final))

        async def stream(send: Send) -> None:
            await send_start(send, 200, SSE_HEADERS)
            current = msg
            while True:
                if isinstance(current, ErrorOut):
                    await send_body(send, sse_event(error_body(current.message, current.kind)))
                    break
                assert isinstance(current, GenerateOut)
                await send_body(send, sse_event(result_dict(current)))
                if current.finished:
                    break
                news = await gen.updates()
                if news is None:
                    return  # the client left: Generation.close aborts the request
                current = news[-1][1]
            await send_body(send, DONE_EVENT, more=False)

        return Streamed(stream, gen.close)


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (404 unknown path, 405 wrong method) in the path's error shape."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if "Allow" in headers:  # Starlette builds it from a set: give it a stable order
        headers["Allow"] = ", ".join(sorted(headers["Allow"].split(", ")))
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; use {headers.get('Allow')}"
    elif exc.status_code == 404:
        message = f"no such endpoint: {request.url.path}"
    else:
        message = exc.detail
    if request.url.path.startswith("/v1/"):
        return openai_routes.error_response(exc.status_code, message, None, headers)
    return native_error(exc.status_code, message, headers=headers)


def build_app(door: FrontDoor) -> Starlette:
    """The Starlette app: native routes, OpenAI routes, JSON routing errors."""
    routes = NativeRoutes(door).routes() + openai_routes.OpenAIRoutes(door).routes()
    return Starlette(routes=routes, exception_handlers={HTTPException: http_exception})


def route_paths(app: Starlette) -> set[str]:
    """Every path the app serves (metric labels for anything else say ``unknown``)."""
    return {r.path for r in app.routes if isinstance(r, Route)}
