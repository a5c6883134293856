"""bench/step_phases.py: its hook times a worker's decode steps by phase, base apart from mixed, and with
``skip_lora`` really skips the LoRA applies (the adapters' rows then decode the base model's tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from step_phases import burst_starts, phase_env, phase_table, read_phases  # noqa: E402

# A stand-in for gpu_worker/main.py (the hook patches only that program): one worker on the real model with the
# six test adapters, four rows prefilled, then decode steps all base and all under adapters; prints the tokens.
DRIVER = textwrap.dedent(
    """
    import json
    import sys

    sys.path[:0] = [sys.argv[1] + "/tests", sys.argv[1]]
    from lora_helpers import six_adapter_worker
    from loom_helpers import prefill_batch
    from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

    worker = six_adapter_worker()
    prompts = [[1, 504, 3458, 282], [1, 9690, 2114], [1, 2030, 5414, 314, 253], [1, 714, 1103]]
    greedy = WorkerSampling(0.0, 1.0, -1, None)
    out = {}
    for mode, uid in (("base", None), ("mixed", "uid-r8-all")):
        bases = [64 * i for i in range(len(prompts))]
        first = worker.step(prefill_batch(prompts, bases)).next_ids
        toks, seqs = list(first), [[t] for t in first]
        for k in range(3):
            reqs = [BatchReq(f"r{i}", i, [toks[i]], len(p) + k, [bases[i] + len(p) + k], uid, greedy, k + 1)
                    for i, p in enumerate(prompts)]
            toks = worker.step(ForwardBatch(step=k + 2, reqs=reqs)).next_ids
            for s, t in zip(seqs, toks):
                s.append(t)
        out[mode] = seqs
    print(json.dumps(out))
    """
)


def _drive(tmp_path: Path, skip_lora: bool) -> tuple[dict, dict]:
    folder = tmp_path / "phases"
    env = {**os.environ, **phase_env(folder, skip_lora=skip_lora, min_rows=4)}
    fake = tmp_path / "gpu_worker" / "main.py"
    fake.parent.mkdir()
    fake.write_text(DRIVER)
    p = subprocess.run([sys.executable, str(fake), str(ROOT)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    files = read_phases(folder)
    assert len(files) == 1, list(folder.iterdir())
    return json.loads(p.stdout.strip().splitlines()[-1]), files[0]


@pytest.mark.parametrize("skip_lora", [False, True], ids=["lora", "skip-lora"])
def test_decode_steps_are_timed_by_phase(tmp_path, skip_lora):
    tokens, phases = _drive(tmp_path, skip_lora)
    assert phases["steps"] == {"base": 3, "mixed": 3}  # the prefills are not decode steps
    base, mixed = phases["base"], phases["mixed"]
    for d in (base, mixed):
        assert d["step"] > 0 and d["mm_qkv"] > 0 and d["mm_down"] > 0 and d["logits"] > 0
        inner = sum(v for k, v in d.items() if k.startswith(("mm_", "lora_")) and k != "mm_other")
        assert inner < d["step"]  # phases are parts of the step (the head's GEMM is inside ``logits``)
    assert not any(k.startswith("lora_") and k != "lora_prepare" for k in base)
    assert {"lora_qkv", "lora_o", "lora_gate_up", "lora_down"} <= set(mixed)
    # r8-all changes these greedy tokens (prefill rows are base in both), so equal tokens mean skipped applies
    assert (tokens["mixed"] == tokens["base"]) == skip_lora, tokens
    table = phase_table(tmp_path / "phases")
    assert "3 base and 3 mixed decode steps" in table and "lora_qkv" in table and "the LoRA applies" in table
    # every step is traced, prefills too: [mode, rows, decode rows, input tokens, ms]
    (trace,) = (tmp_path / "phases").glob("trace-*.jsonl")
    steps = [json.loads(ln) for ln in trace.read_text().splitlines()]
    assert [s[:4] for s in steps[:4]] == [["base", 4, 0, 15], *[["base", 4, 4, 4]] * 3], steps
    assert [s[0] for s in steps] == ["base"] * 5 + ["mixed"] * 3 and all(s[4] > 0 for s in steps)  # base prefills


def test_burst_starts_tells_a_burst_that_started_at_once_from_one_that_trickled():
    warm = [["mixed", 1, 0, 30, 30.0], ["mixed", 1, 1, 1, 9.0]]
    at_once = [["mixed", 64, 1, 700, 600.0]] + [["mixed", 64, 64, 64, 60.0]] * 63
    trickled = [["mixed", 12, 0, 227, 200.0], ["mixed", 26, 12, 289, 250.0], ["mixed", 31, 26, 122, 100.0]]
    trickled += [["mixed", 64, 64, 64, 60.0]] * 60 + [["mixed", 9, 9, 9, 15.0]] * 3
    lines = burst_starts(warm + at_once + warm + trickled + warm)
    assert len(lines) == 2, lines
    assert "64 steps (1 with prefill), 4.38 s (prefill 0.60 s of 699 tokens, 63 full decode" in lines[0]
    assert "decode steps 3.78 s): 64/1 64/64" in lines[0]
    assert "66 steps (3 with prefill), 4.20 s (prefill 0.55 s of 600 tokens, 60 full decode" in lines[1]
    assert "decode steps 3.60 s): 12/0 26/12 31/26 64/64" in lines[1]


def test_a_folder_without_timings_says_so(tmp_path):
    assert "no decode steps were timed" in phase_table(tmp_path)
