"""Continuous batching: admission, per-step plans, finish and abort. Pure logic, no sockets.

Each step's plan holds every running request (one decode token each) plus newly admitted requests (their
whole prompt: prefill). Admission is bounded by ``max_running_requests``, by a KV reservation of
``prompt + max_new_tokens`` tokens (so a running request never runs out of KV), and by the adapter limit:
never more distinct adapters in one batch than LoRA slots. Fairness: requests are considered in arrival
order; one that does not fit may be overtaken, but once the oldest waiting request has waited
``starvation_steps`` steps nothing that would take a new adapter slot or KV it needs overtakes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ipc.messages import BatchReq, FinishReason, ForwardBatch, RowLogprobs, TokenizedReq, TokenOut, WorkerSampling
from scheduler_proc.kv_allocator import KVBudget, SlotAllocator

_CONTEXT_TOKENS = 4  # tokens of left context kept for the next decode (a byte-level character is at most 4)
_MAX_WINDOW_TOKENS = 32  # text still incomplete after this many tokens holds invalid bytes: read on regardless


class _TextView:
    """One rendering of a request's output text, read incrementally: each step decodes only the tokens whose text
    is not fully read yet plus a few tokens of left context, and only the last ``keep`` characters are kept.

    ``specials`` None: the detokenizer's own rendering (special tokens skipped). Otherwise each special token
    is written out as its text, and the runs between them are detokenized.
    """

    def __init__(self, detokenize: Callable[[list[int]], str], specials: Mapping[int, str] | None, keep: int) -> None:
        self._detokenize = detokenize
        self._specials = specials
        self._ids: list[int] = []  # left context, then the tokens whose text is not fully read
        self._read = 0  # characters of detokenize(self._ids) already read
        self._keep = keep
        self._tail = ""

    def push(self, ids: Sequence[int]) -> str:
        """Append tokens; return the last ``keep`` characters read before them followed by the new text."""
        parts = [self._tail]
        for t in ids:
            if self._specials is not None and t in self._specials:
                parts += [self._new_text(final=True), self._specials[t]]
                self._ids, self._read = [], 0
            else:
                self._ids.append(t)
        parts.append(self._new_text(final=False))
        window = "".join(parts)
        self._tail = window[-self._keep :] if self._keep else ""
        return window

    def _new_text(self, final: bool) -> str:
        """Text not read yet, short of a trailing incomplete character (U+FFFD) unless ``final``."""
        if not self._ids:
            return ""
        text = self._detokenize(self._ids)
        # the text before a trailing U+FFFD stays as it is: UTF-8 resynchronises at every character
        end = len(text) if final else len(text.rstrip("\ufffd"))
        new = text[self._read : end]
        self._read = max(self._read, end)
        if len(self._ids) > 2 * _CONTEXT_TOKENS and (end == len(text) or len(self._ids) > _MAX_WINDOW_TOKENS):
            self._ids = self._ids[-_CONTEXT_TOKENS:]  # keep a little left context; all it says has been read
            kept = self._detokenize(self._ids)
            self._read = len(kept) if end == len(text) else len(kept.rstrip("\ufffd"))
        return new


class StopStringMatcher:
    """Finds a request's stop strings in its output as tokens arrive.

    Stop strings are matched against the output text with special tokens skipped, as SGLang and vLLM do. The
    text is tracked incrementally, so a match is found however many tokens it spans (a token may be a third
    of a character: "語" is three tokens of SmolLM2's byte-level vocabulary). A stop string that contains a
    special token's text (``"<|im_end|>"``) is matched instead against the text with special tokens written
    out, so it matches when the model generates that token.
    """

    def __init__(
        self, stops: Sequence[str], detokenize: Callable[[list[int]], str], special_tokens: Mapping[int, str]
    ) -> None:
        texts = set(special_tokens.values())
        marked = [s for s in stops if any(t in s for t in texts)]
        plain = [s for s in stops if s not in marked]
        self._views = [
            (group, _TextView(detokenize, specials, max(len(s) for s in group) - 1))
            for group, specials in ((plain, None), (marked, special_tokens))
            if group
        ]
        self._fed = 0

    def feed(self, output_ids: Sequence[int]) -> str | None:
        """Read the tokens of ``output_ids`` not seen yet; return the first stop string now in the text, if any."""
        new = output_ids[self._fed :]
        self._fed = len(output_ids)
        for group, view in self._views:
            window = view.push(new)
            for s in group:
                if s in window:
                    return s
        return None


@dataclass
class Req:
    """A request's scheduler-side state."""

    rid: str
    input_ids: list[int]
    sampling: WorkerSampling
    max_new_tokens: int
    stop_ids: frozenset[int]
    stop_strs: list[str]
    lora_uid: str | None
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    req_idx: int = -1
    reserved: int = 0
    waited_steps: int = 0
    finished: bool = False
    stop_matcher: StopStringMatcher | None = None
    logprobs: int = -1  # BatchReq.logprobs: -1 none, 0 the sampled token's, k > 0 also the top k

    @property
    def seq_len(self) -> int:
        """Tokens whose KV is (or is being) cached."""
        return len(self.slots)

    def prefill_ids(self) -> list[int]:
        """Tokens to prefill at admission: the prompt, plus every token already produced when a request is
        re-admitted after a worker restart (its KV was lost; the next sampled token continues the output)."""
        return self.input_ids + self.output_ids


class Scheduler:
    """Continuous-batching scheduler.

    Args:
        kv_capacity: token slots in the KV pool (min over TP ranks).
        context_len: longest sequence (prompt + output) allowed.
        eos_ids: model EOS token ids (ignored per request with ``ignore_eos``).
        detokenize: ``ids -> text`` with special tokens skipped, used for stop strings (None disables them).
        special_tokens: special token id -> its text; stop strings that contain such text are matched against
            the output with special tokens written out (see :class:`StopStringMatcher`).
        max_loras_per_batch: LoRA slots per rank; ``pinned_uids`` hold one each permanently.
    """

    def __init__(
        self,
        *,
        max_running: int,
        kv_capacity: int,
        context_len: int,
        eos_ids: list[int],
        detokenize: Callable[[list[int]], str] | None = None,
        special_tokens: Mapping[int, str] | None = None,
        max_loras_per_batch: int = 8,
        starvation_steps: int = 64,
    ) -> None:
        self.max_running = max_running
        self.kv = KVBudget(kv_capacity)
        self.rows = SlotAllocator(max_running)
        self.context_len = context_len
        self.eos_ids = frozenset(eos_ids)
        self.detokenize = detokenize
        self.special_tokens: dict[int, str] = dict(special_tokens or {})
        self.max_loras_per_batch = max_loras_per_batch
        self.starvation_steps = starvation_steps
        self.pinned_uids: set[str] = set()
        # pinned loads not yet confirmed by every rank: their slot is reserved from the moment they arrive
        self.reserved_pins: set[str] = set()
        self.waiting: deque[Req] = deque()
        self.running: dict[str, Req] = {}
        self.blocked_uids: set[str] = set()  # adapters being unloaded: refuse new requests
        # adapters every rank confirmed loading; None = not tracked (the process loop tracks it)
        self.loaded_uids: set[str] | None = None
        # adapters a worker restart could not restore: uid -> the never-been-loaded error for their requests
        self.lost_uids: dict[str, str] = {}
        # adapters with a load (a restore) under way: their requests wait in the queue until it finishes
        self.loading_uids: set[str] = set()
        self._arrivals = 0
        self._step = 0
        self._in_flight: list[Req] | None = None

    # ------------------------------------------------------------------ intake
    def add(self, msg: TokenizedReq) -> list[TokenOut]:
        """Queue a request, or refuse it at once (returns its error TokenOut) if it can never fit."""
        sp = msg.sampling
        n = len(msg.input_ids)
        need = n + sp.max_new_tokens
        err, kind = None, "bad_request"
        known = msg.rid in self.running or any(r.rid == msg.rid for r in self.waiting)
        if known and msg.resume:
            return []  # resubmitted after a scheduler restart, but this scheduler already has it
        if known:
            err = f"request id {msg.rid!r} is already in use"
        elif n == 0:
            err = "the prompt is empty"
        elif need > self.context_len:
            err = (
                f"prompt ({n} tokens) + max_new_tokens ({sp.max_new_tokens}) = {need} exceeds the context "
                f"length {self.context_len}"
            )
        elif need > self.kv.slots.capacity:
            err = f"prompt + max_new_tokens = {need} tokens exceeds the whole KV pool ({self.kv.slots.capacity})"
        elif msg.lora_uid is not None and msg.lora_uid in self.blocked_uids:
            err = f"LoRA adapter {msg.lora_uid} is being unloaded"
        elif msg.lora_uid is not None and msg.lora_uid in self.lost_uids:
            err, kind = self.lost_uids[msg.lora_uid], "not_found"
        elif (
            msg.lora_uid is not None
            and self.loaded_uids is not None
            and msg.lora_uid not in self.loaded_uids
            and msg.lora_uid not in self.loading_uids
        ):
            err = f"LoRA adapter uid {msg.lora_uid} is not loaded on the workers (reload it)"
        if err is not None:
            return [TokenOut(msg.rid, [], n, 0, True, FinishReason("abort", message=err), error=err, error_kind=kind)]
        stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self.eos_ids)
        self.waiting.append(
            Req(
                rid=msg.rid,
                input_ids=list(msg.input_ids),
                sampling=WorkerSampling(sp.temperature, sp.top_p, sp.top_k, sp.seed),
                max_new_tokens=sp.max_new_tokens,
                stop_ids=stop_ids,
                stop_strs=sp.stop_strings(),
                lora_uid=msg.lora_uid,
                arrival=self._arrivals,
                output_ids=list(msg.output_ids),
                logprobs=msg.top_logprobs_num if msg.return_logprob else -1,
            )
        )
        self._arrivals += 1
        return []

    def abort(self, rid: str, reason: str = "aborted") -> list[TokenOut]:
        """Drop ``rid`` wherever it is and free its KV at once. Unknown rids are ignored."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                return [self._finish_out(r, FinishReason("abort", message=reason))]
        r = self.running.get(rid)
        if r is None:
            return []
        self._release(r)
        return [self._finish_out(r, FinishReason("abort", message=reason))]

    def uses_adapter(self, uid: str) -> bool:
        """Whether any waiting or running request names adapter ``uid``."""
        return any(r.lora_uid == uid for r in self.waiting) or any(r.lora_uid == uid for r in self.running.values())

    @property
    def has_work(self) -> bool:
        """Whether a step could be scheduled."""
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ planning
    def _unpinned_slots(self) -> int:
        return self.max_loras_per_batch - len(self.pinned_uids | self.reserved_pins)

    def can_pin(self) -> bool:
        """Whether a reserved pinned load may go to the workers now: the running requests' unpinned adapters
        fit in the slots the pinned ones (including the reserved) leave. Loading it earlier would let it take
        a slot the next step needs, and that step would fail."""
        running = {r.lora_uid for r in self.running.values() if r.lora_uid and r.lora_uid not in self.pinned_uids}
        return len(running) <= self._unpinned_slots()

    def _admit(self) -> list[Req]:
        adapters = {r.lora_uid for r in self.running.values() if r.lora_uid and r.lora_uid not in self.pinned_uids}
        admitted: list[Req] = []
        oldest_starving = bool(self.waiting) and self.waiting[0].waited_steps >= self.starvation_steps
        for r in list(self.waiting):
            if len(self.running) + len(admitted) >= self.max_running:
                break
            need = len(r.input_ids) + r.max_new_tokens  # covers a re-admission's produced tokens too
            if r.lora_uid is not None and self.loaded_uids is not None and r.lora_uid not in self.loaded_uids:
                continue  # its adapter is still being restored
            new_adapter = r.lora_uid is not None and r.lora_uid not in self.pinned_uids and r.lora_uid not in adapters
            fits = self.kv.can_reserve(need) and not (new_adapter and len(adapters) >= self._unpinned_slots())
            if not fits:
                if oldest_starving:
                    break  # the oldest request waits for room; nobody overtakes it
                continue
            self.waiting.remove(r)
            if new_adapter:
                adapters.add(r.lora_uid)
            self.kv.reserve(need)
            r.reserved = need
            r.req_idx = self.rows.alloc(1)[0]
            admitted.append(r)
            oldest_starving = bool(self.waiting) and self.waiting[0].waited_steps >= self.starvation_steps
        for r in self.waiting:
            r.waited_steps += 1
        return admitted

    def next_batch(self) -> ForwardBatch | None:
        """Plan the next step (None when idle). Must be answered with :meth:`on_result` before the next."""
        assert self._in_flight is None, "previous step still in flight"
        plan: list[BatchReq] = []
        reqs: list[Req] = []
        for r in self.running.values():
            slots = self.kv.take(1)
            r.reserved -= 1
            prefix = r.seq_len
            r.slots.extend(slots)
            plan.append(
                BatchReq(
                    r.rid,
                    r.req_idx,
                    [r.output_ids[-1]],
                    prefix,
                    slots,
                    r.lora_uid,
                    r.sampling,
                    len(r.output_ids),
                    r.logprobs,
                )
            )
            reqs.append(r)
        for r in self._admit():
            ids = r.prefill_ids()
            slots = self.kv.take(len(ids))
            r.reserved -= len(slots)
            r.slots = list(slots)  # the plan keeps its own list
            self.running[r.rid] = r
            plan.append(
                BatchReq(r.rid, r.req_idx, ids, 0, slots, r.lora_uid, r.sampling, len(r.output_ids), r.logprobs)
            )
            reqs.append(r)
        if not plan:
            return None
        # group requests by adapter so each adapter's tokens form one contiguous segment (fewer LoRA matmuls)
        order = sorted(range(len(plan)), key=lambda i: plan[i].lora_uid or "")
        plan = [plan[i] for i in order]
        reqs = [reqs[i] for i in order]
        self._in_flight = reqs
        self._step += 1
        return ForwardBatch(step=self._step, reqs=plan)

    # ------------------------------------------------------------------ results
    def on_result(
        self,
        next_ids: list[int],
        row_errors: dict[int, str] | None = None,
        logprobs: dict[int, RowLogprobs] | None = None,
    ) -> list[TokenOut]:
        """Apply rank 0's tokens (plan order) and return what changed; finished requests free KV at once.

        A row in ``row_errors`` (plan index -> why rank 0 could not sample it) ends only its own request, with
        kind ``server_error`` and the reason; the other rows go on as usual. ``logprobs`` (plan index -> the
        row's :class:`RowLogprobs`) rides along on each token's :class:`TokenOut`.
        """
        reqs, self._in_flight = self._in_flight or [], None
        if len(next_ids) != len(reqs):
            raise RuntimeError(f"worker returned {len(next_ids)} tokens for {len(reqs)} requests")
        outs: list[TokenOut] = []
        for i, (r, tok) in enumerate(zip(reqs, next_ids, strict=True)):
            if r.finished or r.rid not in self.running:
                continue  # aborted while the step ran
            why = (row_errors or {}).get(i)
            if why is not None:
                message = f"rank 0: {why}"
                self._release(r)
                out = self._finish_out(r, FinishReason("abort", message=message), error=message)
                out.error_kind = "server_error"
                outs.append(out)
                continue
            r.output_ids.append(tok)
            reason = self._finish_reason(r, tok)
            if reason is None:
                out = TokenOut(r.rid, [tok], len(r.input_ids), len(r.output_ids))
            else:
                self._release(r)
                out = self._finish_out(r, reason, [tok])
            lp = (logprobs or {}).get(i)
            if lp is not None:
                out.new_token_logprobs = [(lp.logprob, tok)]
                if r.logprobs > 0:
                    out.new_top_logprobs = [list(lp.top)]
            outs.append(out)
        return outs

    def fail_in_flight(self, message: str) -> list[TokenOut]:
        """The step failed: end every request it carried with ``message``."""
        reqs, self._in_flight = self._in_flight or [], None
        outs = []
        for r in reqs:
            if r.rid in self.running:
                self._release(r)
                out = self._finish_out(r, FinishReason("abort", message=message), error=message)
                out.error_kind = "server_error"
                outs.append(out)
        return outs

    def requeue_running(self) -> int:
        """The workers lost their KV (a TP group restart): drop the step in flight, free every running request's
        KV and row, and put them back at the head of the queue in arrival order. Each is re-admitted with a
        prefill of prompt + produced tokens, so it continues exactly where it stopped. Returns how many."""
        self._in_flight = None
        back = sorted(self.running.values(), key=lambda r: r.arrival)
        for r in back:
            self.kv.release(r.slots, r.reserved)
            self.rows.free([r.req_idx])
            r.slots, r.reserved, r.req_idx = [], 0, -1
        self.running.clear()
        self.waiting.extendleft(reversed(back))
        return len(back)

    def drop_all(self) -> int:
        """Forget every request without a reply (their front door is gone); returns how many."""
        n = len(self.running) + len(self.waiting)
        self.requeue_running()
        self.waiting.clear()
        return n

    def fail_adapter(self, uid: str, message: str) -> list[TokenOut]:
        """Adapter ``uid`` is gone for good: end its waiting requests with ``message`` (kind ``not_found``) and
        refuse later ones the same way."""
        self.lost_uids[uid] = message
        outs = []
        for r in [r for r in self.waiting if r.lora_uid == uid]:
            self.waiting.remove(r)
            out = self._finish_out(r, FinishReason("abort", message=message), error=message)
            out.error_kind = "not_found"
            outs.append(out)
        return outs

    def _finish_reason(self, r: Req, tok: int) -> FinishReason | None:
        if tok in r.stop_ids:
            return FinishReason("stop", matched=tok)
        if r.stop_strs and self.detokenize is not None:
            if r.stop_matcher is None:  # built at the first token, so a resumed request reads its earlier output
                r.stop_matcher = StopStringMatcher(r.stop_strs, self.detokenize, self.special_tokens)
            matched = r.stop_matcher.feed(r.output_ids)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(r.output_ids) >= r.max_new_tokens:
            return FinishReason("length", matched=None)
        return None

    def _release(self, r: Req) -> None:
        r.finished = True
        self.running.pop(r.rid, None)
        self.kv.release(r.slots, r.reserved)
        self.rows.free([r.req_idx])
        r.slots, r.reserved = [], 0

    def _finish_out(
        self, r: Req, reason: FinishReason, new_ids: list[int] | None = None, error: str | None = None
    ) -> TokenOut:
        r.finished = True
        return TokenOut(r.rid, new_ids or [], len(r.input_ids), len(r.output_ids), True, reason, error)
