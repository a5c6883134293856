"""Quantised weights on the real SmolLM2 against references nobody here wrote.

The references are transformers (fp32) and transformers + peft (fp32) on the *dequantised* checkpoint, i.e. the
very weights the GGUF's blocks encode. The 4-bit kernel takes bf16 activations, so ``--quantization gguf`` can be
held to the standard of Loom's own bf16 path on those weights (which is itself not bit-equal to fp32):

- logits (prefill and teacher-forced decode steps) no further from fp32 than the bf16 path's are: the mean
  |Δlogit| within 1.25x the bf16 path's, and the largest within 1.6x (one step's largest swings with which kernel
  the start-up measurement gave each batch size: 0.91 against bf16's 0.78 on a Zen 4, 1.13 against 0.78 on a
  Zen 5, whose mean |Δlogit| was 1.09x bf16's);
- greedy tokens identical to the fp32 reference until a step where the reference's top-2 logit margin is below
  ``TIE`` (a near-tie that bf16 rounding may flip; measured: every divergence seen had a margin under 0.1);
- with LoRA adapters over the quantised base, in one mixed batch: the same two rules against peft, and each
  row closer to its own adapter's reference than to the base model's (so a wrong adapter cannot pass);
- TP=2 over quantised weights (whole blocks per rank) within the same bounds;
- the weights' resident memory under half of the bf16 checkpoint's.

``--quantization int8`` (per-row int8 made at load, not exact by construction) is reported and held to looser
bounds; its figures print with ``-s``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from loom_helpers import (
    PROMPTS,
    load_reference,
    make_args,
    output_ids,
    run_engine,
    teacher_forced_logits,
    tp_logits,
    until_eos,
)
from lora_helpers import ADAPTER_NAMES, peft_reference, six_adapter_worker

from ipc.messages import BatchReq, ForwardBatch, SamplingParams, TokenizedReq, WorkerSampling

pytestmark = pytest.mark.slow

NAMES = [p.name for p in PROMPTS]
STEPS = tuple(range(24))
TIE = {"gguf": 0.25, "int8": 0.5}  # reference top-2 margins below which a flipped greedy token is a near-tie
# With adapters the bf16 path itself strays further from peft (up to 1.7 on these adapters' logits, which reach
# ~30 where bf16 values lie 0.125 apart), so a flip counts as a near-tie below this margin
TIE_LORA = 0.75
GREEDY = WorkerSampling(0.0, 1.0, -1, None)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k][i] - b[k][i]).abs().max()) for k in a for i in a[k])


def _mean_diff(a: dict, b: dict) -> float:
    """Mean |Δlogit| over every step, prompt and vocabulary entry."""
    d = [float((a[k][i] - b[k][i]).abs().mean()) for k in a for i in a[k]]
    return sum(d) / len(d)


def _first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), None)


def _margin(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.fixture(scope="module")
def ref(model_path):
    return load_reference(model_path)


@pytest.fixture(scope="module")
def forced(ref):
    ids = [ref[n]["input_ids"] for n in NAMES]
    return ids, [ref[n]["greedy"] for n in NAMES]


@pytest.fixture(scope="module")
def fp32_steps(model_path, forced):
    """Loom fp32 logits along transformers' greedy path at every step (Loom fp32 == transformers within 1e-3)."""
    from gpu_worker.worker import Worker

    return teacher_forced_logits(Worker(make_args(model_path)), *forced, STEPS)


@pytest.fixture(scope="module")
def bf16_steps(model_path, forced) -> dict:
    from gpu_worker.worker import Worker

    return teacher_forced_logits(Worker(make_args(model_path, dtype="bfloat16")), *forced, STEPS)


@pytest.fixture(scope="module")
def bf16_error(bf16_steps, fp32_steps) -> float:
    return _max_diff(bf16_steps, fp32_steps)


