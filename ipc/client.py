"""Python clients for a Loom cluster's ZMQ front door (a DEALER talking to the tokenizer's ROUTER).

``generate`` returns SGLang's shape: ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens",
"completion_tokens", "finish_reason"}}``; server errors raise :class:`LoomError` carrying the server's text.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ipc.codec import Codec
from ipc.messages import (
    AbortReq,
    AdminOut,
    ChatMessage,
    ClientMsg,
    ErrorOut,
    GenerateOut,
    GenerateReq,
    HealthReq,
    ListLorasReq,
    LoadLoraReq,
    LoraListOut,
    SamplingParams,
    ServerMsg,
    UnloadLoraReq,
)

DEFAULT_ENDPOINT = "ipc:///tmp/loom.sock"


class LoomError(RuntimeError):
    """The server refused or failed a request. ``kind``: bad_request | not_found | server_error | timeout."""

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
) -> GenerateReq:
    try:
        sp = msgspec.convert(sampling_params or {}, SamplingParams)
        msgs = None if messages is None else [msgspec.convert(m, ChatMessage) for m in messages]
    except msgspec.ValidationError as e:
        raise LoomError(f"invalid request: {e}", "bad_request") from None
    return GenerateReq(text, input_ids, msgs, sp, stream, lora_path, rid or uuid.uuid4().hex)


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER connected to ``endpoint``; a malformed endpoint frees socket and context, then re-raises."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close()
        ctx.term()
        raise
    return sock


def _result(msg: GenerateOut) -> dict[str, Any]:
    return {"text": msg.text, "output_ids": msg.output_ids, "meta_info": msgspec.to_builtins(msg.meta_info)}


class LoomClient:
    """Blocking client. One DEALER socket; not thread-safe (use one client per thread).

    Args:
        endpoint: the cluster's front address (``launch.py`` prints it).
        timeout_s: longest wait for any reply before :class:`LoomError` (kind ``timeout``).
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 600.0) -> None:
        self.ctx = zmq.Context()
        self.sock = _dealer(self.ctx, endpoint)
        self.timeout_s = timeout_s
        self.timeout_ms = max(1, round(timeout_s * 1000))
        self.out: Codec = Codec(ClientMsg)
        self.inc: Codec = Codec(ServerMsg)
        self._stash: dict[str, list[Any]] = {}

    def close(self) -> None:
        """Close the socket (requests still running on the server are aborted when their replies bounce)."""
        self.sock.close()
        self.ctx.term()

    def __enter__(self) -> LoomClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_raw(self, frame: bytes) -> None:
        """Send raw bytes as one message (for testing how the server treats garbage)."""
        self.sock.send(frame)

    def recv(self) -> Any:
        """Next server message (raises LoomError on timeout)."""
        if not self.sock.poll(self.timeout_ms):
            raise LoomError(f"no reply from the server in {self.timeout_s:g} s", "timeout")
        return self.inc.decode(self.sock.recv())

    def _next_for(self, rid: str) -> Any:
        stash = self._stash.get(rid)
        if stash:
            return stash.pop(0)
        while True:
            msg = self.recv()
            mrid = getattr(msg, "rid", None)
            if mrid == rid or (isinstance(msg, ErrorOut) and mrid == ""):
                return msg
            if mrid is not None:
                self._stash.setdefault(mrid, []).append(msg)

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
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Generate from exactly one of ``text``, ``input_ids`` or chat ``messages``.

        Returns the result dict, or (``stream=True``) an iterator of cumulative result dicts; closing the
        iterator early aborts the request. Raises LoomError with the server's message on failure.
        """
        req = _request(text, input_ids, messages, sampling_params, stream, lora_path, rid)
        self.sock.send(self.out.encode(req))
        if stream:
            return self._stream(req.rid)
        return self._final(req.rid)

    def _final(self, rid: str) -> dict[str, Any]:
        while True:
            msg = self._next_for(rid)
            if isinstance(msg, ErrorOut):
                raise LoomError(msg.message, msg.kind, msg.rid)
            if isinstance(msg, GenerateOut) and msg.finished:
                return _result(msg)

    def _stream(self, rid: str) -> Iterator[dict[str, Any]]:
        done = False
        try:
            while not done:
                msg = self._next_for(rid)
                if isinstance(msg, ErrorOut):
                    done = True
                    raise LoomError(msg.message, msg.kind, msg.rid)
                done = msg.finished
                yield _result(msg)
        finally:
            if not done:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` (sent by this client)."""
        self.sock.send(self.out.encode(AbortReq(rid)))

    def _admin(self, msg: Any) -> Any:
        self.sock.send(self.out.encode(msg))
        while True:
            reply = self.recv()
            if isinstance(reply, (AdminOut, LoraListOut)):
                return reply
            if isinstance(reply, ErrorOut) and not reply.rid:
                raise LoomError(reply.message, reply.kind)
            self._stash.setdefault(reply.rid, []).append(reply)

    def _admin_ok(self, msg: Any) -> dict[str, Any]:
        reply = self._admin(msg)
        if not reply.ok:
            raise LoomError(reply.message, "bad_request")
        return {"message": reply.message, **reply.info}

    def health(self) -> dict[str, Any]:
        """``{"message": "ok", "running": N}`` when the front door answers."""
        return self._admin_ok(HealthReq())

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Load a PEFT adapter folder on every rank; raises LoomError naming what was wrong."""
        return self._admin_ok(LoadLoraReq(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload an adapter (running requests that use it finish first)."""
        return self._admin_ok(UnloadLoraReq(lora_name))

    def list_loras(self) -> list[dict[str, Any]]:
        """Loaded adapters: name, uid, path, rank, pinned and ``slots`` ({"rank N": slot})."""
        reply = self._admin(ListLorasReq())
        return [msgspec.to_builtins(a) for a in reply.adapters]


