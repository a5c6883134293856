"""OpenAI's chat and completions API as msgspec Structs, and the conversions between it and Loom's requests.

No I/O here: :mod:`tokenizer_proc.openai_routes` decodes bodies into these Structs, turns them into
:class:`~ipc.messages.GenerateReq` with :func:`sampling_params`, and formats Loom's replies with the builders
below. Fields Loom does not implement are refused by name (400), never ignored: an unknown field by the decoder,
a known one (``tools``, ``response_format``, penalties, ``logit_bias``, ...) unless it holds its no-op value.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Collection
from typing import Any, Literal

import msgspec

from ipc.lora_config import MODEL_ADAPTER_SEPARATOR
from ipc.messages import FinishReason, MetaInfo, SamplingParams
from tokenizer_proc.http_io import HttpError
from tokenizer_proc.token_bytes import TextOffsets, token_string
from tokenizer_proc.validate import CHAT_ROLES

MAX_N = 64  # choices per request
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_SEED = 2**63 - 1  # the largest seed Loom's samplers take
ROLES = (*CHAT_ROLES, "developer")  # developer is taken as system
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?")
_AT = re.compile(r" - at `\$\.?([^`]*)`")
TokenBytesOf = Callable[[int], bytes]  # a token id's bytes (tokenizer_proc.token_bytes)

# ----------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``stream_options``: with ``include_usage`` a last chunk carries the usage (and every other one ``null``)."""

    include_usage: bool = False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    """One part of a message's content; Loom serves text parts only."""

    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    """A chat message as OpenAI clients send it (``developer`` is taken as ``system``)."""

    role: str
    content: str | list[ContentPart] | None = None


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by chat and completions requests."""

    def __post_init__(self) -> None:
        # null means the default for every optional field, as OpenAI's schema types them (``T | null``)
        if self.n is None:
            self.n = 1
        self.stream = bool(self.stream)
        self.ignore_eos = bool(self.ignore_eos)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1  # null means the default, as in OpenAI's schema
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's records; Loom does not use it
    # accepted only at their no-op values (refused by name otherwise)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    service_tier: str | None = None
    # Loom extensions with SGLang's / vLLM's names (the openai client sends them with extra_body)
    top_k: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None  # tags for OpenAI's stored completions; Loom stores none
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/completions`` (``prompt``: a string, a list of strings, token ids, or lists of token ids)."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.echo = bool(self.echo)


def decode_request(body: bytes, typ: type) -> Any:
    """Decode a request body; HttpError 400 naming the field for bad JSON, unknown or ill-typed fields."""
    if not body.strip():
        raise HttpError(400, "request body is empty: expected a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _UNKNOWN_FIELD.search(text)
        if m is not None:
            where = m.group(2) or ""
            param = f"{where}.{m.group(1)}" if where else m.group(1)
            raise HttpError(400, f"Unsupported field `{param}`: Loom does not implement it", param=param) from None
        at = _AT.search(text)
        raise HttpError(400, f"Invalid request: {text}", param=at.group(1) if at else None) from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"Request body is not valid JSON: {e}") from None


def _refuse(field: str, accepted: str) -> None:
    why = f"Unsupported field `{field}`: Loom does not implement it (accepted only as {accepted})"
    raise HttpError(400, why, param=field)


def check_supported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse (400, naming the field) every known field Loom does not implement unless it holds its no-op value,
    and values outside Loom's limits (``n``, logprobs)."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0):
            _refuse(name, "0")
    if req.logit_bias:
        _refuse("logit_bias", "{}")
    if req.service_tier not in (None, "auto", "default"):
        _refuse("service_tier", '"auto" or "default"')
    if not 1 <= req.n <= MAX_N:
        raise HttpError(400, f"n={req.n} must be in [1, {MAX_N}]", param="n")
    check_seed(req.seed, req.n)
    if req.stream_options is not None and not req.stream:
        raise HttpError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if isinstance(req, ChatCompletionRequest):
        if req.response_format not in (None, {"type": "text"}):
            _refuse("response_format", '{"type": "text"}')
        if req.tools:
            _refuse("tools", "[]")
        if req.tool_choice not in (None, "none"):
            _refuse("tool_choice", '"none"')
        if req.store:
            _refuse("store", "false")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise HttpError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise HttpError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
            raise HttpError(400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens")
    else:
        if req.echo:
            _refuse("echo", "false")
        if req.suffix:
            _refuse("suffix", "null")
        if req.best_of not in (None, req.n):
            _refuse("best_of", f"n ({req.n})")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise HttpError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")


def check_seed(seed: int | None, n: int) -> None:
    """Refuse (400, param ``seed``) a seed outside ``[0, 2**63 - 1]``, or one whose choices' seeds
    ``seed + i`` (``i < n``) would pass that limit."""
    if seed is None:
        return
    if not 0 <= seed <= MAX_SEED:
        raise HttpError(400, f"seed={seed} must be in [0, {MAX_SEED}] (2**63 - 1)", param="seed")
    if seed + n - 1 > MAX_SEED:
        why = (
            f"seed={seed} with n={n}: choice i is sampled with seed + i, and seed + n - 1 = {seed + n - 1} exceeds "
            f"the largest seed {MAX_SEED} (2**63 - 1); use a seed of at most {MAX_SEED - n + 1}"
        )
        raise HttpError(400, why, param="seed")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as Loom's chat template takes them (text parts joined by newlines). Refuses (400, naming
    ``messages[i].role`` / ``messages[i].content``) an empty list, an unknown role and a message without
    content (Loom serves no tool calls, so every message carries its content)."""
    if not req.messages:
        raise HttpError(400, "messages is empty: give at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            where = f"messages[{i}].role"
            raise HttpError(400, f"{where}={m.role!r} must be one of {', '.join(ROLES)}", param=where)
        if m.content is None:
            where = f"messages[{i}].content"
            why = f"{where} is required: every message carries its text (Loom supports no tool calls)"
            raise HttpError(400, why, param=where)
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    where = f"messages[{i}].content[{j}]"
                    why = f"{where}: content type {part.type!r} is not supported (text only)"
                    raise HttpError(400, why, param=where)
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """``prompt`` as a list of prompts, each a string or token ids."""
    p = req.prompt
    if isinstance(p, str):
        if not p:
            raise HttpError(400, "prompt is empty", param="prompt")
        return [p]
    if not p:
        raise HttpError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p):
        for j, x in enumerate(p):
            if not x:
                raise HttpError(400, f"prompt[{j}] is empty", param="prompt")
        return list(p)
    if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        for j, x in enumerate(p):
            if not x:
                raise HttpError(400, f"prompt[{j}] is empty", param="prompt")
        return [list(x) for x in p]
    raise HttpError(400, "prompt must be a string, a list of strings, token ids or lists of token ids", param="prompt")


