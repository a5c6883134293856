"""OpenAI-compatible endpoints over the front door: ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions`` (streamed as server-sent events ending with ``data: [DONE]``, or not).

``model`` is the base model's id, an adapter's name, or ``BASE:ADAPTER``. A prompt is tokenized once and its
``n`` choices are submitted as ``n`` requests (a seeded request's choices get seeds ``seed + i``). Errors use
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad or unsupported field (named),
404 for an unknown model or adapter (Loom's ``never been loaded`` text), 500 for a server error and 503 while
overloaded or draining.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Send

from ipc.lora_config import DEFAULT_SERVED_MODEL_NAME, MODEL_ADAPTER_SEPARATOR
from ipc.messages import ChatMessage, ErrorOut, GenerateOut, GenerateReq, SamplingParams, ServerMsg
from tokenizer_proc import openai_api as oa
from tokenizer_proc.http_io import (
    DONE_EVENT,
    KIND_STATUS,
    SSE_HEADERS,
    Generation,
    HttpError,
    Streamed,
    closing_on_error,
    disconnected_response,
    guarded,
    json_response,
    read_body,
    send_body,
    send_start,
    sse_event,
)
from tokenizer_proc.text import ChatTemplateError
from tokenizer_proc.token_bytes import TextOffsets
from tokenizer_proc.validate import BadRequest, PromptTooLong, validate_sampling

if TYPE_CHECKING:
    from tokenizer_proc.front_door import FrontDoor

DEFAULT_BASE_ID = DEFAULT_SERVED_MODEL_NAME


def error_response(
    status: int, message: str, param: str | None, headers: dict[str, str] | None = None, kind: str = ""
) -> Response:
    """An OpenAI-shaped JSON error (``kind``: Loom's error kind, which names a 503's ``code``)."""
    return json_response(status, oa.error_detail(status, message, param, kind), headers)


CHAT_DEFAULT_NOTE = "max_tokens was not given: it defaults to what the context leaves after the prompt, at least 1"


def _error_for(msg: ErrorOut, adapter: str | None = None) -> Response:
    """The response for a front-door error. Every field the front door checks was checked (and named) before
    the call was submitted, except the adapter: a 404, or with an adapter a 400, is about ``model``."""
    about_model = msg.kind == "not_found" or (msg.kind == "bad_request" and adapter is not None)
    status = KIND_STATUS.get(msg.kind, 500)
    return error_response(status, oa.openai_message(msg.message), "model" if about_model else None, None, msg.kind)


@dataclass
class Call:
    """One OpenAI call turned into Loom requests: choice ``i`` is request ``i``."""

    kind: str  # "chat" | "completion"
    model: str  # as the client named it (echoed in every response)
    reqs: list[GenerateReq]
    prompt_tokens: int  # counted once per prompt, whatever ``n`` is
    stream: bool
    include_usage: bool
    want_logprobs: bool
    want_top: bool  # completions: top_logprobs dicts


@dataclass
class Limits:
    """How many tokens a call's completions may take, as its length checks and their errors need it."""

    name: str  # the field the client sent (``max_tokens`` / ``max_completion_tokens``)
    given: int | None  # the value used for every choice (None: a chat's default, what the context leaves)
    prompt_param: str  # the prompt's OpenAI field: ``messages`` or ``prompt``
    note: str | None = None  # how the default was chosen, when the client gave no value

    @property
    def least(self) -> int:
        """The fewest tokens a completion may take (1 for a chat's default)."""
        return 1 if self.given is None else self.given


