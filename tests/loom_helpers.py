"""Helpers shared by the test modules: prompts, transformers references, cluster launcher, in-process driver.

Kept out of ``conftest.py`` so test modules (and ``torch.multiprocessing`` children) can import them by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EOS = 2

# ----------------------------------------------------------------------------- prompts

_LONG_PASSAGE = (
    "The water cycle describes how water moves between the oceans, the air and the land. Energy from the sun "
    "warms the surface of lakes and seas, and some of that water evaporates into the atmosphere as vapour. "
    "Plants add more vapour through their leaves in a process called transpiration. As the warm, moist air "
    "rises it cools, and the vapour condenses around tiny particles of dust and salt to form clouds. When the "
    "droplets in a cloud grow heavy enough they fall back to the ground as rain, snow, sleet or hail. Some of "
    "this precipitation soaks into the soil and refills underground aquifers, some runs off into streams and "
    "rivers, and some is stored for months or years as ice in glaciers and polar caps. Rivers carry water back "
    "to the sea, where the cycle begins again. The cycle moves heat around the planet, shapes weather and "
    "climate, erodes mountains and carves valleys, and supplies the fresh water that every living thing needs. "
    "Human activity changes the cycle too: cities cover the soil with concrete, farms draw water from rivers "
    "and wells, and a warmer climate speeds up evaporation, so droughts and floods both become more severe."
)

_LONG_STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker named "
    "Elias. Every morning he opened the wooden shutters of his shop, wound the hundred clocks that hung on its "
    "walls, and listened to them tick together like a quiet orchestra. Children from the village often pressed "
    "their noses against his window to watch him work with tiny screws and springs. One winter a traveller "
    "arrived carrying a broken pocket watch wrapped in a faded blue cloth. The watch had belonged to her "
    "grandmother, she said, and it had stopped on the night the old woman died. Nobody in the city had been "
    "able to repair it. Elias turned the watch over in his hands, opened its case and studied the gears for a "
    "long time. The mechanism was unlike anything he had seen: the wheels were carved from a pale stone, and "
    "the spring was a single strand of silver hair. He worked on it for seven days and seven nights, and on "
    "the morning of the eighth day, just as the first pale light touched the frosted window of the shop,"
)


@dataclass(frozen=True)
class Prompt:
    """A test prompt: chat ``messages`` or raw ``text``."""

    name: str
    text: str | None = None
    messages: list[dict[str, str]] | None = field(default=None, hash=False)

    def request_kwargs(self) -> dict:
        """Keyword arguments for ``LoomClient.generate`` (the server tokenizes and templates)."""
        return {"text": self.text} if self.text is not None else {"messages": self.messages}


PROMPTS: list[Prompt] = [
    Prompt(
        "chat_france", messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ),
    Prompt(
        "chat_system_haiku",
        messages=[
            {"role": "system", "content": "You are a poet who answers only in haiku."},
            {"role": "user", "content": "Describe the sea at night."},
        ],
    ),
    Prompt("raw_fox", text="The quick brown fox"),
    Prompt("raw_code", text='def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    Prompt(
        "chat_long_summary",
        messages=[{"role": "user", "content": _LONG_PASSAGE + "\n\nSummarize the text above in two sentences."}],
    ),
    Prompt("raw_long_story", text=_LONG_STORY),
]


def prompt_ids(codec, prompt: Prompt) -> list[int]:
    """Loom's own tokenization of ``prompt`` (``tokenizer_proc.text.TextCodec``)."""
    text = prompt.text if prompt.text is not None else codec.render_chat(prompt.messages)
    return codec.encode(text)


def until_eos(ids: list[int], n: int | None = None) -> list[int]:
    """``ids`` cut to the first ``n`` tokens, then up to and including the first EOS."""
    ids = list(ids[:n] if n is not None else ids)
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


# ----------------------------------------------------------------------------- transformers reference

REF_NEW_TOKENS = 24  # greedy tokens the reference holds per prompt (the most any test compares)
DECODE_STEPS = (1, 7, 15, 23)  # generation steps whose logits the reference keeps (step k predicts token k)


