"""scheduler_proc process: owns the waiting queue and the step loop; talks to the front door and workers.

One step is in flight at a time: the same ForwardBatch goes to every TP rank, and the next plan is made
once every rank has answered (rank 0's tokens are used; the others' slot digests are checked against it).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
import uuid

import zmq
from tokenizers import Tokenizer

from ipc.codec import Codec, WireError
from ipc.config import ServerArgs
from ipc.lora_config import never_loaded_message
from ipc.messages import (
    AbortRid,
    AdapterState,
    BatchTokenOut,
    ClusterEvent,
    ClusterView,
    FromWorkerMsg,
    FrontDoorHello,
    LoraLoadCmd,
    LoraOpAck,
    LoraOpResult,
    LoraSlotsQuery,
    LoraUnloadCmd,
    RestartWorkers,
    SchedulerBeat,
    SchedulerHello,
    ShutdownCmd,
    StepResult,
    TokenizedReq,
    ToSchedulerMsg,
    ToTokenizerMsg,
    ToWorkerMsg,
    WorkerPong,
    WorkerReady,
    WorkerShutdown,
    WorkersRestarting,
)
from ipc.model_config import load_model_config
from ipc.proc import StopRequested, begin_cleanup, child_setup
from ipc.sockets import CONTROL_CODEC, UNBOUNDED, HeartbeatSender, failed, make_socket, ready
from scheduler_proc.burst_wait import BurstWait
from scheduler_proc.health import BEAT_INTERVAL_S, LOOP_STALL_S, FirstReady, RankLiveness, batch_stats, count_evictions
from scheduler_proc.lora_ops import LoadedAdapter, LoraOps
from scheduler_proc.recovery import GroupRecovery, RestoreOutcome
from scheduler_proc.scheduler import Scheduler

log = logging.getLogger("scheduler")


FATAL_EXIT_CODE = 3  # tells the launcher not to restart us: the cluster's state cannot be trusted


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


# a step may take this long per token it carries on top of --step-timeout before the group counts as hung
# (a 4,000-token prefill takes about 5 s on a 2-core CPU; 20 ms per token leaves a wide margin)
STEP_TIMEOUT_PER_TOKEN_S = 0.02
# what is left of a hold under this starts the step now: the poll's tick is 1 ms, and a poll that returned a
# little early would otherwise sleep a whole second tick (a lone request waited 1.3-2.2 ms instead of 1)
BURST_POLL_SLACK_S = 0.0003


class SchedulerLoop:
    """Sockets + the :class:`Scheduler`; ``run`` returns when asked to shut down."""

    def __init__(self, args: ServerArgs, ctx: zmq.Context, restarts: dict[str, int] | None = None) -> None:
        self.args = args
        ep = args.endpoints
        # no high-water mark either way (ZeroMQ's default of 1,000 drops or blocks): the front door bounds the
        # requests it sends by --max-queued-requests, and this loop sends one output message per step; while the
        # front door restarts, what is sent waits in the socket (the new one ignores rids it does not know)
        self.from_front = make_socket(ctx, zmq.PULL, ep.to_scheduler, bind=True, options={zmq.RCVHWM: UNBOUNDED})
        self.to_front = make_socket(ctx, zmq.PUSH, ep.to_tokenizer, bind=False, options={zmq.SNDHWM: UNBOUNDED})
        self.workers = make_socket(ctx, zmq.ROUTER, ep.workers, bind=True)
        # a restarted rank reconnects under the same identity: let it take over the dead one's route at once
        self.workers.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.control = make_socket(ctx, zmq.PUSH, ep.control, bind=False)
        self.heartbeat = HeartbeatSender(ctx, ep.control, "scheduler_proc")
        self.in_codec: Codec = Codec(ToSchedulerMsg)
        self.front_codec: Codec = Codec(ToTokenizerMsg)
        self.worker_in: Codec = Codec(FromWorkerMsg)
        self.worker_out: Codec = Codec(ToWorkerMsg)
        self.ops = LoraOps(args.tp_size)
        self.recovery = GroupRecovery(args.tp_size)
        self.ready: dict[int, WorkerReady] = {}
        self.results: dict[int, StepResult] = {}
        self.step_started = 0.0
        self.step_no = 0
        self.step_deadline_s = 0.0
        self.sched: Scheduler | None = None
        self.in_flight = False
        self.last_tables: dict[int, dict[str, int]] = {}
        self.resumed = 0
        self.incarnation = uuid.uuid4().hex
        self.front_incarnation: str | None = None
        self.restarts: dict[str, int] = dict(restarts or {})
        self.liveness = RankLiveness(args.tp_size)  # heartbeats for the front door's /health
        self.last_timeout_check = time.monotonic()
        self.last_beat = 0.0
        self.slot_evictions = 0  # adapters evicted from a slot on rank 0 (for /metrics)
        self.orphan_ops: set[int] = set()  # LoRA commands of a dead front door still at the ranks
        self.burst = BurstWait.for_gap(args.batch_wait_ms / 1000)

    # ------------------------------------------------------------------ start-up
    def wait_for_workers(self) -> None:
        """Block until every rank of the newest TP group epoch said READY, then rebuild the adapter table from
        what the ranks hold (a restarted scheduler starts empty; the workers kept their adapters).

        Ranks that were up before this scheduler register again when asked (``SchedulerHello``). If some ranks
        answer and others stay silent for ``--step-timeout`` (e.g. stuck in a collective that the dead
        scheduler's last plan started on only some ranks), the launcher is asked to replace the group; after
        ``PEER_SKEW_S`` instead once a rank that had run steps in the group answered (``FirstReady``).

        Raises:
            TimeoutError: naming the ranks that did not report READY within ``--ready-timeout``.
        """
        deadline = time.monotonic() + self.args.ready_timeout_s
        hello = self.worker_out.encode(SchedulerHello(self.incarnation))
        asked_restart = 0
        last_hello = 0.0
        first_ready = FirstReady()  # ranks silent this long after another rank of their epoch answered are stuck
        while True:
            self.heartbeat.beat()
            epoch = max((r.epoch for r in self.ready.values()), default=0)
            current = {k: r for k, r in self.ready.items() if r.epoch == epoch}
            if len(current) == self.args.tp_size:
                break
            now = time.monotonic()
            if now > deadline:
                missing = sorted(set(range(self.args.tp_size)) - set(current))
                raise TimeoutError(f"workers {missing} did not report READY in {self.args.ready_timeout_s} s")
            if now - last_hello > 0.5:
                last_hello = now
                for r in set(range(self.args.tp_size)) - set(current):
                    try:
                        self.workers.send_multipart([f"rank-{r}".encode(), hello], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # not connected (yet): it sends READY by itself when it starts
            if current and first_ready.stuck(epoch, now, self.args.step_timeout_s) and asked_restart < epoch:
                asked_restart = epoch
                self._ask_launcher(epoch, f"ranks {sorted(set(range(self.args.tp_size)) - set(current))} silent")
            if self.workers.poll(200):
                _, frame = self.workers.recv_multipart()
                try:
                    msg = self.worker_in.decode(frame)
                except WireError:
                    continue
                if isinstance(msg, WorkerReady):  # results of a dead scheduler's plans arrive first: skipped
                    self.ready[msg.rank] = msg
                    first_ready.seen(msg.epoch, time.monotonic(), msg.steps)
        self.ready = current
        cfg = load_model_config(self.args.model_path)
        tok = Tokenizer.from_file(f"{self.args.model_path}/tokenizer.json")
        capacity = min(r.kv_capacity_tokens for r in self.ready.values())
        self.sched = Scheduler(
            max_running=self.args.max_running_requests,
            kv_capacity=capacity,
            context_len=min(self.args.context_length or cfg.max_position_embeddings, capacity),
            eos_ids=cfg.eos_token_ids,
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
            special_tokens={i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special},
            max_loras_per_batch=self.args.max_loras_per_batch,
            max_lora_rank=self.args.max_lora_rank,
            lora_pool_rows=self._pool_rows(),
            enable_prefix_cache=not self.args.disable_radix_cache,
            chunked_prefill_size=self.args.chunked_prefill_size,
            max_prefill_tokens=self.args.max_prefill_tokens,
        )
        # the adapters any rank holds; a rank lacking one of them gets it restored (same uid, content hash)
        for rank in sorted(self.ready):
            for a in self.ready[rank].adapters:
                self.ops.loaded.setdefault(
                    a.uid, LoadedAdapter(a.uid, a.name, a.path, a.pinned, a.content_hash, a.rows)
                )
        self.recovery.epoch = epoch
        self.recovery.phase = "waiting"
        for rank in sorted(self.ready):
            complete, loads = self.recovery.on_ready(self.ready[rank], self.ops.loaded, self.ops.next_internal_id)
            for m in loads:
                self._broadcast(m)
        self.sched.set_adapters(self.ops.state())
        self._send_view()

    def _pool_rows(self, epoch: int | None = None) -> int:
        """The smallest LoRA pool, in rank rows, among the ranks that said READY (of ``epoch`` when given);
        0 without LoRA."""
        rows = [r.lora_rows for r in self.ready.values() if epoch is None or r.epoch == epoch]
        return min(rows, default=0)

    def _send_view(self) -> None:
        """Tell the front door which adapters the workers hold (and that this scheduler incarnation is up)."""
        adapters = [
            AdapterState(a.uid, a.name, a.path, a.pinned, a.content_hash, a.rows) for a in self.ops.loaded.values()
        ]
        adapters.sort(key=lambda a: a.uid)
        serving = self.recovery.serving
        self._to_front(ClusterView(self.incarnation, self.recovery.epoch, adapters, self.restarts, serving))

    # ------------------------------------------------------------------ sending
    def _to_front(self, msg: object) -> None:
        """Queue ``msg`` for the front door; never blocks the loop (the socket has no high-water mark)."""
        try:
            self.to_front.send(self.front_codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # only while the context closes at shutdown
            log.error("cannot queue %s for the front door: %s", type(msg).__name__, e)

    def _broadcast(self, msg: object) -> None:
        frame = self.worker_out.encode(msg)
        for r in range(self.args.tp_size):
            try:
                self.workers.send_multipart([f"rank-{r}".encode(), frame])
            except zmq.ZMQError as e:  # EHOSTUNREACH: the rank is dead or not yet back; recovery resends
                log.warning("rank %d unreachable (%s); dropping %s", r, e, type(msg).__name__)

    def _emit(self, outs: list) -> None:
        if outs:
            self._to_front(BatchTokenOut(outs))

    # ------------------------------------------------------------------ handlers
    def on_front(self, frame: bytes) -> bool:
        """Handle one message from the tokenizer (or the launcher); False means shut down."""
        try:
            msg = self.in_codec.decode(frame)
        except WireError as e:
            log.error("dropping bad frame from tokenizer: %s", e)
            return True
        s = self.sched
        if isinstance(msg, TokenizedReq):
            idle, queued = not s.running and not s.waiting, len(s.waiting)
            self._emit(s.add(msg))
            if len(s.waiting) > queued:  # a request refused at once (too long, a duplicate) holds nothing up
                self.burst.arrived(time.monotonic(), idle)
        elif isinstance(msg, AbortRid):
            self._emit(s.abort(msg.rid, msg.reason))
        elif isinstance(msg, LoraLoadCmd):
            self.ops.start(msg)
            self.sched.set_adapters(self.ops.state())
        elif isinstance(msg, LoraUnloadCmd):
            s.block_adapter(msg.uid)
            self.ops.start(msg)
        elif isinstance(msg, LoraSlotsQuery):
            self._to_front(LoraOpResult(msg.op_id, True, slots=self._slot_tables()))
        elif isinstance(msg, WorkersRestarting):
            for proc, n in msg.restarts.items():
                self.restarts[proc] = max(n, self.restarts.get(proc, 0))
            self._group_lost(msg.epoch, msg.cause, msg.process)
        elif isinstance(msg, FrontDoorHello):
            if msg.incarnation != self.front_incarnation:
                n = s.drop_all()  # the requests of an earlier front door: nobody can receive their output
                self.in_flight, self.results = False, {}  # the step in flight is void (its result is dropped)
                if n:
                    log.warning("front door %s (re)started: dropped %d requests of the one before", msg.incarnation, n)
                if self.front_incarnation is not None:
                    self._orphan_lora_ops()
                self.front_incarnation = msg.incarnation
            self._send_view()
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
        """Handle one message from a worker rank; messages of a replaced TP group are dropped."""
        try:
            msg = self.worker_in.decode(frame)
        except WireError as e:
            log.error("dropping bad frame from a worker: %s", e)
            return
        if isinstance(msg, WorkerReady):
            if msg.epoch >= self.recovery.epoch:
                self.liveness.answered(msg.rank)
            self._on_ready(msg)
            return
        if not self.recovery.is_current(msg.epoch):
            log.info("dropping %s of replaced TP group epoch %d", type(msg).__name__, msg.epoch)
            return
        self.liveness.answered(msg.rank)
        if isinstance(msg, WorkerPong):
            if self.liveness.owns(msg.op_id):
                self.liveness.on_probe_ack(msg.rank)
            return
        if isinstance(msg, StepResult):
            if not self.in_flight or msg.step != self.step_no:
                return  # the result of a step that was voided (its requests were requeued or dropped)
            self.results[msg.rank] = msg
            if len(self.results) == self.args.tp_size:
                self._finish_step()
        elif isinstance(msg, LoraOpAck):
            if self.recovery.owns(msg.op_id):
                outcome = self.recovery.on_ack(msg, self.ops.next_internal_id)
                if outcome is not None:
                    self._finish_recovery(outcome)
                return
            op = self.ops.pending.get(msg.op_id)
            result, rollback = self.ops.on_ack(msg)
            for m in rollback:
                self._broadcast(m)
            if result is not None:
                self.sched.set_adapters(self.ops.state())
                if msg.op_id in self.orphan_ops:  # a dead front door's command changed the workers: say so
                    self.orphan_ops.discard(msg.op_id)
                    self._send_view()
                failed_load = not result.ok and op is not None and isinstance(op.cmd, LoraLoadCmd)
                if failed_load and op.cmd.uid not in self.ops.loaded:
                    # the adapter is not on the workers (a restore the registry asked for, or any load, failed):
                    # requests queued for its uid while it loaded would wait for ever; they end as later ones do
                    names = [a.name for a in self.ops.loaded.values()]
                    self._emit(self.sched.fail_adapter(op.cmd.uid, never_loaded_message(op.cmd.name, names)))
                self._to_front(result)

    def _orphan_lora_ops(self) -> None:
        """A new front door rebuilds its registry from the view it is about to get; LoRA commands of the dead one
        would change the workers behind its back. Those not yet sent (an unload or eviction waiting for its
        adapter's requests, which were just dropped; a pinned load waiting for room) are cancelled, so the view
        stays true; those already at the ranks finish, and each sends a fresh view when it does, which the front
        door reconciles (an adapter it adopted and the ranks then unloaded is restored under the same uid)."""
        s = self.sched
        for op_id, op in list(self.ops.pending.items()):
            if op_id <= 0 or self.recovery.owns(op_id):
                continue  # the scheduler's own (rollbacks, restores)
            if op.sent:
                self.orphan_ops.add(op_id)
                continue
            del self.ops.pending[op_id]
            if isinstance(op.cmd, LoraUnloadCmd):
                s.unblock_adapter(op.cmd.uid)
            log.warning("front door restarted: cancelled its unsent LoRA command %s", op.cmd)
        self.sched.set_adapters(self.ops.state())

    # ------------------------------------------------------------------ TP group replacement
    def _group_lost(self, epoch: int, cause: str, process: str = "gpu_worker") -> None:
        """Group ``epoch`` replaces the current one: requeue the running requests, void what was in flight."""
        if not self.recovery.begin(epoch, cause, process):
            return
        self.in_flight = False
        self.results = {}
        self.liveness.reset()
        n = self.sched.requeue_running()
        self.resumed += n
        self.ops.resend_all()
        log.warning("TP group replaced by epoch %d (%s); %d running requests will resume", epoch, cause, n)
        ev = ClusterEvent("workers_restarting", cause, epoch=epoch, process=process, restarts=dict(self.restarts))
        self._to_front(ev)

    def _ask_launcher(self, epoch: int, reason: str) -> None:
        log.error("TP group epoch %d is hung (%s); asking the launcher to replace it", epoch, reason)
        try:
            self.control.send(CONTROL_CODEC.encode(RestartWorkers(epoch, reason)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.error("cannot reach the launcher: %s", e)

    def _request_restart(self, reason: str) -> None:
        """The group is hung: ask the launcher to replace it, and stop waiting for it at once."""
        old = self.recovery.epoch
        self._ask_launcher(old, reason)
        self.restarts["gpu_worker"] = self.restarts.get("gpu_worker", 0) + 1  # as the launcher will count it
        self._group_lost(old + 1, reason, "gpu_worker")

    def _on_ready(self, msg: WorkerReady) -> None:
        if msg.epoch < self.recovery.epoch:
            return
        if msg.epoch > self.recovery.epoch:  # READY overtook the launcher's notice
            self._group_lost(msg.epoch, f"rank {msg.rank} re-registered", "gpu_worker")
        if self.recovery.phase != "waiting":
            log.warning("rank %d sent READY again for epoch %d; ignored", msg.rank, msg.epoch)
            return
        self.ready[msg.rank] = msg
        complete, loads = self.recovery.on_ready(msg, self.ops.loaded, self.ops.next_internal_id)
        for m in loads:
            self._broadcast(m)
        if complete:
            self._finish_recovery(RestoreOutcome())

    def _finish_recovery(self, outcome: RestoreOutcome) -> None:
        # the replacement group's pools set the LoRA budget from now on (the same, unless its kernel choice differs)
        rows = self._pool_rows(self.recovery.epoch)
        if rows:
            self.sched.lora_rows_total = rows
        for m in outcome.rollback:
            self._broadcast(m)
        for lost in outcome.lost:
            log.error("LoRA adapter %s (uid %s) could not be restored: %s", lost.name, lost.uid, lost.reason)
            self.ops.forget(lost.uid)
        self.sched.set_adapters(self.ops.state())
        names = sorted(a.name for a in self.ops.loaded.values())
        for lost in outcome.lost:
            self._emit(self.sched.fail_adapter(lost.uid, never_loaded_message(lost.name, names)))
        took = time.monotonic() - self.recovery.since
        log.warning(
            "TP group epoch %d serving again: %d requests resumed, adapters restored %s, lost %s (%.2f s)",
            self.recovery.epoch,
            self.resumed,
            outcome.restored,
            [x.name for x in outcome.lost],
            took,
        )
        self._to_front(
            ClusterEvent(
                "workers_recovered",
                f"TP group epoch {self.recovery.epoch} serving again",
                epoch=self.recovery.epoch,
                resumed=self.resumed,
                restored=outcome.restored,
                lost=outcome.lost,
                process=self.recovery.process,
            )
        )
        self.resumed = 0

    def _finish_step(self) -> None:
        results, self.results = self.results, {}
        self.in_flight = False
        errors = [r.error for r in results.values() if r.error]
        if errors:
            self._emit(self.sched.fail_in_flight("; ".join(errors)))
            return
        check_digests(results)
        self.slot_evictions += count_evictions(self.last_tables.get(0, {}), results[0].slots)
        self.last_tables = {r: res.slots for r, res in results.items()}
        self._emit(self.sched.on_result(results[0].next_ids, results[0].row_errors, results[0].logprobs))

    # ------------------------------------------------------------------ hang detection
    def _check_timeouts(self) -> None:
        now = time.monotonic()
        # a scheduler that itself stalled (a long start-up step, a busy machine) has not read the pongs meanwhile:
        # that time does not count against the ranks
        self.liveness.discount(now - self.last_timeout_check - LOOP_STALL_S)
        self.last_timeout_check = now
        rec = self.recovery
        if self.in_flight and now - self.step_started > self.step_deadline_s:
            missing = sorted(set(range(self.args.tp_size)) - set(self.results))
            why = f"step timed out after {self.step_deadline_s:.1f} s waiting for ranks {missing}"
            if len(missing) > 1:  # one hung rank holds its peers in the step's next all-reduce: all look hung
                why += " (a rank waiting in a collective for a hung peer does not answer either)"
            self._request_restart(why)
        elif rec.phase == "waiting" and now - rec.since > self.args.ready_timeout_s:
            missing = sorted(set(range(self.args.tp_size)) - set(rec.ready))
            self._request_restart(f"ranks {missing} did not report READY in {self.args.ready_timeout_s:.0f} s")
        elif rec.phase == "restoring" and now - rec.since > self.args.lora_op_timeout_s:
            self._request_restart(f"restoring adapters took over {self.args.lora_op_timeout_s:.0f} s")
        elif rec.serving:
            late = self.ops.overdue(self.args.lora_op_timeout_s)
            if late is not None:
                self._request_restart(f"LoRA operation {late} got no answer in {self.args.lora_op_timeout_s:.0f} s")
            elif self.liveness.probe_waited() > self.args.step_timeout_s:
                self._request_restart(
                    f"idle TP ranks {self.liveness.unanswered()} left a liveness probe unanswered for "
                    f"{self.liveness.probe_waited():.1f} s (--step-timeout {self.args.step_timeout_s:g})"
                )

    # ------------------------------------------------------------------ health
    def _health_tick(self) -> None:
        """Probe idle ranks (see :mod:`scheduler_proc.health`) and send the front door its heartbeat."""
        if self.recovery.serving:
            busy = self.in_flight or any(op.sent for op in self.ops.pending.values())
            probe = self.liveness.probe(self.ops.next_internal_id, busy)
            if probe is not None:
                self._broadcast(probe)
        now = time.monotonic()
        if now - self.last_beat < BEAT_INTERVAL_S:
            return
        self.last_beat = now
        slots = self.last_tables.get(0, {})
        self._to_front(
            SchedulerBeat(
                self.incarnation,
                self.recovery.epoch,
                rank_silence_s=self.liveness.silence(),
                unresponsive=self.liveness.unresponsive() if self.recovery.serving else {},
                slot_uids=sorted(slots),
                slot_evictions=self.slot_evictions,
                **batch_stats(self.sched),
                **(self.sched.cache_stats() if self.sched is not None else {}),
            )
        )

    # ------------------------------------------------------------------ loop
    def _start_step(self) -> float:
        """Send the LoRA commands that may go now and the next step's batch, if any and none is in flight.

        Returns:
            Seconds to wait for more arrivals before planning the step (0: planned, or nothing to do): an idle
            scheduler holds its first step while a burst is still arriving (:mod:`scheduler_proc.burst_wait`).
        """
        if self.in_flight or not self.recovery.serving:
            return 0.0
        for m in self.ops.ready_to_send(self.sched.uses_adapter, self.sched.can_pin):
            self._broadcast(m)  # LoRA commands never wait for a burst
        if not self.sched.running and self.sched.waiting:
            hold_s = self.burst.hold_s(time.monotonic())
            if hold_s > BURST_POLL_SLACK_S:
                return hold_s
        fb = self.sched.next_batch()
        if fb is not None:
            self._broadcast(fb)
            self.in_flight, self.step_no = True, fb.step
            self.step_started = time.monotonic()
            tokens = sum(len(r.input_ids) for r in fb.reqs)
            self.step_deadline_s = self.args.step_timeout_s + STEP_TIMEOUT_PER_TOKEN_S * tokens
        return 0.0

    def run(self) -> None:
        """Serve until ShutdownCmd or SIGTERM."""
        poller = zmq.Poller()
        poller.register(self.from_front, zmq.POLLIN)
        poller.register(self.workers, zmq.POLLIN)
        while True:
            self.heartbeat.beat()
            self._health_tick()
            hold_s = self._start_step()
            timeout_ms = max(1, round(hold_s * 1000)) if hold_s > 0 else 200 if self.in_flight else 500
            events = dict(poller.poll(timeout_ms))
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
            self._check_timeouts()


def main() -> None:
    """Entry point: ``python -m scheduler_proc.main --config-file F``."""
    args, ns = child_setup("scheduler")
    ctx = zmq.Context()
    loop = None
    try:
        loop = SchedulerLoop(args, ctx, json.loads(ns.restarts))
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
        begin_cleanup(args)  # the launcher's SIGTERM, which follows our report, must not interrupt the exit
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
        raise SystemExit(FATAL_EXIT_CODE) from None
    finally:
        begin_cleanup(args)
        ctx.destroy(0)


if __name__ == "__main__":
    main()
