"""Shared benchmark helpers: start/stop a Loom cluster, prompts, medians."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    """``n`` single-turn chats (questions repeat with a numbered suffix so prompts differ)."""
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}] for i in range(n)]


def median(xs: list[float]) -> float:
    """Median of measured values."""
    return statistics.median(xs)


@contextmanager
def loom_cluster(*flags: str, timeout_s: float = 600.0):
    """Run ``launch.py`` with ``flags`` on a private ipc endpoint; yields the endpoint; stops it after."""
    tmp = tempfile.mkdtemp(prefix="loom-bench-")
    endpoint = f"ipc://{tmp}/front.sock"
    log = open(Path(tmp) / "launch.log", "w+")
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "--zmq-endpoint", endpoint, *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(ROOT),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            log.seek(0)
            text = log.read()
            if "Loom ready" in text:
                break
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Loom failed to start:\n{text}")
            time.sleep(0.5)
        yield endpoint
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        log.close()
        if p.returncode == 0:
            shutil.rmtree(tmp, ignore_errors=True)