def reference_cache_file(model_path: Path) -> Path:
    """Where the transformers references for ``model_path`` are cached (keyed by checkpoint and prompts)."""
    from ipc.model_source import cache_root

    h = hashlib.sha256()
    h.update(str(Path(model_path).resolve()).encode())
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        f = Path(model_path) / name
        h.update(f.read_bytes() if f.is_file() else b"-")
    for st in sorted(Path(model_path).glob("*.safetensors")):
        h.update(f"{st.name}:{st.stat().st_size}:{int(st.stat().st_mtime)}".encode())
    h.update(json.dumps([[p.name, p.text, p.messages] for p in PROMPTS]).encode())
    h.update(f"{REF_NEW_TOKENS}:{DECODE_STEPS}:v2".encode())
    return cache_root() / "test-refs" / f"smollm2-{h.hexdigest()[:16]}.pt"


def compute_reference(model_path: Path) -> dict:
    """Greedy tokens and prefill last-token logits from transformers ``LlamaForCausalLM`` fp32, per prompt.

    Returns ``{name: {"input_ids", "greedy", "logits" (prefill, last token), "step_logits" {k: logits at step k}}}``;
    chat prompts are tokenized with ``apply_chat_template``, raw ones without special tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    out = {}
    for p in PROMPTS:
        if p.messages is not None:
            ids = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # BatchEncoding in recent transformers
                ids = ids["input_ids"]
        else:
            ids = tok(p.text, add_special_tokens=False)["input_ids"]
        ids = [int(i) for i in ids]
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0, -1].float().clone()
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=REF_NEW_TOKENS,
                pad_token_id=EOS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        greedy = [int(t) for t in gen.sequences[0, len(ids) :]]
        steps = {k: gen.logits[k][0].float().clone() for k in DECODE_STEPS if k < len(greedy)}
        out[p.name] = {"input_ids": ids, "greedy": greedy, "logits": logits, "step_logits": steps}
    return out


def load_reference(model_path: Path) -> dict:
    """The cached reference, computed (about 20 s) and stored on first use."""
    import torch

    f = reference_cache_file(model_path)
    if f.is_file():
        try:
            return torch.load(f, weights_only=True)
        except Exception:  # noqa: BLE001 - a corrupt cache is recomputed
            pass
    ref = compute_reference(model_path)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".tmp{os.getpid()}")
    torch.save(ref, tmp)
    os.replace(tmp, f)
    return ref


# ----------------------------------------------------------------------------- in-process engine (TP=1)


def kernel_or_skip(load, notes: dict, folder: Path, what: str):
    """``load(folder)`` (a C kernel loader of ``gpu_worker``), or skip the tests that need it with the reason the
    loader left in ``notes[folder]`` (no compiler, no AMX, ...)."""
    import pytest

    built = load(folder)
    if built is None:
        pytest.skip(f"no {what} here: {notes[folder]}")
    return built


def make_args(model_path: Path, **kw):
    """``ServerArgs`` for an in-process Worker/Scheduler (endpoints are never bound)."""
    from ipc.config import Endpoints, ServerArgs

    eps = Endpoints(front="inproc://f", to_scheduler="", to_tokenizer="", workers="", control="", dist_init="")
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 16)
    kw.setdefault("context_length", 2048)
    kw.setdefault("dtype", "float32")
    return ServerArgs(model_path=str(model_path), device="cpu", endpoints=eps, **kw)


def run_engine(worker, scheduler, arrivals: dict[int, list], max_steps: int = 10_000) -> dict[str, list]:
    """Drive ``scheduler`` + ``worker`` like ``scheduler_proc.main`` does, without sockets.

    ``arrivals`` maps a step number to the ``TokenizedReq``s added before that step is planned (staggered
    arrival). Returns ``{rid: [TokenOut, ...]}`` for every request, plus the plans under the key ``"__plans__"``.
    """
    outs: dict[str, list] = {}
    plans = []
    step = 0
    pending = dict(arrivals)
    while step < max_steps:
        for msg in pending.pop(step, []):
            for o in scheduler.add(msg):
                outs.setdefault(o.rid, []).append(o)
        fb = scheduler.next_batch()
        if fb is None:
            if not pending:
                break
            step += 1
            continue
        plans.append(fb)
        res = worker.step(fb)
        for o in scheduler.on_result(res.next_ids, res.row_errors, res.logprobs):
            outs.setdefault(o.rid, []).append(o)
        step += 1
    outs["__plans__"] = plans
    return outs


def output_ids(token_outs: list) -> list[int]:
    """Concatenated ``new_ids`` of one request's TokenOuts."""
    return [t for o in token_outs for t in o.new_ids]


