"""Shared benchmark helpers: start/stop a Loom cluster, the machine header every benchmark prints, prompts, medians.

Use: ``print(bench_header("title", dtype=..., tp_size=...))`` first, then ``with loom_cluster(*launch_flags) as
cluster:`` and talk to ``cluster.endpoint`` (``cluster.proc`` is the launcher, ``cluster.log_path`` its log).
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the /proc/cpuinfo flags that decide which GEMM paths torch takes on CPU
RELEVANT_FLAGS = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"]

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis to a child.",
    "Write a haiku about the sea.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is a prime number?",
    "Describe the water cycle.",
    "Who wrote Hamlet?",
    "How do airplanes fly?",
    "Summarise the plot of Cinderella.",
    "What does a CPU do?",
    "Name four planets.",
    "How do vaccines work?",
    "Tell me a joke about cats.",
    "What is machine learning?",
]


def chat_prompts(n: int, run: int = 0, groups: int = 1) -> list[list[dict[str, str]]]:
    """``n`` single-turn chats (questions repeat with a numbered suffix so prompts differ).

    ``run`` > 0 starts each with a tag, so the prompts of one run never hit the prefix cache that an earlier run's
    filled (they share only the chat template's system prompt). The tag opens with the request's group letter
    (request ``i`` is in group ``i % groups``), then the run and ``i``: requests share a start only within their
    group. bench/multi_lora.py makes the groups its traffic's adapters (and base), so a base run shares prompt
    starts the same way a mixed run can under each adapter's own prefix cache. With the former ``(run N, i)`` tag,
    every base request shared ``(run N, `` with all the others but a mixed one only with its adapter's 7, so a
    base burst that started in two steps computed ~200 prompt tokens fewer.
    """
    if run:
        letters = string.ascii_uppercase
        return [
            [{"role": "user", "content": f"{letters[i % groups % 26]}{run}-{i}) {QUESTIONS[i % len(QUESTIONS)]}"}]
            for i in range(n)
        ]
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}] for i in range(n)]


def random_prompt_ids(n_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """``n_tokens`` seeded random token ids above the special-token range: an exact prompt length, distinct per
    seed (so a prefix cache could never make two requests cheaper than they are)."""
    rng = random.Random(seed)
    return [rng.randrange(256, vocab_size) for _ in range(n_tokens)]


def median(xs: list[float]) -> float:
    """Median of measured values."""
    return statistics.median(xs)


def quantile(xs: list[float], q: float) -> float:
    """Nearest-rank quantile (nan for no data)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# ----------------------------------------------------------------------------- the machine


def cpu_flags() -> str:
    """The relevant CPU flags of the first ``flags`` line of /proc/cpuinfo, present and absent."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown (no flags line in /proc/cpuinfo)"
    have = set(line.split(":", 1)[1].split())
    present = [f for f in RELEVANT_FLAGS if f in have]
    absent = [f for f in RELEVANT_FLAGS if f not in have]
    return f"{' '.join(present) or '-'} (absent: {' '.join(absent) or '-'})"


def cpu_model() -> str:
    """The ``model name`` of /proc/cpuinfo (or the platform's processor string)."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def loadavg() -> str:
    """The machine's 1-minute load average ("?" where /proc has none)."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def worker_threads_rule(tp_size: int) -> str:
    """The torch intra-op thread count a CPU ``gpu_worker`` took before it logged its choice: ``OMP_NUM_THREADS``
    when set, else ``os.cpu_count() // tp_size``, at least 1."""
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp:
        return f"{omp} (OMP_NUM_THREADS)"
    return f"{max(1, (os.cpu_count() or 1) // tp_size)} (cpu_count {os.cpu_count()} // tp_size {tp_size})"


def loom_revision() -> str:
    """Short commit of the working tree, marked when it has uncommitted changes (read-only git calls)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{head or 'unknown'}{' + uncommitted changes' if dirty else ''}"


def bench_header(title: str, *, dtype: str, tp_size: int, model: str = "", extra: str = "") -> str:
    """The lines every benchmark prints first: what ran, on which CPU (flags), with how many torch threads."""
    import torch

    from gpu_worker.native_build import isa_caps

    device = "cpu"
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible)"
    lines = [
        f"== {title} ==",
        f"model: {model or 'embedded SmolLM2-135M-Instruct'}, dtype {dtype}, tp_size {tp_size}, device {device}",
        f"cpu: {cpu_model()}, {os.cpu_count()} cpus, load average {loadavg()} at the start",
        f"cpu flags: {cpu_flags()}",
        f"instruction set: {isa_caps()} (narrowed by LOOM_MARCH, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, "
        "MKL_ENABLE_INSTRUCTIONS)",
        f"torch {torch.__version__} ({torch.get_num_threads()} threads in this process; each gpu_worker's count is "
        f"printed once the cluster is up), python {platform.python_version()}, loom {loom_revision()}",
    ]
    if device == "cpu" and dtype in ("bfloat16", "auto") and not {"avx512_bf16", "amx_bf16"} & _flag_set():
        lines.append(
            "note: this CPU has no bf16 instructions (avx512_bf16, amx_bf16): dense bf16 weights (--quantization "
            "none) are upcast per call for 8+ rows, so their figures measure that slow path; --dtype float32 or "
            "--quantization gguf is the fast choice here"
        )
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def _flag_set() -> set[str]:
    """Every flag of the first ``flags`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


# ----------------------------------------------------------------------------- processes


def _proc_children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                for line in f:
                    if line.startswith("PPid:"):
                        kids.setdefault(int(line.split()[1]), []).append(int(d))
                        break
        except OSError:
            continue
    return kids


def _proc_name(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid}"
    if "-m" in args and args.index("-m") + 1 < len(args):
        name = args[args.index("-m") + 1].split(".")[0]
        if "--rank" in args and args.index("--rank") + 1 < len(args):
            name += f"[{args[args.index('--rank') + 1]}]"
        return name
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid {pid}"


def cluster_procs(launcher: int) -> dict[str, int]:
    """name -> pid for the launcher and every descendant (``gpu_worker[0]``, ``scheduler_proc``, ...)."""
    kids = _proc_children()
    out = {"launcher": launcher}
    todo = list(kids.get(launcher, []))
    while todo:
        pid = todo.pop()
        name = _proc_name(pid)
        out[name if name not in out else f"{name} ({pid})"] = pid
        todo.extend(kids.get(pid, []))
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used (0.0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


# ----------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    """A running ``launch.py``: where clients connect, the launcher process and its log.

    Set ``keep_log`` to keep the log folder after the cluster stops (it is kept anyway when the launcher
    failed or exited non-zero).
    """

    endpoint: str
    proc: subprocess.Popen
    log_path: Path
    tmp: Path
    tp_size: int = 1
    keep_log: bool = False

    def procs(self) -> dict[str, int]:
        """name -> pid of the launcher and every process it started (``gpu_worker[0]``, ``scheduler_proc``, ...)."""
        return cluster_procs(self.proc.pid)

    def worker_threads(self) -> str:
        """Each rank's torch intra-op thread count as its log line says (``N intra-op thread(s): why``); without
        that line (a CUDA run, or a Loom that does not log it), the rule CPU workers used before."""
        text = self.log_path.read_text(errors="replace")
        found = re.findall(r" gpu_worker(\d+) \w+ (\d+) intra-op thread\(s\): ([^\n]*)", text)
        if found:
            return "; ".join(f"rank {r}: {n} ({why})" for r, n, why in found)
        return f"not logged; by the former rule {worker_threads_rule(self.tp_size)} per rank"

    def worker_cpu_s(self) -> float:
        """CPU seconds the ``gpu_worker`` processes have used so far (a replaced worker starts again at 0)."""
        return sum(cpu_s(pid) for name, pid in self.procs().items() if name.startswith("gpu_worker"))


def _term_with_parent() -> None:
    """In the launcher's child before exec: have Linux send it SIGTERM when the benchmark dies, so a crash that skips
    every cleanup (llama.cpp's general protection fault on a VM that lists AMX but faults on it) leaves no cluster."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextmanager
def loom_cluster(*flags: str, timeout_s: float = 600.0, prefix: str = "loom-bench-") -> Iterator[Cluster]:
    """Run ``launch.py`` with ``flags`` on a private ipc endpoint until "Loom ready"; stop it after.

    Stopping sends SIGINT and waits 30 s, then SIGKILLs the launcher's process group. The temporary folder
    (socket and ``launch.log``) is removed unless the launcher exited non-zero, the body raised or ``keep_log``
    is set; then the log's path goes to stderr. Raises RuntimeError with the log's tail if the cluster does not come up.
    """
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    log_path = tmp / "launch.log"
    endpoint = f"ipc://{tmp}/front.sock"
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "--zmq-endpoint", endpoint, *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
            start_new_session=True,
            preexec_fn=_term_with_parent,
        )
    tp = int(flags[flags.index("--tp-size") + 1]) if "--tp-size" in flags[:-1] else 1
    cluster = Cluster(endpoint, p, log_path, tmp, tp)
    try:
        deadline = time.monotonic() + timeout_s
        while "Loom ready" not in log_path.read_text(errors="replace"):
            if p.poll() is not None or time.monotonic() > deadline:
                cluster.keep_log = True
                text = log_path.read_text(errors="replace")
                raise RuntimeError(f"Loom failed to start (log {log_path}):\n{text[-4000:]}")
            time.sleep(0.5)
        print(f"gpu_worker threads: {cluster.worker_threads()}", flush=True)
        yield cluster
    except BaseException:
        cluster.keep_log = True  # the log explains what went wrong
        raise
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if p.returncode == 0 and not cluster.keep_log:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"cluster log kept in {log_path} (launcher exit status {p.returncode})", file=sys.stderr)


def add_quantization_arg(p) -> None:
    """``--quantization`` for a throughput benchmark: ``none`` (bf16 weights, what issue 10's figures track) by
    default; launch.py's own default is ``auto`` (4-bit GGUF blocks for the embedded model, faster at batch 1 and
    slower than bf16 from about 16 rows per step on this CPU)."""
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "gguf", "auto"],
        help="passed to launch.py (default none: bf16 weights; launch.py's own default is auto)",
    )
