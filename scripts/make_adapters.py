#!/usr/bin/env python
"""Make PEFT LoRA adapters for a base checkpoint (random, visibly changing greedy text) for tests and demos.

    python scripts/make_adapters.py --out /tmp/loom-adapters            # for the embedded default model

    python scripts/make_adapters.py --out /tmp/many --random 1000 --ranks 8,12,16 --targets q_proj,v_proj

Each adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``). The test and ``--bench``
sets are written by ``peft`` itself with ``init_lora_weights=False`` so both A and B are random. ``--random N``
writes N adapters directly (random bf16 tensors under PEFT's names, no ``peft``/``transformers`` needed), about
a second per hundred adapters plus the disk writes. Folders that already exist are reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def random_adapter_bytes(model_path: str | Path, ranks: list[int], targets: list[str], dtype: str = "bfloat16") -> int:
    """Bytes of tensor data :func:`make_random_adapters` writes for adapters of ``ranks`` (one each)."""
    from gpu_worker.lora_weights import module_dims
    from ipc.model_config import load_model_config

    cfg = load_model_config(model_path)
    per_rank = cfg.num_layers * sum(sum(module_dims(cfg, m)) for m in targets)
    item = 4 if dtype == "float32" else 2
    return sum(per_rank * r * item for r in ranks)


def make_random_adapters(
    model_path: str | Path,
    out_dir: str | Path,
    n: int,
    ranks: tuple[int, ...] = (8, 12, 16),
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    dtype: str = "bfloat16",
    seed: int = 0,
    prefix: str = "a",
) -> dict[str, Path]:
    """Write (or reuse) ``n`` random PEFT adapters ``{prefix}0000 ..`` under ``out_dir``; returns name -> folder.

    Adapter ``i`` has rank ``ranks[i % len(ranks)]`` (``lora_alpha`` = 2 x rank) on ``targets`` in every layer.
    Tensors are drawn straight into ``dtype`` (A ~ N(0, 1/in), B ~ N(0, 0.02^2), seeded per adapter) and saved
    with safetensors under PEFT's key names, so ``peft`` and Loom both load them. Each folder is written under
    a temporary name and renamed, so an interrupted run never leaves a half-written adapter.
    """
    import torch
    from safetensors.torch import save_file

    from gpu_worker.lora_weights import module_dims, module_path
    from ipc.lora_config import CONFIG_FILE, LLAMA_LORA_MODULES, WEIGHTS_FILE
    from ipc.model_config import load_model_config

    bad = sorted(set(targets) - set(LLAMA_LORA_MODULES))
    if bad:
        raise ValueError(f"unknown target modules {bad}; choose from {list(LLAMA_LORA_MODULES)}")
    cfg = load_model_config(model_path)
    tdtype = getattr(torch, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    width = max(4, len(str(n - 1)))
    paths = {f"{prefix}{i:0{width}d}": out / f"{prefix}{i:0{width}d}" for i in range(n)}
    gen = torch.Generator()
    for i, (name, folder) in enumerate(paths.items()):
        if (folder / WEIGHTS_FILE).is_file():
            continue
        r = ranks[i % len(ranks)]
        gen.manual_seed(seed * 1_000_003 + i)
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(cfg.num_layers):
            for m in targets:
                fin, fout = module_dims(cfg, m)
                key = f"base_model.model.{module_path(layer, m)}"
                a = torch.randn(r, fin, generator=gen, dtype=tdtype).mul_(fin**-0.5)
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = torch.randn(fout, r, generator=gen, dtype=tdtype).mul_(0.02)
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model_path),
            "r": r,
            "lora_alpha": 2 * r,
            "target_modules": list(targets),
            "lora_dropout": 0.0,
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "init_lora_weights": False,
            "inference_mode": True,
            "rank_pattern": {},
            "alpha_pattern": {},
        }
        tmp = out / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        tmp.rename(folder)
    return paths


def main() -> int:
    """CLI: write the test adapters (or ``--bench N`` benchmark adapters) for ``--model-path``."""
    from ipc.model_source import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True)
    p.add_argument("--bench", type=int, default=0, help="make N benchmark adapters instead of the test set")
    p.add_argument("--random", type=int, default=0, help="make N random adapters directly (fast; no peft)")
    p.add_argument("--ranks", default="8,12,16", help="--random: ranks, cycled over the adapters")
    p.add_argument("--targets", default="q_proj,v_proj", help="--random: target modules (comma-separated)")
    p.add_argument("--seed", type=int, default=0, help="--random: seed")
    a = p.parse_args()
    if a.random:
        ranks = tuple(int(x) for x in a.ranks.split(","))
        targets = tuple(a.targets.split(","))
        paths = make_random_adapters(resolve_model_path(a.model_path), a.out, a.random, ranks, targets, seed=a.seed)
        print(f"{len(paths)} adapters in {a.out}")
        return 0
    specs = bench_adapters(a.bench) if a.bench else TEST_ADAPTERS
    for name, path in make_adapters(resolve_model_path(a.model_path), a.out, specs).items():
        print(f"{name}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
