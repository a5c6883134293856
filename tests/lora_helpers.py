"""Helpers for the multi-LoRA tests: tiny adapters, pool driver, peft references, a cluster launcher.

Kept out of ``conftest.py`` (and importable by name from ``tests/``) so that the subprocess pool driver and
every ``test_lora_*`` module share one copy. Expensive artefacts (the six PEFT test adapters for the real
model, the transformers+peft greedy references) are cached on disk under ``$LOOM_CACHE_DIR`` /
``~/.cache/loom`` and in memory per session.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))

from import_hook import patch_on_import  # noqa: E402, F401  (re-exported: tests import it from here)

from ipc.config import Endpoints, ServerArgs  # noqa: E402
from ipc.lora_config import LLAMA_LORA_MODULES  # noqa: E402
from ipc.model_config import ModelConfig  # noqa: E402

EOS = 2
ALL = list(LLAMA_LORA_MODULES)
ADAPTER_NAMES = ["r8-all", "r16-attn", "r32-qv", "r64-all", "r16-rslora", "r8-pattern"]

# ----------------------------------------------------------------------------- tiny model (pool unit tests)

TINY = ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    eos_token_ids=[EOS],
)

DUMMY_ENDPOINTS = Endpoints(
    front="ipc:///nonexistent/front",
    to_scheduler="ipc:///nonexistent/s",
    to_tokenizer="ipc:///nonexistent/t",
    workers="ipc:///nonexistent/w",
    control="ipc:///nonexistent/c",
    dist_init="tcp://127.0.0.1:1",
)


def server_args(model_path: str = "/nonexistent", **kw) -> ServerArgs:
    """ServerArgs for in-process Worker/LoraPool tests (no sockets are ever opened; on the CPU unless ``device``
    says otherwise, as the tests' fp32 CPU references and C kernels expect, also on a GPU machine)."""
    kw.setdefault("device", "cpu")
    return ServerArgs(model_path=str(model_path), endpoints=DUMMY_ENDPOINTS, **kw)


def _block(module: str) -> str:
    return "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def _dims(cfg: ModelConfig, module: str) -> tuple[int, int]:
    from gpu_worker.lora_weights import module_dims

    return module_dims(cfg, module)


def write_adapter(
    folder: Path,
    cfg: ModelConfig = TINY,
    *,
    r: int = 4,
    alpha: float = 8,
    targets: list[str] | None = None,
    seed: int = 0,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    use_rslora: bool = False,
    config_extra: dict | None = None,
    tensor_overrides: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a PEFT-format LoRA folder (config + safetensors with PEFT's tensor names) for ``cfg``.

    ``rank_pattern`` keys are short module names (``"q_proj"``); ``tensor_overrides`` replaces or adds
    tensors by full name after generation.
    """
    targets = list(targets or ALL)
    rank_pattern = dict(rank_pattern or {})
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            rr = rank_pattern.get(m, r)
            fin, fout = _dims(cfg, m)
            base = f"base_model.model.model.layers.{layer}.{_block(m)}.{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rr, fin, generator=g) * 0.1
            tensors[f"{base}.lora_B.weight"] = torch.randn(fout, rr, generator=g) * 0.1
    tensors.update(tensor_overrides or {})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": targets,
        "use_rslora": use_rslora,
        "rank_pattern": rank_pattern,
        "alpha_pattern": dict(alpha_pattern or {}),
        "bias": "none",
        "lora_dropout": 0.0,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    config.update(config_extra or {})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def tiny_pool(
    slots: int = 3,
    policy: str = "lru",
    max_rank: int = 16,
    targets: list[str] | None = None,
    cfg: ModelConfig = TINY,
    tp_size: int = 1,
    rank: int = 0,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
):
    """An in-process :class:`LoraPool` over the tiny config (CPU, ``dtype``, fp32 by default; ``backend`` is
    ``--lora-backend``; the test is skipped for cpu-sgmv on a machine without a C compiler). ``slots`` slots on
    every backend: ``--max-running-requests`` is 1, so a pool that reads adapters in place (``slots - 1`` plus one
    per running request) has as many."""
    from gpu_worker.lora_pool import LoraPool
    from gpu_worker.tp_plan import plan_for_model

    args = server_args(
        enable_lora=True,
        max_loras_per_batch=slots,
        max_running_requests=1,
        max_lora_rank=max_rank,
        lora_eviction_policy=policy,
        lora_target_modules=list(targets or ALL),
        lora_backend=backend,
    )
    plan = plan_for_model(cfg, tp_size, rank)
    if backend == "cpu-sgmv":
        skip_without_kernel()
    return LoraPool(args, cfg, plan, dtype, torch.device("cpu"))


def skip_without_kernel() -> None:
    """Skip the calling test where the cpu-sgmv kernel cannot be built (no C compiler)."""
    from gpu_worker.lora_kernel import load_sgmv
    from ipc.model_source import cache_root

    if load_sgmv(cache_root() / "kernels") is None:
        pytest.skip("no C compiler: the cpu-sgmv kernel cannot be built here")


# ----------------------------------------------------------------------------- cross-process pool driver

DRIVER_SLOTS = 3


def driver_uids(seed: int, n: int) -> list[str]:
    """``n`` uuid-shaped uids drawn from ``seed`` (identical in every process)."""
    rng = random.Random(seed)
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n)]


def _assign_in_set_order(self, uids):
    """A deliberately broken ``LoraPool.assign`` that iterates a set (the bug class the sort prevents)."""
    from gpu_worker.lora_pool import LoraPoolError

    needed = list({u for u in uids if u is not None})
    if len(needed) > self.n_slots:
        raise LoraPoolError("too many adapters")
    for u in needed:
        self._ensure_slot(u, protected=needed)
    return [-1 if u is None else self.uid_slot[u] for u in uids]


def drive_pool(adapter_root: str, seed: int, steps: int, broken: bool = False) -> None:
    """Run a seeded random stream of loads, unloads and batches through a tiny pool; print JSON lines.

    Every line is ``{"run", "i", "event", "digest", "table", "slots"}``; two processes given the same
    arguments must print identical lines whatever their ``PYTHONHASHSEED``. ``broken`` swaps in a set-order
    ``assign`` (for the rest of the process) to show the check has teeth.
    """
    from gpu_worker.lora_pool import LoraPool

    if broken:
        LoraPool.assign = _assign_in_set_order
    run = f"{seed}{'-broken' if broken else ''}"
    folders = sorted(Path(adapter_root).iterdir())
    uids = driver_uids(seed, len(folders))
    rng = random.Random(seed + 1)
    # ranks 2-6 (4 or 8 rank rows) in 3 slots of 8 rows: evictions, gaps and compactions all happen
    pool = tiny_pool(slots=DRIVER_SLOTS, max_rank=6, policy="lru" if seed % 2 == 0 else "fifo")
    pinned = uids[0]
    for i, (u, f) in enumerate(zip(uids, folders, strict=True)):
        pool.load(u, f"a{i}", str(f), pinned=(u == pinned))
    loaded = set(uids)
    unpinned = sorted(uids[1:])

    def emit(i: int, event: str, slots: list[int] | None = None) -> None:
        digest, table = pool.digest()
        line = {"run": run, "i": i, "event": event, "digest": digest, "table": table, "slots": slots}
        print(json.dumps(line, sort_keys=True), flush=True)

    for i in range(steps):
        if rng.random() < 0.1:  # unload or reload a random unpinned adapter between steps
            u = rng.choice(unpinned)
            if u in loaded:
                pool.unload(u)
                loaded.discard(u)
                emit(i, f"unload {u}")
            else:
                pool.load(u, "again", str(folders[uids.index(u)]))
                loaded.add(u)
                emit(i, f"load {u}")
        avail = sorted(loaded - {pinned})
        distinct = rng.sample(avail, rng.randint(0, min(DRIVER_SLOTS - 1, len(avail))))
        batch: list[str | None] = [rng.choice(distinct + [None, pinned]) for _ in range(rng.randint(1, 6))]
        batch += distinct
        rng.shuffle(batch)
        emit(i, "step", pool.assign(batch))


# ----------------------------------------------------------------------------- the real model and its adapters


@functools.lru_cache(maxsize=1)
def real_model_path() -> Path:
    """The embedded SmolLM2 checkpoint folder (converted once from the GGUF)."""
    from ipc.model_source import resolve_model_path

    return resolve_model_path(None)


@functools.lru_cache(maxsize=1)
def real_adapters() -> dict[str, Path]:
    """The six PEFT test adapters of ``scripts/make_adapters.py`` for the real model (made once, cached)."""
    from ipc.model_source import cache_root
    from scripts.make_adapters import TEST_ADAPTERS, make_adapters

    mp = real_model_path()
    out = cache_root() / "test-adapters" / mp.name
    paths = {name: out / name for name in TEST_ADAPTERS}
    if all((p / "adapter_model.safetensors").is_file() for p in paths.values()):
        return paths  # skip make_adapters' peft/transformers imports (about 7 s)
    return {k: Path(v) for k, v in make_adapters(mp, out).items()}


REF_NEW_TOKENS = 16
REF_PROMPTS: list[dict] = [
    {"name": "chat_france", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "raw_fox", "text": "The quick brown fox"},
    {"name": "raw_code", "text": "def fibonacci(n):\n"},
]


def _reference_file() -> Path:
    from ipc.model_source import cache_root

    h = hashlib.sha256()
    mp = real_model_path()
    for f in ("config.json", "tokenizer.json"):
        h.update((mp / f).read_bytes())
    for st in sorted(mp.glob("*.safetensors")):
        h.update(f"{st.name}:{st.stat().st_size}".encode())
    for name, folder in sorted(real_adapters().items()):
        h.update(name.encode())
        h.update((folder / "adapter_config.json").read_bytes())
        h.update(hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).digest())
    h.update(json.dumps([REF_PROMPTS, REF_NEW_TOKENS, "peft-v1"]).encode())
    return cache_root() / "test-refs" / f"lora-peft-{h.hexdigest()[:16]}.pt"


def compute_peft_reference() -> dict:
    """transformers + peft fp32 greedy tokens and last-token prefill logits, one adapter at a time.

    Returns ``{"input_ids": {prompt: ids}, "greedy": {(adapter or "base", prompt): ids},
    "logits": {(adapter or "base", prompt): tensor}}`` (keys joined as ``"adapter|prompt"``).
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mp = str(real_model_path())
    tok = AutoTokenizer.from_pretrained(mp)
    base = AutoModelForCausalLM.from_pretrained(mp, dtype=torch.float32).eval()
    input_ids: dict[str, list[int]] = {}
    for p in REF_PROMPTS:
        if "messages" in p:
            ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
        else:
            ids = tok(p["text"], add_special_tokens=False)["input_ids"]
        input_ids[p["name"]] = [int(i) for i in ids]
    greedy: dict[str, list[int]] = {}
    logits: dict[str, torch.Tensor] = {}

    def run(model, tag: str) -> None:
        for name, ids in input_ids.items():
            x = torch.tensor([ids])
            with torch.no_grad():
                logits[f"{tag}|{name}"] = model(x).logits[0, -1].float().clone()
                out = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=REF_NEW_TOKENS,
                    pad_token_id=EOS,
                )
            greedy[f"{tag}|{name}"] = [int(t) for t in out[0, len(ids) :]]

    run(base, "base")
    for name, folder in sorted(real_adapters().items()):
        model = PeftModel.from_pretrained(base, str(folder)).eval()
        run(model, name)
        base = model.unload()
    return {"input_ids": input_ids, "greedy": greedy, "logits": logits}


@functools.lru_cache(maxsize=1)
def peft_reference() -> dict:
    """The cached peft reference (computed once, about a minute, then read from disk)."""
    f = _reference_file()
    if f.is_file():
        with contextlib.suppress(Exception):
            return torch.load(f, weights_only=True)
    ref = compute_peft_reference()
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".tmp{os.getpid()}")
    torch.save(ref, tmp)
    os.replace(tmp, f)
    return ref


def six_adapter_worker(**kw):
    """An in-process ``Worker`` on the real model with LoRA on and the six test adapters loaded as ``uid-NAME``
    (``kw``: ``server_args`` overrides, e.g. ``dtype`` or ``quantization``)."""
    from gpu_worker.worker import Worker

    kw = {"enable_lora": True, "max_loras_per_batch": 6, "max_lora_rank": 64, **kw}
    worker = Worker(server_args(real_model_path(), **kw))
    for name, folder in real_adapters().items():
        worker.lora.load(f"uid-{name}", name, str(folder))
    return worker


def until_eos(ids: list[int], n: int | None = None) -> list[int]:
    """``ids`` cut to ``n`` tokens, then up to and including the first EOS."""
    ids = list(ids[:n] if n is not None else ids)
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


# ----------------------------------------------------------------------------- clusters


class Cluster:
    """A ``launch.py`` process started by :func:`launch_cluster`."""

    def __init__(self, proc: subprocess.Popen, endpoint: str, log: Path) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.log = log

    def client(self, timeout_s: float = 120.0):
        """A blocking client connected to this cluster (close it, or use it as a context manager)."""
        from ipc.client import LoomClient

        return LoomClient(self.endpoint, timeout_s=timeout_s)

    def log_text(self) -> str:
        """Everything the launcher and its children printed so far."""
        return self.log.read_text(errors="replace")

    def wait_exit(self, timeout_s: float) -> int | None:
        """The launcher's exit code once it exits within ``timeout_s`` (None if it is still running)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGINT the launcher (it stops its children); SIGKILL its process group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def launch_cluster(
    extra_args: list[str], env_extra: dict[str, str] | None = None, ready_timeout_s: float = 240.0
) -> Iterator[Cluster]:
    """Start ``launch.py --max-total-tokens 4096 <extra_args>`` on a private endpoint; stop it afterwards."""
    work = Path(tempfile.mkdtemp(prefix="loom-lora-", dir="/tmp"))
    endpoint = f"ipc://{work}/front.sock"
    log = work / "cluster.log"
    env = dict(os.environ)
    env.update(env_extra or {})
    cmd = [sys.executable, str(REPO / "launch.py"), "--max-total-tokens", "4096", "--zmq-endpoint", endpoint]
    if not any(a.startswith("--quantization") for a in extra_args):
        cmd += ["--quantization", "none"]  # the references are fp32; launch.py's default serves 4-bit blocks
        if not any(a.startswith("--dtype") for a in extra_args):
            cmd += ["--dtype", "float32"]  # what auto gives on CPU; on CUDA auto serves a float32 checkpoint in bf16
    cmd += ["--log-level", "warning", *extra_args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=str(REPO), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster = Cluster(proc, endpoint, log)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while "Loom ready" not in cluster.log_text():
            if proc.poll() is not None:
                raise RuntimeError(f"launch.py exited with {proc.returncode}:\n{cluster.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ready in {ready_timeout_s} s:\n{cluster.log_text()[-4000:]}")
            time.sleep(0.2)
        yield cluster
    finally:
        cluster.stop()
        with contextlib.suppress(OSError):
            for f in work.iterdir():
                f.unlink()
            work.rmdir()


def generate_many(endpoint: str, requests: list[dict], timeout_s: float = 300.0) -> list[dict]:
    """Send every request (kwargs of ``AsyncLoomClient.generate``) at once; results in request order."""
    import asyncio

    from ipc.client import AsyncLoomClient

    async def go() -> list[dict]:
        c = AsyncLoomClient(endpoint, timeout_s=timeout_s)
        try:
            return await asyncio.gather(*(c.generate(**r) for r in requests))
        finally:
            c.close()

    return asyncio.run(go())


def greedy(n: int) -> dict:
    """Greedy sampling params for ``n`` new tokens."""
    return {"max_new_tokens": n, "temperature": 0.0}


if __name__ == "__main__":  # the subprocess pool driver: python lora_helpers.py ROOT STEPS SEED[-broken] ...
    for spec in sys.argv[3:]:
        drive_pool(sys.argv[1], int(spec.split("-")[0]), int(sys.argv[2]), broken=spec.endswith("-broken"))


# ----------------------------------------------------------------------------- tiny checkpoint + peft adapters

# name -> LoraConfig kwargs: PEFT features whose maths Loom must reproduce on the tiny model
TINY_PEFT_SPECS: dict[str, dict] = {
    # a regex string target: only layer 1's q and v
    "regex-target": {"r": 4, "lora_alpha": 8, "target_modules": r".*\.layers\.1\.self_attn\.(q_proj|v_proj)"},
    # layer-specific and module-wide patterns; the first matching key wins, as in PEFT
    "layer-patterns": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ALL,
        "rank_pattern": {"layers.0.mlp.down_proj": 2, "q_proj": 6},
        "alpha_pattern": {"layers.1.self_attn.k_proj": 3, "o_proj": 20},
    },
    "rslora-pattern": {
        "r": 8,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "gate_proj", "down_proj"],
        "rank_pattern": {"gate_proj": 2},
    },
    "one-layer": {"r": 3, "lora_alpha": 5, "target_modules": ALL, "layers_to_transform": [1]},
}


def make_tiny_checkpoint(folder: Path) -> Path:
    """A random fp32 Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) saved as a safetensors checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=1,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def make_tiny_peft_adapters(model_dir: Path, out: Path) -> dict[str, Path]:
    """One PEFT adapter per :data:`TINY_PEFT_SPECS` entry, written by ``peft`` (random A and B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    paths = {}
    for i, (name, spec) in enumerate(TINY_PEFT_SPECS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **spec))
        model.save_pretrained(str(out / name))
        paths[name] = out / name
        base = model.unload()
    return paths