def prefill_batch(prompts_ids: list[list[int]], bases: list[int] | None = None):
    """A ForwardBatch prefilling every prompt at once (greedy) in rows 0..P-1.

    Prompt ``i`` is written to KV slots ``bases[i], bases[i] + 1, ...`` (default: packed one after another).
    """
    from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

    if bases is None:
        bases = [sum(len(x) for x in prompts_ids[:i]) for i in range(len(prompts_ids))]
    greedy = WorkerSampling(0.0, 1.0, -1, None)
    reqs = []
    for i, (ids, base) in enumerate(zip(prompts_ids, bases, strict=True)):
        reqs.append(BatchReq(f"r{i}", i, list(ids), 0, list(range(base, base + len(ids))), None, greedy))
    return ForwardBatch(step=1, reqs=reqs)


def teacher_forced_logits(worker, prompts_ids: list[list[int]], forced: list[list[int]], steps) -> dict:
    """Prefill every prompt in one batch, then decode them together feeding ``forced`` tokens (teacher forcing).

    Returns ``{k: {prompt index: logits [V]}}`` for each ``k`` in ``steps`` (step 0 = prefill), so Loom's batched
    decode path (paged KV, padded attention mask, mixed lengths) is compared with the reference at step k.
    """
    from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

    greedy = WorkerSampling(0.0, 1.0, -1, None)
    last = max(steps)
    base, bases = 0, []
    for ids in prompts_ids:
        bases.append(base)
        base += len(ids) + last + 1
    out: dict[int, dict[int, object]] = {k: {} for k in steps}
    logits = worker.forward_logits(prefill_batch(prompts_ids, bases))
    if 0 in out:
        out[0] = {i: logits[i] for i in range(len(prompts_ids))}
    for k in range(1, last + 1):
        live = [i for i in range(len(prompts_ids)) if k < len(forced[i])]
        if not live:
            break
        reqs = []
        for i in live:
            pos = len(prompts_ids[i]) + k - 1
            reqs.append(BatchReq(f"r{i}", i, [forced[i][k - 1]], pos, [bases[i] + pos], None, greedy, k))
        logits = worker.forward_logits(ForwardBatch(step=k + 1, reqs=reqs))
        if k in out:
            out[k] = {i: logits[j] for j, i in enumerate(live)}
    return out


