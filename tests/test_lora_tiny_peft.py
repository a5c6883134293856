"""PEFT features on a tiny random Llama, one in-process Worker batch mixing base and every adapter, against
transformers + peft fp32: regex ``target_modules``, layer-specific ``rank_pattern``/``alpha_pattern`` (first
matching key wins), rsLoRA with patterns, ``layers_to_transform``."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import TINY_PEFT_SPECS, make_tiny_checkpoint, make_tiny_peft_adapters, server_args

from ipc.messages import BatchReq, ForwardBatch, WorkerSampling


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-llama")
    model_dir = make_tiny_checkpoint(root / "model")
    return model_dir, make_tiny_peft_adapters(model_dir, root / "adapters")


def test_tiny_mixed_batch_matches_peft(tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gpu_worker.worker import Worker

    model_dir, adapters = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 3)]
    tags = [None, *TINY_PEFT_SPECS]
    # reference: last-token logits per (tag, prompt), one adapter at a time
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    want = {}
    for t in tags:
        model = base if t is None else PeftModel.from_pretrained(base, str(adapters[t])).eval()
        with torch.no_grad():
            for k, ids in enumerate(prompts):
                want[(t, k)] = model(torch.tensor([ids])).logits[0, -1].float()
        if t is not None:
            base = model.unload()
    for t in TINY_PEFT_SPECS:  # every adapter changes the output (the comparison has teeth)
        assert float((want[(t, 0)] - want[(None, 0)]).abs().max()) > 1e-3, t

    args = server_args(
        model_dir, dtype="float32", enable_lora=True, max_loras_per_batch=4, max_lora_rank=8, max_total_tokens=256
    )
    worker = Worker(args)
    for t, folder in adapters.items():
        worker.lora.load(f"uid-{t}", t, str(folder))
    plan, rows, nxt = [], [], 0
    sp = WorkerSampling(0.0, 1.0, -1, None)
    for k, ids in enumerate(prompts):
        for j in range(len(tags)):
            t = tags[(j + k) % len(tags)]
            plan.append(BatchReq(f"{t}-{k}", len(plan), ids, 0, list(range(nxt, nxt + len(ids))), t and f"uid-{t}", sp))
            nxt += len(ids)
            rows.append((t, k))
    got = worker.forward_logits(ForwardBatch(1, plan))
    for i, key in enumerate(rows):
        err = float((got[i] - want[key]).abs().max())
        assert err < 1e-4, f"{key}: max |logit diff| {err:.2e}"