@dataclass
class Cursor:
    """How much of one choice a stream has sent."""

    chars: int = 0
    tokens: int = 0
    finished: bool = False
    offsets: TextOffsets = field(default_factory=TextOffsets)  # completions' text_offset, fed as tokens are sent
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class OpenAIRoutes:
    """The OpenAI endpoints over a :class:`FrontDoor`."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.created = int(time.time())
        self.base_id = door.args.served_model_name or DEFAULT_BASE_ID
        self.token_bytes: Callable[[int], bytes] = lambda tok: door.codec.token_bytes(tok)

    def routes(self) -> list[Route]:
        """The Starlette routes."""
        g = guarded(error_response)
        return [
            Route("/v1/models", g(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", g(self.model), methods=["GET"]),
            Route("/v1/chat/completions", g(self.chat), methods=["POST"]),
            Route("/v1/completions", g(self.completions), methods=["POST"]),
        ]

    # ------------------------------------------------------------------ /v1/models
    def _cards(self) -> list[oa.ModelCard]:
        door = self.door
        reg = door.registry
        cards = [oa.ModelCard(self.base_id, self.created, door.args.model_path, None, door.context_len)]
        paths = {name: e.path for name, e in reg.loaded.items()}
        paths.update({name: ref[0] for name, ref in reg.refs.items() if name not in paths})
        for name in sorted(paths):
            cards.append(oa.ModelCard(name, self.created, paths[name], self.base_id, door.context_len))
        return cards

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the base model and every adapter a request may name (``parent`` = the base)."""
        return json_response(200, oa.ModelList(self._cards()))

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: one entry of the list (``BASE:ADAPTER`` names the adapter's, as in a
        request's ``model``); 404 ``model_not_found`` for any other id."""
        model = request.path_params["model"]
        prefix = self.base_id + MODEL_ADAPTER_SEPARATOR
        cards = self._cards()
        for want in (model, model[len(prefix) :] if model.startswith(prefix) else None):
            for card in cards:
                if card.id == want:
                    return json_response(200, card)
        raise HttpError(404, f"The model `{model}` does not exist", param="model")

    # ------------------------------------------------------------------ requests
    def _adapter(self, model: str) -> str | None:
        reg = self.door.registry
        names = set(reg.loaded) | set(reg.refs)
        return oa.resolve_model(model, self.base_id, names, self.door.args.enable_lora)

    async def _tokenize(self, limits: Limits, **prompt: Any) -> list[int]:
        """Token ids of one prompt (``text=`` or ``messages=``), checked and tokenized by the front door (its
        length checks count the ``max_tokens`` the request will use)."""
        probe = GenerateReq(sampling_params=SamplingParams(max_new_tokens=limits.least), **prompt)
        try:
            return await self.door.prompt_ids(probe, limits.name)
        except BadRequest as e:
            note = f" ({limits.note})" if isinstance(e, PromptTooLong) and limits.note else ""
            param = oa.openai_param(e.field, limits.prompt_param, limits.name)
            raise HttpError(400, oa.openai_message(str(e), limits.name) + note, param=param) from None
        except ChatTemplateError as e:
            raise HttpError(400, str(e), param="messages") from None
        except RuntimeError as e:  # Overloaded: too many long prompts wait for the tokenizer thread
            raise HttpError(503, str(e), kind="overloaded") from None

    def _check_sampling(self, req: oa.ChatCompletionRequest | oa.CompletionRequest, limits: Limits) -> None:
        """Check the sampling values as the front door will (its errors name OpenAI's fields here)."""
        probe = GenerateReq(sampling_params=oa.sampling_params(req, limits.least, 0))
        try:
            validate_sampling(probe, self.door.context_len, self.door.vocab_size)
        except BadRequest as e:
            param = oa.openai_param(e.field, limits.prompt_param, limits.name)
            raise HttpError(400, oa.openai_message(str(e), limits.name), param=param) from None

    def _check_ids(self, ids: list[int], limits: Limits, where: str) -> None:
        """Refuse a tokenized prompt that leaves no room for its completion, or (token-id prompts) holds an id
        outside the vocabulary; ``where`` names the prompt (``prompt``, ``prompt[1]``, ``messages``)."""
        context, vocab = self.door.context_len, self.door.vocab_size
        if limits.given is not None and len(ids) + limits.given > context:
            why = (
                f"{where} ({len(ids)} tokens) + {limits.name} ({limits.given}) exceeds the context length {context}; "
                f"shorten the prompt or lower {limits.name}"
            )
            raise HttpError(400, why + (f" ({limits.note})" if limits.note else ""), param=limits.prompt_param)
        if limits.given is None and len(ids) + 1 > context:
            why = f"{where} ({len(ids)} tokens) leaves no room for a completion in the context length {context}"
            raise HttpError(400, f"{why} ({limits.note})", param=limits.prompt_param)
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                why = f"{where}[{i}]={t} is outside the vocabulary [0, {vocab})"
                raise HttpError(400, why, param=limits.prompt_param)

    def _check_admitting(self) -> None:
        if self.door.health.draining is not None:
            raise HttpError(503, self.door.health.draining)

    def _check_choices(self, count: int, what: str) -> None:
        """400 when one call asks for more generations than the server ever queues: a 503 "retry later" would
        be retried in vain."""
        if count > self.door.max_queued:
            raise HttpError(
                400,
                f"{what} asks for {count} generations, more than the server ever queues at once "
                f"(--max-queued-requests {self.door.max_queued})",
                param="n",
            )

    def _requests(
        self,
        req: oa.ChatCompletionRequest | oa.CompletionRequest,
        prompts: list[list[int]],
        max_tokens: Callable[[list[int]], int],
        top_n: int | None,
    ) -> list[GenerateReq]:
        lora = self._adapter(req.model)
        out = []
        for ids in prompts:
            for j in range(req.n):
                sp = oa.sampling_params(req, max_tokens(ids), j)
                out.append(
                    GenerateReq(
                        input_ids=ids,
                        sampling_params=sp,
                        stream=req.stream,
                        lora_path=lora,
                        return_logprob=top_n is not None,
                        top_logprobs_num=top_n or 0,
                    )
                )
        return out

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        req: oa.ChatCompletionRequest = oa.decode_request(await read_body(request), oa.ChatCompletionRequest)
        oa.check_supported(req)
        self._check_admitting()
        self._check_choices(req.n or 1, f"n={req.n}")
        self._adapter(req.model)  # an unknown model fails before the prompt is tokenized
        messages = [ChatMessage(m["role"], m["content"]) for m in oa.chat_messages(req)]
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        limits = Limits(name, limit, "messages", None if limit is not None else CHAT_DEFAULT_NOTE)
        self._check_sampling(req, limits)
        ids = await self._tokenize(limits, messages=messages)
        self._check_ids(ids, limits, "the chat prompt")
        context = self.door.context_len

        def max_tokens(p: list[int]) -> int:
            return limit if limit is not None else max(1, context - len(p))

        top_n = (req.top_logprobs or 0) if req.logprobs else None
        call = Call(
            "chat",
            req.model,
            self._requests(req, [ids], max_tokens, top_n),
            len(ids),
            req.stream,
            bool(req.stream_options and req.stream_options.include_usage),
            req.logprobs,
            False,
        )
        return await self._run(request, call)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        req: oa.CompletionRequest = oa.decode_request(await read_body(request), oa.CompletionRequest)
        oa.check_supported(req)
        self._check_admitting()
        self._adapter(req.model)
        limit = oa.COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        note = None if req.max_tokens is not None else f"max_tokens defaults to {oa.COMPLETIONS_DEFAULT_MAX_TOKENS}"
        limits = Limits("max_tokens", limit, "prompt", note)
        self._check_sampling(req, limits)
        given = oa.completion_prompts(req)
        what = f"n={req.n}" if len(given) == 1 else f"n={req.n} for each of {len(given)} prompts"
        self._check_choices(len(given) * (req.n or 1), what)
        prompts = []
        for j, p in enumerate(given):
            ids = p if isinstance(p, list) else await self._tokenize(limits, text=p)
            self._check_ids(ids, limits, "prompt" if len(given) == 1 else f"prompt[{j}]")
            prompts.append(ids)
        call = Call(
            "completion",
            req.model,
            self._requests(req, prompts, lambda _p: limit, req.logprobs),
            sum(len(p) for p in prompts),
            req.stream,
            bool(req.stream_options and req.stream_options.include_usage),
            req.logprobs is not None,
            bool(req.logprobs),
        )
        return await self._run(request, call)

    # ------------------------------------------------------------------ running a call
    async def _run(self, request: Request, call: Call) -> Response:
        gen = Generation(self.door, request.receive)
        with closing_on_error(gen):
            await gen.submit(call.reqs)
            adapter = call.reqs[0].lora_path
            err = gen.first_error()
            if err is not None:
                gen.close()
                return _error_for(err, adapter)
            if not call.stream:
                results = await gen.results()
                gen.close()
                if results is None:
                    return disconnected_response()
                if isinstance(results[0], ErrorOut):
                    return _error_for(results[0], adapter)
                return json_response(200, self._final(call, [r for r in results if isinstance(r, GenerateOut)]))
            first = await gen.updates()
            if first is None:
                gen.close()
                return disconnected_response()
            errors = [m for _, m in first if isinstance(m, ErrorOut)]
            if errors:  # nothing was sent yet: a plain error response
                gen.close()
                return _error_for(errors[0], adapter)

        async def stream(send: Send) -> None:
            await self._stream(send, call, gen, first)

        return Streamed(stream, gen.close)

    def _final(self, call: Call, outs: list[GenerateOut]) -> Any:
        rid = oa.new_id("chat" if call.kind == "chat" else "completion")
        created = int(time.time())
        used = oa.usage(
            call.prompt_tokens,
            sum(o.meta_info.completion_tokens for o in outs),
            [(o.meta_info.prompt_tokens, o.meta_info.cached_tokens) for o in outs],
        )
        if call.kind == "chat":
            choices = [
                oa.ChatChoice(
                    i,
                    oa.AssistantMessage(o.text),
                    oa.chat_logprobs(o.meta_info, 0, None, self.token_bytes) if call.want_logprobs else None,
                    oa.finish_reason(o.meta_info.finish_reason),
                )
                for i, o in enumerate(outs)
            ]
            return oa.ChatCompletion(rid, created, call.model, choices, used)
        completions = []
        for i, o in enumerate(outs):
            lp = None
            if call.want_logprobs:
                lp = oa.completion_logprobs(o.meta_info, 0, call.want_top, self.token_bytes)
            completions.append(oa.CompletionChoice(i, o.text, lp, oa.finish_reason(o.meta_info.finish_reason)))
        return oa.Completion(rid, created, call.model, completions, usage=used)

    async def _stream(self, send: Send, call: Call, gen: Generation, news: list[tuple[int, ServerMsg]]) -> None:
        """Write the SSE response: per choice its text deltas (and logprobs), then its finish reason; with
        ``include_usage`` a last chunk with the usage; then ``[DONE]``. A failure mid-stream is an error event
        followed by ``[DONE]``."""
        rid = oa.new_id("chat" if call.kind == "chat" else "completion")
        created = int(time.time())
        usage_field: Any = None if call.include_usage else msgspec.UNSET
        cursors = [Cursor() for _ in call.reqs]

        def chat_chunk(choice: oa.ChatChunkChoice) -> bytes:
            return sse_event(oa.ChatCompletionChunk(rid, created, call.model, [choice], usage=usage_field))

        def text_chunk(choice: oa.CompletionChoice) -> bytes:
            return sse_event(oa.Completion(rid, created, call.model, [choice], usage=usage_field))

        await send_start(send, 200, SSE_HEADERS)
        if call.kind == "chat":
            for i in range(len(call.reqs)):
                await send_body(send, chat_chunk(oa.ChatChunkChoice(i, oa.Delta(role="assistant", content=""))))
        while True:
            for i, msg in news:
                if isinstance(msg, ErrorOut):
                    status = KIND_STATUS.get(msg.kind, 500)
                    detail = oa.error_detail(status, oa.openai_message(msg.message), None, msg.kind)
                    await send_body(send, sse_event(detail))
                    await send_body(send, DONE_EVENT, more=False)
                    return
                assert isinstance(msg, GenerateOut)
                for data in self._chunks(call, cursors[i], i, msg, chat_chunk, text_chunk):
                    await send_body(send, data)
            if all(c.finished for c in cursors):
                break
            next_news = await gen.updates()
            if next_news is None:
                return  # the client left: Generation.close aborts what still runs
            news = next_news
        if call.include_usage:
            used = oa.usage(
                call.prompt_tokens,
                sum(c.completion_tokens for c in cursors),
                [(c.prompt_tokens, c.cached_tokens) for c in cursors],
            )
            if call.kind == "chat":
                await send_body(send, sse_event(oa.ChatCompletionChunk(rid, created, call.model, [], usage=used)))
            else:
                await send_body(send, sse_event(oa.Completion(rid, created, call.model, [], usage=used)))
        await send_body(send, DONE_EVENT, more=False)

    def _chunks(
        self,
        call: Call,
        cur: Cursor,
        i: int,
        msg: GenerateOut,
        chat_chunk: Callable[[oa.ChatChunkChoice], bytes],
        text_chunk: Callable[[oa.CompletionChoice], bytes],
    ) -> list[bytes]:
        """The chunks that bring choice ``i`` from ``cur`` up to ``msg`` (and advance ``cur``)."""
        if cur.finished:
            return []
        meta = msg.meta_info
        delta = msg.text[cur.chars :] if len(msg.text) > cur.chars else ""
        n_lp = len(meta.output_token_logprobs or ())
        out = []
        reason = oa.finish_reason(meta.finish_reason) if msg.finished else None
        if call.kind == "chat":
            lps = oa.chat_logprobs(meta, cur.tokens, None, self.token_bytes) if call.want_logprobs else None
            if delta or (lps is not None and lps.content):
                out.append(chat_chunk(oa.ChatChunkChoice(i, oa.Delta(content=delta), lps)))
            if reason is not None:
                out.append(chat_chunk(oa.ChatChunkChoice(i, oa.Delta(), None, reason)))
        else:
            lp = (
                oa.completion_logprobs(meta, cur.tokens, call.want_top, self.token_bytes, cur.offsets)
                if call.want_logprobs
                else None
            )
            if delta or reason is not None or (lp is not None and lp.tokens):
                out.append(text_chunk(oa.CompletionChoice(i, delta, lp, reason)))
        cur.chars += len(delta)
        cur.tokens = max(cur.tokens, n_lp)
        if msg.finished:
            cur.finished = True
            cur.completion_tokens = meta.completion_tokens
            cur.prompt_tokens, cur.cached_tokens = meta.prompt_tokens, meta.cached_tokens
        return out
