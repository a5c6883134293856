"""Loom on a CUDA device, against transformers + peft on the CPU (fp32): the same oracles as the CPU suite.

Skipped where PyTorch sees no CUDA device (CI has none); on a GPU machine run ``pytest tests/test_cuda.py``.

- in-process prefill logits of one batch mixing base rows and six adapters (ranks 8-64): fp32 within 1e-3 of
  peft; bf16 as close to fp32 peft on average as transformers + peft in bf16 on the same GPU;
- clusters (``--device cuda``): greedy tokens identical to peft for every adapter and base in one batch, with
  slot churn (two slots for six adapters), and through a ``kill -9`` of the worker mid-decode (adapters restored
  under the same uids, every request finishing with the fault-free tokens);
- the quickstart's defaults serve bf16 weights on the GPU (``--quantization auto`` resolves to ``none``);
- more TP ranks than CUDA devices is refused at start-up with a message naming both counts.
"""

from __future__ import annotations

import pytest
import torch
from loom_helpers import launch_cluster as launch_handle
from lora_helpers import (
    ADAPTER_NAMES,
    generate_many,
    greedy,
    launch_cluster,
    peft_reference,
    real_adapters,
    real_model_path,
    six_adapter_worker,
)
from test_failover_worker import adapter_uids, assert_streams_consistent, kill, mixed_requests, run_round
from test_lora_correctness import _check

from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TAGS = ["base", *ADAPTER_NAMES]


@pytest.fixture(scope="module")
def ref() -> dict:
    return peft_reference()


def _mixed_prefill(worker, ref: dict) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    """Every prompt x (base + six adapters) in one ForwardBatch, rows interleaved; returns (logits [R, V] fp32 on
    the CPU, (tag, prompt) per row)."""
    rows, plan, next_slot = [], [], 0
    sp = WorkerSampling(0.0, 1.0, -1, None)
    for i, (p, ids) in enumerate(ref["input_ids"].items()):
        for j in range(len(TAGS)):
            t = TAGS[(j * 3 + i) % len(TAGS)]
            slots = list(range(next_slot, next_slot + len(ids)))
            next_slot += len(ids)
            plan.append(BatchReq(f"{t}-{p}", len(plan), ids, 0, slots, None if t == "base" else f"uid-{t}", sp))
            rows.append((t, p))
    return worker.forward_logits(ForwardBatch(1, plan)).float().cpu(), rows


def _errors(logits: torch.Tensor, rows, ref: dict) -> tuple[float, float]:
    """(mean over rows of the mean |logit diff|, largest |logit diff|) against the fp32 peft reference."""
    diffs = [(logits[k] - ref["logits"][f"{t}|{p}"]).abs() for k, (t, p) in enumerate(rows)]
    return sum(float(d.mean()) for d in diffs) / len(diffs), max(float(d.max()) for d in diffs)


def test_fp32_mixed_prefill_logits_match_peft(ref):
    w = six_adapter_worker(device="cuda", dtype="float32", max_total_tokens=1024, max_running_requests=32)
    assert w.device.type == "cuda" and w.lora is not None
    logits, rows = _mixed_prefill(w, ref)
    for k, (t, p) in enumerate(rows):
        want = ref["logits"][f"{t}|{p}"]
        err = float((logits[k] - want).abs().max())
        assert err < 1e-3, f"{t} on {p}: max |logit diff| {err:.2e}"
        assert int(logits[k].argmax()) == int(want.argmax()), f"{t} on {p}"
    del w


