#!/usr/bin/env python
"""Make PEFT LoRA adapters for a base checkpoint (random, visibly changing greedy text) for tests and demos.

    python scripts/make_adapters.py --out /tmp/loom-adapters            # for the embedded default model

Each adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) written by ``peft``
itself with ``init_lora_weights=False`` so both A and B are random. Folders that already exist are reused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig kwargs; covers ranks 8-64, all/attention-only/q,v-only targets, rsLoRA and rank_pattern
TEST_ADAPTERS: dict[str, dict[str, Any]] = {
    "r8-all": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "r16-attn": {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "r32-qv": {"r": 32, "lora_alpha": 64, "target_modules": ["q_proj", "v_proj"]},
    "r64-all": {"r": 64, "lora_alpha": 32, "target_modules": ALL},
    "r16-rslora": {"r": 16, "lora_alpha": 8, "target_modules": ALL, "use_rslora": True},
    "r8-pattern": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ALL,
        "rank_pattern": {"q_proj": 16, "down_proj": 4},
        "alpha_pattern": {"v_proj": 32},
    },
}


def bench_adapters(n: int = 8) -> dict[str, dict[str, Any]]:
    """``n`` adapters with ranks spread over 8-64 for the multi-LoRA benchmark."""
    ranks = [8, 16, 32, 64]
    return {
        f"bench-{i}-r{ranks[i % 4]}": {"r": ranks[i % 4], "lora_alpha": ranks[i % 4], "target_modules": ALL}
        for i in range(n)
    }


def make_adapters(
    model_path: str | Path, out_dir: str | Path, specs: dict[str, dict[str, Any]] | None = None, scale: float = 1.0
) -> dict[str, Path]:
    """Write (or reuse) one PEFT adapter per spec under ``out_dir``; returns name -> folder.

    ``scale`` multiplies the random A/B init so the adapters change text clearly without wrecking it.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    specs = TEST_ADAPTERS if specs is None else specs
    out = Path(out_dir)
    paths = {name: out / name for name in specs}
    todo = [n for n, p in paths.items() if not (p / "adapter_model.safetensors").is_file()]
    if not todo:
        return paths
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    for i, name in enumerate(sorted(specs)):
        if name not in todo:
            continue
        torch.manual_seed(1234 + i)
        cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM", **specs[name])
        model = get_peft_model(base, cfg)
        with torch.no_grad():
            for n_, p in model.named_parameters():
                if "lora_" in n_:
                    p.mul_(scale)
        tmp = out / f".{name}.tmp"
        model.save_pretrained(str(tmp))
        tmp.rename(paths[name])
        base = model.unload()  # take the LoRA layers out again before the next adapter
    return paths


def main() -> int:
    """CLI: write the test adapters (or ``--bench N`` benchmark adapters) for ``--model-path``."""
    from ipc.model_source import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True)
    p.add_argument("--bench", type=int, default=0, help="make N benchmark adapters instead of the test set")
    a = p.parse_args()
    specs = bench_adapters(a.bench) if a.bench else TEST_ADAPTERS
    for name, path in make_adapters(resolve_model_path(a.model_path), a.out, specs).items():
        print(f"{name}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
