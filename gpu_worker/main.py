"""gpu_worker process: one TP rank. Receives plans from the scheduler's ROUTER, answers with tokens."""

from __future__ import annotations

import logging
import signal
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from gpu_worker import timing
from gpu_worker.lora_reader import AdapterReader
from gpu_worker.shm_allreduce import ShmAllReduce, select_all_reduce
from gpu_worker.threads import ThreadRecheck, pick_num_threads, thread_cap
from gpu_worker.worker import Worker, pick_device
from ipc.codec import Codec, WireError
from ipc.messages import (
    ForwardBatch,
    FromWorkerMsg,
    SchedulerHello,
    StepResult,
    ToWorkerMsg,
    WorkerLoraLoad,
    WorkerLoraUnload,
    WorkerPing,
    WorkerPong,
    WorkerShutdown,
)
from ipc.proc import StopRequested, begin_cleanup, child_setup, set_parent_death_signal
from ipc.sockets import failed, make_socket, ready

log = logging.getLogger("gpu_worker")


def init_distributed(init_method: str, rank: int, world: int, device: torch.device) -> object | None:
    """Join the TP group (gloo on CPU, nccl on CUDA); None at TP=1."""
    if world == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(minutes=5))
    return dist.group.WORLD


def _peer_gone(e: BaseException) -> bool:
    """Whether a step error is a collective that lost its peer (gloo/nccl connection errors, shm peer gone)."""
    text = str(e)
    keys = ("Connection reset by peer", "Connection closed by peer", "gloo", "NCCL", "shm all-reduce")
    return any(k in text for k in keys)


def setup_cpu_all_reduce(worker: Worker, group: object | None, epoch: int) -> ShmAllReduce | None:
    """On a CPU TP group, swap the model's gloo all-reduce for the same-host shared-memory one where it works.

    Every rank decides the same way (:func:`select_all_reduce` gathers the facts over gloo): shm needs all ranks
    on one host and x86-64 (TSO makes its counter-after-data store safe); env ``LOOM_TP_ALLREDUCE=auto|shm|gloo``
    forces a choice (``shm`` fails start-up if it cannot be used). CUDA keeps nccl. Logs the choice at INFO.
    Returns the reducer (to close at exit) or None.
    """
    if group is None or worker.device.type != "cpu":
        return None
    shm, why = select_all_reduce(group, epoch=epoch)
    if shm is not None:
        worker.model.all_reduce_fn = shm.all_reduce
        worker.model.gather_logits_fn = shm.gather_columns
    log.info("TP all-reduce: %s", why)
    return shm


