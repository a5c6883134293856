"""The front door's logic: turn client requests into scheduler messages and scheduler output into replies.

Shared by the ZMQ ROUTER and the HTTP server: each request carries a *sink* that delivers its replies.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import msgspec

from ipc.config import ServerArgs
from ipc.messages import (
    AbortRid,
    AdminOut,
    BatchTokenOut,
    ClusterEvent,
    ClusterView,
    ErrorOut,
    FinishReason,
    GenerateOut,
    GenerateReq,
    LoraListOut,
    LoraOpResult,
    MetaInfo,
    SchedulerBeat,
    ServerMsg,
    TokenizedReq,
    TokenOut,
)
from ipc.model_config import load_model_config
from tokenizer_proc.health import ClusterHealth
from tokenizer_proc.lora_admin import LoraAdmin
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.registry import AdapterRefused, LoraRegistry, UnknownAdapter
from tokenizer_proc.stop_text import StopText
from tokenizer_proc.text import ChatTemplateError, IncrementalText, TextCodec
from tokenizer_proc.validate import (
    BadRequest,
    PromptTooLong,
    check_one_prompt,
    check_prompt_chars,
    validate_logprobs,
    validate_prompt_ids,
    validate_sampling,
)

log = logging.getLogger("tokenizer")
INLINE_TOKENIZE_CHARS = 4096  # shorter prompts are tokenized on the event loop (well under a millisecond)
MAX_TOKENIZING = 64  # longer prompts waiting for the tokenizer thread at once; more are answered `overloaded`


class Overloaded(RuntimeError):
    """The front door cannot take this request now; the client should retry later."""


@dataclass(eq=False)
class Intake:
    """A request being validated and tokenized, not yet sent to the scheduler."""

    client_rid: str
    sink: Sink
    aborted: str | None = None  # set by an abort meanwhile: answered as aborted instead of submitted
    failed: str | None = None  # set by fail_all meanwhile: answered with this server error


class Sink(Protocol):
    """Where one request's replies go. ``send`` returns False when the client is gone."""

    def send(self, msg: ServerMsg) -> bool:
        """Deliver one reply; False if the client can no longer be reached."""
        ...


__all__ = ["ClusterHealth", "FrontDoor", "Overloaded", "Sink"]


@dataclass
class Pending:
    """A request the scheduler is working on."""

    rid: str
    client_rid: str
    sink: Sink
    stream: bool
    text: IncrementalText
    prompt_tokens: int
    lora_name: str | None
    req: TokenizedReq  # what was sent, kept to resubmit it after a scheduler restart
    aborted: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when the front door got it (latency metrics)
    last_token_at: float | None = None  # when its latest tokens arrived (None: none yet)
    token_logprobs: list[tuple[float, int]] = field(default_factory=list)  # with return_logprob, per token
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # with top_logprobs_num > 0


