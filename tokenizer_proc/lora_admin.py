"""The front door's LoRA administration: load, unload, list, reload-by-request and failover reconciliation.

Every path changes an adapter name only through the registry's state machine (see
:mod:`tokenizer_proc.registry`), so concurrent operations on one name cannot interleave:

- An explicit load or unload that meets another explicit one in flight on the same name is refused at once with
  what is happening (``LoRA adapter a is being loaded``) and changes nothing. One that meets the cluster's own
  work (a reload for a request, a host-tier eviction, a failover restore) waits for it to end and then acts on
  the outcome, as if it had arrived just after it.
- A request waits for a load, reload or eviction of its adapter and then uses (or reloads) it; during an
  explicit unload it fails at once as never loaded; during a restore it goes on under the same uid.
- Each transition is driven by a task this object owns, so a caller that goes away never abandons a uid on the
  workers; a load that got no answer is followed by an unload of its uid.
- Host-tier eviction happens after the new adapter loaded on every rank, so a failed or refused load evicts
  nothing (a pinned load that would leave no free slot is refused before anything is sent).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

from ipc.config import ServerArgs
from ipc.lora_config import DEFAULT_SERVED_MODEL_NAME, LoraConfigError, adapter_content_hash
from ipc.messages import (
    AdapterInfo,
    AdapterState,
    AdminOut,
    ClusterView,
    LoraListOut,
    LoraLoadCmd,
    LoraOpResult,
    LoraSlotsQuery,
    LoraUnloadCmd,
    LostAdapter,
)
from tokenizer_proc.registry import (
    AdapterRefused,
    IllegalTransition,
    Kind,
    LoraRegistry,
    ServerStopping,
    Transition,
)
from tokenizer_proc.registry_journal import JOURNAL_FILE, RegistryJournal, RegistrySnapshot
from tokenizer_proc.validate import BadRequest

log = logging.getLogger("tokenizer")
LORA_OP_TIMEOUT_S = 300.0


class LostCounter(Protocol):
    """Where adapters the cluster could not keep are counted (``loom_lora_adapters_lost_total``)."""

    adapters_lost: int


class LoraAdmin:
    """The registry plus the LoRA commands in flight to the scheduler. ``send`` delivers a command."""

    def __init__(
        self,
        args: ServerArgs,
        send: Callable[[object], None],
        health: LostCounter,
        tie_word_embeddings: bool | None = None,
        on_loaded: Callable[[str, float], None] | None = None,
        num_layers: int = 0,
    ) -> None:
        self.args = args
        self.send = send
        self.health = health
        self.on_loaded = on_loaded  # (kind, seconds) of each load that succeeded on every rank (metrics)
        self.registry = LoraRegistry(
            lora_root=args.lora_root,
            base_dir=args.base_dir,
            max_lora_rank=args.max_lora_rank,
            max_loaded=args.max_loaded_loras,
            max_slots=args.max_loras_per_batch,
            tie_word_embeddings=tie_word_embeddings,
            served_model_name=args.served_model_name or DEFAULT_SERVED_MODEL_NAME,
            num_layers=num_layers,
        )
        self._ops: dict[int, asyncio.Future] = {}
        self._op_cmds: dict[int, object] = {}  # answered commands leave; the rest are resent to a new scheduler
        self._op_ids = itertools.count(1)
        self._settle: dict[str, asyncio.Future] = {}  # name -> resolved (with the error or None) when it settles
        self._tasks: set[asyncio.Task] = set()
        self._viewed = ""  # the scheduler incarnation of the last ClusterView
        folder = args.endpoints.socket_dir
        self.journal = RegistryJournal(Path(folder) / JOURNAL_FILE if folder else None)
        self.registry.on_change = lambda: self.journal.save(self.registry.snapshot())
        self._carried: RegistrySnapshot | None = None  # a restarted front door's journal until its first view
        self.stopping: str | None = None  # why loads and unloads are refused (draining or stopping)
        self._closed = False  # this front door stops: it sends no more LoRA commands (see interrupt)

    def seed_from_journal(self) -> None:
        """A restarted front door, before its first cluster view: keep the previous incarnation's settled adapters
        (``tokenizer_proc/registry_journal.py``) for :meth:`on_cluster_view`, which carries over those the workers
        lack too (they were restarted as well), so they are restored under the same uids instead of dropped."""
        self._carried = self.journal.read()

    def _carry_over(self, snap: RegistrySnapshot, held: set[str]) -> None:
        """Take ``snap``'s adapters that the workers do not hold (those they hold were adopted, with their checks)
        into the registry when their files still hash as at their first load; report the rest lost (their requests
        fail as never loaded). Names only the ref cache knew are remembered."""
        carried = []
        for e in snap.loaded:
            if e.uid in held or self.registry.state(e.name) != "gone":
                continue
            try:
                if adapter_content_hash(e.path, e.name) != e.content_hash:
                    raise LoraConfigError(f"the files in {e.path} changed since it was loaded")
                self.registry.adopt(e.name, e.uid, e.path, e.pinned, e.content_hash)
                carried.append(e.name)
            except (LoraConfigError, OSError) as err:
                self.health.adapters_lost += 1
                log.error("LoRA adapter %s (uid %s) could not be carried over and was removed: %s", e.name, e.uid, err)
        for r in snap.known:
            if self.registry.state(r.name) == "gone":
                self.registry.remember(r.name, r.path, r.pinned)
        log.info("LoRA registry carried over from the previous front door: %s (+%d in the ref cache)", carried,
                 len(snap.known))  # fmt: skip

    # ------------------------------------------------------------------ commands to the scheduler
    def _start_op(self, cmd_factory: Callable[[int], object]) -> tuple[int, asyncio.Future]:
        """Send a LoRA command now; its result arrives on the returned future. Kept until answered, so a
        scheduler restart resends it."""
        op_id = next(self._op_ids)
        fut = asyncio.get_running_loop().create_future()
        if self._closed:  # a stopping front door changes nothing at the workers (its successor owns them)
            fut.set_exception(ServerStopping(self.stopping or "the front door is stopping"))
            return op_id, fut
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

    def _fire(self, cmd_factory: Callable[[int], object], what: str) -> None:
        """Send a command nobody waits for (kept for resending until answered; a failure is logged)."""
        op_id, fut = self._start_op(cmd_factory)

        async def wait() -> None:
            try:
                res = await self._wait_op(op_id, fut)
            except RuntimeError as e:
                log.error("%s: %s", what, e)
                return
            if not res.ok:
                log.error("%s failed: %s", what, res.error)

        self._spawn(wait())

    def _unload_stray(self, uid: str, name: str) -> None:
        """The workers may hold ``uid`` although the registry no longer tracks it: unload it."""
        self._fire(lambda op: LoraUnloadCmd(op, uid), f"unloading stray LoRA adapter {name} (uid {uid})")

    def refuse_changes(self, why: str) -> None:
        """Refuse every later load and unload with ServerStopping(``why``) (a drain or shutdown began)."""
        self.stopping = why

    def interrupt(self, why: str) -> None:
        """This front door stops now: refuse later loads and unloads and end the ones waiting for the scheduler
        with ServerStopping, so their callers get an answer before the connections close. Nothing is sent to
        undo them: a command the ranks already have may still finish, and the next front door adopts what the
        workers then hold (a dying front door must not change the workers behind its successor's back)."""
        self.refuse_changes(why)
        self._closed = True
        for fut in self._ops.values():
            if not fut.done():
                fut.set_exception(ServerStopping(why))

    def _check_not_stopping(self) -> None:
        if self.stopping is not None:
            raise ServerStopping(f"{self.stopping}: LoRA adapters are not loaded or unloaded now")

    def on_op_result(self, msg: LoraOpResult) -> None:
        """Complete the waiting load/unload/list call."""
        fut = self._ops.get(msg.op_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    # ------------------------------------------------------------------ transitions
    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as a task this object owns (its exception, if nobody awaits it, is not reported twice)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: callers that care awaited it

    def _settled(self, name: str, error: Exception | None = None) -> None:
        """The transition of ``name`` ended (``error``: why it failed); wake whoever waits for the name (the
        registry already holds the outcome, so waiters look at it again)."""
        fut = self._settle.pop(name, None)
        if fut is not None and not fut.done():
            fut.set_result(error)

    async def _wait_settled(self, name: str) -> Exception | None:
        """Wait until the transition of ``name`` in flight ends; returns its error (None: it succeeded)."""
        fut = self._settle.get(name)
        if fut is None:
            fut = self._settle[name] = asyncio.get_running_loop().create_future()
        return await asyncio.shield(fut)

    async def _wait_for_cluster_work(self, name: str, op: str) -> None:
        """Wait while a reload, eviction or restore of ``name`` runs; refuse if another explicit call runs."""
        while (t := self.registry.busy(name)) is not None:
            if t.explicit:
                raise AdapterRefused(f"{t.describe(name)} by another call; this {op} changed nothing")
            await self._wait_settled(name)

    def _in_flight(self, name: str, kinds: tuple[str, ...]) -> Transition:
        t = self.registry.busy(name)
        if t is None or t.kind not in kinds:
            raise IllegalTransition(f"LoRA adapter {name}: expected a {'/'.join(kinds)} in flight, found {t}")
        return t

    async def _run_load(self, name: str) -> AdminOut:
        """Drive the load (or reload) of ``name`` begun in the registry to its end, then evict over capacity."""
        t = self._in_flight(name, ("load", "reload"))
        started = time.monotonic()
        try:
            res = await self._op(lambda op: LoraLoadCmd(op, t.uid, name, t.path, t.pinned))
        except ServerStopping as e:  # the ranks may load it yet: the next front door adopts it then
            self.registry.finish_load(name, ok=False)
            err = ServerStopping(f"LoRA adapter {name}: the load was cut short ({e}); the ranks may still load it: "
                                 "list the adapters once the server answers again")  # fmt: skip
            self._settled(name, err)
            raise err from None
        except RuntimeError as e:  # no answer: the ranks may still load it later, so unload it after all
            self.registry.finish_load(name, ok=False)
            self._unload_stray(t.uid, name)
            err = RuntimeError(f"LoRA adapter {name} was not loaded: {e}")
            self._settled(name, err)
            raise err from None
        except BaseException:  # shutdown
            self.registry.finish_load(name, ok=False)
            self._settled(name, RuntimeError(f"LoRA adapter {name} was not loaded: shutting down"))
            raise
        if not res.ok:
            self.registry.finish_load(name, ok=False)
            err = AdapterRefused(f"LoRA adapter {name} failed to load: {res.error}")
            self._settled(name, err)
            raise err
        e = self.registry.finish_load(name, ok=True, content_hash=res.content_hash)
        self._settled(name)
        if self.on_loaded is not None:
            self.on_loaded(t.kind, time.monotonic() - started)
        await self._evict_over_capacity(keep=name)
        return AdminOut(True, f"loaded {name}", {"uid": e.uid, "rank": e.rank})

    async def _run_unload(self, name: str) -> None:
        """Drive the unload (or eviction) of ``name`` begun in the registry to its end."""
        t = self._in_flight(name, ("unload", "evict"))
        error = None
        try:
            res = await self._op(lambda op: LoraUnloadCmd(op, t.uid))
            error = None if res.ok else res.error
        except ServerStopping as e:  # no stray unload sent: the next front door adopts what the ranks hold
            raise ServerStopping(f"LoRA adapter {name}: the unload was cut short ({e}); list the adapters once the "
                                 "server answers again") from None  # fmt: skip
        except RuntimeError as e:
            error = str(e)
        finally:
            self.registry.finish_unload(name)
            self._settled(name)
        if error is not None:
            self._unload_stray(t.uid, name)  # ask again: nothing may stay on the workers untracked
            raise RuntimeError(f"LoRA adapter {name} failed to unload: {error}")

    async def _evict_over_capacity(self, keep: str) -> None:
        """Evict least recently used adapters (not ``keep``) while the host tier is over --max-loaded-loras."""
        while (victim := self.registry.eviction_victim(keep)) is not None:
            log.info(
                "host tier full (--max-loaded-loras %d): evicting LoRA adapter %s",
                self.registry.max_loaded,
                victim.name,
            )
            self.registry.begin_unload(victim.name, evict=True)
            try:
                await self._run_unload(victim.name)
            except RuntimeError as e:
                log.error("%s", e)
                return

    def _begin_load(self, name: str, path: str, pinned: bool, deterministic: bool, kind: Kind) -> Transition:
        resolved, rank = self.registry.check_adapter(name, path)
        refusal = self.registry.pin_refusal(name, pinned, rank)
        if refusal is not None:
            raise AdapterRefused(refusal)
        uid = self.registry.new_uid(name, resolved, deterministic)
        return self.registry.begin_load(name, uid, resolved, pinned, rank, kind)

    # ------------------------------------------------------------------ the API
    async def load_adapter(self, name: str, path: str, pinned: bool = False, deterministic: bool = False) -> AdminOut:
        """Load ``name`` on every rank (all or nothing).

        Raises:
            AdapterRefused: LoRA is off, the name is loaded or busy with another call, the path or config is
                bad, pinning would leave no free slot, or a rank refused it. Nothing changed then.
            RuntimeError: the scheduler did not answer.
        """
        if not self.args.enable_lora:
            raise AdapterRefused("LoRA is not enabled: start the server with --enable-lora")
        self._check_not_stopping()
        await self._wait_for_cluster_work(name, "load")
        if self.registry.state(name) == "loaded":
            raise AdapterRefused(f"LoRA adapter {name} is already loaded; unload it first")
        self._begin_load(name, path, pinned, deterministic, "load")
        return await asyncio.shield(self._spawn(self._run_load(name)))

    async def unload_adapter(self, name: str) -> AdminOut:
        """Unload ``name``: new requests for it fail at once, running ones finish first.

        Raises:
            UnknownAdapter: no part of the cluster knows ``name``.
            AdapterRefused: ``name`` is empty, or another call is loading or unloading it (nothing changed).
            RuntimeError: the scheduler did not answer.
        """
        if not name.strip():  # as a load of that name is refused (400), not a never-loaded 404
            raise AdapterRefused("LoRA adapter name is empty: name the adapter to unload")
        self._check_not_stopping()
        await self._wait_for_cluster_work(name, "unload")
        st = self.registry.state(name)
        if st == "gone":
            raise self.registry.unknown(name)
        if st == "known":
            self.registry.forget(name)
            return AdminOut(True, f"{name} was not resident; forgotten")
        self.registry.begin_unload(name)
        await asyncio.shield(self._spawn(self._run_unload(name)))
        return AdminOut(True, f"unloaded {name}")

    async def resolve_adapter(self, name: str | None) -> str | None:
        """uid for ``name`` (None = base), reloading it transparently if only the ref cache knows it.

        Raises:
            BadRequest: LoRA is off.
            UnknownAdapter: the name is unknown, or being unloaded.
            AdapterRefused / RuntimeError: the reload failed (every request waiting for it gets the error).
        """
        if name is None:
            return None
        if not self.args.enable_lora:
            raise BadRequest(
                f"lora_path={name!r} given but LoRA is not enabled (start with --enable-lora)", "lora_path"
            )
        while True:
            t = self.registry.busy(name)
            if t is None or t.kind == "restore":  # a restore keeps the uid: the scheduler queues its requests
                e = self.registry.lookup(name)
                if e is not None:
                    return e.uid
                path, pinned = self.registry.refs[name]
                if not Path(path).is_dir():  # its files are gone: nothing can restore it (as after a failover)
                    self.registry.forget(name)
                    log.warning("LoRA adapter %s cannot be reloaded: %s is gone; forgotten", name, path)
                    raise self.registry.unknown(name)
                log.info("reloading LoRA adapter %s from %s", name, path)
                t = self._begin_load(name, path, pinned, False, "reload")
                self._spawn(self._run_load(name))
            elif t.kind == "unload":
                raise self.registry.unknown(name)
            err = await self._wait_settled(name)
            if err is not None and t.kind == "reload":
                raise type(err)(str(err))

    async def list_adapters(self) -> LoraListOut:
        """Every loaded adapter with the slot each rank holds it in."""
        res = await self._op(lambda op: LoraSlotsQuery(op))
        out = []
        for e in sorted(self.registry.loaded.values(), key=lambda e: e.name):
            out.append(AdapterInfo(e.name, e.uid, e.path, e.rank, e.pinned, res.slots.get(e.uid, {})))
        return LoraListOut(out)

    # ------------------------------------------------------------------ failover: one view of the adapters
    def on_lost(self, lost: list[LostAdapter]) -> None:
        """Forget adapters a worker restart could not restore (a newer load of the same name is kept)."""
        for a in lost:
            self.registry.lose(a.name, a.uid)
            self.health.adapters_lost += 1
            log.error("LoRA adapter %s could not be restored and was removed: %s", a.name, a.reason)

    def on_cluster_view(self, view: ClusterView, restarted: bool, resubmit_requests: Callable[[], int]) -> None:
        """Reconcile the registry with the adapters the workers hold; after a scheduler restart resend.

        - An adapter the workers hold but the registry does not track (this front door restarted and rebuilds
          its registry) is adopted if its files still hold the same content; otherwise it is unloaded and reported.
        - An adapter the registry holds but the workers lack is restored under the same uid (the ranks check
          the content hash); if that fails it is removed, and its requests fail as never loaded.
        - A new scheduler incarnation (``restarted``) lost every request and LoRA command in flight:
          ``resubmit_requests`` resends the requests (after the restores, so they wait for them), then every
          LoRA command still unanswered goes again.
        """
        adapters = sorted(f"{a.name}:{a.uid}" for a in view.adapters)
        level = logging.INFO if view.scheduler_incarnation != self._viewed else logging.DEBUG  # once per scheduler
        self._viewed = view.scheduler_incarnation
        log.log(level, "cluster view of scheduler %s: the workers hold %s", view.scheduler_incarnation[:12], adapters)
        held = {a.uid for a in view.adapters}
        tracked = self.registry.tracked_uids()
        for a in view.adapters:
            if a.uid not in tracked:
                self._adopt(a)
        if self._carried is not None:  # the first view after this front door restarted
            snap, self._carried = self._carried, None
            self._carry_over(snap, held)
        restores: list[tuple[str, int, asyncio.Future]] = []
        for name, e in sorted(self.registry.loaded.items()):
            if e.uid in held or self.registry.busy(name) is not None:
                continue  # a load or unload in flight is resent below (or still pending in the scheduler)
            log.warning("LoRA registry out of sync: the workers lack %s (uid %s); restoring it", name, e.uid)
            t = self.registry.begin_restore(name)
            op_id, fut = self._start_op(
                lambda op, t=t, n=name: LoraLoadCmd(op, t.uid, n, t.path, t.pinned, t.content_hash)
            )
            restores.append((name, op_id, fut))
        if restarted:
            n = resubmit_requests()
            fresh = {op_id for _, op_id, _ in restores}
            again = [cmd for op_id, cmd in sorted(self._op_cmds.items()) if op_id not in fresh]
            for cmd in again:
                self.send(cmd)
            log.warning("scheduler restarted: resubmitted %d requests and %d LoRA commands", n, len(again))
        for name, op_id, fut in restores:
            self._spawn(self._finish_restore(name, op_id, fut))

    def _adopt(self, a: AdapterState) -> None:
        reason = None
        try:
            if adapter_content_hash(a.path, a.name) != a.content_hash:
                reason = f"the files in {a.path} changed since it was loaded"
            elif self.registry.state(a.name) not in ("gone", "known"):
                owner = self.registry.loaded.get(a.name) or self.registry.busy(a.name)
                reason = f"the name {a.name} belongs to uid {owner.uid if owner else '?'}"
            else:
                self.registry.adopt(a.name, a.uid, a.path, a.pinned, a.content_hash)
                log.info("LoRA registry: %s (uid %s) rebuilt from the workers", a.name, a.uid)
                return
        except LoraConfigError as e:
            reason = str(e)
        log.error("LoRA adapter %s (uid %s) is no longer valid and is unloaded: %s", a.name, a.uid, reason)
        self.health.adapters_lost += 1
        if self.registry.state(a.name) == "known":
            self.registry.forget(a.name)
        self._unload_stray(a.uid, a.name)

    async def _finish_restore(self, name: str, op_id: int, fut: asyncio.Future) -> None:
        t = self._in_flight(name, ("restore",))
        started = time.monotonic()
        try:
            res = await self._wait_op(op_id, fut)
        except ServerStopping as err:  # nothing undone: the next front door restores it, or adopts what was loaded
            self.registry.finish_load(name, ok=False)
            self._settled(name, err)
            return
        except RuntimeError as err:
            res = LoraOpResult(op_id, False, str(err))
            self._unload_stray(t.uid, name)
        if res.ok and self.on_loaded is not None:
            self.on_loaded("restore", time.monotonic() - started)
        lost_meanwhile = t.forget
        self.registry.finish_load(name, ok=res.ok)
        self._settled(name, None if res.ok else RuntimeError(res.error or "restore failed"))
        if not res.ok and not lost_meanwhile:
            self.health.adapters_lost += 1
            log.error("LoRA adapter %s could not be restored and was removed: %s", name, res.error)
