"""Load one TP rank's shard of a Llama checkpoint from safetensors (only the rows/columns it owns)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_worker.gguf_weights import load_gguf_shard
from gpu_worker.quant import Int8Linear, check_device, quantize_int8_rows
from gpu_worker.tp_plan import ShardPlan
from ipc.model_config import ModelConfig
from ipc.model_source import gguf_source


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Loading frees many large temporaries (fp32 reads, decoded blocks); glibc keeps such memory mapped, so
    without this a worker's resident size would count weights it no longer holds.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class CheckpointError(RuntimeError):
    """A tensor the model needs is missing or has the wrong shape; the message names it."""


class _Shards:
    """Tensor name -> file index over all ``*.safetensors`` shards in a folder."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        self._handles = [safe_open(str(model_dir / f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def slice(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None, cols=None):
        if name not in self._where:
            raise CheckpointError(f"checkpoint lacks tensor {name}")
        sl = self._where[name].get_slice(name)
        got = tuple(sl.get_shape())
        if got != shape:
            raise CheckpointError(f"tensor {name} has shape {list(got)}, the config implies {list(shape)}")
        if rows is not None:
            return sl[rows[0] : rows[1]]
        if cols is not None:
            return sl[:, cols[0] : cols[1]]
        return sl[:]


def load_shard(
    model_dir: str | Path,
    cfg: ModelConfig,
    plan: ShardPlan,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
):
    """Return this rank's weights as a dict of tensors in ``dtype`` on ``device``.

    ``quantization`` ``"int8"`` stores every linear layer and the embedding as ``Int8Linear`` (symmetric int8,
    one scale per output row, quantised from the full row before the TP split, so every TP size computes the
    same products); ``"gguf"`` reads the GGUF the folder was converted from (``gguf_weights.load_gguf_shard``).

    Column-parallel layers (q/k/v fused as ``qkv``, gate/up fused as ``gate_up``) keep the output rows this
    rank owns; row-parallel layers (o, down) keep the input columns. Embeddings, norms and the LM head are
    replicated (the vocab is small next to the per-step all-reduces, and replication avoids a gather).
    Layout: ``layers[i]["qkv"]`` is ``[(nq+2*nkv)*head_dim, hidden]``, ``["o"]`` ``[hidden, nq*head_dim]``,
    ``["gate_up"]`` ``[2*ffn_local, hidden]``, ``["down"]`` ``[hidden, ffn_local]``.

    Raises:
        CheckpointError: a missing tensor or a shape that disagrees with config.json.
    """
    if quantization not in ("none", "int8", "gguf"):
        raise ValueError(f"--quantization {quantization!r}: choose none, int8 or gguf")
    if quantization != "none":
        check_device(device)
    if quantization == "gguf":
        return load_gguf_shard(gguf_source(model_dir), cfg, plan, dtype, device)
    src = _Shards(Path(model_dir))
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q_rows = (plan.q_heads[0] * d, plan.q_heads[1] * d)
    kv_rows = (plan.kv_heads[0] * d, plan.kv_heads[1] * d)

    def put(t: torch.Tensor) -> torch.Tensor:
        # copy=True: never keep a view of the mmapped file (rewriting it would corrupt or SIGBUS a running server)
        return t.to(device=device, dtype=dtype, copy=True).contiguous()

    if quantization == "int8":
        return _load_int8(src, cfg, plan, put)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = src.slice(p + "self_attn.q_proj.weight", (hq * d, h), rows=q_rows)
        k = src.slice(p + "self_attn.k_proj.weight", (hkv * d, h), rows=kv_rows)
        v = src.slice(p + "self_attn.v_proj.weight", (hkv * d, h), rows=kv_rows)
        gate = src.slice(p + "mlp.gate_proj.weight", (cfg.intermediate_size, h), rows=plan.ffn)
        up = src.slice(p + "mlp.up_proj.weight", (cfg.intermediate_size, h), rows=plan.ffn)
        layers.append(
            {
                "input_norm": put(src.slice(p + "input_layernorm.weight", (h,))),
                "post_norm": put(src.slice(p + "post_attention_layernorm.weight", (h,))),
                "qkv": put(torch.cat([q, k, v], 0)),
                "o": put(src.slice(p + "self_attn.o_proj.weight", (h, hq * d), cols=q_rows)),
                "gate_up": put(torch.cat([gate, up], 0)),
                "down": put(src.slice(p + "mlp.down_proj.weight", (h, cfg.intermediate_size), cols=plan.ffn)),
            }
        )
    embed = put(src.slice("model.embed_tokens.weight", (cfg.vocab_size, h)))
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = put(src.slice("lm_head.weight", (cfg.vocab_size, h)))
    return {"layers": layers, "embed": embed, "norm": put(src.slice("model.norm.weight", (h,))), "lm_head": lm_head}


def _int8(src: _Shards, name: str, shape: tuple[int, ...], rows=None, cols=None) -> Int8Linear:
    """``name`` as per-row int8, cut to this rank. Rows are independent, so a row slice is quantised alone; a
    column slice (row-parallel layers) keeps the scale of the whole row, so every TP size computes the same."""
    q, s = quantize_int8_rows(src.slice(name, shape, rows=rows))
    if cols is not None:
        q = q[:, cols[0] : cols[1]].contiguous()
    return Int8Linear(q, s)


def _stack(parts: list[Int8Linear]) -> Int8Linear:
    """Row-stack int8 linears (fused qkv, gate_up)."""
    return Int8Linear(torch.cat([p.q for p in parts]), torch.cat([p.scales.float() for p in parts]))


def _load_int8(src: _Shards, cfg: ModelConfig, plan: ShardPlan, put) -> dict:
    """This rank's weights with every linear layer and the embedding as ``Int8Linear`` (norms via ``put``)."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q_rows = (plan.q_heads[0] * d, plan.q_heads[1] * d)
    kv_rows = (plan.kv_heads[0] * d, plan.kv_heads[1] * d)
    ffn = (cfg.intermediate_size, h)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            {
                "input_norm": put(src.slice(p + "input_layernorm.weight", (h,))),
                "post_norm": put(src.slice(p + "post_attention_layernorm.weight", (h,))),
                "qkv": _stack(
                    [
                        _int8(src, p + "self_attn.q_proj.weight", (hq * d, h), rows=q_rows),
                        _int8(src, p + "self_attn.k_proj.weight", (hkv * d, h), rows=kv_rows),
                        _int8(src, p + "self_attn.v_proj.weight", (hkv * d, h), rows=kv_rows),
                    ]
                ),
                "o": _int8(src, p + "self_attn.o_proj.weight", (h, hq * d), cols=q_rows),
                "gate_up": _stack(
                    [
                        _int8(src, p + "mlp.gate_proj.weight", ffn, rows=plan.ffn),
                        _int8(src, p + "mlp.up_proj.weight", ffn, rows=plan.ffn),
                    ]
                ),
                "down": _int8(src, p + "mlp.down_proj.weight", (h, cfg.intermediate_size), cols=plan.ffn),
            }
        )
    embed = _int8(src, "model.embed_tokens.weight", (cfg.vocab_size, h))
    head = embed if cfg.tie_word_embeddings else _int8(src, "lm_head.weight", (cfg.vocab_size, h))
    return {"layers": layers, "embed": embed, "norm": put(src.slice("model.norm.weight", (h,))), "lm_head": head}