@pytest.mark.parametrize("mode", ["gguf", "int8"])
def test_quantized_logits_and_greedy_tokens(model_path, ref, forced, fp32_steps, bf16_steps, bf16_error, mode):
    from gpu_worker.worker import Worker
    from scheduler_proc.scheduler import Scheduler

    w = Worker(make_args(model_path, quantization=mode, dtype="auto"))
    assert w.dtype == torch.bfloat16
    got = teacher_forced_logits(w, *forced, STEPS)
    err, mean_err = _max_diff(got, fp32_steps), _mean_diff(got, fp32_steps)
    bf16_mean = _mean_diff(bf16_steps, fp32_steps)
    if mode == "gguf":  # the 8-bit head hands over its fp32 sums: logits are not on bf16's grid (steps of 0.125)
        row = got[1][0]
        assert float((row != row.bfloat16().float()).float().mean()) > 0.9
    reqs = [TokenizedReq(n, ref[n]["input_ids"], SamplingParams(max_new_tokens=24, temperature=0.0)) for n in NAMES]
    outs = run_engine(w, Scheduler(max_running=16, kv_capacity=2048, context_len=2048, eos_ids=[2]), {0: reqs})
    matched, total, report = 0, 0, []
    for i, n in enumerate(NAMES):
        got, want = until_eos(output_ids(outs[n])), until_eos(ref[n]["greedy"], 24)
        j = _first_divergence(got, want)
        total += len(want)
        matched += len(want) if j is None else j
        if j is not None:
            m = _margin(fp32_steps[j][i])
            report.append(f"{n} diverges at token {j} (reference margin {m:.3f})")
            assert m < TIE[mode], f"{mode}: {n} differs at token {j} where the reference is decisive (margin {m:.3f})"
    print(
        f"\n{mode}: max logit diff vs fp32 {err:.3f} (bf16 path {bf16_error:.3f}), mean {mean_err:.4f} (bf16 path "
        f"{bf16_mean:.4f}); greedy tokens matching "
        f"transformers before any divergence {matched}/{total}; {'; '.join(report) or 'no divergence'}"
    )
    if mode == "gguf":
        assert mean_err <= 1.25 * bf16_mean, (mean_err, bf16_mean)
        assert err <= 1.6 * bf16_error + 0.05, (err, bf16_error)
    else:
        assert err <= 2.5, err
        assert matched >= 0.6 * total


def _lora_rows(ref: dict) -> list[tuple[str, str]]:
    """(tag, prompt) for every prompt x (base + each adapter), interleaved so no adapter's rows are adjacent."""
    tags = ["base", *ADAPTER_NAMES]
    return [(tags[(j * 3 + i) % len(tags)], p) for i, p in enumerate(ref["input_ids"]) for j in range(len(tags))]


_LORA_POOL = {"max_total_tokens": 4096, "max_running_requests": 64}


def _mixed_decode(w, ref: dict, rows: list, steps: int, forced: dict | None) -> tuple[list[list[int]], list[list]]:
    """Prefill every row in one mixed batch, then decode ``steps`` tokens together (greedy, or fed ``forced``).

    Returns each row's tokens and its logits at every step (step 0 = prefill).
    """
    plan, bases, base = [], [], 0
    for k, (t, p) in enumerate(rows):
        ids = ref["input_ids"][p]
        bases.append(base)
        plan.append(
            BatchReq(
                f"r{k}", k, ids, 0, list(range(base, base + len(ids))), None if t == "base" else f"uid-{t}", GREEDY
            )
        )
        base += len(ids) + steps + 1
    logits = w.forward_logits(ForwardBatch(1, plan))
    toks = [[int(logits[k].argmax())] for k in range(len(rows))]
    seen = [[logits[k]] for k in range(len(rows))]
    for s in range(1, steps):
        reqs = []
        for k, (_t, p) in enumerate(rows):
            n = len(ref["input_ids"][p])
            feed = forced[k][s - 1] if forced is not None else toks[k][s - 1]
            pos = n + s - 1
            reqs.append(BatchReq(f"r{k}", k, [feed], pos, [bases[k] + pos], plan[k].lora_uid, GREEDY, s))
        logits = w.forward_logits(ForwardBatch(s + 1, reqs))
        for k in range(len(rows)):
            toks[k].append(int(logits[k].argmax()))
            seen[k].append(logits[k])
    return toks, seen


def test_lora_on_gguf_base_matches_peft_in_a_mixed_batch(model_path):
    ref = peft_reference()
    rows = _lora_rows(ref)
    n = 16
    want = [ref["greedy"][f"{t}|{p}"][:n] for t, p in rows]
    forced = [w + [2] * (n - len(w)) for w in want]  # rows that stop early are padded with EOS (not compared)
    _, exact = _mixed_decode(six_adapter_worker(**_LORA_POOL, dtype="float32"), ref, rows, n, forced)
    _, dense_bf16 = _mixed_decode(six_adapter_worker(**_LORA_POOL, dtype="bfloat16"), ref, rows, n, forced)
    quant = six_adapter_worker(**_LORA_POOL, quantization="gguf", dtype="auto")
    _, q_forced = _mixed_decode(quant, ref, rows, n, forced)
    got, _ = _mixed_decode(quant, ref, rows, n, None)
    worst, worst_bf16, report = 0.0, 0.0, []
    mean, mean_bf16 = [], []  # each row's mean |logit diff| over its live steps
    for k, (t, p) in enumerate(rows):
        prefill = q_forced[k][0]
        live = range(len(until_eos(want[k])))
        worst = max(worst, max(float((q_forced[k][s] - exact[k][s]).abs().max()) for s in live))
        worst_bf16 = max(worst_bf16, max(float((dense_bf16[k][s] - exact[k][s]).abs().max()) for s in live))
        mean.append(sum(float((q_forced[k][s] - exact[k][s]).abs().mean()) for s in live) / len(live))
        mean_bf16.append(sum(float((dense_bf16[k][s] - exact[k][s]).abs().mean()) for s in live) / len(live))
        # fp32 Loom + LoRA is peft within 1e-3 (test_lora_correctness); check it here too, so the margins are peft's
        assert float((exact[k][0] - ref["logits"][f"{t}|{p}"]).abs().max()) < 1e-3, (t, p)
        if t != "base":
            own = float((prefill - ref["logits"][f"{t}|{p}"]).abs().max())
            base = float((prefill - ref["logits"][f"base|{p}"]).abs().max())
            assert own < base, f"{t} on {p}: closer to the base model ({base:.3f}) than to its adapter ({own:.3f})"
        w = until_eos(want[k])
        j = _first_divergence(until_eos(got[k])[: len(w)], w)
        if j is not None:
            m = _margin(exact[k][j])
            report.append(f"{t}/{p}@{j} margin {m:.3f}")
            assert m < TIE_LORA, f"{t} on {p}: token {j} differs from peft where peft is decisive ({m:.3f})"
    mean_q, mean_b = sum(mean) / len(mean), sum(mean_bf16) / len(mean_bf16)
    print(
        f"\nLoRA over gguf: {len(rows)} rows, logit diff vs peft fp32: mean {mean_q:.3f}, max {worst:.3f} "
        f"(bf16 path: mean {mean_b:.3f}, max {worst_bf16:.3f}); near-tie flips: {report}"
    )
    # the 4-bit base adds little to bf16's own error: judged on the mean, since the maximum over ~1,000 logit rows
    # of 16 forced steps swings by +-40% between equally accurate paths (measured: kernel vs torch LoRA path)
    assert mean_q <= 1.25 * mean_b + 0.02
    assert worst <= 2 * worst_bf16 + 0.1


