"""Continuous batching: admission, per-step plans, finish and abort. Pure logic, no sockets.

Each step's plan holds every running request (one decode token each) plus prefill work: the next chunk of
requests still being prefilled, then newly admitted requests. With ``chunked_prefill_size`` > 0 a step carries
at most that many prefill tokens, so a long prompt is prefilled over several steps while the decodes go on.
Admission is bounded by ``max_running_requests``, by a KV reservation of ``prompt + max_new_tokens`` tokens
minus the cached prefix (so a running request never runs out of KV), and by the adapter limit: a batch's
distinct adapters must fit in the LoRA pools' rank rows, each at its own rank. Fairness: requests are
considered in arrival order; one that does not fit may be overtaken, but once the oldest waiting request has
waited ``starvation_steps`` steps nothing that would take a new adapter slot or KV it needs overtakes it.

With the prefix cache (:mod:`scheduler_proc.radix_cache`) a request starting with tokens already cached under
the same adapter uid reuses their KV slots (``prefix_len`` = the match in its first plan, ``prefix_slots`` =
their slots, sent once) and prefills only the rest; at least its last prompt token is always recomputed so
there are logits to sample from. Prefilled prompts enter the tree as soon as their KV is written, outputs when
the request finishes. Unreferenced cached KV is evicted (LRU) whenever admission needs room.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ipc.lora_config import lora_rows
from ipc.messages import BatchReq, FinishReason, ForwardBatch, RowLogprobs, TokenizedReq, TokenOut, WorkerSampling
from scheduler_proc.kv_allocator import KVBudget, SlotAllocator
from scheduler_proc.radix_cache import RadixCache, RadixNode, common_prefix

_CONTEXT_TOKENS = 4  # tokens of left context kept for the next decode (a byte-level character is at most 4)
_MAX_WINDOW_TOKENS = 32  # text still incomplete after this many tokens holds invalid bytes: read on regardless
# a waiting request whose uncached prompt starts like a prompt being prefilled (same adapter) waits until that
# prefill is cached, then reuses it instead of computing the same KV again, when waiting saves this many prompt
# tokens: its own shared start alone, or that start times the waiting requests that share it (a burst of 32
# prompts opening with the same 6 tokens); a step of delay for tokens that cost about as much to compute
_SHARED_PREFILL_TOKENS = 32
_SHARED_SCAN = 64  # waiting requests looked at for others sharing a short start (bounds a step's planning time)
_GREEDY = WorkerSampling(0.0, 1.0, -1, None)  # for prefill chunks whose token is discarded (no RNG drawn)


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


@dataclass(frozen=True)
class AdapterState:
    """What the scheduler's LoRA operations know of the ranks' adapters, handed to :meth:`Scheduler.set_adapters`
    whole after every change (so the scheduler owns its copy and nothing else writes its fields).

    ``loaded``: uid -> (name, rank rows; 0 = unknown) of adapters every rank holds; ``pinned``: those pinned;
    ``loading``: uids with a load (or restore) under way; ``reserved_pins``: pinned loads not yet confirmed by
    every rank (their rows are reserved from arrival); ``unloading``: uids with an unload waiting or under way.
    """

    loaded: Mapping[str, tuple[str, int]]
    pinned: frozenset[str] = frozenset()
    loading: frozenset[str] = frozenset()
    reserved_pins: frozenset[str] = frozenset()
    unloading: frozenset[str] = frozenset()


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
    prefill_len: int = 0  # tokens to prefill at this admission (prompt + tokens produced before a requeue)
    first_chunk_at: int = 0  # prefix_len of the first chunk: its plan carries the cached prefix's slots
    cache_node: RadixNode | None = None  # end of the locked radix-cache path this request reads
    cached: int = 0  # leading entries of ``slots`` that belong to the radix cache (the rest are the request's)
    cached_tokens: int = 0  # prompt tokens reused from the cache at admission (reported as meta_info.cached_tokens)
    counted: bool = False  # prompt tokens already added to the scheduler's hit-rate counters

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
        max_loras_per_batch, max_lora_rank: the workers' LoRA pools hold ``max_loras_per_batch`` adapters at
            ``max_lora_rank`` (more where they read adapters in place), i.e. that many times
            ``lora_rows(max_lora_rank)`` rank rows, which adapters share at their own rank: a batch's distinct
            adapters, plus the pinned ones, must fit in those rows.
            ``adapter_rows`` (uid -> rows, from the workers' load acks) gives each adapter's need; an adapter
            missing there counts a whole slot. ``lora_pool_rows``, when given, is the pools' real size in rank rows
            (the workers' READY: a pool that reads adapters in place has one slot per running request).
        enable_prefix_cache: keep finished and prefilled KV in a radix tree keyed by (adapter uid, token ids)
            and reuse it for requests that start the same way (``--disable-radix-cache`` turns it off; off by
            default here so a bare ``Scheduler`` frees every slot when idle).
        chunked_prefill_size: most prefill tokens in one step (0 or less: no limit, whole prompts at once).
        max_prefill_tokens: most prefill tokens in a step with no decode row, when larger than
            ``chunked_prefill_size``: chunking protects running streams' inter-token gaps, and with none running
            a burst of prompts is prefilled in fewer, larger steps (SGLang's ``--max-prefill-tokens``).

    Hit-rate counters: ``prompt_tokens_total`` (prompt tokens admitted, each request counted once) and
    ``cached_tokens_total`` (of those, taken from the prefix cache); see :meth:`cache_stats`.
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
        max_lora_rank: int = 64,
        lora_pool_rows: int = 0,
        starvation_steps: int = 64,
        enable_prefix_cache: bool = False,
        chunked_prefill_size: int = 0,
        max_prefill_tokens: int = 0,
    ) -> None:
        self.max_running = max_running
        self.kv = KVBudget(kv_capacity)
        self.rows = SlotAllocator(max_running)
        self.context_len = context_len
        self.eos_ids = frozenset(eos_ids)
        self.detokenize = detokenize
        self.special_tokens: dict[int, str] = dict(special_tokens or {})
        self.max_loras_per_batch = max_loras_per_batch
        self.slot_size = lora_rows(max_lora_rank)  # rank rows of one adapter at the largest rank
        self.lora_rows_total = lora_pool_rows or max_loras_per_batch * self.slot_size
        self.adapter_rows: dict[str, int] = {}
        self.adapter_names: dict[str, str] = {}  # uid -> name of the adapters the workers hold, for messages
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
        self._in_flight: list[tuple[Req, str]] | None = None  # (request, "chunk" | "last" | "decode") per row
        self.cache: RadixCache | None = RadixCache(self.kv.slots) if enable_prefix_cache else None
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

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
            name = self.adapter_names.get(msg.lora_uid)
            err = f"LoRA adapter {name or msg.lora_uid} is being unloaded" + (f" (uid {msg.lora_uid})" if name else "")
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
    def _rows(self, uid: str) -> int:
        """Rank rows adapter ``uid`` takes in the pools (a whole slot when not known)."""
        return self.adapter_rows.get(uid, self.slot_size)

    def _unpinned_rows(self) -> int:
        return self.lora_rows_total - sum(self._rows(u) for u in self.pinned_uids | self.reserved_pins)

    def can_pin(self) -> bool:
        """Whether a reserved pinned load may go to the workers now: the running requests' unpinned adapters
        fit in the rank rows the pinned ones (including the reserved) leave. Loading it earlier would let it
        take rows the next step needs, and that step would fail."""
        running = {r.lora_uid for r in self.running.values() if r.lora_uid and r.lora_uid not in self.pinned_uids}
        return sum(self._rows(u) for u in running) <= self._unpinned_rows()

    def _insertable(self, uid: str | None) -> bool:
        """Whether KV computed under ``uid`` may enter the cache (not for an adapter being unloaded or gone)."""
        if uid is None:
            return True
        if uid in self.blocked_uids or uid in self.lost_uids:
            return False
        return self.loaded_uids is None or uid in self.loaded_uids

    def _shares_prefill(self, r: Req, ids: list[int], start: int, prefilling: list[Req]) -> bool:
        """Whether ``r`` should wait for a prompt still being prefilled (same adapter) to be cached rather than
        compute the same KV too: ``ids[start:]`` starts with ``k`` of its tokens, and ``k`` alone, or ``k`` times
        the waiting requests (``r`` among them; the first ``_SHARED_SCAN`` looked at) whose prompts start with
        the same ``start + k`` tokens, reaches ``_SHARED_PREFILL_TOKENS``. The idea is SGLang's in-batch prefix
        check (a request sharing a prefix with one already in the batch waits for the next), here also for a
        short start that many requests repeat."""
        k, end = 0, min(start + _SHARED_PREFILL_TOKENS, len(ids) - 1)  # past 32 shared tokens, more changes nothing
        for p in prefilling:
            if p.lora_uid == r.lora_uid and p.prefill_len > start:
                k = max(k, common_prefix(_prompt(p)[start:end], ids, start, end))
        if k >= _SHARED_PREFILL_TOKENS:
            return True
        if k == 0:
            return False
        head, need, sharers = ids[: start + k], -(-_SHARED_PREFILL_TOKENS // k), 0
        for w in itertools.islice(self.waiting, _SHARED_SCAN):
            if w.lora_uid == r.lora_uid and _prompt(w)[: start + k] == head:
                sharers += 1
                if sharers >= need:
                    return True
        return False

    def _admit(self, budget: float, prefilling: list[Req]) -> list[Req]:
        adapters = {r.lora_uid for r in self.running.values() if r.lora_uid and r.lora_uid not in self.pinned_uids}
        used_rows, free_rows = sum(self._rows(u) for u in adapters), self._unpinned_rows()
        admitted: list[Req] = []
        oldest_starving = bool(self.waiting) and self.waiting[0].waited_steps >= self.starvation_steps
        for r in list(self.waiting):
            if len(self.running) + len(admitted) >= self.max_running or budget <= 0:
                break
            if r.lora_uid is not None and self.loaded_uids is not None and r.lora_uid not in self.loaded_uids:
                continue  # its adapter is still being restored
            ids = r.prefill_ids()
            matched, node, cached_slots = 0, None, []
            if self.cache is not None:
                matched, node, cached_slots = self.cache.match(r.lora_uid, ids, len(ids) - 1)
                if self._shares_prefill(r, ids, matched, prefilling + admitted):
                    continue  # its prefix is being computed right now: reuse it next step
            need = len(r.input_ids) + r.max_new_tokens - matched  # covers a re-admission's produced tokens too
            new_adapter = r.lora_uid is not None and r.lora_uid not in self.pinned_uids and r.lora_uid not in adapters
            if node is not None:
                self.cache.lock(node)  # before eviction, so it cannot evict the prefix it is about to read
            room = self.kv.slots.num_free - self.kv.reserved
            evictable = self.cache.evictable_tokens if self.cache is not None else 0
            fits = room + evictable >= need and not (new_adapter and used_rows + self._rows(r.lora_uid) > free_rows)
            if not fits:
                if node is not None:
                    self.cache.unlock(node)
                if oldest_starving:
                    break  # the oldest request waits for room; nobody overtakes it
                continue
            if room < need:
                self.cache.evict(need - room)
            self.waiting.remove(r)
            if new_adapter:
                adapters.add(r.lora_uid)
                used_rows += self._rows(r.lora_uid)
            self.kv.reserve(need)
            r.reserved = need
            r.req_idx = self.rows.alloc(1)[0]
            r.prefill_len = len(ids)
            r.first_chunk_at = matched
            r.cache_node, r.cached = node, matched
            r.slots = cached_slots
            r.cached_tokens = min(matched, len(r.input_ids))
            if not r.counted:
                r.counted = True
                self.prompt_tokens_total += len(r.input_ids)
                self.cached_tokens_total += r.cached_tokens
            budget -= len(ids) - matched
            admitted.append(r)
            oldest_starving = bool(self.waiting) and self.waiting[0].waited_steps >= self.starvation_steps
        for r in self.waiting:
            r.waited_steps += 1
        return admitted

    def _chunk(self, r: Req, budget: float) -> tuple[BatchReq, str]:
        """Plan the next prefill chunk of ``r`` (at most ``budget`` tokens); the row kind is "last" when it ends
        the prefill (its sampled token counts), else "chunk"."""
        start = len(r.slots)
        ids = r.prefill_ids()[start : start + int(min(budget, r.prefill_len - start))]
        slots = self.kv.take(len(ids))
        r.reserved -= len(slots)
        prefix_slots = list(r.slots) if start == r.first_chunk_at and start > 0 else []
        r.slots.extend(slots)
        kind = "last" if len(r.slots) == r.prefill_len else "chunk"
        sampling, logprobs = (r.sampling, r.logprobs) if kind == "last" else (_GREEDY, -1)
        req = BatchReq(
            r.rid, r.req_idx, ids, start, slots, r.lora_uid, sampling, len(r.output_ids), logprobs, prefix_slots
        )
        return req, kind

    def next_batch(self) -> ForwardBatch | None:
        """Plan the next step (None when idle). Must be answered with :meth:`on_result` before the next."""
        assert self._in_flight is None, "previous step still in flight"
        plan: list[BatchReq] = []
        rows: list[tuple[Req, str]] = []
        budget: float = self.chunked_prefill_size if self.chunked_prefill_size > 0 else float("inf")
        prefilling: list[Req] = []
        for r in self.running.values():
            if len(r.slots) < r.prefill_len:
                prefilling.append(r)
                continue
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
            rows.append((r, "decode"))
        if not plan and budget < self.max_prefill_tokens:  # no stream decodes this step: nothing to keep smooth
            budget = self.max_prefill_tokens
        elif plan and self.chunked_prefill_size > 0 and len(self.waiting) > len(plan):
            # a burst waits behind few streams: the chunk grows with how far the waiting requests outnumber the
            # decoding ones (at most max_prefill_tokens), so a burst starts in a few steps rather than one chunk
            # per step while most of the batch sits idle; with as many streams as waiting requests it is the chunk
            # (whole tokens: a fractional budget left over would plan an empty chunk)
            grown = self.chunked_prefill_size * len(self.waiting) // len(plan)
            budget = max(budget, min(self.max_prefill_tokens, grown))
        prefilling.sort(key=lambda r: r.arrival)
        for r in prefilling:  # requests part-way through their prefill go first
            if budget <= 0:
                break
            req, kind = self._chunk(r, budget)
            budget -= len(req.input_ids)
            plan.append(req)
            rows.append((r, kind))
        for r in self._admit(budget, prefilling):
            self.running[r.rid] = r
            req, kind = self._chunk(r, budget)
            budget -= len(req.input_ids)
            plan.append(req)
            rows.append((r, kind))
        if not plan:
            return None
        # group requests by adapter so each adapter's tokens form one contiguous segment (fewer LoRA matmuls)
        order = sorted(range(len(plan)), key=lambda i: plan[i].lora_uid or "")
        plan = [plan[i] for i in order]
        self._in_flight = [rows[i] for i in order]
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
        row's :class:`RowLogprobs`) rides along on each token's :class:`TokenOut`. A prefill chunk that does not
        end its prompt produces no output (its token is discarded); its KV enters the prefix cache.
        """
        rows, self._in_flight = self._in_flight or [], None
        if len(next_ids) != len(rows):
            raise RuntimeError(f"worker returned {len(next_ids)} tokens for {len(rows)} requests")
        outs: list[TokenOut] = []
        for i, ((r, kind), tok) in enumerate(zip(rows, next_ids, strict=True)):
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
            if kind != "decode":
                self._cache_prefill(r)
                if kind == "chunk":
                    continue
            r.output_ids.append(tok)
            reason = self._finish_reason(r, tok)
            if reason is None:
                out = TokenOut(r.rid, [tok], len(r.input_ids), len(r.output_ids), cached_tokens=r.cached_tokens)
            else:
                self._release(r, keep=True)
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
        rows, self._in_flight = self._in_flight or [], None
        outs = []
        for r, _ in rows:
            if r.rid in self.running:
                self._release(r)
                out = self._finish_out(r, FinishReason("abort", message=message), error=message)
                out.error_kind = "server_error"
                outs.append(out)
        return outs

    def requeue_running(self) -> int:
        """The workers lost their KV (a TP group restart): drop the step in flight, free every running request's
        KV and row, empty the prefix cache, and put the requests back at the head of the queue in arrival order.
        Each is re-admitted with a prefill of prompt + produced tokens, so it continues exactly where it stopped.
        Returns how many."""
        self._in_flight = None
        back = sorted(self.running.values(), key=lambda r: r.arrival)
        for r in back:
            self.kv.release(r.slots[r.cached :], r.reserved)
            self.rows.free([r.req_idx])
            r.slots, r.reserved, r.req_idx, r.cache_node, r.cached = [], 0, -1, None, 0
        self.running.clear()
        if self.cache is not None:
            self.cache.clear()
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
        self.drop_adapter(uid)
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

    def _cache_prefill(self, r: Req) -> None:
        """A prefill chunk of ``r`` ran: hand its KV (now written) to the prefix cache, still locked by ``r``."""
        if self.cache is None or not self._insertable(r.lora_uid):
            return
        node = r.cache_node if r.cache_node is not None else self.cache.root(r.lora_uid)
        n = len(r.slots)
        child = self.cache.extend_locked(node, r.prefill_ids()[r.cached : n], r.slots[r.cached : n])
        if child is not None:
            r.cache_node, r.cached = child, n

    def _release(self, r: Req, keep: bool = False) -> None:
        """Free ``r``'s row and KV. ``keep`` (a normal finish): first cache the tokens whose KV was written
        (prompt + output but the last token), so later requests can reuse them."""
        r.finished = True
        self.running.pop(r.rid, None)
        own = r.slots[r.cached :]
        if self.cache is not None and keep and self._insertable(r.lora_uid):
            node = r.cache_node if r.cache_node is not None else self.cache.root(r.lora_uid)
            seq = r.input_ids + r.output_ids
            own = self.cache.insert(node, seq[r.cached : len(r.slots)], own)
        self.kv.release(own, r.reserved)
        if r.cache_node is not None:
            self.cache.unlock(r.cache_node)
        self.rows.free([r.req_idx])
        r.slots, r.reserved, r.cache_node, r.cached = [], 0, None, 0

    # ------------------------------------------------------------------ prefix cache
    def set_adapters(self, state: AdapterState) -> None:
        """Take the ranks' adapter state (the process loop's LoRA operations call this after every change).

        An adapter loaded again since a restart lost it is no longer refused, and an adapter is blocked only
        while its unload is pending (a cancelled or finished unload unblocks it)."""
        self.loaded_uids = set(state.loaded)
        self.adapter_names = {u: name for u, (name, _) in state.loaded.items()}
        self.adapter_rows = {u: rows for u, (_, rows) in state.loaded.items() if rows}
        self.pinned_uids = set(state.pinned)
        self.loading_uids = set(state.loading)
        self.reserved_pins = set(state.reserved_pins)
        for uid in self.loaded_uids & set(self.lost_uids):
            del self.lost_uids[uid]
        self.blocked_uids &= self.loaded_uids | state.unloading

    def block_adapter(self, uid: str) -> None:
        """An unload of ``uid`` arrived: refuse new requests for it and forget its cached KV now (never reused,
        even if the unload then fails)."""
        self.blocked_uids.add(uid)
        self.drop_adapter(uid)

    def unblock_adapter(self, uid: str) -> None:
        """The unload of ``uid`` was cancelled before it reached the ranks: accept its requests again."""
        self.blocked_uids.discard(uid)

    def drop_adapter(self, uid: str) -> int:
        """Adapter ``uid`` is being unloaded (or is lost): forget its cached KV. Requests still reading some of
        it keep it until they finish; nothing of it is ever matched again. Returns slots freed now."""
        return 0 if self.cache is None else self.cache.drop(uid)

    def kv_in_use(self) -> int:
        """KV slots held by running requests alone (not by the prefix cache)."""
        return sum(len(r.slots) - r.cached for r in self.running.values())

    def cache_stats(self) -> dict[str, int]:
        """Prefix-cache counters, all in tokens.

        Returns:
            ``prompt_tokens_total`` and ``cached_tokens_total`` (prompt tokens admitted since start, each
            request once, and how many of them came from the cache: hit rate = cached / prompt),
            ``cache_tokens`` (KV slots the cache holds now), ``cache_evictable_tokens`` (of those, read by no
            running request) and ``cache_evicted_tokens`` (freed by LRU eviction since start). The cache
            counters are 0 with the cache off.
        """
        c = self.cache
        return {
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "cache_tokens": 0 if c is None else c.cached_tokens,
            "cache_evictable_tokens": 0 if c is None else c.evictable_tokens,
            "cache_evicted_tokens": 0 if c is None else c.evicted_tokens,
        }

    def _finish_out(
        self, r: Req, reason: FinishReason, new_ids: list[int] | None = None, error: str | None = None
    ) -> TokenOut:
        r.finished = True
        return TokenOut(
            r.rid,
            new_ids or [],
            len(r.input_ids),
            len(r.output_ids),
            True,
            reason,
            error,
            cached_tokens=r.cached_tokens,
        )


def _prompt(r: Req) -> list[int]:
    """``r.prefill_ids()`` without building a new list when nothing was produced yet (the usual case)."""
    return r.prefill_ids() if r.output_ids else r.input_ids
