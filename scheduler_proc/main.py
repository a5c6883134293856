"""scheduler_proc process: owns the waiting queue and the step loop; talks to the front door and workers.

One step is in flight at a time: the same ForwardBatch goes to every TP rank, and the next plan is made
once every rank has answered (rank 0's tokens are used; the others' slot digests are checked against it).
"""

from __future__ import annotations

import logging
import time
import traceback

import zmq
from tokenizers import Tokenizer

from ipc.codec import Codec, WireError
from ipc.config import ServerArgs
from ipc.messages import (
    AbortRid,
    BatchTokenOut,
    ClusterEvent,
    FromWorkerMsg,
    LoraLoadCmd,
    LoraOpAck,
    LoraOpResult,
    LoraSlotsQuery,
    LoraUnloadCmd,
    ShutdownCmd,
    StepResult,
    TokenizedReq,
    ToSchedulerMsg,
    ToTokenizerMsg,
    ToWorkerMsg,
    WorkerReady,
    WorkerShutdown,
)
from ipc.model_config import load_model_config
from ipc.proc import StopRequested, begin_cleanup, child_setup
from ipc.sockets import failed, make_socket, ready
from scheduler_proc.lora_ops import LoraOps
from scheduler_proc.scheduler import Scheduler

log = logging.getLogger("scheduler")


class DivergenceError(RuntimeError):
    """TP ranks reached different LoRA slot decisions; serving on would mix adapters' weights."""


def check_digests(results: dict[int, StepResult]) -> None:
    """Raise DivergenceError naming the ranks whose slot tables differ from rank 0's."""
    ref = results[0]
    bad = [r for r in sorted(results) if results[r].slot_digest != ref.slot_digest]
    if bad:
        detail = "; ".join(f"rank {r}: {results[r].slots}" for r in bad)
        raise DivergenceError(
            f"LoRA slot tables diverged at step {ref.step}: rank 0 has {ref.slots}, {detail}. "
            "Every rank must make the same slot and eviction decisions; stopping."
        )


