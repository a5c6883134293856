"""Replacing a TP group: epochs, READY from every new rank, restoring adapters under their uids. No sockets.

A ``torch.distributed`` group cannot survive a member's death, so the launcher replaces the whole group and
numbers each group with an *epoch*. The scheduler accepts worker messages of the current epoch only (a
result from a replaced group is void), waits until every rank of the new epoch said READY, compares the
adapters each rank holds with the ones every rank held before (a fresh rank holds none: the registry is out
of sync), and restores the missing ones on every rank in sorted uid order, so every rank makes the same slot
decisions. An adapter whose files are gone, changed (content hash) or now invalid cannot be restored and is
reported as lost; the scheduler then fails its requests with the never-been-loaded error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ipc.messages import LoraOpAck, LostAdapter, WorkerLoraLoad, WorkerLoraUnload, WorkerReady
from scheduler_proc.lora_ops import LoadedAdapter

log = logging.getLogger("scheduler")


@dataclass
class RestoreOutcome:
    """What a finished recovery did: adapters restored (names), adapters lost, rollbacks to send."""

    restored: list[str] = field(default_factory=list)
    lost: list[LostAdapter] = field(default_factory=list)
    rollback: list[WorkerLoraUnload] = field(default_factory=list)


class GroupRecovery:
    """The scheduler's view of the TP group's epoch and of a replacement in progress.

    ``phase`` is ``serving`` (steps may run), ``waiting`` (for READY from every rank of ``epoch``) or
    ``restoring`` (adapter loads sent, acks outstanding). ``since`` is when the phase began (monotonic s).
    """

    def __init__(self, tp_size: int, epoch: int = 1) -> None:
        self.tp_size = tp_size
        self.epoch = epoch
        self.phase = "serving"
        self.since = time.monotonic()
        self.cause = ""
        self.process = ""
        self.ready: dict[int, WorkerReady] = {}
        self._restores: dict[int, LoadedAdapter] = {}  # op id -> adapter being restored
        self._acks: dict[int, dict[int, LoraOpAck]] = {}

    @property
    def serving(self) -> bool:
        """Whether steps and LoRA commands may go to the workers."""
        return self.phase == "serving"

    def is_current(self, epoch: int) -> bool:
        """Whether a worker message of ``epoch`` belongs to the group being served or restored."""
        return epoch == self.epoch

    def begin(self, epoch: int, cause: str, process: str = "") -> bool:
        """Group ``epoch`` replaces the current one because of ``cause``. False if it is not newer (a second
        notice of a replacement already under way)."""
        if epoch <= self.epoch:
            return False
        self.epoch = epoch
        self.phase = "waiting"
        self.since = time.monotonic()
        self.cause = cause
        self.process = process
        self.ready = {}
        self._restores.clear()
        self._acks.clear()
        return True

    def on_ready(
        self, msg: WorkerReady, loaded: dict[str, LoadedAdapter], next_op_id
    ) -> tuple[bool, list[WorkerLoraLoad]]:
        """Record a rank's READY of the current epoch.

        Returns ``(complete, loads)``: ``complete`` once every rank is READY and nothing needs restoring;
        ``loads`` are the restores to send to every rank (sorted by uid) when the group became complete.
        """
        if msg.epoch != self.epoch or self.phase != "waiting":
            return False, []
        self.ready[msg.rank] = msg
        if len(self.ready) < self.tp_size:
            return False, []
        loads: list[WorkerLoraLoad] = []
        missing_any: set[str] = set()
        for rank in sorted(self.ready):
            r = self.ready[rank]
            missing = sorted(set(loaded) - set(r.loaded_uids))
            if missing:
                names = [loaded[u].name for u in missing]
                log.warning(
                    "LoRA registry out of sync: rank %d (epoch %d, incarnation %s) lacks adapters %s; restoring",
                    rank,
                    self.epoch,
                    r.incarnation[:12],
                    names,
                )
                missing_any.update(missing)
        for uid in sorted(missing_any):
            a = loaded[uid]
            op = next_op_id()
            self._restores[op] = a
            self._acks[op] = {}
            loads.append(WorkerLoraLoad(op, a.uid, a.name, a.path, a.pinned, content_hash=a.content_hash))
        if not loads:
            self.phase = "serving"
            return True, []
        self.phase = "restoring"
        self.since = time.monotonic()
        return False, loads

    def owns(self, op_id: int) -> bool:
        """Whether ``op_id`` is one of this recovery's restore loads."""
        return op_id in self._restores

    def on_ack(self, ack: LoraOpAck, next_op_id) -> RestoreOutcome | None:
        """Record a restore ack of the current epoch; the outcome once every restore got every rank's ack."""
        if ack.epoch != self.epoch or ack.op_id not in self._acks:
            return None
        self._acks[ack.op_id][ack.rank] = ack
        if any(len(a) < self.tp_size for a in self._acks.values()):
            return None
        out = RestoreOutcome()
        for op, a in sorted(self._restores.items(), key=lambda kv: kv[1].uid):
            bad = [x for x in sorted(self._acks[op].values(), key=lambda x: x.rank) if not x.ok]
            if bad:
                reason = "; ".join(f"rank {x.rank}: {x.error}" for x in bad)
                out.lost.append(LostAdapter(a.uid, a.name, reason))
                out.rollback.append(WorkerLoraUnload(next_op_id(), a.uid, rollback=True))
            else:
                out.restored.append(a.name)
        self._restores.clear()
        self._acks.clear()
        self.phase = "serving"
        return out
