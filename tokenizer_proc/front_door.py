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

import msgspec

from ipc.config import ServerArgs
from ipc.lora_config import LoraConfigError, adapter_content_hash
from ipc.messages import (
    AbortRid,
    AdapterInfo,
    AdapterState,
    AdminOut,
    BatchTokenOut,
    ClusterEvent,
    ClusterView,
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

    def merge_restarts(self, counts: dict[str, int]) -> None:
        """Take the launcher's restart counts (from whichever process forwards them; never go back)."""
        for proc, n in counts.items():
            self.restarts[proc] = max(n, self.restarts.get(proc, 0))


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
        self._op_cmds: dict[int, object] = {}
        self.sched_incarnation: str | None = None
        self.synced = asyncio.Event()  # set by the first ClusterView: the registry agrees with the workers
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
        msg = TokenizedReq(rid, ids, req.sampling_params, uid, req.stream)
        self.pending[rid] = Pending(
            rid, client_rid, sink, req.stream, IncrementalText(self.codec), len(ids), req.lora_path, msg
        )
        self.by_client[(id(sink), client_rid)] = rid
        self.send(msg)

    def abort(self, sink: Sink, client_rid: str, reason: str = "aborted by client") -> None:
        """Abort a request of this client (unknown ids are ignored)."""
        rid = self.by_client.get((id(sink), client_rid))
        if rid is not None:
            self.pending[rid].aborted = True
            self.send(AbortRid(rid, reason))

    def abort_sink(self, sink: Sink, reason: str) -> None:
        """Abort every request whose replies go to ``sink`` (its client went away)."""
        for p in list(self.pending.values()):
            if p.sink is sink:
                p.aborted = True
                self.send(AbortRid(p.rid, reason))

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
                item = msgspec.structs.replace(item, new_ids=item.new_ids[len(p.text.ids) - start :])
                if not item.new_ids and not item.finished:
                    continue
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
    def _start_op(self, cmd_factory: Callable[[int], object]) -> tuple[int, asyncio.Future]:
        """Send a LoRA command now; its result arrives on the returned future. Kept until answered, so a
        scheduler restart resends it."""
        op_id = next(self._op_ids)
        fut = asyncio.get_running_loop().create_future()
        cmd = cmd_factory(op_id)
        self._ops[op_id] = fut
        self._op_cmds[op_id] = cmd
        self.send(cmd)
        return op_id, fut

    async def _wait_op(self, op_id: int, fut: asyncio.Future) -> LoraOpResult:
        try:
            return await asyncio.wait_for(fut, LORA_OP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"LoRA operation {op_id} got no answer in {LORA_OP_TIMEOUT_S} s") from None
        finally:
            self._ops.pop(op_id, None)
            self._op_cmds.pop(op_id, None)

    async def _op(self, cmd_factory: Callable[[int], object]) -> LoraOpResult:
        return await self._wait_op(*self._start_op(cmd_factory))

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
        e = self.registry.add(name, uid, resolved, pinned, res.content_hash)
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
            h.merge_restarts(ev.restarts)
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

    # ------------------------------------------------------------------ restarts: one view of the adapters
    def on_cluster_view(self, view: ClusterView) -> None:
        """Reconcile the registry with the adapters the workers hold, and resubmit after a scheduler restart.

        - An adapter the workers hold but the registry lacks (this front door restarted and rebuilds its
          registry) is adopted if its files still hold the same content; otherwise it is unloaded and reported.
        - An adapter the registry holds but the workers lack is restored under the same uid (the ranks check
          the content hash); if that fails it is removed, and its requests fail as never loaded.
        - A new scheduler incarnation lost every request and LoRA command in flight: resubmit them, each
          request with the tokens its client already has, so it continues where it stopped.
        """
        self.health.merge_restarts(view.restarts)
        restarted = self.sched_incarnation is not None and view.scheduler_incarnation != self.sched_incarnation
        self.sched_incarnation = view.scheduler_incarnation
        held = {a.uid for a in view.adapters}
        known = {e.uid for e in self.registry.loaded.values()}
        for a in view.adapters:
            if a.uid not in known:
                self._adopt(a)
        restores = []
        for e in list(self.registry.loaded.values()):
            if e.uid not in held:
                log.warning("LoRA registry out of sync: the workers lack %s (uid %s); restoring it", e.name, e.uid)
                restores.append((e, self._start_op(lambda op, e=e: self._restore_cmd(op, e))))
        if restarted:
            for p in list(self.pending.values()):
                r = p.req
                self.send(TokenizedReq(r.rid, r.input_ids, r.sampling, r.lora_uid, r.stream, list(p.text.ids), True))
                if p.aborted:
                    self.send(AbortRid(p.rid, "aborted by client"))
            for op_id, cmd in sorted(self._op_cmds.items()):
                if all(op_id != x[1][0] for x in restores):
                    self.send(cmd)
            log.warning(
                "scheduler restarted: resubmitted %d requests and %d LoRA commands",
                len(self.pending),
                len(self._op_cmds),
            )
        for e, (op_id, fut) in restores:
            asyncio.ensure_future(self._finish_restore(e, op_id, fut))
        self.synced.set()

    @staticmethod
    def _restore_cmd(op_id: int, e) -> LoraLoadCmd:
        return LoraLoadCmd(op_id, e.uid, e.name, e.path, e.pinned, e.content_hash)

    def _adopt(self, a: AdapterState) -> None:
        reason = None
        try:
            if adapter_content_hash(a.path, a.name) != a.content_hash:
                reason = f"the files in {a.path} changed since it was loaded"
            elif a.name in self.registry.loaded:
                reason = f"the name {a.name} belongs to uid {self.registry.loaded[a.name].uid}"
            else:
                self.registry.add(a.name, a.uid, a.path, a.pinned, a.content_hash)
                log.info("LoRA registry: %s (uid %s) rebuilt from the workers", a.name, a.uid)
                return
        except LoraConfigError as e:
            reason = str(e)
        log.error("LoRA adapter %s (uid %s) is no longer valid and is unloaded: %s", a.name, a.uid, reason)
        self.health.adapters_lost += 1
        if a.name not in self.registry.loaded:
            self.registry.refs.pop(a.name, None)
        self._start_op(lambda op: LoraUnloadCmd(op, a.uid))  # answered later; nobody waits for it

    async def _finish_restore(self, e, op_id: int, fut: asyncio.Future) -> None:
        try:
            res = await self._wait_op(op_id, fut)
        except RuntimeError as err:
            res = LoraOpResult(op_id, False, str(err))
        cur = self.registry.loaded.get(e.name)
        if res.ok or cur is None or cur.uid != e.uid:
            return
        self.registry.remove(e.name, forget=True)
        self.health.adapters_lost += 1
        log.error("LoRA adapter %s could not be restored and was removed: %s", e.name, res.error)