def resolve_model(model: str, base_id: str, adapters: Collection[str], lora_enabled: bool) -> str | None:
    """The adapter ``model`` names (None: the base model): the base model's id, an adapter's name, or
    ``BASE:ADAPTER``. Any other name is taken as an adapter name, so the front door answers 404 with its
    ``never been loaded`` text; ``OTHER:ADAPTER`` for another base, and any name without LoRA, is a 404
    ``model_not_found``. An empty ``model`` or an empty
    adapter after ``BASE:`` is a 400."""
    if model == base_id:
        return None
    if not model.strip():
        why = f"model={model!r} is empty: name the base model `{base_id}` or a LoRA adapter"
        raise HttpError(400, why, param="model")
    prefix = base_id + MODEL_ADAPTER_SEPARATOR
    if model.startswith(prefix) and not model[len(prefix) :].strip():
        why = f"model={model!r} names no adapter after `{prefix}`: give `{prefix}ADAPTER` or the base model `{base_id}`"
        raise HttpError(400, why, param="model")
    if not lora_enabled:
        raise HttpError(404, f"The model `{model}` does not exist: this server serves `{base_id}`", param="model")
    if model not in adapters and model.startswith(prefix):
        return model[len(prefix) :]
    if MODEL_ADAPTER_SEPARATOR in model and model not in adapters:  # no adapter name holds one (adapter_name_problem)
        other = model.split(MODEL_ADAPTER_SEPARATOR, 1)[0]
        why = f"The model `{model}` does not exist: `{other}` is not this server's model `{base_id}` (name an adapter "
        raise HttpError(404, why + f"as `{prefix}ADAPTER` or by its own name)", param="model")
    return model


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_new_tokens: int, choice: int) -> SamplingParams:
    """Loom's sampling parameters for choice number ``choice`` (a seeded request's choices get seeds
    ``seed``, ``seed + 1``, ... so that they differ and each stays reproducible; :func:`check_seed` refused a
    seed whose choices would pass ``MAX_SEED``)."""
    seed = req.seed
    if seed is not None and choice:
        seed = seed + choice
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=seed,
    )


