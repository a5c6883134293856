"""Shared fixtures: the real SmolLM2 checkpoint, its transformers references, Loom's text codec, clusters."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One intra-op thread per process, for the test process and (inherited) every cluster process it starts: this
# machine has 2 cores shared by up to 3 TP ranks plus the test, and oversubscribed OpenMP threads make each step
# several times slower. Set OMP_NUM_THREADS yourself to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the serving packages are imported from the checkout, installed or not
    sys.path.insert(0, str(REPO))

from loom_helpers import PROMPTS, launch_cluster, load_reference, prompt_ids  # noqa: E402

__all__ = ["launch_cluster"]


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint folder (converted once, ~45 s, then cached)."""
    from ipc.model_source import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def text_codec(model_path):
    """Loom's tokenizer / chat template for the checkpoint."""
    from tokenizer_proc.text import TextCodec

    return TextCodec(model_path)


@pytest.fixture(scope="session")
def reference(model_path) -> dict:
    """transformers fp32 greedy tokens and prefill logits per prompt (cached on disk between runs)."""
    return load_reference(model_path)


@pytest.fixture(scope="session")
def prompts_ids(reference) -> dict[str, list[int]]:
    """Each test prompt's token ids as transformers tokenizes (and chat-templates) it."""
    return {p.name: reference[p.name]["input_ids"] for p in PROMPTS}


@pytest.fixture(scope="session")
def loom_prompt_ids(text_codec) -> dict[str, list[int]]:
    """Each test prompt's token ids as Loom's own TextCodec tokenizes it."""
    return {p.name: prompt_ids(text_codec, p) for p in PROMPTS}


def pytest_configure(config):
    import torch

    try:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    except ValueError:
        pass


@pytest.fixture(autouse=True)
def _start_up_timings_count_as_alone(monkeypatch):
    """A test that reads a start-up choice back expects it kept, even one timed while this busy test machine had
    no core to spare (contended timings are tested in tests/test_timing.py, which sets the limit back)."""
    from gpu_worker import timing

    monkeypatch.setattr(timing, "WAIT_SHARE", float("inf"))


@pytest.fixture(scope="session", autouse=True)
def _no_stray_socket_dirs():
    """In-process tests build ServerArgs with ipc.config.make_endpoints(), which makes an (empty) socket folder
    under the temp dir; remove the empty ones this session created so the suite leaves nothing behind."""
    import tempfile
    import time

    start = time.time()
    yield
    # only this process's folders (make_endpoints names them loom-PID-...): other sessions may be running
    for d in Path(tempfile.gettempdir()).glob(f"loom-{os.getpid()}-*"):
        try:
            if d.is_dir() and d.stat().st_mtime >= start - 1 and not any(d.iterdir()):
                d.rmdir()
        except OSError:
            pass