def _tp_rank_main(
    rank: int,
    world: int,
    init_method: str,
    model_path: str,
    prompts_ids: list,
    forced: list,
    steps,
    out_file: str,
    args_kw: dict | None = None,
) -> None:
    """One TP rank for :func:`tp_prefill_logits` (a ``torch.multiprocessing.spawn`` target)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gpu_worker.worker import Worker

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    reducer = None
    try:
        kw = {"tp_size": world, **(args_kw or {})}
        w = Worker(make_args(Path(model_path), **kw), rank, dist.group.WORLD, torch.device("cpu"))
        from gpu_worker.main import setup_cpu_all_reduce

        reducer = setup_cpu_all_reduce(w, dist.group.WORLD, 1)  # the shm all-reduce clusters use on CPU
        solo = [w.forward_logits(prefill_batch([ids]))[0] for ids in prompts_ids]
        decode = teacher_forced_logits(w, prompts_ids, forced, steps)
        if rank == 0:
            torch.save({"solo": torch.stack(solo), "steps": decode}, out_file)
    finally:
        if reducer is not None:
            reducer.close()
        dist.destroy_process_group()


def tp_logits(
    model_path: Path, prompts_ids: list[list[int]], forced: list, steps, world: int, out_dir: Path, **args_kw
) -> dict:
    """Logits from ``world`` real gloo ranks, each a ``Worker`` running ``forward_logits`` on its shard.

    ``args_kw`` go to every rank's ``make_args`` (e.g. ``quantization="gguf"``).

    Returns rank 0's ``{"solo": [P, V] prefill logits one prompt per batch, "steps": teacher_forced_logits(...)}``.
    """
    import torch
    import torch.multiprocessing as mp

    from ipc.config import free_tcp_port

    out_file = str(out_dir / f"tp{world}_logits.pt")
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    mp.spawn(
        _tp_rank_main,
        args=(world, init, str(model_path), prompts_ids, forced, tuple(steps), out_file, args_kw),
        nprocs=world,
        join=True,
    )
    return torch.load(out_file, weights_only=False)


# ----------------------------------------------------------------------------- real clusters (launch.py)

READY_TIMEOUT_S = 180.0


def _proc_children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; Linux only)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ..." - comm may hold spaces, so split after the last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(d.name))
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@dataclass
class ClusterHandle:
    """A running ``launch.py`` started by :func:`launch_cluster`."""

    proc: subprocess.Popen
    endpoint: str
    log_path: Path
    tp_size: int = 1
    children: dict[str, int] = field(default_factory=dict)  # "gpu_worker[0]" -> pid
    config_file: str = ""
    http_port: int = 0  # set by launch_http_cluster

    @property
    def socket_dir(self) -> Path:
        """The launcher's private ``/tmp/loom-*`` folder holding internal sockets and config.json."""
        return Path(self.config_file).parent

    @property
    def front_path(self) -> Path:
        """Filesystem path of the ipc:// front socket."""
        return Path(self.endpoint[len("ipc://") :])

    def log(self) -> str:
        """Everything the launcher and its children wrote so far."""
        return self.log_path.read_text(errors="replace")

    def client(self, timeout_s: float = 120.0):
        """A new blocking ``LoomClient`` for this cluster (close it, or use it in a ``with``)."""
        from ipc.client import LoomClient

        return LoomClient(self.endpoint, timeout_s=timeout_s)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int:
        """Send ``sig`` to the launcher and wait for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def kill_everything(self) -> None:
        """Last resort: SIGKILL the launcher's process group and every child pid it started."""
        if self.proc.poll() is None:  # never signal a reaped (hence reusable) process group id
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.children.values():
            # children run in their own sessions; only kill a pid still running our config (no pid reuse)
            if pid_alive(pid) and self.config_file and self.config_file in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def _find_children(h: ClusterHandle) -> None:
    for pid in _proc_children(h.proc.pid):
        cmd = _cmdline(pid)
        if "--config-file" not in cmd:
            continue
        h.config_file = cmd[cmd.index("--config-file") + 1]
        if "gpu_worker.main" in cmd:
            name = f"gpu_worker[{cmd[cmd.index('--rank') + 1]}]"
        else:
            name = next((m.split(".")[0] for m in cmd if m.endswith("_proc.main")), f"pid{pid}")
        h.children[name] = pid


def _launcher_preexec() -> None:
    """In the launcher before exec: its own session, and SIGTERM (a clean stop) if the test process dies."""
    os.setsid()
    from ipc.proc import set_parent_death_signal

    set_parent_death_signal()


def _fp32_unless_asked(flags) -> list[str]:
    """``flags`` plus ``--quantization none`` and ``--dtype float32`` unless they choose: the tests' references
    are fp32 (launch.py's default, ``auto``, serves the embedded GGUF's own 4-bit blocks with bf16 activations, and
    on CUDA a float32 checkpoint in bf16)."""
    flags = list(flags)
    if any(f.startswith("--quantization") for f in flags):
        return flags
    return [
        *flags,
        "--quantization",
        "none",
        *([] if any(f.startswith("--dtype") for f in flags) else ["--dtype", "float32"]),
    ]