def peft_logits(device: str, dtype: torch.dtype, ref: dict) -> dict[str, torch.Tensor]:
    """transformers + peft last-token prefill logits (fp32, on the CPU) per ``"tag|prompt"``, in ``dtype`` on
    ``device``: the yardstick for how far a bf16 forward may stray from the fp32 reference."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(real_model_path()), dtype=dtype).to(device).eval()
    out: dict[str, torch.Tensor] = {}
    for tag in TAGS:
        model = base if tag == "base" else PeftModel.from_pretrained(base, str(real_adapters()[tag])).eval()
        for p, ids in ref["input_ids"].items():
            with torch.no_grad():
                out[f"{tag}|{p}"] = model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
        if tag != "base":
            base = model.unload()
    return out


def test_bf16_mixed_prefill_logits_as_close_to_fp32_as_peft_in_bf16_on_the_gpu(ref):
    """bf16 strays from fp32 by rounding alone: Loom's mixed batch on average no further than transformers + peft
    in bf16 on the same GPU (one adapter at a time), and its largest difference within twice peft's."""
    w = six_adapter_worker(device="cuda", dtype="bfloat16", max_total_tokens=1024, max_running_requests=32)
    assert w.device.type == "cuda" and w.dtype == torch.bfloat16
    logits, rows = _mixed_prefill(w, ref)
    del w
    loom = _errors(logits, rows, ref)
    peft_bf16 = peft_logits("cuda", torch.bfloat16, ref)
    peft = _errors(torch.stack([peft_bf16[f"{t}|{p}"] for t, p in rows]), rows, ref)
    assert loom[0] <= 1.25 * peft[0] + 0.01, {"loom": loom, "peft bf16": peft}
    assert loom[1] <= 2 * peft[1] + 0.5, {"loom": loom, "peft bf16": peft}


def _lora_flags(slots: int) -> list[str]:
    out = ["--device", "cuda", "--dtype", "float32", "--enable-lora", "--max-loras-per-batch", str(slots)]
    return [*out, "--lora-paths", *(f"{n}={p}" for n, p in sorted(real_adapters().items()))]


@pytest.mark.parametrize("slots", [6, 2])
def test_cluster_greedy_tokens_match_peft_with_every_adapter_in_one_batch(ref, slots):
    """Six slots hold every adapter; two slots (LRU) make the adapters replace each other mid-run."""
    with launch_cluster(_lora_flags(slots)) as c:
        _check(c, ref, TAGS, 16)
        with c.client() as cl:
            held = [a["name"] for a in cl.list_loras() if a["slots"]]
        assert len(held) == 6 if slots == 6 else 2 <= len(held) < 6, held  # slots hold rank rows, not adapters


def test_worker_kill_mid_decode_restores_adapters_and_resumes_exactly(tmp_path):
    ad = real_adapters()
    flags = ["--device", "cuda", "--dtype", "float32", "--max-total-tokens", "2048", "--enable-lora"]
    flags += ["--max-loras-per-batch", "4", "--lora-paths", f"a={ad['r8-all']}", f"b={ad['r32-qv']}"]
    reqs = mixed_requests([None, "a", "b", "a"])
    with launch_handle(tmp_path / "cluster", *flags) as h:
        uids = adapter_uids(h.endpoint)
        fault_free, _ = run_round(h.endpoint, reqs)
        assert all(isinstance(t, str) and t for t in fault_free), fault_free
        outs, chunks = run_round(h.endpoint, reqs, kill(h, "gpu_worker[0]"))
        assert outs == fault_free, h.log()[-3000:]
        assert_streams_consistent(chunks)
        assert adapter_uids(h.endpoint) == uids
        assert "gpu_worker[0] exited with code -9 (SIGKILL); restarting the TP group as epoch 2" in h.log()


def test_quickstart_defaults_serve_bf16_on_the_gpu(tmp_path, ref):
    """No --device/--dtype/--quantization (as the quickstart): bf16 weights on cuda:0, and the base model's greedy
    tokens agree with fp32 peft's on their first tokens (bf16 may part from fp32 later, at a near-tie)."""
    with launch_handle(tmp_path / "cluster", "--quantization", "auto") as h:
        log = h.log()
        for fact in ("'device': 'cuda:0'", "'dtype': 'torch.bfloat16'", "'quantization': 'none'"):
            assert fact in log, (fact, log[-2000:])
        reqs = [{"input_ids": ids, "sampling_params": greedy(4)} for ids in ref["input_ids"].values()]
        results = generate_many(h.endpoint, reqs)
        for r, p in zip(results, ref["input_ids"], strict=True):
            assert r["output_ids"][:2] == ref["greedy"][f"base|{p}"][:2], (p, r["output_ids"])


def test_more_tp_ranks_than_cuda_devices_is_refused(tmp_path):
    n = torch.cuda.device_count()
    with pytest.raises(RuntimeError) as e, launch_handle(tmp_path / "cluster", "--tp-size", str(n + 1)):
        pass
    assert f"TP rank {n} needs its own CUDA device" in str(e.value), str(e.value)[-2000:]
