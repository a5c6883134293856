"""The front door's logic: turn client requests into scheduler messages and scheduler output into replies.

Shared by the ZMQ ROUTER and the HTTP server: each request carries a *sink* that delivers its replies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ipc.config import ServerArgs
from ipc.messages import (
    AbortRid,
    AdapterInfo,
    AdminOut,
    BatchTokenOut,
    ClusterEvent,
    ErrorOut,
    GenerateOut,
    GenerateReq,
    LoraListOut,
    LoraLoadCmd,
    LoraOpResult,
    LoraSlotsQuery,
    LoraUnloadCmd,
    MetaInfo,
    ServerMsg,
    TokenizedReq,
    TokenOut,
)
from ipc.model_config import load_model_config
from tokenizer_proc.registry import AdapterRefused, LoraRegistry, UnknownAdapter
from tokenizer_proc.text import ChatTemplateError, IncrementalText, TextCodec
from tokenizer_proc.validate import (
    BadRequest,
    check_one_prompt,
    check_prompt_chars,
    validate_prompt_ids,
    validate_sampling,
)

log = logging.getLogger("tokenizer")
LORA_OP_TIMEOUT_S = 300.0


class Sink(Protocol):
    """Where one request's replies go. ``send`` returns False when the client is gone."""

    def send(self, msg: ServerMsg) -> bool:
        """Deliver one reply; False if the client can no longer be reached."""
        ...


@dataclass
class ClusterHealth:
    """What the front door knows of the cluster: why it cannot serve now (None = it can), and counters."""

    unavailable: str | None = None
    restarts: dict[str, int] = field(default_factory=dict)  # process -> restarts
    resumed: int = 0  # running requests re-admitted after a TP group restart
    adapters_lost: int = 0  # adapters a restart could not restore


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