class FrontDoor:
    """Validation, tokenization, the LoRA registry and reply routing. ``send_to_scheduler`` is injected."""

    def __init__(
        self, args: ServerArgs, send_to_scheduler: Callable[[object], None], metrics: Metrics | None = None
    ) -> None:
        self.args = args
        self.send = send_to_scheduler
        self.codec = TextCodec(args.model_path)
        cfg = load_model_config(args.model_path)
        self.context_len = args.context_length or cfg.max_position_embeddings
        if args.max_total_tokens:  # the scheduler caps the context at the KV pool too
            self.context_len = min(self.context_len, args.max_total_tokens)
        self.vocab_size = cfg.vocab_size
        self.health = ClusterHealth()
        self.metrics = metrics or Metrics()
        self.lora = LoraAdmin(  # the registry and LoRA commands
            args,
            send_to_scheduler,
            self.health,
            cfg.tie_word_embeddings,
            on_loaded=self.metrics.lora_loaded,
            num_layers=cfg.num_layers,
        )
        self.pending: dict[str, Pending] = {}
        self.by_client: dict[tuple[int, str], str] = {}
        self.intake: dict[tuple[int, str], Intake] = {}  # requests being validated and tokenized
        self.max_queued: int = args.max_queued_requests
        self.tokenizing = 0  # long prompts waiting for or in the tokenizer thread
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.sched_incarnation: str | None = None
        self.synced = asyncio.Event()  # set by the first ClusterView: the registry agrees with the workers
        self.metrics.watch(self)

    # ------------------------------------------------------------------ generate
    def _check_chars(
        self, what: str, n_chars: int, req: GenerateReq, field: str, limit_name: str = "max_new_tokens"
    ) -> None:
        check_prompt_chars(
            what,
            n_chars,
            req.sampling_params.max_new_tokens,
            self.context_len,
            self.codec.max_token_chars,
            field=field,
            limit_name=limit_name,
        )

    def _chat_ids(self, req: GenerateReq, limit_name: str = "max_new_tokens") -> list[int]:
        """Render and tokenize a chat request (after its content passed the length check)."""
        messages = [{"role": m.role, "content": m.content} for m in req.messages or ()]
        rendered = self.codec.render_chat(messages)
        self._check_chars("the rendered chat", len(rendered), req, "messages", limit_name)
        return self.codec.encode_chat(
            messages, allow_special_tokens_in_content=req.allow_special_tokens_in_content, rendered=rendered
        )

    async def _off_loop(self, fn: Callable[[GenerateReq], list[int]], req: GenerateReq, n_chars: int) -> list[int]:
        """Run ``fn(req)`` on the event loop for a short prompt, else in the tokenizer thread.

        Raises:
            Overloaded: ``MAX_TOKENIZING`` long prompts already wait for the thread.
        """
        if n_chars <= INLINE_TOKENIZE_CHARS:
            return fn(req)
        if self.tokenizing >= MAX_TOKENIZING:
            raise Overloaded(f"{self.tokenizing} long prompts are waiting to be tokenized; retry later")
        self.tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, req)
        finally:
            self.tokenizing -= 1

    async def prompt_ids(self, req: GenerateReq, limit_name: str = "max_new_tokens") -> list[int]:
        """The prompt's token ids. Every length is checked before the prompt is walked or tokenized, and a long
        prompt is tokenized off the event loop, so a huge request never stalls the streams of others.
        ``limit_name`` is what length errors call ``max_new_tokens`` (the OpenAI routes say ``max_tokens``).

        Raises:
            BadRequest / ChatTemplateError: the prompt is malformed or can never fit the context.
            Overloaded: too many long prompts wait for the tokenizer thread.
        """
        check_one_prompt(req)
        if req.input_ids is not None:
            n = len(req.input_ids)
            budget = self.context_len - req.sampling_params.max_new_tokens
            if n > budget:  # before looking at any id: a 3,000,000-id prompt costs no more than a short one
                raise PromptTooLong(
                    f"prompt ({n} tokens) + {limit_name} ({req.sampling_params.max_new_tokens}) exceeds the "
                    f"context length {self.context_len}",
                    "input_ids",
                )
            return list(req.input_ids)
        if req.messages is not None:
            if len(req.messages) > self.context_len:
                raise PromptTooLong(
                    f"messages has {len(req.messages)} entries; at most {self.context_len} can fit the context",
                    "messages",
                )
            n_chars = sum(len(m.content) for m in req.messages)
            self._check_chars("the messages' content", n_chars, req, "messages", limit_name)
            return await self._off_loop(lambda r: self._chat_ids(r, limit_name), req, n_chars)
        text = req.text or ""
        self._check_chars("the text", len(text), req, "text", limit_name)
        # TextCodec encodes through the tokenizers library's batch call, which releases the GIL
        return await self._off_loop(lambda r: self.codec.encode(r.text or ""), req, len(text))

    def _overloaded(self) -> str | None:
        """Why a new request must be refused now (None: there is room)."""
        n = len(self.pending) + len(self.intake)
        if n >= self.max_queued:
            return (
                f"server overloaded: {n} requests are queued or running, the most it takes "
                f"(--max-queued-requests {self.max_queued}); retry later"
            )
        return None

    async def generate(self, req: GenerateReq, sink: Sink) -> None:
        """Validate and submit ``req``; replies go to ``sink``. Never raises.

        Every request gets exactly one terminal reply: its result (or stream end), or an ``ErrorOut`` —
        ``overloaded`` when ``--max-queued-requests`` requests are already queued, running or being tokenized.
        A request aborted (or failed by :meth:`fail_all`) while it is being tokenized is never submitted.
        """
        arrived = time.monotonic()
        client_rid = req.rid or uuid.uuid4().hex
        key = (id(sink), client_rid)
        if self.health.draining is not None:
            sink.send(ErrorOut(client_rid, self.health.draining, "unavailable"))
            return
        busy = self._overloaded()
        if busy is not None:
            sink.send(ErrorOut(client_rid, busy, "overloaded"))
            return
        if key in self.by_client or key in self.intake:
            sink.send(ErrorOut(client_rid, f"request id {client_rid!r} is already running", "bad_request"))
            return
        entry = self.intake[key] = Intake(client_rid, sink)
        try:
            validate_sampling(req, self.context_len, self.vocab_size)
            validate_logprobs(req)
            ids = await self.prompt_ids(req)
            validate_prompt_ids(ids, req.sampling_params.max_new_tokens, self.context_len, self.vocab_size)
            uid = await self.resolve_adapter(req.lora_path)
        except (BadRequest, ChatTemplateError, AdapterRefused) as e:
            sink.send(ErrorOut(client_rid, str(e), "bad_request"))
            return
        except UnknownAdapter as e:
            sink.send(ErrorOut(client_rid, str(e), "not_found"))
            return
        except Overloaded as e:
            sink.send(ErrorOut(client_rid, f"server overloaded: {e}", "overloaded"))
            return
        except RuntimeError as e:
            sink.send(ErrorOut(client_rid, str(e), "server_error"))
            return
        except Exception as e:  # noqa: BLE001 - a bug answers this request, the front door stays up
            log.exception("request %s failed in the front door", client_rid)
            sink.send(ErrorOut(client_rid, f"internal error: {type(e).__name__}: {e}", "server_error"))
            return
        finally:
            if self.intake.get(key) is entry:
                del self.intake[key]
        if entry.failed is not None:
            sink.send(ErrorOut(client_rid, entry.failed, "server_error"))
            return
        if entry.aborted is not None:  # the same final reply the scheduler gives an aborted request
            meta = MetaInfo(client_rid, len(ids), 0, FinishReason("abort", message=entry.aborted), req.lora_path)
            sink.send(GenerateOut(client_rid, "", [], meta, True))
            return
        rid = uuid.uuid4().hex
        msg = TokenizedReq(
            rid,
            ids,
            req.sampling_params,
            uid,
            req.stream,
            return_logprob=req.return_logprob,
            top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
        )
        self.pending[rid] = Pending(
            rid, client_rid, sink, req.stream, IncrementalText(self.codec), len(ids), req.lora_path, msg, False, arrived
        )
        self.by_client[key] = rid
        self.metrics.request_submitted(len(ids), req.lora_path)
        self.send(msg)

    def abort(self, sink: Sink, client_rid: str, reason: str = "aborted by client") -> None:
        """Abort a request of this client (unknown ids are ignored)."""
        key = (id(sink), client_rid)
        entry = self.intake.get(key)
        if entry is not None:
            entry.aborted = entry.aborted or reason
        rid = self.by_client.get(key)
        if rid is not None and not self.pending[rid].aborted:
            self.pending[rid].aborted = True
            self.send(AbortRid(rid, reason))

    def abort_sink(self, sink: Sink, reason: str) -> int:
        """Abort every request whose replies go to ``sink`` (its client went away); returns how many."""
        n = 0
        for entry in self.intake.values():
            if entry.sink is sink and entry.aborted is None:
                entry.aborted = reason
                n += 1
        for p in list(self.pending.values()):
            if p.sink is sink and not p.aborted:
                p.aborted = True
                self.send(AbortRid(p.rid, reason))
                n += 1
        return n

    def sinks_in_use(self) -> set[Sink]:
        """Every sink with a request queued, running or being tokenized."""
        return {p.sink for p in self.pending.values()} | {e.sink for e in self.intake.values()}

    def on_tokens(self, msg: BatchTokenOut) -> None:
        """Route one scheduler step's output to the clients."""
        for item in msg.items:
            p = self.pending.get(item.rid)
            if p is None:
                continue
            # tokens are positioned (completion_tokens counts them all): after a scheduler restart a late
            # message of the old scheduler may repeat tokens the client already has; deliver each token once
            start = item.completion_tokens - len(item.new_ids)
            if start < len(p.text.ids) and item.new_ids:
                skip = len(p.text.ids) - start
                item = msgspec.structs.replace(
                    item,
                    new_ids=item.new_ids[skip:],
                    new_token_logprobs=None if item.new_token_logprobs is None else item.new_token_logprobs[skip:],
                    new_top_logprobs=None if item.new_top_logprobs is None else item.new_top_logprobs[skip:],
                )
                if not item.new_ids and not item.finished:
                    continue
            self._account(p, item)
            self._deliver(p, item)

    def _account(self, p: Pending, item: TokenOut) -> None:
        """Metrics and logprobs of ``item``'s new tokens (before they are delivered)."""
        now = time.monotonic()
        if item.new_ids:
            first = now - p.arrived if p.last_token_at is None else None
            gap = None if p.last_token_at is None else now - p.last_token_at
            self.metrics.tokens_delivered(len(item.new_ids), first, gap)
            p.last_token_at = now
            if p.req.return_logprob and item.new_token_logprobs is not None:
                p.token_logprobs.extend(item.new_token_logprobs)
            if p.req.top_logprobs_num and item.new_top_logprobs is not None:
                p.top_logprobs.extend(item.new_top_logprobs)
        if item.finished:
            reason = "error" if item.error is not None else (item.finish_reason.type if item.finish_reason else "stop")
            self.metrics.request_finished(now - p.arrived, reason)
            self.metrics.prefix_cache(item.prompt_tokens, item.cached_tokens)

    def _meta(self, p: Pending, item: TokenOut) -> MetaInfo:
        """The client's meta_info for ``item`` (cumulative logprobs when the request asked for them)."""
        meta = MetaInfo(
            p.client_rid,
            item.prompt_tokens,
            item.completion_tokens,
            item.finish_reason if item.finished else None,
            p.lora_name,
            cached_tokens=item.cached_tokens,
        )
        if p.req.return_logprob and p.token_logprobs:
            meta.output_token_logprobs = list(p.token_logprobs)
            if p.req.top_logprobs_num and p.top_logprobs:
                meta.output_top_logprobs = list(p.top_logprobs)
        return meta

    def _deliver(self, p: Pending, item: TokenOut) -> None:
        if not (p.stream or item.finished or item.error):
            p.text.ids.extend(item.new_ids)  # decode only when someone will read the text
            return
        text = p.text.push(item.new_ids, final=item.finished)
        if item.finished:
            self.pending.pop(p.rid, None)
            self.by_client.pop((id(p.sink), p.client_rid), None)
        if item.error is not None:
            p.sink.send(ErrorOut(p.client_rid, item.error, item.error_kind))
            return
        fr = item.finish_reason
        stops = StopText(p.req.sampling.stop_strings(), self.codec)
        if item.finished and fr is not None and fr.type == "stop" and isinstance(fr.matched, str):
            text = stops.final(text, p.text.ids)  # cut where the first stop string begins
        elif not item.finished and stops:
            text = stops.visible(text, p.text.ids)  # hold back what may still become a stop string
        ok = p.sink.send(GenerateOut(p.client_rid, text, list(p.text.ids), self._meta(p, item), item.finished))
        if not ok and not item.finished:
            log.info("client of %s is gone; aborting", p.client_rid)
            self.send(AbortRid(p.rid, "client disconnected"))

    def fail_all(self, message: str, only: Callable[[Sink], bool] | None = None, kind: str = "server_error") -> None:
        """End every pending request (of the sinks ``only`` accepts, default all) with an error of ``kind`` (the
        cluster is going down); requests still being tokenized get the same error instead of being submitted."""
        for entry in self.intake.values():
            if only is None or only(entry.sink):
                entry.failed = entry.failed or message
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            if only is not None and not only(p.sink):
                continue
            p.sink.send(ErrorOut(p.client_rid, message, kind))
            self.metrics.request_finished(now - p.arrived, "error")
            del self.pending[rid]
            self.by_client.pop((id(p.sink), p.client_rid), None)

    # ------------------------------------------------------------------ LoRA: delegated to LoraAdmin
    @property
    def registry(self) -> LoraRegistry:
        """The LoRA registry (owned by :attr:`lora`)."""
        return self.lora.registry

    async def load_adapter(self, name: str, path: str, pinned: bool = False, deterministic: bool = False) -> AdminOut:
        """See :meth:`LoraAdmin.load_adapter`."""
        return await self.lora.load_adapter(name, path, pinned, deterministic)

    async def unload_adapter(self, name: str) -> AdminOut:
        """See :meth:`LoraAdmin.unload_adapter`."""
        return await self.lora.unload_adapter(name)

    async def resolve_adapter(self, name: str | None) -> str | None:
        """See :meth:`LoraAdmin.resolve_adapter`."""
        return await self.lora.resolve_adapter(name)

    async def list_adapters(self) -> LoraListOut:
        """See :meth:`LoraAdmin.list_adapters`."""
        return await self.lora.list_adapters()

    def on_op_result(self, msg: LoraOpResult) -> None:
        """Complete the waiting LoRA load/unload/list call."""
        self.lora.on_op_result(msg)

    def on_scheduler_beat(self, beat: SchedulerBeat) -> None:
        """The scheduler's heartbeat: its loop runs; which TP ranks answer; the batch (for /metrics)."""
        self.health.on_beat(beat)

    def begin_drain(self, reason: str) -> None:
        """Stop admitting requests and LoRA loads/unloads (they get ``unavailable``); those in flight go on."""
        self.health.draining = reason
        self.lora.refuse_changes(reason)

    @property
    def in_flight(self) -> int:
        """Requests queued, running or being tokenized."""
        return len(self.pending) + len(self.intake)

    def on_cluster_event(self, ev: ClusterEvent) -> None:
        """Track the TP group's health; forget adapters a worker restart could not restore."""
        h = self.health
        if ev.kind == "workers_restarting":
            h.unavailable = f"TP group restarting (epoch {ev.epoch}): {ev.message}"
            h.merge_restarts(ev.restarts)
            log.warning("%s; requests wait in the queue", h.unavailable)
        elif ev.kind == "workers_recovered":
            h.unavailable = None
            h.resumed += ev.resumed
            self.lora.on_lost(ev.lost)
            log.info("%s: %d requests resumed, adapters restored %s", ev.message, ev.resumed, ev.restored)
        elif ev.kind == "fatal":
            log.error("cluster error: %s", ev.message)
            h.unavailable = ev.message
            self.fail_all(ev.message)

    # ------------------------------------------------------------------ restarts: one view of the adapters
    def on_cluster_view(self, view: ClusterView) -> None:
        """Reconcile the LoRA registry with the adapters the workers hold (:meth:`LoraAdmin.on_cluster_view`);
        after a scheduler restart resubmit every pending request, each with the tokens its client already has,
        so it continues where it stopped."""
        self.health.merge_restarts(view.restarts)
        # a scheduler that restarted while the TP group was being replaced never sends that group's recovery
        # event: its view says whether the group serves
        if view.serving and (self.health.unavailable or "").startswith("TP group restarting"):
            self.health.unavailable = None
        restarted = self.sched_incarnation is not None and view.scheduler_incarnation != self.sched_incarnation
        self.sched_incarnation = view.scheduler_incarnation
        self.lora.on_cluster_view(view, restarted, self._resubmit_pending)
        self.synced.set()

    def _resubmit_pending(self) -> int:
        """Send every pending request again to a new scheduler; returns how many."""
        for p in list(self.pending.values()):
            r = p.req
            self.send(msgspec.structs.replace(r, output_ids=list(p.text.ids), resume=True))
            if p.aborted:
                self.send(AbortRid(p.rid, "aborted by client"))
        return len(self.pending)