def openai_message(text: str, max_tokens_name: str = "max_tokens") -> str:
    """A front-door error message with Loom's native field names replaced by OpenAI's (``max_tokens_name``: the
    field the client sent, ``max_tokens`` or ``max_completion_tokens``)."""
    text = text.replace("sampling_params.max_new_tokens", max_tokens_name).replace("max_new_tokens", max_tokens_name)
    return text.replace("sampling_params.", "").replace("lora_path", "model")


def openai_param(field: str | None, prompt_param: str, max_tokens_name: str = "max_tokens") -> str | None:
    """The OpenAI field (``param``) for a native field named by a :class:`~tokenizer_proc.validate.BadRequest`:
    ``sampling_params.X`` is ``X`` (``max_new_tokens`` is ``max_tokens_name``), the prompt's fields
    (``text``, ``input_ids[...]``) are ``prompt_param``, ``lora_path`` is ``model``; ``messages[...]`` stays."""
    if field is None:
        return None
    if field == "sampling_params.max_new_tokens":
        return max_tokens_name
    if field.startswith("sampling_params."):
        return field[len("sampling_params.") :]
    if field == "text" or field.startswith("input_ids"):
        return prompt_param
    if field == "lora_path":
        return "model"
    if field == "top_logprobs_num":
        return "top_logprobs" if prompt_param == "messages" else "logprobs"
    return field


# ----------------------------------------------------------------------------- responses


class ErrorDetail(msgspec.Struct):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """``{"error": {...}}``."""

    error: ErrorDetail


def error_detail(status: int, message: str, param: str | None, loom_kind: str = "") -> ErrorResponse:
    """OpenAI's error shape for an HTTP status (``code`` ``model_not_found`` for a 404 about ``model``; a 503's
    ``code`` is ``overloaded`` for a full queue, so that a client can tell it from ``unavailable``, a drain or
    restart)."""
    if status >= 500:
        kind = "server_error"
        code = ("overloaded" if loom_kind == "overloaded" else "unavailable") if status == 503 else None
    else:
        kind, code = "invalid_request_error", {413: "request_too_large"}.get(status)
        if status == 404 and param == "model":
            code = "model_not_found"
    return ErrorResponse(ErrorDetail(message, kind, param, code))


class PromptTokensDetails(msgspec.Struct):
    """How many prompt tokens came from Loom's prefix cache (OpenAI's ``usage.prompt_tokens_details``)."""

    cached_tokens: int


