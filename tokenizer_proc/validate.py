"""Check a client's GenerateReq before it costs anything; every error names the bad field and value."""

from __future__ import annotations

import math

from ipc.messages import GenerateReq

MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


class BadRequest(ValueError):
    """The request is malformed; the message names what is wrong and ``field`` the native field at fault
    (``sampling_params.temperature``, ``messages[0].role``, ``input_ids``, ...; None when no one field is)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLong(BadRequest):
    """The prompt (with the tokens asked for) can never fit the context."""


def _check_number(name: str, value: float, lo: float, hi: float, lo_open: bool, meaning: str) -> None:
    """Raise BadRequest unless ``value`` is a finite number in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``)."""
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    field = f"sampling_params.{name}"
    if math.isnan(value):
        raise BadRequest(f"{field}={value} is not a number; it must be in {interval} ({meaning})", field)
    if math.isinf(value):
        raise BadRequest(f"{field}={value} is not finite; it must be in {interval} ({meaning})", field)
    if not (lo < value if lo_open else lo <= value) or value > hi:
        raise BadRequest(f"{field}={value} must be in {interval} ({meaning})", field)


def validate_sampling(req: GenerateReq, context_len: int, vocab_size: int) -> None:
    """Raise BadRequest for a sampling value outside its range, naming the field and the value.

    Every value accepted here can be sampled (see ``gpu_worker/sampling.py``): a temperature below
    ``GREEDY_TEMPERATURE_EPS`` (1e-5) is greedy, and a ``top_p`` too small for any token keeps the top one.
    NaN and infinities are refused by name for the float fields.
    """
    sp = req.sampling_params
    if not 1 <= sp.max_new_tokens <= context_len:
        raise BadRequest(
            f"sampling_params.max_new_tokens={sp.max_new_tokens} must be in [1, {context_len}]",
            "sampling_params.max_new_tokens",
        )
    _check_number("temperature", sp.temperature, 0.0, MAX_TEMPERATURE, False, "0 or below 1e-5 = greedy")
    _check_number("top_p", sp.top_p, 0.0, 1.0, True, "1 = off")
    if sp.top_k != -1 and not 1 <= sp.top_k <= vocab_size:
        raise BadRequest(
            f"sampling_params.top_k={sp.top_k} must be -1 (off) or in [1, {vocab_size}]", "sampling_params.top_k"
        )
    stops = sp.stop_strings()
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LEN for s in stops):
        raise BadRequest(
            f"sampling_params.stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LEN} chars",
            "sampling_params.stop",
        )
    bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"sampling_params.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})",
            "sampling_params.stop_token_ids",
        )
    if sp.seed is not None and not 0 <= sp.seed < 2**63:
        raise BadRequest(f"sampling_params.seed={sp.seed} must be in [0, 2**63)", "sampling_params.seed")


MAX_TOP_LOGPROBS = 20


def validate_logprobs(req: GenerateReq) -> None:
    """Raise BadRequest unless ``top_logprobs_num`` is in [0, 20] and only given with ``return_logprob``."""
    if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise BadRequest(
            f"top_logprobs_num={req.top_logprobs_num} must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs_num"
        )
    if req.top_logprobs_num and not req.return_logprob:
        raise BadRequest(f"top_logprobs_num={req.top_logprobs_num} needs return_logprob=true", "top_logprobs_num")


def validate_prompt_ids(ids: list[int], max_new_tokens: int, context_len: int, vocab_size: int) -> None:
    """Raise BadRequest for an empty prompt, ids outside the vocabulary or a prompt over the context."""
    if not ids:
        raise BadRequest("the prompt is empty", "input_ids")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise BadRequest(f"input_ids[{i}]={t} is outside the vocabulary [0, {vocab_size})", f"input_ids[{i}]")
    if len(ids) + max_new_tokens > context_len:
        raise PromptTooLong(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context length {context_len}",
            "input_ids",
        )


MAX_RID_LEN = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_prompt_chars(
    what: str,
    n_chars: int,
    max_new_tokens: int,
    context_len: int,
    max_token_chars: int,
    *,
    field: str | None = None,
    limit_name: str = "max_new_tokens",
) -> None:
    """Raise PromptTooLong when ``n_chars`` characters can never fit the context, before anything is tokenized.

    No token stands for more than ``max_token_chars`` characters, so a prompt longer than
    ``(context_len - max_new_tokens) * max_token_chars`` characters needs more tokens than the context leaves.
    ``field`` is the prompt's field and ``limit_name`` what the message calls ``max_new_tokens`` (the OpenAI
    routes say ``max_tokens``).
    """
    budget = max(0, context_len - max_new_tokens)
    limit = budget * max_token_chars
    if n_chars > limit and budget == 0:
        raise PromptTooLong(
            f"{limit_name} ({max_new_tokens}) leaves no room for {what} in the context length {context_len}: "
            f"lower {limit_name} below {context_len}",
            field,
        )
    if n_chars > limit:
        raise PromptTooLong(
            f"{what} is {n_chars} characters, longer than the {limit} characters that could ever fit: "
            f"the context length {context_len} minus {limit_name} ({max_new_tokens}) leaves {budget} tokens "
            f"and no token is longer than {max_token_chars} characters",
            field,
        )


def check_one_prompt(req: GenerateReq) -> None:
    """Raise BadRequest unless exactly one of text, input_ids, messages is given.

    Also refuses an insane rid, chat roles other than system/user/assistant/tool, an empty ``lora_path`` and
    ``allow_special_tokens_in_content`` on a prompt that has no chat content (it would do nothing there).
    """
    if req.rid is not None and not 0 < len(req.rid) <= MAX_RID_LEN:
        raise BadRequest(f"rid must be 1 to {MAX_RID_LEN} characters (got {len(req.rid)})", "rid")
    given = [n for n in ("text", "input_ids", "messages") if getattr(req, n) is not None]
    if len(given) != 1:
        raise BadRequest(f"give exactly one of text, input_ids, messages (got {given or 'none'})")
    if req.text is not None and not req.text:
        raise BadRequest("the prompt is empty (text='')", "text")
    if req.messages is not None and not req.messages:
        raise BadRequest("messages is empty", "messages")
    for i, m in enumerate(req.messages or ()):
        if m.role not in CHAT_ROLES:
            raise BadRequest(
                f"messages[{i}].role={m.role!r} must be one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role"
            )
    if req.lora_path is not None and not req.lora_path:
        raise BadRequest("lora_path must be a non-empty adapter name (or null for the base model)", "lora_path")
    if req.allow_special_tokens_in_content and req.messages is None:
        raise BadRequest(
            "allow_special_tokens_in_content applies to messages only; a text prompt always recognises special "
            "tokens and input_ids are used as given",
            "allow_special_tokens_in_content",
        )