@contextlib.contextmanager
def launch_cluster(
    tmp_path: Path, *flags: str, ready_timeout_s: float = READY_TIMEOUT_S, cwd: Path | None = None
) -> Iterator[ClusterHandle]:
    """Start ``python launch.py --zmq-endpoint ipc://TMP/front.sock *flags`` (in ``cwd``, default the repository)
    and wait for "Loom ready:".

    stdout/stderr go to ``TMP/launch.log`` (raised with the error if start-up fails). On exit the launcher gets
    SIGINT; if it is not gone within 30 s its process group and every child pid are SIGKILLed, so nothing is left
    behind. Should the test process itself die, the launcher gets SIGTERM from the kernel and stops the cluster.
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    endpoint = f"ipc://{tmp_path}/front.sock"
    log_path = tmp_path / "launch.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(REPO / "launch.py"), "--zmq-endpoint", endpoint, *_fp32_unless_asked(flags)]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            cmd, cwd=str(cwd or REPO), stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=_launcher_preexec
        )
    tp = int(flags[flags.index("--tp-size") + 1]) if "--tp-size" in flags else 1
    h = ClusterHandle(proc=proc, endpoint=endpoint, log_path=log_path, tp_size=tp)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while "Loom ready:" not in h.log():
            _find_children(h)
            if proc.poll() is not None:
                raise RuntimeError(f"launch.py exited with code {proc.returncode} before READY:\n{h.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"launch.py did not print 'Loom ready:' in {ready_timeout_s} s:\n{h.log()}")
            time.sleep(0.2)
        _find_children(h)
        yield h
    finally:
        try:
            h.stop(signal.SIGINT, timeout_s=30)
        except subprocess.TimeoutExpired:
            print(f"launch.py ignored SIGINT for 30 s; killing it. Log:\n{h.log()}", file=sys.stderr)
        h.kill_everything()


def ready_pids(log: str) -> dict[str, int]:
    """``{process name: pid}`` from the launcher's "NAME ready (pid N)" log lines."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(\S+) ready \(pid (\d+)\)", log)}


@dataclass
class Timed:
    """One request's final result and when it was sent, first streamed, and finished (monotonic seconds)."""

    result: dict
    sent: float
    first: float
    done: float
    chunks: int


def run_concurrently(endpoint: str, jobs: list[tuple[float, dict]], timeout_s: float = 300.0) -> list[Timed]:
    """Stream several requests through one ``AsyncLoomClient``; job ``i`` is sent ``delay_i`` s after the start.

    ``jobs`` is ``[(delay, generate kwargs)]``; results come back in job order.
    """
    import asyncio

    from ipc.client import AsyncLoomClient

    async def main() -> list[Timed]:
        client = AsyncLoomClient(endpoint, timeout_s=timeout_s)
        t0 = time.monotonic()

        async def one(delay: float, kw: dict) -> Timed:
            await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
            sent = time.monotonic()
            first, last, n = None, None, 0
            async for chunk in client.generate_stream(**kw):
                first = first or time.monotonic()
                last, n = chunk, n + 1
            return Timed(last, sent, first, time.monotonic(), n)

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(d, kw) for d, kw in jobs)), timeout_s)
        finally:
            client.close()

    return asyncio.run(main())


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Largest number of ``[start, end]`` intervals that are open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def decode_step_seconds(endpoint: str, n: int = 9) -> float:
    """Measured wall time of one decode step of a lone request (to space staggered arrivals in steps)."""
    from ipc.client import LoomClient

    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    with LoomClient(endpoint, timeout_s=120) as c:
        times = [time.monotonic() for _ in c.generate(text="Count: 1, 2, 3,", sampling_params=sp, stream=True)]
    return (times[-1] - times[0]) / (len(times) - 1)


class ListSink:
    """Collects replies."""

    def __init__(self) -> None:
        self.msgs: list[object] = []

    def send(self, msg: object) -> bool:
        self.msgs.append(msg)
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_http_cluster(tmp_path: Path, *flags: str) -> Iterator[ClusterHandle]:
    """:func:`launch_cluster` with the HTTP API on a free port (``handle.http_port``)."""
    port = free_port()
    with launch_cluster(tmp_path, "--http-port", str(port), *flags) as h:
        h.http_port = port
        yield h