class Usage(msgspec.Struct):
    """Token counts of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached: list[tuple[int, int]] | None = None) -> Usage:
    """A :class:`Usage` with its total.

    ``cached`` holds each choice's ``(prompt tokens, cached prompt tokens)``; as ``prompt_tokens`` counts each
    prompt once however many choices it has, the cached count is scaled the same way (the choices' mean).
    """
    details = None
    if cached is not None:
        seen = sum(p for p, _ in cached)
        hit = sum(c for _, c in cached)
        details = PromptTokensDetails(0 if seen == 0 else min(prompt_tokens, hit * prompt_tokens // seen))
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


class TopLogprob(msgspec.Struct):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    """The chosen token at a position and its alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    """A chat choice's ``logprobs``."""

    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    """A completions choice's ``logprobs`` (the legacy shape)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class AssistantMessage(msgspec.Struct):
    """The generated message."""

    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(msgspec.Struct):
    """A chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: None = None


class Delta(msgspec.Struct, omit_defaults=True):
    """What a chat chunk adds to a choice (``{}`` in the chunk that ends it)."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice's part of a chat chunk."""

    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    """A streamed chat chunk (``usage`` is present only with ``stream_options.include_usage``)."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: None = None
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class CompletionChoice(msgspec.Struct):
    """One choice of a completion (also a streamed chunk's choice, with ``finish_reason`` None until the end)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    """A completion, or a streamed completion chunk (``usage`` as for chat chunks)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    system_fingerprint: None = None
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct):
    """One entry of ``/v1/models``: the base model (``parent`` None) or an adapter (``parent`` = the base)."""

    id: str
    created: int
    root: str
    parent: str | None
    max_model_len: int
    object: str = "model"
    owned_by: str = "loom"


class ModelList(msgspec.Struct):
    """``GET /v1/models``."""

    data: list[ModelCard]
    object: str = "list"


def new_id(kind: Literal["chat", "completion"]) -> str:
    """A response id (``chatcmpl-...`` / ``cmpl-...``)."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def finish_reason(fr: FinishReason | None) -> str:
    """OpenAI's finish reason: ``length`` for a request that hit its token limit, else ``stop``."""
    return "length" if fr is not None and fr.type == "length" else "stop"


def _top(meta: MetaInfo, i: int) -> list[tuple[float, int]]:
    tops = meta.output_top_logprobs
    return list(tops[i]) if tops is not None and i < len(tops) else []


def chat_logprobs(meta: MetaInfo, start: int, end: int | None, token_bytes: TokenBytesOf) -> ChatLogprobs | None:
    """The chat ``logprobs`` of tokens ``start:end`` (None when meta_info carries no logprobs): each token's real
    bytes, and its text, or ``bytes:\\xNN...`` for a piece of a character (:func:`token_string`)."""
    lps = meta.output_token_logprobs
    if lps is None:
        return None
    out = []
    stop = len(lps) if end is None else min(end, len(lps))
    for i in range(start, stop):
        lp, tok = lps[i]
        raw = token_bytes(tok)
        tops = []
        for v, t in _top(meta, i):
            top_raw = token_bytes(t)
            tops.append(TopLogprob(token_string(top_raw), v, list(top_raw)))
        out.append(TokenLogprob(token_string(raw), lp, list(raw), tops))
    return ChatLogprobs(out)


def completion_logprobs(
    meta: MetaInfo, start: int, want_top: bool, token_bytes: TokenBytesOf, offsets: TextOffsets | None = None
) -> CompletionLogprobs | None:
    """The legacy completions ``logprobs`` of tokens from ``start`` (None when meta_info carries no logprobs);
    ``text_offset`` counts the output text's characters before each token. ``offsets``: a stream's counter,
    which has seen tokens ``[0, start)`` (a fresh one, or one that has not, starts again from token 0)."""
    lps = meta.output_token_logprobs
    if lps is None:
        return None
    if offsets is None or offsets.tokens != start:
        offsets = TextOffsets()
        offsets.feed(token_bytes(tok) for _, tok in lps[:start])
    tokens, values, tops = [], [], []
    pieces = [token_bytes(tok) for _, tok in lps[start:]]
    for i, raw in enumerate(pieces, start):
        tokens.append(token_string(raw))
        values.append(lps[i][0])
        tops.append({token_string(token_bytes(t)): v for v, t in _top(meta, i)})
    offsets_out = offsets.feed(pieces)
    return CompletionLogprobs(tokens, values, tops if want_top else None, offsets_out)