class FrontDoor:
    """Validation, tokenization, the LoRA registry and reply routing. ``send_to_scheduler`` is injected."""

    def __init__(self, args: ServerArgs, send_to_scheduler: Callable[[object], None]) -> None:
        self.args = args
        self.send = send_to_scheduler
        self.codec = TextCodec(args.model_path)
        cfg = load_model_config(args.model_path)
        self.context_len = args.context_length or cfg.max_position_embeddings
        if args.max_total_tokens:  # the scheduler caps the context at the KV pool too
            self.context_len = min(self.context_len, args.max_total_tokens)
        self.vocab_size = cfg.vocab_size
        self.registry = LoraRegistry(
            lora_root=args.lora_root, max_lora_rank=args.max_lora_rank, max_loaded=args.max_loaded_loras
        )
        self.pending: dict[str, Pending] = {}
        self.by_client: dict[tuple[int, str], str] = {}
        self._ops: dict[int, asyncio.Future] = {}
        self._op_ids = itertools.count(1)
        self._reloads: dict[str, asyncio.Future] = {}
        self.health = ClusterHealth()

    # ------------------------------------------------------------------ generate
    def _check_chars(self, what: str, n_chars: int, req: GenerateReq) -> None:
        check_prompt_chars(
            what, n_chars, req.sampling_params.max_new_tokens, self.context_len, self.codec.max_token_chars
        )

    def _prompt_ids(self, req: GenerateReq) -> list[int]:
        check_one_prompt(req)
        if req.input_ids is not None:
            return list(req.input_ids)
        if req.messages is not None:
            if len(req.messages) > self.context_len:
                raise BadRequest(
                    f"messages has {len(req.messages)} entries; at most {self.context_len} can fit the context"
                )
            self._check_chars("the messages' content", sum(len(m.content) for m in req.messages), req)
            rendered = self.codec.render_chat([{"role": m.role, "content": m.content} for m in req.messages])
            self._check_chars("the rendered chat", len(rendered), req)
            return self.codec.encode(rendered)
        text = req.text or ""
        self._check_chars("text", len(text), req)
        return self.codec.encode(text)

    async def generate(self, req: GenerateReq, sink: Sink) -> None:
        """Validate and submit ``req``; replies go to ``sink``. Never raises for client mistakes."""
        client_rid = req.rid or uuid.uuid4().hex
        try:
            if (id(sink), client_rid) in self.by_client:
                raise BadRequest(f"request id {client_rid!r} is already running")
            validate_sampling(req, self.context_len, self.vocab_size)
            ids = self._prompt_ids(req)
            validate_prompt_ids(ids, req.sampling_params.max_new_tokens, self.context_len, self.vocab_size)
            uid = await self.resolve_adapter(req.lora_path)
        except (BadRequest, ChatTemplateError, AdapterRefused) as e:
            sink.send(ErrorOut(client_rid, str(e), "bad_request"))
            return
        except UnknownAdapter as e:
            sink.send(ErrorOut(client_rid, str(e), "not_found"))
            return
        except RuntimeError as e:
            sink.send(ErrorOut(client_rid, str(e), "server_error"))
            return
        rid = uuid.uuid4().hex
        self.pending[rid] = Pending(
            rid, client_rid, sink, req.stream, IncrementalText(self.codec), len(ids), req.lora_path
        )
        self.by_client[(id(sink), client_rid)] = rid
        self.send(TokenizedReq(rid, ids, req.sampling_params, uid, req.stream))

    def abort(self, sink: Sink, client_rid: str, reason: str = "aborted by client") -> None:
        """Abort a request of this client (unknown ids are ignored)."""
        rid = self.by_client.get((id(sink), client_rid))
        if rid is not None:
            self.send(AbortRid(rid, reason))

    def abort_sink(self, sink: Sink, reason: str) -> None:
        """Abort every request whose replies go to ``sink`` (its client went away)."""
        for p in list(self.pending.values()):
            if p.sink is sink:
                self.send(AbortRid(p.rid, reason))

    def on_tokens(self, msg: BatchTokenOut) -> None:
        """Route one scheduler step's output to the clients."""
        for item in msg.items:
            p = self.pending.get(item.rid)
            if p is not None:
                self._deliver(p, item)

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
        if item.finished and fr is not None and fr.type == "stop" and isinstance(fr.matched, str):
            cut = text.find(fr.matched)
            text = text[:cut] if cut >= 0 else text
        meta = MetaInfo(
            p.client_rid, item.prompt_tokens, item.completion_tokens, fr if item.finished else None, p.lora_name
        )
        ok = p.sink.send(GenerateOut(p.client_rid, text, list(p.text.ids), meta, item.finished))
        if not ok and not item.finished:
            log.info("client of %s is gone; aborting", p.client_rid)
            self.send(AbortRid(p.rid, "client disconnected"))

    def fail_all(self, message: str) -> None:
        """End every pending request with a server error (the cluster is going down)."""
        for p in list(self.pending.values()):
            p.sink.send(ErrorOut(p.client_rid, message, "server_error"))
        self.pending.clear()
        self.by_client.clear()

    # ------------------------------------------------------------------ LoRA registry
    async def _op(self, cmd_factory: Callable[[int], object]) -> LoraOpResult:
        op_id = next(self._op_ids)
        fut = asyncio.get_running_loop().create_future()
        self._ops[op_id] = fut
        self.send(cmd_factory(op_id))
        try:
            return await asyncio.wait_for(fut, LORA_OP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"LoRA operation {op_id} got no answer in {LORA_OP_TIMEOUT_S} s") from None
        finally:
            self._ops.pop(op_id, None)

    def on_op_result(self, msg: LoraOpResult) -> None:
        """Complete the waiting load/unload/list call."""
        fut = self._ops.get(msg.op_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def load_adapter(self, name: str, path: str, pinned: bool = False, deterministic: bool = False) -> AdminOut:
        """Load ``name`` on every rank (all or nothing). Raises AdapterRefused for a bad path or config."""
        if not self.args.enable_lora:
            raise AdapterRefused("LoRA is not enabled: start the server with --enable-lora")
        if name in self.registry.loaded:
            raise AdapterRefused(f"LoRA adapter {name} is already loaded; unload it first")
        resolved = self.registry.check_path(name, path)
        victim = self.registry.eviction_victim()
        if victim is not None:  # host tier full: evict the LRU unpinned adapter, keep it in the ref cache
            await self._unload_uid(victim.name, victim.uid, forget=False)
        uid = self.registry.new_uid(name, resolved, deterministic)
        res = await self._op(lambda op: LoraLoadCmd(op, uid, name, resolved, pinned))
        if not res.ok:
            raise AdapterRefused(f"LoRA adapter {name} failed to load: {res.error}")
        e = self.registry.add(name, uid, resolved, pinned)
        return AdminOut(True, f"loaded {name}", {"uid": e.uid, "rank": e.rank})

    async def _unload_uid(self, name: str, uid: str, forget: bool) -> None:
        self.registry.remove(name, forget=forget)
        res = await self._op(lambda op: LoraUnloadCmd(op, uid))
        if not res.ok:
            raise RuntimeError(f"LoRA adapter {name} failed to unload: {res.error}")

    async def unload_adapter(self, name: str) -> AdminOut:
        """Unload ``name``: new requests for it fail at once, running ones finish first."""
        e = self.registry.loaded.get(name)
        if e is None:
            self.registry.lookup(name)  # raises the never-loaded error for unknown names
            self.registry.remove(name)
            return AdminOut(True, f"{name} was not resident; forgotten")
        await self._unload_uid(name, e.uid, forget=True)
        return AdminOut(True, f"unloaded {name}")

    async def resolve_adapter(self, name: str | None) -> str | None:
        """uid for ``name`` (None = base), reloading it transparently if only the ref cache knows it."""
        if name is None:
            return None
        if not self.args.enable_lora:
            raise BadRequest(f"lora_path={name!r} given but LoRA is not enabled (start with --enable-lora)")
        e = self.registry.lookup(name)
        if e is not None:
            return e.uid
        fut = self._reloads.get(name)
        if fut is None:
            path, pinned = self.registry.refs[name]
            log.info("reloading LoRA adapter %s from %s", name, path)
            fut = asyncio.ensure_future(self.load_adapter(name, path, pinned))
            self._reloads[name] = fut
            fut.add_done_callback(lambda _f: self._reloads.pop(name, None))
        await asyncio.shield(fut)
        return self.registry.loaded[name].uid

    async def list_adapters(self) -> LoraListOut:
        """Every loaded adapter with the slot each rank holds it in."""
        res = await self._op(lambda op: LoraSlotsQuery(op))
        out = []
        for e in sorted(self.registry.loaded.values(), key=lambda e: e.name):
            out.append(AdapterInfo(e.name, e.uid, e.path, e.rank, e.pinned, res.slots.get(e.uid, {})))
        return LoraListOut(out)

    def on_cluster_event(self, ev: ClusterEvent) -> None:
        """Track the TP group's health; forget adapters a worker restart could not restore."""
        h = self.health
        if ev.kind == "workers_restarting":
            h.unavailable = f"TP group restarting (epoch {ev.epoch}): {ev.message}"
            h.restarts[ev.process or "gpu_worker"] = h.restarts.get(ev.process or "gpu_worker", 0) + 1
            log.warning("%s; requests wait in the queue", h.unavailable)
        elif ev.kind == "workers_recovered":
            h.unavailable = None
            h.resumed += ev.resumed
            for lost in ev.lost:
                e = self.registry.loaded.get(lost.name)
                if e is None or e.uid == lost.uid:  # never drop a newer load of the same name
                    self.registry.remove(lost.name, forget=True)
                h.adapters_lost += 1
                log.error("LoRA adapter %s could not be restored and was removed: %s", lost.name, lost.reason)
            log.info("%s: %d requests resumed, adapters restored %s", ev.message, ev.resumed, ev.restored)
        elif ev.kind == "fatal":
            log.error("cluster error: %s", ev.message)
            h.unavailable = ev.message
            self.fail_all(ev.message)
