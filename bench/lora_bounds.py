"""What a mixed-adapter decode step can cost at best: the bounds that bench/multi_lora.py and decode_step.py print.

A decode step with LoRA rows multiplies every row by the base weights and each LoRA row by its adapter's A and B,
and reads every adapter in the batch once however many rows use it. So against the base-only step, the mixed step
does ``sum over rows of the row's adapter parameters`` more multiply-adds and reads ``sum over the batch's distinct
adapters of their bytes`` more. Three ceilings of mixed / base throughput follow:

- FLOP ceiling: both parts compute-bound at the same rate (what the issue's "about 0.94" counts).
- byte ceiling: both parts stream their weights at the same bandwidth (a memory-bound base step).
- streaming ceiling: the base step as measured, plus the adapters' bytes at the bandwidth a plain two-thread sum
  reaches on this machine, with no overlap: what a LoRA kernel that reads at that speed, and does its
  arithmetic while it reads, would give without being fused into the base GEMMs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipc.model_config import ModelConfig


def base_linear_params(cfg: ModelConfig) -> int:
    """Weights one decode row multiplies by in the base model: the 7 linears of every layer plus the LM head.

    ``cfg``: the model's :class:`~ipc.model_config.ModelConfig` (``load_model_config``). Returns a count of
    weights (each one multiply-add per row). Embedding lookups and norms are not counted (they read a row or a
    vector, not a matrix).
    """
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def adapter_params(folder: str | Path) -> int:
    """Weights of one PEFT adapter (every ``lora_A``/``lora_B`` tensor in ``adapter_model.safetensors``).

    Reads only the safetensors header (shapes), not the weights. Raises ``FileNotFoundError`` when the file is
    missing and ``ValueError`` when its header is not valid safetensors JSON.
    """
    path = Path(folder) / "adapter_model.safetensors"
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(size))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: header is not JSON ({e})") from e
    total = 0
    for name, meta in header.items():
        if name != "__metadata__" and ("lora_A" in name or "lora_B" in name):
            n = 1
            for d in meta["shape"]:
                n *= d
            total += n
    return total


def batch_bounds(cfg: ModelConfig, adapters: dict[str, int], row_adapters: Sequence[str | None]) -> dict[str, float]:
    """FLOP and byte ceilings of mixed / base throughput for one decode step (see the module docstring).

    ``adapters`` maps name -> weight count (:func:`adapter_params`); ``row_adapters`` gives each row's adapter
    name (None = base model). Returns ``flop`` and ``byte`` ceilings in (0, 1] and ``lora_weights`` (read once
    per adapter in the batch) and ``base_weights``, as counts (times the element size for bytes).

    Raises ``KeyError`` for a row naming an adapter not in ``adapters``.
    """
    base = base_linear_params(cfg)
    rows = len(row_adapters)
    lora_macs = sum(adapters[n] for n in row_adapters if n is not None)
    read = sum(adapters[n] for n in set(row_adapters) if n is not None)
    return {
        "flop": rows * base / (rows * base + lora_macs),
        "byte": base / (base + read),
        "lora_weights": float(read),
        "base_weights": float(base),
    }


def plain_sum_gbps(mb: int = 256, repeats: int = 5) -> float:
    """Bandwidth (GB/s, 1e9 bytes) of ``torch.sum`` over a ``mb`` MiB fp32 buffer with torch's threads, median
    of ``repeats`` after one warm-up: the rate a kernel reading long runs of memory can expect here. fp32, since
    PyTorch's bf16 sums (with or without an fp32 accumulator) run below the memory's speed (measured: 29 GB/s
    fp32, 18 bf16, 2 bf16 into fp32 on the AMX Xeon)."""
    import torch

    buf = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        buf.sum()
        if i:
            times.append(time.perf_counter() - t)
    times.sort()
    return buf.numel() * 4 / times[len(times) // 2] / 1e9


def describe(bounds: dict[str, float], elem_bytes: int, base_ms: float | None = None, gbps: float | None = None) -> str:
    """One printable line: the weights each part reads (MB at ``elem_bytes`` per weight) and the ceilings; with
    a measured base step time (``base_ms``) and a plain-sum bandwidth (``gbps``), the streaming ceiling too."""
    lora_mb = bounds["lora_weights"] * elem_bytes / 1e6
    base_mb = bounds["base_weights"] * elem_bytes / 1e6
    line = (
        f"per decode step: base weights {base_mb:.0f} MB, adapters in the batch {lora_mb:.0f} MB "
        f"({lora_mb / base_mb:.0%} of the base's); mixed/base ceilings: FLOPs {bounds['flop']:.2f}, "
        f"bytes {bounds['byte']:.2f}"
    )
    if base_ms is not None and gbps:
        lora_ms = lora_mb / 1e3 / gbps * 1e3
        line += (
            f", streaming {base_ms / (base_ms + lora_ms):.2f} (base step {base_ms:.1f} ms = "
            f"{base_mb / base_ms:.1f} GB/s of weights; adapters at the plain-sum {gbps:.1f} GB/s: {lora_ms:.1f} ms)"
        )
    return line
