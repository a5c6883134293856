"""Read a PEFT adapter's safetensors, check every tensor against the base model, cut this rank's shard.

All validation happens here, at load time, never inside a forward step. Errors name the adapter and the
file, tensor or field that is wrong. ``.bin`` (pickle) files are never opened.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import NamedTuple

import safetensors.torch
import torch

from gpu_worker.tp_plan import ShardPlan
from ipc.lora_config import LLAMA_LORA_MODULES, WEIGHTS_FILE, LoraAdapterConfig, module_path, vocab_refusal
from ipc.model_config import ModelConfig

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# PEFT's tensors for an adapted (or fully saved) vocabulary layer: lm_head.lora_A.weight, lm_head.base_layer.weight,
# embed_tokens.lora_embedding_A, ...
_VOCAB_KEY = re.compile(r"(?:^|\.)(lm_head|embed_tokens)\.")


class LoraWeightsError(ValueError):
    """An adapter's weights file is missing, unreadable or disagrees with the base model."""


def module_dims(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of a base Llama linear."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        "q_proj": (h, cfg.num_heads * d),
        "k_proj": (h, cfg.num_kv_heads * d),
        "v_proj": (h, cfg.num_kv_heads * d),
        "o_proj": (cfg.num_heads * d, h),
        "gate_proj": (h, cfg.intermediate_size),
        "up_proj": (h, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, h),
    }[module]


def shard_range(cfg: ModelConfig, plan: ShardPlan, module: str) -> tuple[int, int]:
    """The slice of the module's sharded dimension this rank owns (output rows for column layers,
    input columns for row layers)."""
    d = cfg.head_dim
    if module == "q_proj" or module == "o_proj":
        return plan.q_heads[0] * d, plan.q_heads[1] * d
    if module in ("k_proj", "v_proj"):
        return plan.kv_heads[0] * d, plan.kv_heads[1] * d
    return plan.ffn


class ModuleRun(NamedTuple):
    """One module's weights over consecutive layers of equal rank, stacked on dim 0 (this rank's shard).

    ``a`` is ``[layers, r, in_local]`` and ``b`` ``[layers, out_local, r]`` (scaling folded in), both in the
    pool's dtype; ``first`` is the first layer."""

    module: str
    first: int
    r: int
    a: torch.Tensor
    b: torch.Tensor

    @property
    def layers(self) -> range:
        """The layers the run covers."""
        return range(self.first, self.first + self.a.shape[0])


