"""tokenizer_proc process: the ZMQ ROUTER front door (and HTTP when ``--http-port`` is set).

Queue policy of the client-facing ROUTER (every queue between processes has one; ZeroMQ's default drops):

- Inbound, per client: at most ``ROUTER_RCVHWM`` frames wait in libzmq, each at most ``MAX_FRAME_BYTES``
  (``ZMQ_MAXMSGSIZE``: a bigger frame closes that connection before it is read). A full inbound pipe only stops
  reading from that client (backpressure), it never drops.
- Outbound, per client: ``ROUTER_SNDHWM`` replies in libzmq. A full pipe (EAGAIN under ``ROUTER_MANDATORY``) moves
  replies to the client's outbox (:class:`ZmqSink`), flushed as the client reads; in the outbox a newer stream
  chunk replaces an older one of the same request (chunks are cumulative), so it holds about one message per
  request. Nothing is dropped unless the client is gone, or leaves over ``OUTBOX_LIMIT`` replies unread (then
  it counts as gone).
- A client that vanished (killed, or silent for ``PEER_HEARTBEAT_IVL_MS`` + ``PEER_HEARTBEAT_TIMEOUT_MS``: ZMTP
  heartbeats from the ROUTER) has its connection closed by libzmq; a socket monitor then makes the front door
  probe every client with requests in flight (an empty frame, which clients skip; EHOSTUNREACH = gone), as it
  also does every ``PROBE_INTERVAL_S``, and the gone client's requests are aborted.
- To the scheduler: unbounded at the socket (``UNBOUNDED``), bounded by ``--max-queued-requests``. A message
  sent while the scheduler is down waits in the socket and reaches the restarted scheduler, which also gets
  every pending request resubmitted (duplicates are ignored), so no request is failed or lost for an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import traceback
import uuid
from collections import deque

import zmq
import zmq.asyncio

from ipc.codec import Codec, FramePeek, WireError, peek_request
from ipc.config import ServerArgs
from ipc.messages import (
    AbortReq,
    AdminOut,
    BatchTokenOut,
    ClientMsg,
    ClusterEvent,
    ClusterView,
    DrainCmd,
    ErrorOut,
    FrontDoorHello,
    GenerateOut,
    GenerateReq,
    HealthReq,
    ListLorasReq,
    LoadLoraReq,
    LoraOpResult,
    SchedulerBeat,
    ServerMsg,
    ToSchedulerMsg,
    ToTokenizerMsg,
    UnloadLoraReq,
)
from ipc.proc import begin_cleanup, child_setup, cluster_stopping
from ipc.sockets import (
    HEARTBEAT_INTERVAL_S,
    MAX_FRAME_BYTES,
    UNBOUNDED,
    HeartbeatSender,
    failed,
    make_socket,
    ready,
)
from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.registry import AdapterRefused, ServerStopping, UnknownAdapter

log = logging.getLogger("tokenizer")
SERVER_CODEC: Codec = Codec(ServerMsg)

ROUTER_SNDHWM = 1000  # replies per client queued in libzmq; beyond, they wait in the client's outbox
ROUTER_RCVHWM = 16  # frames per client queued in libzmq before it stops reading that connection (no drops)
PEER_HEARTBEAT_IVL_MS = 500  # the ROUTER pings every client this often ...
PEER_HEARTBEAT_TIMEOUT_MS = 1200  # ... and closes a connection silent this long after a ping
PROBE_INTERVAL_S = 0.5  # clients with requests in flight are probed at least this often
PROBE_AFTER_DISCONNECT_S = (0.0, 0.05, 0.25)  # and at these delays after any connection closes
OUTBOX_RETRY_S = 0.005  # how often full outboxes retry
OUTBOX_LIMIT = 65536  # replies a client may leave unread before it counts as gone
PEEK_BYTES = 64 * 1024  # frames larger than this have their sizes checked before they are decoded
YIELD_EVERY = 64  # small frames read before the event loop gets a turn (one large frame counts as many)
PROBE_FRAME = b""  # a zero-length frame: a liveness probe that clients skip
SINK_PRUNE_S = 5.0  # how often sinks of clients with nothing in flight are forgotten


class ZmqSink:
    """Replies to one DEALER client through the ROUTER; ``send`` is False once the client is gone.

    A reply that finds the client's pipe full waits in ``outbox`` (see the module docstring); the server
    flushes outboxes as the client reads. ``last_ok`` is when a send last reached the client's pipe.
    """

    def __init__(self, server: FrontDoorServer, identity: bytes) -> None:
        self.server = server
        self.identity = identity
        self.gone = False
        self.last_ok = 0.0
        self.outbox: deque[list] = deque()  # [message, its encoded frame or None]
        self.handling = 0  # this client's messages whose handler has not ended (see FrontDoorServer._dispatch)
        self._chunk: dict[str, list] = {}  # rid -> its queued stream chunk (a newer chunk replaces it)

    def send(self, msg: ServerMsg) -> bool:
        """Send one reply without blocking (queued if the client's pipe is full); False if the client is gone."""
        if self.gone:
            return False
        if not self.outbox:
            frame = SERVER_CODEC.encode(msg)
            err = self.server.send_frame(self.identity, frame)
            if not err:
                self.last_ok = time.monotonic()
                return True
            if err != zmq.EAGAIN:
                self.lost("unreachable")
                return False
            self._queue(msg, frame)
            self.server.backlog(self)
            return True
        self._queue(msg, None)
        return not self.gone

    def _queue(self, msg: ServerMsg, frame: bytes | None) -> None:
        if isinstance(msg, GenerateOut) and not msg.finished:
            entry = self._chunk.get(msg.rid)
            if entry is not None:  # cumulative: the newer chunk says everything the queued one did
                entry[0], entry[1] = msg, frame
                return
            entry = self._chunk[msg.rid] = [msg, frame]
        else:
            entry = [msg, frame]
        self.outbox.append(entry)
        if len(self.outbox) > self.server.outbox_limit:
            self.lost(f"left over {self.server.outbox_limit} replies unread")

    def flush(self) -> bool:
        """Send what the outbox holds until the client's pipe is full; True once it is empty (or the client gone)."""
        while self.outbox and not self.gone:
            entry = self.outbox[0]
            if entry[1] is None:
                entry[1] = SERVER_CODEC.encode(entry[0])
            err = self.server.send_frame(self.identity, entry[1])
            if err == zmq.EAGAIN:
                return False
            if err:
                self.lost("unreachable")
                break
            self.last_ok = time.monotonic()
            self.outbox.popleft()
            rid = getattr(entry[0], "rid", None)
            if self._chunk.get(rid) is entry:
                del self._chunk[rid]
        return True

    def probe(self) -> None:
        """Find out whether the client is still connected (an empty frame it skips; a full pipe means alive)."""
        if self.gone or self.outbox:
            return  # a waiting outbox is retried (and so probed) every few milliseconds
        err = self.server.send_frame(self.identity, PROBE_FRAME)
        if not err:
            self.last_ok = time.monotonic()
        elif err != zmq.EAGAIN:
            self.lost("disconnected")

    def lost(self, why: str) -> None:
        """The client is gone (or stuck): drop what waits for it and abort its requests."""
        if self.gone:
            return
        self.gone = True
        self.outbox.clear()
        self._chunk.clear()
        self.server.client_gone(self, why)


class FrontDoorServer:
    """Sockets and the asyncio tasks around :class:`FrontDoor`."""

    def __init__(self, args: ServerArgs, ctx: zmq.asyncio.Context, incarnation: int = 1) -> None:
        ep = args.endpoints
        self.args = args
        self.ctx = ctx
        self.incarnation = incarnation
        self.router: zmq.asyncio.Socket | None = None  # bound once the registry agrees with the workers
        self.from_sched = make_socket(ctx, zmq.PULL, ep.to_tokenizer, bind=True, options={zmq.RCVHWM: UNBOUNDED})
        self.to_sched = make_socket(ctx, zmq.PUSH, ep.to_scheduler, bind=False, options={zmq.SNDHWM: UNBOUNDED})
        self.sched_out: Codec = Codec(ToSchedulerMsg)
        self.sched_in: Codec = Codec(ToTokenizerMsg)
        self.client_in: Codec = Codec(ClientMsg)
        self.door = FrontDoor(args, self._send_sched)
        self.sinks: dict[bytes, ZmqSink] = {}
        self.outbox_limit = max(OUTBOX_LIMIT, 4 * self.door.max_queued)
        self._backlog: set[ZmqSink] = set()
        self._backlog_wake = asyncio.Event()
        self.stop = asyncio.Event()
        self.drained = False  # a drain (SIGTERM to the cluster) ended: exit without being restarted
        self._drain: asyncio.Task | None = None

    def _send_sched(self, msg: object) -> None:
        """Queue ``msg`` for the scheduler. The socket has no high-water mark, so this never drops: while the
        scheduler is down the message waits for its restart (which also gets every pending request again)."""
        try:
            self.to_sched.send(self.sched_out.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # only at shutdown (the context is closing)
            log.error("cannot queue %s for the scheduler: %s", type(msg).__name__, e)

    # ------------------------------------------------------------------ clients
    def _sink(self, identity: bytes) -> ZmqSink:
        s = self.sinks.get(identity)
        if s is None:
            s = self.sinks[identity] = ZmqSink(self, identity)
        return s

    def send_frame(self, identity: bytes, frame: bytes) -> int:
        """Send one frame to a client without blocking: 0, or the errno (EAGAIN: its pipe is full,
        EHOSTUNREACH: it is not connected)."""
        # every send is non-blocking, so zmq.asyncio completes it at once and reports failure through the
        # returned future (read here, so asyncio never logs an unretrieved exception)
        fut = self.router.send_multipart([identity, frame], zmq.NOBLOCK)
        if not fut.done():  # not expected: only if a blocking send were ever queued on this socket
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            return 0
        exc = fut.exception()
        if exc is None:
            return 0
        return exc.errno if isinstance(exc, zmq.ZMQError) else zmq.EHOSTUNREACH

    def backlog(self, sink: ZmqSink) -> None:
        """``sink`` has replies waiting in its outbox: flush it as its client reads."""
        self._backlog.add(sink)
        self._backlog_wake.set()

    def client_gone(self, sink: ZmqSink, why: str) -> None:
        """A client vanished: abort its requests (the scheduler stops working for it) and forget it."""
        if self.sinks.get(sink.identity) is sink:
            del self.sinks[sink.identity]
        self._backlog.discard(sink)
        n = self.door.abort_sink(sink, "client disconnected")
        if n:
            log.info("client %s %s: aborted its %d requests", sink.identity.hex(), why, n)

    async def flush_outboxes(self) -> None:
        """Retry the outboxes of clients whose pipe was full, every ``OUTBOX_RETRY_S`` while any is waiting."""
        while True:
            await self._backlog_wake.wait()
            self._backlog_wake.clear()
            while self._backlog:
                for sink in list(self._backlog):
                    if sink.flush():
                        self._backlog.discard(sink)
                if self._backlog:
                    await asyncio.sleep(OUTBOX_RETRY_S)

    def _probe_clients(self, force: bool) -> None:
        """Probe the clients with requests in flight (those that got a reply within the interval are known to
        be connected unless ``force``)."""
        now = time.monotonic()
        for sink in self.door.sinks_in_use():
            if isinstance(sink, ZmqSink) and (force or now - sink.last_ok >= PROBE_INTERVAL_S):
                sink.probe()

    def _prune_sinks(self) -> None:
        """Forget the sinks of clients with nothing in flight and nothing waiting (one is made again on their
        next message), so clients that come and go do not accumulate."""
        busy = self.door.sinks_in_use()
        for identity, sink in list(self.sinks.items()):
            if sink not in busy and not sink.outbox and not sink.handling:
                del self.sinks[identity]

    async def watch_clients(self) -> None:
        """Notice clients that vanished with requests in flight, and abort those requests.

        libzmq closes a dead client's connection (at once for a killed process, after the ROUTER's ZMTP
        heartbeat timeout for a frozen one or a dead network path); the ROUTER's monitor reports each closed
        connection without saying whose, so every client with requests in flight is probed then, a few times
        (the route disappears a moment after the event), and every ``PROBE_INTERVAL_S`` in any case.
        """
        mon = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        last_prune = time.monotonic()
        try:
            while True:
                closed = False
                if await mon.poll(round(PROBE_INTERVAL_S * 1000)):
                    while True:
                        try:
                            await mon.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        closed = True
                if closed:
                    for delay in PROBE_AFTER_DISCONNECT_S:
                        await asyncio.sleep(delay)
                        self._probe_clients(force=True)
                else:
                    self._probe_clients(force=False)
                if time.monotonic() - last_prune > SINK_PRUNE_S:
                    last_prune = time.monotonic()
                    self._prune_sinks()
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self.router.disable_monitor()
            mon.close()

    def _refuse_oversized(self, peek: FramePeek) -> str | None:
        """Why a request is refused by its sizes alone (read without decoding its lists), or None."""
        ctx, door = self.door.context_len, self.door
        if peek.input_ids is not None and peek.input_ids > ctx:
            return f"input_ids has {peek.input_ids} tokens; the context length is {ctx}"
        if peek.messages is not None and peek.messages > ctx:
            return f"messages has {peek.messages} entries; at most {ctx} can fit the context"
        limit = (ctx - 1) * door.codec.max_token_chars  # characters: with max_new_tokens=1, the most allowed
        if peek.text_bytes is not None and (peek.text_bytes + 3) // 4 > limit:  # >= bytes/4 characters
            return f"text is at least {(peek.text_bytes + 3) // 4} characters; at most {limit} could ever fit"
        if peek.stop_token_ids is not None and peek.stop_token_ids > door.vocab_size:
            return f"sampling_params.stop_token_ids has {peek.stop_token_ids} ids, more than the vocabulary"
        return None

    def _decode_client(self, frame: memoryview, sink: ZmqSink) -> object | None:
        """The message in ``frame``, or None after answering a frame that is refused or unreadable.

        A large frame is refused by its sizes before it is decoded (decoding millions of ids would stall every
        stream); an error names the request's rid whenever the frame has a readable one.
        """
        if len(frame) > PEEK_BYTES:
            peek = peek_request(frame)
            why = self._refuse_oversized(peek)
            if why is not None:
                sink.send(ErrorOut(peek.rid, why, "bad_request"))
                return None
        try:
            return self.client_in.decode(frame)
        except WireError as e:
            sink.send(ErrorOut(peek_request(frame).rid, str(e), "bad_request"))
            return None

    async def serve_clients(self) -> None:
        """Read client frames forever; a bad frame gets an ErrorOut, never a crash."""
        work = 0
        while True:
            # a frame already queued completes this await without yielding: yield now and then (after each
            # large frame), so a burst of frames never holds up the streams of other clients
            if work >= YIELD_EVERY:
                work = 0
                await asyncio.sleep(0)
            parts = await self.router.recv_multipart(copy=False)
            sink = self._sink(parts[0].bytes)
            if len(parts) != 2:
                sink.send(ErrorOut("", f"expected one frame per message, got {len(parts) - 1}"))
                continue
            frame = parts[1].buffer
            work += 1 if len(frame) <= PEEK_BYTES else YIELD_EVERY
            msg = self._decode_client(frame, sink)
            if msg is not None:  # tasks start in arrival order: a request is registered before its abort runs
                self._dispatch(msg, sink)

    def _dispatch(self, msg: object, sink: ZmqSink) -> asyncio.Future:
        """Handle ``msg`` in a task of its own. ``sink`` counts as busy until the handler ends: pruned between a
        request's arrival and its registration, the client's next message (its abort) would get a new sink and
        match nothing, and the request would run to its end for nobody (found by reading, after a storm trial)."""
        sink.handling += 1
        return asyncio.ensure_future(self._handle(msg, sink))

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
                down = self.door.health.problem()
                sink.send(AdminOut(down is None, down or "ok", {"running": len(self.door.pending)}))
        except AdapterRefused as e:
            sink.send(AdminOut(False, str(e), kind="bad_request"))
        except ServerStopping as e:  # draining or stopping: as generation requests are told then
            sink.send(AdminOut(False, str(e), kind="unavailable"))
        except UnknownAdapter as e:  # the kind the HTTP API's 404 carries
            sink.send(AdminOut(False, str(e), kind="not_found"))
        except Exception as e:  # noqa: BLE001 - a handler bug answers this client, the server stays up
            log.error("handler failed: %s", traceback.format_exc())
            sink.send(AdminOut(False, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
        finally:
            sink.handling -= 1

    async def serve_scheduler(self) -> None:
        """Route scheduler output to clients."""
        while True:
            frame = await self.from_sched.recv()
            try:
                msg = self.sched_in.decode(frame)
            except WireError as e:
                log.error("dropping bad frame from scheduler: %s", e)
                continue
            if isinstance(msg, DrainCmd):  # from the launcher, which shares this socket
                if self._drain is None:
                    self._drain = asyncio.ensure_future(self.drain(msg.timeout_s))
                continue
            self.door.health.heard_from_scheduler()
            if isinstance(msg, SchedulerBeat):
                self.door.on_scheduler_beat(msg)
            elif isinstance(msg, BatchTokenOut):
                self.door.on_tokens(msg)
            elif isinstance(msg, LoraOpResult):
                self.door.on_op_result(msg)
            elif isinstance(msg, ClusterEvent):
                self.door.on_cluster_event(msg)
            elif isinstance(msg, ClusterView):
                self.door.on_cluster_view(msg)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting (new requests get ``unavailable`` / HTTP 503), wait up to ``timeout_s`` for the
        requests in flight, fail what is left, then make :meth:`run` return (the process exits, and the
        launcher stops the rest of the cluster)."""
        self.door.begin_drain(
            f"Loom is shutting down: new requests are refused while those in flight finish (up to {timeout_s:g} s)"
        )
        started = time.monotonic()
        log.info("draining: %d requests in flight; waiting up to %.0f s", self.door.in_flight, timeout_s)
        while self.door.in_flight and time.monotonic() - started < timeout_s:
            await asyncio.sleep(0.05)
        left = self.door.in_flight
        if left:
            log.warning("drain: %d requests still running after %.0f s; failing them", left, timeout_s)
            self.door.fail_all(f"server shutting down: the request did not finish within {timeout_s:g} s")
        else:
            log.info("drained in %.2f s", time.monotonic() - started)
        self.drained = True
        self.stop.set()

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
            if self.stop.is_set():  # the cluster stops before it ever came up (e.g. a worker failed to start)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler did not answer in {self.args.ready_timeout_s} s")
            self._send_sched(hello)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.door.synced.wait(), 1.0)

    async def load_initial_adapters(self) -> None:
        """Load ``--lora-paths`` adapters (deterministic uids) at the first start; any failure stops start-up.

        A restarted front door loads nothing: its registry was carried over from the previous one (and the
        workers' view), and a start-up adapter missing from both was unloaded by a user or lost (its files changed
        or vanished); loading it again would bring back what was removed, under the uid of weights that no longer
        exist."""
        if self.incarnation > 1:
            return
        for spec in self.args.lora_paths:
            try:
                await self.door.load_adapter(spec.name, spec.path, spec.pinned, deterministic=True)
            except (ValueError, LookupError) as e:  # refused (bad folder, pin, rank ...): the user's, not a bug
                raise StartupRefused(f"--lora-paths {spec.name}: {e}") from None

    async def run(self) -> None:
        """Start serving; returns on SIGTERM (in-flight requests are answered "server shutting down" when the
        cluster stops; otherwise the launcher restarts this front door and ZMQ clients resubmit them) or when a
        drain (:class:`DrainCmd`) has ended."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        # beat from the start: a front door that hangs while it syncs is found and restarted too
        if self.incarnation > 1:  # before the first cluster view: it restores what the workers lack
            self.door.lora.seed_from_journal()
        tasks = [asyncio.ensure_future(self.serve_scheduler()), asyncio.ensure_future(self.beat())]
        await self.sync_with_scheduler()
        if self.stop.is_set():
            for t in tasks:
                t.cancel()
            return
        await self.load_initial_adapters()
        self.router = make_socket(
            self.ctx,
            zmq.ROUTER,
            self.args.endpoints.front,
            bind=True,
            options={
                zmq.ROUTER_HANDOVER: 1,
                zmq.MAXMSGSIZE: MAX_FRAME_BYTES,
                zmq.SNDHWM: ROUTER_SNDHWM,
                zmq.RCVHWM: ROUTER_RCVHWM,
                zmq.HEARTBEAT_IVL: PEER_HEARTBEAT_IVL_MS,
                zmq.HEARTBEAT_TIMEOUT: PEER_HEARTBEAT_TIMEOUT_MS,
            },
        )
        tasks.append(asyncio.ensure_future(self.serve_clients()))
        tasks.append(asyncio.ensure_future(self.flush_outboxes()))
        tasks.append(asyncio.ensure_future(self.watch_clients()))
        http = None
        if self.args.http_port:
            from tokenizer_proc.http_server import start_http

            http = await start_http(self.door, self.args.http_host, self.args.http_port)
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
        # no ShutdownCmd to the scheduler: the launcher stops every process itself when the cluster stops, and a
        # SIGTERM to this process alone must restart only the front door, not cascade through the cluster. Only
        # when the cluster goes away are in-flight requests told so; otherwise the launcher restarts this front
        # door and the clients resubmit them
        stopping = self.drained or cluster_stopping(self.args)
        why = "server shutting down" if stopping else "the front door is restarting"
        # from now on /health says 503, so no client takes this dying front door for the next one. Only when the
        # cluster goes away are new requests refused: ZMQ clients resubmit what reaches a restarting front door.
        # LoRA calls waiting for the scheduler are answered (HTTP 503) before the connections close
        if stopping:
            self.door.begin_drain(why)
        else:
            self.door.health.restarting = why
        self.door.lora.interrupt(why)
        if stopping:
            self.door.fail_all("server shutting down")
        else:  # ZMQ clients resubmit to the restarted front door; an HTTP client can only be told to retry
            self.door.fail_all(
                "the front door is restarting; retry the request", lambda s: not isinstance(s, ZmqSink), "unavailable"
            )
        if http is not None:  # answers what fail_all delivered, then closes every connection
            await http.stop()
        for t in tasks:
            t.cancel()


class StartupRefused(RuntimeError):
    """A start-up adapter (``--lora-paths``) was refused: reported in one line, without a traceback."""


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
        log.error("tokenizer failed: %s", e if isinstance(e, StartupRefused) else traceback.format_exc())
        failed(zmq.Context.instance(), args.endpoints.control, "tokenizer_proc", f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    finally:
        begin_cleanup(args)
        ctx.destroy(0)
        zmq.Context.instance().destroy(0)


if __name__ == "__main__":
    main()