class AsyncLoomClient:
    """asyncio client: many concurrent ``generate`` calls share one DEALER socket.

    A ``rid`` must be unique among this client's requests in flight (a duplicate is refused with
    :class:`LoomError` kind ``bad_request``). Use ``async with AsyncLoomClient(...) as c:`` to close it.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 600.0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = _dealer(self.ctx, endpoint)
        self.timeout_s = timeout_s
        self.out: Codec = Codec(ClientMsg)
        self.inc: Codec = Codec(ServerMsg)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def _read(self) -> None:
        while True:
            msg = self.inc.decode(await self.sock.recv())
            q = self._queues.get(getattr(msg, "rid", ""))
            if q is not None:
                q.put_nowait(msg)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())

    async def generate_stream(
        self, text: str | None = None, *, _stream: bool = True, **kw: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Like :meth:`LoomClient.generate` with ``stream=True``; yields cumulative result dicts."""
        self._ensure_reader()
        req = _request(
            text,
            kw.get("input_ids"),
            kw.get("messages"),
            kw.get("sampling_params"),
            _stream,
            kw.get("lora_path"),
            kw.get("rid"),
        )
        if req.rid in self._queues:  # would steal the running request's replies: refuse before sending
            raise LoomError(f"request id {req.rid!r} is already running on this client", "bad_request", req.rid)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.rid] = q
        await self.sock.send(self.out.encode(req))
        done = False
        try:
            while not done:
                try:
                    msg = await asyncio.wait_for(q.get(), self.timeout_s)
                except asyncio.TimeoutError:
                    raise LoomError(f"no reply from the server in {self.timeout_s:g} s", "timeout", req.rid) from None
                if isinstance(msg, ErrorOut):
                    done = True
                    raise LoomError(msg.message, msg.kind, msg.rid)
                done = msg.finished
                yield _result(msg)
        finally:
            if self._queues.get(req.rid) is q:
                del self._queues[req.rid]
            if not done:
                await self.sock.send(self.out.encode(AbortReq(req.rid)))

    async def generate(self, text: str | None = None, **kw: Any) -> dict[str, Any]:
        """Like :meth:`LoomClient.generate` (non-streaming: one reply at the end); safe to run many at once."""
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
        self.sock.close()
        self.ctx.term()
