"""All-or-nothing LoRA load/unload across TP ranks, as the scheduler coordinates it.

A load goes to every rank; it succeeds only if every rank acks ok. Otherwise the ranks that did load it get a
rollback unload and the error names each failing rank. An unload first blocks new requests for the adapter,
waits until no waiting or running request uses it, then goes to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.messages import LoraLoadCmd, LoraOpAck, LoraOpResult, LoraUnloadCmd, WorkerLoraLoad, WorkerLoraUnload


@dataclass
class PendingOp:
    """One load/unload waiting for acks from all ranks."""

    cmd: LoraLoadCmd | LoraUnloadCmd
    acks: dict[int, LoraOpAck] = field(default_factory=dict)
    sent: bool = False


class LoraOps:
    """Tracks LoRA commands in flight. ``tp_size`` ranks must all ack each command."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.pending: dict[int, PendingOp] = {}
        self.pinned: dict[str, bool] = {}  # uid -> pinned, for adapters loaded on every rank
        self._rollback_ids = -1

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
                out.append(WorkerLoraLoad(c.op_id, c.uid, c.name, c.path, c.pinned))
                op.sent = True
            elif not in_use(c.uid):
                out.append(WorkerLoraUnload(c.op_id, c.uid))
                op.sent = True
        return out

    def pending_pins(self) -> set[str]:
        """uids of pinned loads not yet answered by every rank."""
        return {op.cmd.uid for op in self.pending.values() if isinstance(op.cmd, LoraLoadCmd) and op.cmd.pinned}

    def on_ack(self, ack: LoraOpAck) -> tuple[LoraOpResult | None, list[WorkerLoraUnload]]:
        """Record an ack. When all ranks answered, return the result and any rollback messages."""
        op = self.pending.get(ack.op_id)
        if op is None:
            return None, []  # a rollback's ack
        op.acks[ack.rank] = ack
        if len(op.acks) < self.tp_size:
            return None, []
        del self.pending[ack.op_id]
        bad = [a for a in sorted(op.acks.values(), key=lambda a: a.rank) if not a.ok]
        c = op.cmd
        if not bad:
            if isinstance(c, LoraLoadCmd):
                self.pinned[c.uid] = c.pinned
            else:
                self.pinned.pop(c.uid, None)
            return LoraOpResult(c.op_id, True), []
        error = "; ".join(f"rank {a.rank}: {a.error}" for a in bad)
        rollback: list[WorkerLoraUnload] = []
        if isinstance(c, LoraLoadCmd):
            self._rollback_ids -= 1
            rollback.append(WorkerLoraUnload(self._rollback_ids, c.uid, rollback=True))
        return LoraOpResult(c.op_id, False, error), rollback
