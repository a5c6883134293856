"""tokenizer_proc process: the ZMQ ROUTER front door (and HTTP when ``--http-port`` is set)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import traceback
import uuid

import zmq
import zmq.asyncio

from ipc.codec import Codec, WireError
from ipc.config import ServerArgs
from ipc.messages import (
    AbortReq,
    AdminOut,
    BatchTokenOut,
    ClientMsg,
    ClusterEvent,
    ClusterView,
    ErrorOut,
    FrontDoorHello,
    GenerateReq,
    HealthReq,
    ListLorasReq,
    LoadLoraReq,
    LoraOpResult,
    ServerMsg,
    ShutdownCmd,
    ToSchedulerMsg,
    ToTokenizerMsg,
    UnloadLoraReq,
)
from ipc.proc import begin_cleanup, child_setup
from ipc.sockets import HEARTBEAT_INTERVAL_S, HeartbeatSender, failed, make_socket, ready
from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.registry import AdapterRefused, UnknownAdapter

log = logging.getLogger("tokenizer")
SERVER_CODEC: Codec = Codec(ServerMsg)


class ZmqSink:
    """Replies to one DEALER client through the ROUTER; ``send`` is False once the client is unreachable."""

    def __init__(self, router: zmq.asyncio.Socket, identity: bytes) -> None:
        self.router = router
        self.identity = identity

    def send(self, msg: ServerMsg) -> bool:
        """Send one reply without blocking; False if the client is gone."""
        try:
            fut = self.router.send_multipart([self.identity, SERVER_CODEC.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        # zmq.asyncio never raises here: a failed non-blocking send (EHOSTUNREACH: the client is gone) is
        # reported through the returned future, which must be read or asyncio logs it as never retrieved
        if fut.done():
            return not fut.cancelled() and fut.exception() is None
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return True


class FrontDoorServer:
    """Sockets and the asyncio tasks around :class:`FrontDoor`."""

    def __init__(self, args: ServerArgs, ctx: zmq.asyncio.Context, incarnation: int = 1) -> None:
        ep = args.endpoints
        self.args = args
        self.ctx = ctx
        self.incarnation = incarnation
        self.router: zmq.asyncio.Socket | None = None  # bound once the registry agrees with the workers
        self.from_sched = make_socket(ctx, zmq.PULL, ep.to_tokenizer, bind=True)
        self.to_sched = make_socket(ctx, zmq.PUSH, ep.to_scheduler, bind=False)
        self.sched_out: Codec = Codec(ToSchedulerMsg)
        self.sched_in: Codec = Codec(ToTokenizerMsg)
        self.client_in: Codec = Codec(ClientMsg)
        self.door = FrontDoor(args, self._send_sched)
        self.sinks: dict[bytes, ZmqSink] = {}
        self.stop = asyncio.Event()

    def _send_sched(self, msg: object) -> None:
        try:
            self.to_sched.send(self.sched_out.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the scheduler is down: what it must know is resubmitted when it is back
            log.warning("scheduler unreachable; %s not sent (resubmitted after its restart)", type(msg).__name__)

    def _sink(self, identity: bytes) -> ZmqSink:
        s = self.sinks.get(identity)
        if s is None:
            s = self.sinks[identity] = ZmqSink(self.router, identity)
        return s

    async def serve_clients(self) -> None:
        """Read client frames forever; a bad frame gets an ErrorOut, never a crash."""
        while True:
            parts = await self.router.recv_multipart()
            if len(parts) != 2:
                if parts:
                    self._sink(parts[0]).send(ErrorOut("", f"expected one frame per message, got {len(parts) - 1}"))
                continue
            identity, frame = parts
            sink = self._sink(identity)
            try:
                msg = self.client_in.decode(frame)
            except WireError as e:
                sink.send(ErrorOut("", str(e), "bad_request"))
                continue
            asyncio.ensure_future(self._handle(msg, sink))

    async def _handle(self, msg: object, sink: ZmqSink) -> None:
        try:
            if isinstance(msg, GenerateReq):
                await self.door.generate(msg, sink)
            elif isinstance(msg, AbortReq):
                self.door.abort(sink, msg.rid)
            elif isinstance(msg, LoadLoraReq):
                sink.send(await self.door.load_adapter(msg.lora_name, msg.lora_path, msg.pinned))
            elif isinstance(msg, UnloadLoraReq):
                sink.send(await self.door.unload_adapter(msg.lora_name))
            elif isinstance(msg, ListLorasReq):
                sink.send(await self.door.list_adapters())
            elif isinstance(msg, HealthReq):
                down = self.door.health.unavailable
                sink.send(AdminOut(down is None, down or "ok", {"running": len(self.door.pending)}))
        except (AdapterRefused, UnknownAdapter) as e:
            sink.send(AdminOut(False, str(e)))
        except Exception as e:  # noqa: BLE001 - a handler bug answers this client, the server stays up
            log.error("handler failed: %s", traceback.format_exc())
            sink.send(AdminOut(False, f"internal error: {type(e).__name__}: {e}"))

    async def serve_scheduler(self) -> None:
        """Route scheduler output to clients."""
        while True:
            frame = await self.from_sched.recv()
            try:
                msg = self.sched_in.decode(frame)
            except WireError as e:
                log.error("dropping bad frame from scheduler: %s", e)
                continue
            if isinstance(msg, BatchTokenOut):
                self.door.on_tokens(msg)
            elif isinstance(msg, LoraOpResult):
                self.door.on_op_result(msg)
            elif isinstance(msg, ClusterEvent):
                self.door.on_cluster_event(msg)
            elif isinstance(msg, ClusterView):
                self.door.on_cluster_view(msg)

    async def beat(self) -> None:
        """Tell the launcher every second that the event loop still runs (a hung loop gets restarted)."""
        hb = HeartbeatSender(zmq.Context.instance(), self.args.endpoints.control, "tokenizer_proc")
        try:
            while True:
                hb.beat()
                await asyncio.sleep(HEARTBEAT_INTERVAL_S / 2)
        finally:
            hb.close()

    async def sync_with_scheduler(self) -> None:
        """Say hello to the scheduler until it answers with the workers' adapters (a restarted front door
        rebuilds its registry from them); the front door takes no traffic before that.

        Raises:
            TimeoutError: no answer within ``--ready-timeout``.
        """
        hello = FrontDoorHello(uuid.uuid4().hex)
        deadline = time.monotonic() + self.args.ready_timeout_s
        while not self.door.synced.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler did not answer in {self.args.ready_timeout_s} s")
            self._send_sched(hello)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.door.synced.wait(), 1.0)

    async def load_initial_adapters(self) -> None:
        """Load ``--lora-paths`` adapters (deterministic uids). At the first start any failure stops start-up;
        after a restart the ones the workers still hold are already in the registry, and a failure is logged."""
        for spec in self.args.lora_paths:
            if spec.name in self.door.registry.loaded:
                continue
            try:
                await self.door.load_adapter(spec.name, spec.path, spec.pinned, deterministic=True)
            except (AdapterRefused, RuntimeError) as e:
                if self.incarnation == 1:
                    raise
                log.error("start-up adapter %s not loaded after the restart: %s", spec.name, e)

    async def run(self) -> None:
        """Start serving; returns on SIGTERM after telling the scheduler to stop."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        tasks = [asyncio.ensure_future(self.serve_scheduler())]
        await self.sync_with_scheduler()
        await self.load_initial_adapters()
        self.router = make_socket(self.ctx, zmq.ROUTER, self.args.endpoints.front, bind=True)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        tasks.append(asyncio.ensure_future(self.serve_clients()))
        http = None
        if self.args.http_port:
            from tokenizer_proc.http_api import start_http

            http = await start_http(self.door, self.args.http_host, self.args.http_port)
        tasks.append(asyncio.ensure_future(self.beat()))
        ready(
            zmq.Context.instance(),
            self.args.endpoints.control,
            "tokenizer_proc",
            front=self.args.endpoints.front,
            http_port=self.args.http_port,
            adapters=sorted(self.door.registry.loaded),
            incarnation=self.incarnation,
        )
        await self.stop.wait()
        self.door.fail_all("server shutting down")
        try:
            self._send_sched(ShutdownCmd())
        except zmq.ZMQError:
            pass
        for t in tasks:
            t.cancel()
        if http is not None:
            http.close()


def main() -> None:
    """Entry point: ``python -m tokenizer_proc.main --config-file F``."""
    args, ns = child_setup("tokenizer")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    ctx = zmq.asyncio.Context()

    async def amain() -> None:
        server = FrontDoorServer(args, ctx, ns.incarnation)
        server.door.health.merge_restarts(json.loads(ns.restarts))
        await server.run()

    try:
        asyncio.run(amain())
    except Exception as e:  # noqa: BLE001 - start-up or loop failure: tell the launcher, exit non-zero
        log.error("tokenizer failed: %s", traceback.format_exc())
        failed(zmq.Context.instance(), args.endpoints.control, "tokenizer_proc", f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    finally:
        begin_cleanup(args)
        ctx.destroy(0)
        zmq.Context.instance().destroy(0)


if __name__ == "__main__":
    main()
