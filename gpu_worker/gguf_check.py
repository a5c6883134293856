"""Whether a GGUF can be served from its own blocks (``--quantization gguf``) at a TP size, without loading it.

Torch-free (``gguf``, ``msgspec`` only), so ``launch.py`` can refuse an explicit ``gguf`` and turn ``auto`` into
``none`` before any process starts, instead of a worker failing at load.
"""

from __future__ import annotations

from pathlib import Path

from gpu_worker.tp_plan import plan_for_model
from ipc.gguf_convert import hf_tensor_name
from ipc.model_config import load_model_config
from ipc.model_source import ModelSourceError, gguf_source

SERVABLE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F32", "F16", "BF16")
BLOCK = 32


def gguf_unservable(model_dir: str | Path, tp_size: int) -> str | None:
    """Why ``--quantization gguf`` cannot serve ``model_dir`` at ``tp_size`` ranks, or None if it can.

    Reasons: the folder was not converted from a GGUF or the file is gone; a tensor of a block type Loom does
    not repack (K-quants, ...); a row-parallel layer (o, down) whose split across ranks cuts a 32-weight block.
    """
    try:
        path = gguf_source(model_dir)
    except ModelSourceError as e:
        return str(e)
    from ipc.gguf_index import gguf_tensors

    cfg = load_model_config(model_dir)
    kinds = {}
    for t in gguf_tensors(path):
        kind = t.tensor_type.name
        if hf_tensor_name(t.name) is not None and kind not in SERVABLE_TYPES:
            return (
                f"tensor {t.name} of {path.name} is {kind}; --quantization gguf keeps Q4_0, Q4_1 and Q8_0 blocks "
                "(and F32/F16/BF16 tensors) as they are: use --quantization int8 or none for this file"
            )
        kinds[t.name] = kind
    for rank in range(tp_size):
        plan = plan_for_model(cfg, tp_size, rank)
        cuts = {
            "attn_output": (plan.q_heads[0] * cfg.head_dim, plan.q_heads[1] * cfg.head_dim),
            "ffn_down": plan.ffn,
        }
        for module, (a, b) in cuts.items():
            if not (a % BLOCK or b % BLOCK):
                continue
            for name, kind in kinds.items():
                if name.endswith(f".{module}.weight") and kind not in ("F32", "F16", "BF16"):
                    return (
                        f"at --tp-size {tp_size}, rank {rank}'s input columns {a}..{b} of {name} do not fall on "
                        f"{BLOCK}-weight block edges; choose another --tp-size or --quantization none"
                    )
    return None