def test_tp2_over_gguf_blocks(model_path, forced, fp32_steps, bf16_error, tmp_path):
    ids, greedy = forced
    steps = (0, 1, 7, 15, 23)
    got = tp_logits(model_path, ids, greedy, steps, 2, tmp_path, quantization="gguf", dtype="auto")
    fp32 = {k: fp32_steps[k] for k in steps}
    err = _max_diff(got["steps"], fp32)
    for k in steps:
        for i, logits in got["steps"][k].items():
            if _margin(fp32_steps[k][i]) >= TIE["gguf"]:
                assert int(logits.argmax()) == int(fp32_steps[k][i].argmax()), (NAMES[i], k)
    # held to the bf16 path's standard at the same TP size: each rank's partial sums of the row-parallel layers are
    # rounded to bf16 before the all-reduce, which adds error at TP=2 to both (measured on an AVX2 Zen 3: gguf
    # 0.96 at TP=2 against bf16's 0.72 at TP=1, where bf16 batches run their GEMMs in fp32)
    (tmp_path / "bf16").mkdir()
    dense = tp_logits(model_path, ids, greedy, steps, 2, tmp_path / "bf16", quantization="none", dtype="bfloat16")
    bf16_tp2 = _max_diff(dense["steps"], fp32)
    print(f"\nTP=2 gguf: max logit diff vs fp32 {err:.3f} (bf16 path at TP=2 {bf16_tp2:.3f}, at TP=1 {bf16_error:.3f})")
    assert err <= 1.25 * max(bf16_tp2, bf16_error) + 0.05


_RSS_PROBE = textwrap.dedent(
    """
    import gc, json, sys, torch
    import gpu_worker.gguf_weights, gpu_worker.quant  # imports first: only the weights count
    from gpu_worker.tp_plan import plan_for_model
    from gpu_worker.weights import load_shard, release_freed_memory
    from ipc.model_config import load_model_config

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    cfg = load_model_config(sys.argv[1])
    plan = plan_for_model(cfg, 1, 0)
    gc.collect(); release_freed_memory(); before = rss_mb()
    w = load_shard(sys.argv[1], cfg, plan, torch.bfloat16, torch.device("cpu"), sys.argv[2])
    gc.collect(); release_freed_memory()
    print(json.dumps(rss_mb() - before))
    """
)


def test_quantized_weights_take_under_half_the_memory_of_bf16(model_path):
    """Resident memory a worker gains by loading its weights (each mode in a fresh process)."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)

    # the three probes run at once: each measures only its own process's resident memory
    probes = [
        subprocess.Popen(
            [sys.executable, "-c", _RSS_PROBE, str(model_path), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=root,
        )
        for mode in ("none", "gguf", "int8")
    ]
    try:
        outs = [p.communicate(timeout=300) for p in probes]
    finally:
        for p in probes:
            p.kill()
            p.wait()
    for p, (_, err) in zip(probes, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    bf16, gguf, int8 = (float(json.loads(out.strip().splitlines()[-1])) for out, _ in outs)
    print(
        f"\nweights' RSS: bf16 {bf16:.0f} MB, gguf {gguf:.0f} MB ({gguf / bf16:.2f}), int8 {int8:.0f} MB "
        f"({int8 / bf16:.2f})"
    )
    assert bf16 > 200  # the bf16 weights really were loaded (SmolLM2-135M: 256 MB)
    assert gguf < 0.5 * bf16
