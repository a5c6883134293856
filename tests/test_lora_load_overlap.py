"""A LoRA load whose file reads slowly does not stall the requests already running (gpu_worker.lora_reader)."""

from __future__ import annotations

import os
import shutil
import textwrap
import threading
import time

import pytest
from lora_helpers import greedy, launch_cluster, patch_on_import, real_adapters

# Test-only hook: adapter files under a folder named "slow-*" count as not cached and take SLOW_S to read.
SLOW_READS = patch_on_import(
    "gpu_worker.lora_reader",
    textwrap.dedent(
        """
    import time

    SLOW_S = 3.0


    def _patch(mod):
        cached, read = mod.in_page_cache, mod.read_weights_file

        def in_page_cache(path):
            return False if "/slow-" in str(path) else cached(path)

        def read_weights_file(folder, root=None):
            if "/slow-" in str(folder):
                time.sleep(SLOW_S)
            return read(folder, root)

        mod.in_page_cache, mod.read_weights_file = in_page_cache, read_weights_file
    """
    ),
)
SLOW_S = 3.0


@pytest.mark.slow
def test_running_requests_keep_decoding_while_an_adapter_file_reads(tmp_path):
    src = real_adapters()["r8-all"]
    slow = tmp_path / "slow-a"
    shutil.copytree(src, slow)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_READS)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH", "")]))}
    args = ["--enable-lora", "--max-loras-per-batch", "2", "--lora-paths", f"a={src}"]
    with launch_cluster(args, env_extra=env) as cluster, cluster.client(timeout_s=120) as c:
        load: dict[str, float] = {}

        def slow_load() -> None:
            with cluster.client(timeout_s=120) as c2:
                load["start"] = time.monotonic()
                c2.load_lora_adapter("slow-a", str(slow))
                load["end"] = time.monotonic()

        loader = threading.Thread(target=slow_load)
        stamps: list[float] = []
        params = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        for _ in c.generate("Tell me a long story.", sampling_params=params, stream=True):
            stamps.append(time.monotonic())
            if len(stamps) == 3:
                loader.start()
            if "end" in load and stamps[-1] > load["end"] + 0.5:
                break  # the stream outlasted the load: leaving aborts the rest of its 400 tokens
        loader.join(timeout=60)
        assert "end" in load, "the slow load did not finish"
        assert load["end"] - load["start"] >= SLOW_S  # the hook's read really was slow
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > load["start"]]
        # decoding went on while the file read: before, the worker's loop read it in line and every running
        # request stopped for the whole read
        assert max(gaps) < SLOW_S / 2, f"a {max(gaps):.2f} s pause in the stream while the adapter file read"
        assert stamps[-1] > load["end"], "the stream must outlast the load for this test to mean much"
        assert len([t for t in stamps if load["start"] + 0.3 < t < load["end"]]) >= 10
        # the adapter read off the loop is the same adapter: same greedy tokens as the copy loaded at start-up
        prompt = "Name three colours."
        got = c.generate(prompt, sampling_params=greedy(12), lora_path="slow-a")["output_ids"]
        want = c.generate(prompt, sampling_params=greedy(12), lora_path="a")["output_ids"]
        assert got == want