def main() -> None:
    """Entry point: ``python -m gpu_worker.main --config-file F --rank N``."""
    args, ns = child_setup("gpu_worker")
    # a rank may be blocked in a collective, where no Python signal handler runs: if the launcher dies, the
    # kernel kills the rank outright (it owns no socket file; the scheduler and tokenizer clean those up)
    set_parent_death_signal(signal.SIGKILL)
    rank = ns.rank
    name = f"gpu_worker[{rank}]"
    ctx = zmq.Context()
    sock = None
    shm = None
    try:
        device = pick_device(args.device, rank)
        if device.type == "cpu":
            # ranks share the machine's cores; oversubscribed OpenMP threads spin and slow every rank down
            torch.set_num_threads(thread_cap(args.tp_size))  # for loading; measured once the cluster settled
        group = init_distributed(ns.dist_init or args.endpoints.dist_init, rank, args.tp_size, device)
        # the kernels this cluster chose are recorded in its socket folder: a group that replaces a failed one runs
        # exactly those, whatever other processes on this machine have measured and cached since
        timing.cluster_record = Path(args.endpoints.socket_dir) / "kernel-choice" if args.endpoints.socket_dir else None
        timing.replacement = ns.epoch > 1
        worker = Worker(args, rank, group, device, epoch=ns.epoch)
        shm = setup_cpu_all_reduce(worker, group, ns.epoch)
        recheck = None
        if device.type == "cpu":
            threads, why = pick_num_threads(args.tp_size)
            torch.set_num_threads(threads)
            log.info("%d intra-op thread(s): %s", threads, why)
            recheck = ThreadRecheck(threads, thread_cap(args.tp_size))  # OMP_NUM_THREADS: cap = threads, never due
        in_codec: Codec = Codec(ToWorkerMsg)
        out_codec: Codec = Codec(FromWorkerMsg)
        sock = make_socket(ctx, zmq.DEALER, args.endpoints.workers, bind=False, identity=f"rank-{rank}".encode())
        sock.send(out_codec.encode(worker.ready()))
        ready(
            ctx,
            args.endpoints.control,
            name,
            device=str(device),
            dtype=str(worker.dtype),
            quantization=worker.quantization,
            epoch=ns.epoch,
            kv_tokens=worker.kv.num_slots,
            q_heads=list(worker.plan.q_heads),
            kv_heads=list(worker.plan.kv_heads),
        )
    except StopRequested:
        ctx.destroy(0)
        return
    except Exception as e:  # noqa: BLE001 - report any start-up failure to the launcher, then exit non-zero
        log.error("start-up failed: %s", traceback.format_exc())
        begin_cleanup(args)  # the launcher's SIGTERM, which follows our report, must not interrupt the exit
        failed(ctx, args.endpoints.control, name, f"{type(e).__name__}: {e}")
        ctx.destroy(0)
        raise SystemExit(1) from None
    reader = AdapterReader(args.lora_root or None)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(reader, zmq.POLLIN)

    def finish_loads(done: list[tuple[WorkerLoraLoad, bytes | None]]) -> None:
        for load, data in done:
            sock.send(out_codec.encode(worker.load_lora(load, data)))

    try:
        while True:
            if recheck is not None and recheck.due() and not sock.poll(0, zmq.POLLIN):  # idle, nothing waiting
                changed = recheck.run()
                if changed:
                    log.info("%s", changed)
            events = dict(poller.poll(1000))
            finish_loads(reader.ready())
            if sock not in events:
                continue
            frame = sock.recv()
            try:
                msg = in_codec.decode(frame)
            except WireError as e:
                log.error("dropping bad frame from scheduler: %s", e)
                continue
            if isinstance(msg, WorkerLoraLoad) and not msg.pinned and worker.lora is not None:
                reader.submit(msg)  # read off the loop; acked by finish_loads once loaded
                continue
            if not isinstance(msg, ForwardBatch | WorkerPing):
                finish_loads(reader.drain())  # in message order before anything that reads or changes the pool
            if isinstance(msg, ForwardBatch):
                try:
                    reply = worker.step(msg)
                except Exception as e:  # noqa: BLE001 - the scheduler fails the step's requests with this text
                    if group is not None and isinstance(e, dist.DistError | RuntimeError) and _peer_gone(e):
                        # a peer rank died mid-collective: the launcher replaces the whole group; one line will do
                        log.error("step %d: a collective failed (a peer rank is gone): %s", msg.step, str(e)[:200])
                    else:
                        log.error("step %d failed: %s", msg.step, traceback.format_exc())
                    reply = StepResult(msg.step, rank, [], error=f"rank {rank}: {e}", epoch=ns.epoch)
                if recheck is not None:
                    recheck.worked()
            elif isinstance(msg, WorkerLoraLoad):
                reply = worker.load_lora(msg)
            elif isinstance(msg, WorkerLoraUnload):
                reply = worker.unload_lora(msg)
            elif isinstance(msg, SchedulerHello):  # a restarted scheduler: register again (KV contents are void)
                log.info("scheduler %s asks to register; sending READY", msg.incarnation[:12])
                if worker.decode_mirror is not None:
                    worker.decode_mirror.release()  # its requests are gone with the old scheduler
                reply = worker.ready()
            elif isinstance(msg, WorkerPing):
                reply = WorkerPong(msg.op_id, rank, epoch=ns.epoch)
            elif isinstance(msg, WorkerShutdown):
                break
            sock.send(out_codec.encode(reply))
    except StopRequested:
        pass
    finally:
        begin_cleanup(args)
        reader.close()
        sock.close()
        ctx.destroy(0)
        if shm is not None:
            shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
