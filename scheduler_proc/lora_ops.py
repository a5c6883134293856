"""All-or-nothing LoRA load/unload across TP ranks, as the scheduler coordinates it.

A load goes to every rank; it succeeds only if every rank acks ok. Otherwise the ranks that did load it get a
rollback unload and the error names each failing rank. An unload first blocks new requests for the adapter,
waits until no waiting or running request uses it, then goes to every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ipc.messages import LoraLoadCmd, LoraOpAck, LoraOpResult, LoraUnloadCmd, WorkerLoraLoad, WorkerLoraUnload
from scheduler_proc.scheduler import AdapterState


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter every rank holds, with what a restarted rank needs to restore it under the same uid."""

    uid: str
    name: str
    path: str
    pinned: bool
    content_hash: str
    rows: int = 0  # rank rows it takes in a pool (0 = unknown: admission counts a whole slot)


@dataclass
class PendingOp:
    """One load/unload waiting for acks from all ranks."""

    cmd: LoraLoadCmd | LoraUnloadCmd
    acks: dict[int, LoraOpAck] = field(default_factory=dict)
    sent: bool = False
    sent_at: float = 0.0  # monotonic time the command went to the ranks


class LoraOps:
    """Tracks LoRA commands in flight. ``tp_size`` ranks must all ack each command."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.pending: dict[int, PendingOp] = {}
        self.loaded: dict[str, LoadedAdapter] = {}  # uid -> adapter, for adapters loaded on every rank
        self._rollback_ids = -1

    @property
    def pinned(self) -> dict[str, bool]:
        """uid -> pinned, for every adapter loaded on every rank."""
        return {u: a.pinned for u, a in self.loaded.items()}

    def next_internal_id(self) -> int:
        """A negative op id for the scheduler's own commands (rollbacks, restores); front-door ids are > 0."""
        self._rollback_ids -= 1
        return self._rollback_ids

    def resend_all(self) -> None:
        """The TP group was replaced: every command goes again to the new ranks (acks of the old are void)."""
        for op in self.pending.values():
            op.sent = False
            op.acks.clear()

    def forget(self, uid: str) -> None:
        """Drop ``uid`` from the loaded table (a restore could not bring it back)."""
        self.loaded.pop(uid, None)

    def start(self, cmd: LoraLoadCmd | LoraUnloadCmd) -> None:
        """Register a command from the front door."""
        self.pending[cmd.op_id] = PendingOp(cmd)

    def ready_to_send(
        self, in_use: callable, can_pin: callable = lambda: True
    ) -> list[WorkerLoraLoad | WorkerLoraUnload]:
        """Worker messages for commands that can go now (an unload waits until ``in_use(uid)`` is False, a
        pinned load until ``can_pin()`` is True)."""
        out: list[WorkerLoraLoad | WorkerLoraUnload] = []
        for op in self.pending.values():
            if op.sent:
                continue
            c = op.cmd
            if isinstance(c, LoraLoadCmd):
                if c.pinned and not can_pin():
                    continue
                out.append(WorkerLoraLoad(c.op_id, c.uid, c.name, c.path, c.pinned, content_hash=c.content_hash))
            elif not in_use(c.uid):
                out.append(WorkerLoraUnload(c.op_id, c.uid))
            else:
                continue
            op.sent, op.sent_at = True, time.monotonic()
        return out

    def overdue(self, timeout_s: float) -> int | None:
        """The id of a command sent more than ``timeout_s`` ago that not every rank answered (a hung rank)."""
        now = time.monotonic()
        for op_id, op in self.pending.items():
            if op.sent and now - op.sent_at > timeout_s:
                return op_id
        return None

    def loading(self) -> set[str]:
        """uids with a load under way."""
        return {op.cmd.uid for op in self.pending.values() if isinstance(op.cmd, LoraLoadCmd)}

    def pending_pins(self) -> set[str]:
        """uids of pinned loads not yet answered by every rank."""
        return {op.cmd.uid for op in self.pending.values() if isinstance(op.cmd, LoraLoadCmd) and op.cmd.pinned}

    def state(self) -> AdapterState:
        """The adapters as the scheduler must see them (see :class:`AdapterState`)."""
        return AdapterState(
            loaded={u: (a.name, a.rows) for u, a in self.loaded.items()},
            pinned=frozenset(u for u, a in self.loaded.items() if a.pinned),
            loading=frozenset(self.loading()),
            reserved_pins=frozenset(self.pending_pins()),
            unloading=frozenset(op.cmd.uid for op in self.pending.values() if isinstance(op.cmd, LoraUnloadCmd)),
        )

    def on_ack(self, ack: LoraOpAck) -> tuple[LoraOpResult | None, list[WorkerLoraUnload]]:
        """Record an ack. When all ranks answered, return the result and any rollback messages."""
        op = self.pending.get(ack.op_id)
        if op is None:
            return None, []  # a rollback's ack
        op.acks[ack.rank] = ack
        if len(op.acks) < self.tp_size:
            return None, []
        del self.pending[ack.op_id]
        acks = sorted(op.acks.values(), key=lambda a: a.rank)
        bad = [a for a in acks if not a.ok]
        c = op.cmd
        error = "; ".join(f"rank {a.rank}: {a.error}" for a in bad)
        hashes = {a.content_hash for a in acks}
        if not bad and isinstance(c, LoraLoadCmd) and len(hashes) > 1:
            error = f"LoRA adapter {c.name}: the files in {c.path} changed while the ranks read them; load it again"
        if not error:
            if isinstance(c, LoraLoadCmd):
                h = hashes.pop()
                rows = max(a.rows for a in acks)
                self.loaded[c.uid] = LoadedAdapter(c.uid, c.name, c.path, c.pinned, h, rows)
                return LoraOpResult(c.op_id, True, content_hash=h), []
            self.loaded.pop(c.uid, None)
            return LoraOpResult(c.op_id, True), []
        rollback: list[WorkerLoraUnload] = []
        if isinstance(c, LoraLoadCmd):
            rollback.append(WorkerLoraUnload(self.next_internal_id(), c.uid, rollback=True))
        return LoraOpResult(c.op_id, False, error), rollback