class SchedulerLoop:
    """Sockets + the :class:`Scheduler`; ``run`` returns when asked to shut down."""

    def __init__(self, args: ServerArgs, ctx: zmq.Context) -> None:
        self.args = args
        ep = args.endpoints
        self.from_front = make_socket(ctx, zmq.PULL, ep.to_scheduler, bind=True)
        self.to_front = make_socket(ctx, zmq.PUSH, ep.to_tokenizer, bind=False)
        self.workers = make_socket(ctx, zmq.ROUTER, ep.workers, bind=True)
        self.in_codec: Codec = Codec(ToSchedulerMsg)
        self.front_codec: Codec = Codec(ToTokenizerMsg)
        self.worker_in: Codec = Codec(FromWorkerMsg)
        self.worker_out: Codec = Codec(ToWorkerMsg)
        self.ops = LoraOps(args.tp_size)
        self.ready: dict[int, WorkerReady] = {}
        self.results: dict[int, StepResult] = {}
        self.step_started = 0.0
        self.sched: Scheduler | None = None
        self.in_flight = False
        self.last_tables: dict[int, dict[str, int]] = {}

    # ------------------------------------------------------------------ start-up
    def wait_for_workers(self) -> None:
        """Block until every rank said READY (or raise TimeoutError naming the missing ranks)."""
        deadline = time.monotonic() + self.args.ready_timeout_s
        while len(self.ready) < self.args.tp_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.args.tp_size)) - set(self.ready))
                raise TimeoutError(f"workers {missing} did not report READY in {self.args.ready_timeout_s} s")
            if self.workers.poll(500):
                _, frame = self.workers.recv_multipart()
                msg = self.worker_in.decode(frame)
                if isinstance(msg, WorkerReady):
                    self.ready[msg.rank] = msg
        cfg = load_model_config(self.args.model_path)
        tok = Tokenizer.from_file(f"{self.args.model_path}/tokenizer.json")
        capacity = min(r.kv_capacity_tokens for r in self.ready.values())
        self.sched = Scheduler(
            max_running=self.args.max_running_requests,
            kv_capacity=capacity,
            context_len=min(self.args.context_length or cfg.max_position_embeddings, capacity),
            eos_ids=cfg.eos_token_ids,
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
            max_loras_per_batch=self.args.max_loras_per_batch,
        )
        self.sched.loaded_uids = set()

    # ------------------------------------------------------------------ sending
    def _to_front(self, msg: object) -> None:
        self.to_front.send(self.front_codec.encode(msg))

    def _broadcast(self, msg: object) -> None:
        frame = self.worker_out.encode(msg)
        for r in range(self.args.tp_size):
            self.workers.send_multipart([f"rank-{r}".encode(), frame])

    def _emit(self, outs: list) -> None:
        if outs:
            self._to_front(BatchTokenOut(outs))

    # ------------------------------------------------------------------ handlers
    def on_front(self, frame: bytes) -> bool:
        """Handle one message from the tokenizer; False means shut down."""
        try:
            msg = self.in_codec.decode(frame)
        except WireError as e:
            log.error("dropping bad frame from tokenizer: %s", e)
            return True
        s = self.sched
        if isinstance(msg, TokenizedReq):
            self._emit(s.add(msg))
        elif isinstance(msg, AbortRid):
            self._emit(s.abort(msg.rid, msg.reason))
        elif isinstance(msg, LoraLoadCmd):
            self.ops.start(msg)
            s.reserved_pins = self.ops.pending_pins()
        elif isinstance(msg, LoraUnloadCmd):
            s.blocked_uids.add(msg.uid)
            self.ops.start(msg)
        elif isinstance(msg, LoraSlotsQuery):
            self._to_front(LoraOpResult(msg.op_id, True, slots=self._slot_tables()))
        elif isinstance(msg, ShutdownCmd):
            return False
        return True

    def _slot_tables(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for rank, res in sorted(self.last_tables.items()):
            for uid, slot in res.items():
                out.setdefault(uid, {})[f"rank {rank}"] = slot
        return out

    def on_worker(self, frame: bytes) -> None:
        """Handle one message from a worker rank."""
        msg = self.worker_in.decode(frame)
        if isinstance(msg, StepResult):
            self.results[msg.rank] = msg
            if len(self.results) == self.args.tp_size:
                self._finish_step()
        elif isinstance(msg, LoraOpAck):
            result, rollback = self.ops.on_ack(msg)
            for m in rollback:
                self._broadcast(m)
            if result is not None:
                if isinstance(result, LoraOpResult) and result.ok:
                    self._sync_pins()
                self.sched.reserved_pins = self.ops.pending_pins()
                self._to_front(result)
        elif isinstance(msg, WorkerReady):
            log.warning("rank %d re-registered (incarnation %s)", msg.rank, msg.incarnation)
            self._to_front(ClusterEvent("worker_restarted", f"rank {msg.rank} restarted", rank=msg.rank))

    def _sync_pins(self) -> None:
        s = self.sched
        s.pinned_uids = {u for u, p in self.ops.pinned.items() if p}
        s.loaded_uids = set(self.ops.pinned)
        s.blocked_uids &= set(self.ops.pinned) | {
            c.cmd.uid for c in self.ops.pending.values() if isinstance(c.cmd, LoraUnloadCmd)
        }

    def _finish_step(self) -> None:
        results, self.results = self.results, {}
        self.in_flight = False
        errors = [r.error for r in results.values() if r.error]
        if errors:
            self._emit(self.sched.fail_in_flight("; ".join(errors)))
            return
        check_digests(results)
        self.last_tables = {r: res.slots for r, res in results.items()}
        self._emit(self.sched.on_result(results[0].next_ids))

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until ShutdownCmd or SIGTERM."""
        poller = zmq.Poller()
        poller.register(self.from_front, zmq.POLLIN)
        poller.register(self.workers, zmq.POLLIN)
        while True:
            if not self.in_flight:
                for m in self.ops.ready_to_send(self.sched.uses_adapter, self.sched.can_pin):
                    self._broadcast(m)
                fb = self.sched.next_batch()
                if fb is not None:
                    self._broadcast(fb)
                    self.in_flight = True
                    self.step_started = time.monotonic()
            events = dict(poller.poll(1000 if not self.in_flight else 200))
            if self.from_front in events:
                for _ in range(256):
                    try:
                        frame = self.from_front.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if not self.on_front(frame):
                        self._broadcast(WorkerShutdown())
                        return
            if self.workers in events:
                while True:
                    try:
                        _, frame = self.workers.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_worker(frame)
            if self.in_flight and time.monotonic() - self.step_started > self.args.step_timeout_s:
                missing = sorted(set(range(self.args.tp_size)) - set(self.results))
                msg = f"step timed out after {self.args.step_timeout_s} s waiting for ranks {missing}"
                self._emit(self.sched.fail_in_flight(msg))
                self._to_front(ClusterEvent("fatal", msg))
                raise RuntimeError(msg)


def main() -> None:
    """Entry point: ``python -m scheduler_proc.main --config-file F``."""
    args, _ = child_setup("scheduler")
    ctx = zmq.Context()
    loop = None
    try:
        loop = SchedulerLoop(args, ctx)
        loop.wait_for_workers()
        ready(
            ctx,
            args.endpoints.control,
            "scheduler_proc",
            kv_tokens=loop.sched.kv.slots.capacity,
            context_len=loop.sched.context_len,
        )
    except StopRequested:
        ctx.destroy(0)
        return
    except Exception as e:  # noqa: BLE001 - report start-up failures to the launcher
        log.error("start-up failed: %s", traceback.format_exc())
        failed(ctx, args.endpoints.control, "scheduler_proc", f"{type(e).__name__}: {e}")
        ctx.destroy(0)
        raise SystemExit(1) from None
    try:
        loop.run()
    except StopRequested:
        pass
    except DivergenceError as e:
        log.critical("%s", e)
        loop._to_front(ClusterEvent("fatal", str(e)))
        loop.to_front.close(linger=2000)  # ctx.destroy(0) below would drop the event if it had not left yet
        raise SystemExit(3) from None
    finally:
        begin_cleanup(args)
        ctx.destroy(0)


if __name__ == "__main__":
    main()