def read_adapter(
    folder: str | Path,
    name: str,
    acfg: LoraAdapterConfig,
    cfg: ModelConfig,
    plan: ShardPlan,
    max_rank: int,
    dtype: torch.dtype,
    data: bytes | None = None,
) -> list[ModuleRun]:
    """Return this rank's shard of the adapter as :class:`ModuleRun` s (CPU tensors in ``dtype``), sorted by
    module and first layer: each run stacks one module's ``A`` ``[r, in_local]`` and ``B`` ``[out_local, r]``
    (the module's scaling folded into ``B``) over consecutive layers of the same rank, so a typical adapter is
    one run per target module and loading it takes a few tensor operations per module, not a few per layer.

    ``data`` is the weights file's content when the caller read it already (to hash the same bytes it loads);
    otherwise the file is read here. Tensors are deserialised from those bytes in one call (never mapped: a
    file rewritten while Loom serves cannot change or SIGBUS it).

    Column layers (q/k/v/gate/up) keep A whole and split B by output rows (q/k/v by the same KV-group split
    as the base weights); row layers (o/down) split A by input columns and keep B whole (S-LoRA §5).

    Raises:
        LoraWeightsError: zero-byte or truncated file, a tensor that is not a LoRA weight of a Llama
            linear (tensors of lm_head / embed_tokens are refused saying why), a layer/module the model lacks,
            an unpaired A/B, a non-float dtype (int8, bool, ...: named, never cast), a shape that does not match
            the base model or the config's rank, a rank above ``max_rank``, or non-finite values.
    """
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise LoraWeightsError(f"LoRA adapter {name}: {path} is missing")
    if path.stat().st_size == 0:
        raise LoraWeightsError(f"LoRA adapter {name}: {path} is empty (0 bytes)")
    try:
        tensors = safetensors.torch.load(path.read_bytes() if data is None else data)
        keys = sorted(tensors)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for corrupt files
        raise LoraWeightsError(f"LoRA adapter {name}: {path} is not a readable safetensors file: {e}") from None
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        m = _KEY.match(key)
        vocab = _VOCAB_KEY.search(key)
        if m is None and vocab is not None:
            raise LoraWeightsError(
                f"LoRA adapter {name}: tensor {key} in {path.name} adapts {vocab.group(1)}, which is not "
                f"supported: {vocab_refusal(cfg.tie_word_embeddings)}"
            )
        if m is None:
            raise LoraWeightsError(
                f"LoRA adapter {name}: tensor {key} in {path.name} is not a LoRA A/B weight of a Llama linear"
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in LLAMA_LORA_MODULES:
            raise LoraWeightsError(f"LoRA adapter {name}: tensor {key} targets module {module}, which the model lacks")
        if layer >= cfg.num_layers:
            raise LoraWeightsError(
                f"LoRA adapter {name}: tensor {key} targets layer {layer}; the model has {cfg.num_layers}"
            )
        found.setdefault((layer, module), {})[ab] = key
    if not found:
        raise LoraWeightsError(f"LoRA adapter {name}: {path.name} holds no LoRA weights")
    dims = {m: module_dims(cfg, m) for m in LLAMA_LORA_MODULES}
    per_module: dict[str, list[tuple[int, int, str, str, float]]] = {}  # (layer, r, A key, B key, scaling)
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise LoraWeightsError(f"LoRA adapter {name}: layer {layer} {module} has no lora_{missing} weight")
        a, b = tensors[ab["A"]], tensors[ab["B"]]
        for key, t in ((ab["A"], a), (ab["B"], b)):
            if not t.dtype.is_floating_point:
                raise LoraWeightsError(
                    f"LoRA adapter {name}: tensor {key} in {path.name} has dtype {str(t.dtype).removeprefix('torch.')}"
                    "; LoRA weights must be floating point (float32, bfloat16, float16, ...): integer, bool and "
                    "quantised adapter tensors are refused, never cast"
                )
        fin, fout = dims[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or a.shape[1] != fin:
            raise LoraWeightsError(
                f"LoRA adapter {name}: tensor {ab['A']} has shape {list(a.shape)}, expected [r, {fin}]"
            )
        mpath = module_path(layer, module)
        if not acfg.targets(mpath):
            raise LoraWeightsError(
                f"LoRA adapter {name}: tensor {ab['A']} is for {mpath}, which adapter_config.json does not target "
                "(target_modules / exclude_modules / layers_to_transform)"
            )
        want = acfg.rank_for(mpath)
        if r != want:
            raise LoraWeightsError(
                f"LoRA adapter {name}: tensor {ab['A']} has rank {r} but adapter_config.json "
                f"(r / rank_pattern) says {want}"
            )
        # B after A's rank: a B that agrees with the config next to a wrong A is A's error, not B's
        if b.dim() != 2 or tuple(b.shape) != (fout, r):
            raise LoraWeightsError(
                f"LoRA adapter {name}: tensor {ab['B']} has shape {list(b.shape)}, expected [{fout}, {r}]"
            )
        if r > max_rank:
            raise LoraWeightsError(f"LoRA adapter {name}: tensor {ab['A']} has rank {r} > --max-lora-rank {max_rank}")
        scale = acfg.scaling_for(mpath)
        if not math.isfinite(scale):
            raise LoraWeightsError(f"LoRA adapter {name}: scaling for {mpath} is not finite")
        per_module.setdefault(module, []).append((layer, r, ab["A"], ab["B"], scale))
    # (module, first layer, rank) -> [(layer, A key, B key, scaling)]: consecutive layers of one rank
    runs: dict[tuple[str, int, int], list[tuple[int, str, str, float]]] = {}
    for module, entries in sorted(per_module.items()):
        run: list | None = None
        for layer, r, ka, kb, scale in entries:
            if run is None or run[-1][0] != layer - 1 or tensors[run[-1][1]].shape[0] != r:
                run = runs[(module, layer, r)] = []
            run.append((layer, ka, kb, scale))
    out: list[ModuleRun] = []
    sums: list[torch.Tensor] = []
    overflow: str | None = None  # the first module whose scaled B leaves the dtype's range
    for (module, first, r), items in runs.items():
        # one dtype per stack (a file may mix them); a no-op for the usual single-dtype file
        common = functools.reduce(torch.promote_types, [tensors[k].dtype for _, ka, kb, _ in items for k in (ka, kb)])
        a = torch.stack([tensors[ka].to(common) for _, ka, _, _ in items])  # [layers, r, in]
        b = torch.stack([tensors[kb].to(common) for _, _, kb, _ in items])  # [layers, out, r]
        # one fp32 sum per layer's pair: a NaN/Inf anywhere (or an overflowing magnitude) makes it non-finite
        sums.append(a.sum(dim=(1, 2), dtype=torch.float32) + b.sum(dim=(1, 2), dtype=torch.float32))
        scales = [s for *_, s in items]
        scale: float | torch.Tensor = scales[0]
        if any(s != scales[0] for s in scales):  # alpha_pattern / rank_pattern per layer
            scale = torch.tensor(scales, dtype=torch.float32).view(-1, 1, 1)
        # the scaling is folded into B: a huge lora_alpha (or alpha_pattern) must not overflow the slots' dtype.
        # Checked on the whole B every rank reads, so all ranks agree (a NaN fails here too; the sums name it below)
        peak = b.float().abs().amax(dim=(1, 2)) * (scale.view(-1) if isinstance(scale, torch.Tensor) else scale)
        if overflow is None and not bool((peak <= torch.finfo(dtype).max).all()):
            overflow = f"{module} (layers from {first}, scaling up to {max(scales):.3g})"
        lo, hi = shard_range(cfg, plan, module)
        if module in COLUMN_MODULES:
            a_loc, b_loc = a, b[:, lo:hi]
        else:
            a_loc, b_loc = a[:, :, lo:hi], b
        out.append(ModuleRun(module, first, r, a_loc.to(dtype).contiguous(), (b_loc.float() * scale).to(dtype)))
    # checked once for all of them (one sync, not one per tensor); the error names the first bad pair
    finite = torch.cat(sums).isfinite()
    if not bool(finite.all()):
        pairs = [(ka, kb) for items in runs.values() for _, ka, kb, _ in items]
        bad = pairs[int((~finite).nonzero()[0])]
        raise LoraWeightsError(
            f"LoRA adapter {name}: {bad[0]} or {bad[1]} holds NaN or Inf, or values so large that their fp32 sum "
            "overflows"
        )
    if overflow is not None:
        raise LoraWeightsError(
            f"LoRA adapter {name}: lora_B of {overflow} times its scaling (lora_alpha / r, or alpha_pattern) exceeds "
            f"the largest {str(dtype).removeprefix('torch.')} value {torch.finfo(dtype).max:.3g}; lower lora_alpha"
        )
    return out
