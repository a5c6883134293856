"""The cluster's configuration tree: one msgspec Struct that every process receives at start-up."""

from __future__ import annotations

import os
import tempfile
import uuid

import msgspec

# prefill tokens per step on a 2-core CPU: measured in bench/prefix_cache.py (see the README's flag table)
DEFAULT_CHUNKED_PREFILL_SIZE = 64
DEFAULT_MAX_PREFILL_TOKENS = 2048
DEFAULT_DECODE_MIRROR_MB = 512
# an idle scheduler starts once no request arrived for this long: a burst sent at once reaches it over 12-28 ms
# on a 2-core CPU, with gaps of up to ~4-7 ms (scheduler_proc/burst_wait.py)
DEFAULT_BATCH_WAIT_MS = 5.0


class LoraSpec(msgspec.Struct, frozen=True):
    """One adapter named on the command line (``--lora-paths``)."""

    name: str
    path: str
    pinned: bool = False


class Endpoints(msgspec.Struct, frozen=True):
    """ZMQ addresses of every socket edge in the cluster.

    ``front`` is the client-facing ROUTER (``ipc://`` by default, ``tcp://`` when asked). The others are
    internal edges; with ``ipc://`` they live in ``socket_dir``, which the launcher removes at shutdown.
    """

    front: str
    to_scheduler: str  # tokenizer PUSH -> scheduler PULL
    to_tokenizer: str  # scheduler PUSH -> tokenizer PULL
    workers: str  # scheduler ROUTER <-> worker DEALERs
    control: str  # every process PUSH -> launcher PULL (READY / FAILED)
    dist_init: str  # torch.distributed init method (tcp://127.0.0.1:PORT)
    socket_dir: str = ""


class ServerArgs(msgspec.Struct, frozen=True, kw_only=True):
    """Every knob of a Loom cluster. Field names follow SGLang's flags (``--max-running-requests`` ...)."""

    model_path: str  # resolved checkpoint folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "none"  # auto | none | int8 | gguf (weight-only; launch.py's default is auto)
    device: str = "auto"  # auto | cpu | cuda
    tp_size: int = 1
    max_running_requests: int = 64
    max_queued_requests: int = 4096  # requests queued, running or being tokenized at once; more: "overloaded"
    max_total_tokens: int = 0  # KV pool size in tokens (0 = derived from memory)
    context_length: int = 0  # 0 = the model's max_position_embeddings
    mem_fraction_static: float = 0.8  # CUDA only: share of free memory for weights + KV cache
    random_seed: int = 0
    step_timeout_s: float = 20.0  # plus 20 ms per token the step carries; then the TP group counts as hung
    lora_op_timeout_s: float = 30.0  # a LoRA load/unload not answered by every rank by then: the group is hung
    ready_timeout_s: float = 300.0
    crash_loop_deaths: int = 5  # this many worker deaths within crash_loop_window_s stop the cluster
    crash_loop_window_s: float = 60.0
    hang_timeout_s: float = 10.0  # a scheduler/tokenizer whose heartbeats stop this long is killed and restarted
    http_port: int = 0  # 0 = no HTTP server
    http_host: str = "127.0.0.1"
    served_model_name: str = ""  # the base model's id in the OpenAI API ("" = derived from the model path)
    shutdown_timeout_s: float = 30.0  # on SIGTERM: how long requests in flight may take to finish
    endpoints: Endpoints
    # multi-LoRA
    enable_lora: bool = False
    lora_paths: list[LoraSpec] = []
    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    lora_target_modules: list[str] = []
    lora_eviction_policy: str = "lru"
    lora_backend: str = "auto"  # auto | cpu-sgmv (gpu_worker/csrc/lora_sgmv.c) | torch
    lora_root: str = ""
    base_dir: str = ""  # where launch.py ran: relative adapter paths given at run time are relative to it
    max_loaded_loras: int = 0  # host-memory tier bound (0 = unbounded)
    # prefix cache and chunked prefill
    disable_radix_cache: bool = False  # the radix prefix cache (keyed by adapter uid, then token ids) is on by default
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE  # most prefill tokens per step (<= 0: whole prompts)
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # prefill tokens of a step in which no request decodes
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS  # idle server: the first step waits for a burst's arrivals to pause
    decode_mirror_mb: int = DEFAULT_DECODE_MIRROR_MB  # per worker, CPU only; 0 turns the decode KV mirror off
    log_level: str = "info"


def make_endpoints(front: str | None = None, dist_port: int | None = None) -> Endpoints:
    """Fresh endpoints in a private temp folder; ``front`` overrides the client-facing address."""
    sock_dir = tempfile.mkdtemp(prefix=f"loom-{os.getpid()}-{uuid.uuid4().hex[:6]}-")

    def ep(name: str) -> str:
        return f"ipc://{sock_dir}/{name}.sock"

    port = dist_port if dist_port is not None else free_tcp_port()
    return Endpoints(
        front=front or ep("front"),
        to_scheduler=ep("to_scheduler"),
        to_tokenizer=ep("to_tokenizer"),
        workers=ep("workers"),
        control=ep("control"),
        dist_init=f"tcp://127.0.0.1:{port}",
        socket_dir=sock_dir,
    )


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
