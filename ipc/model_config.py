"""Read and validate a Llama-family ``config.json`` into the facts every process needs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

SUPPORTED_MODEL_TYPES = ("llama", "mistral")


class UnsupportedModelError(ValueError):
    """The checkpoint's config asks for something Loom does not implement; the message names the field."""


class ModelConfig(msgspec.Struct, frozen=True):
    """Architecture facts of a Llama-family decoder (sizes in elements, not bytes)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    rope_scaling: dict[str, float | str] | None = None  # llama3-style scaling, already validated


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in need if k not in params]
        if missing:
            raise UnsupportedModelError(f"config.json rope_scaling (llama3) lacks {missing}")
        return theta, {"rope_type": "llama3", **{k: float(params[k]) for k in need}}
    raise UnsupportedModelError(f"config.json rope_scaling.rope_type={kind!r} is not supported (default, llama3)")


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``model_dir/config.json``.

    Raises:
        UnsupportedModelError: naming the field, for a non-Llama architecture, a sliding window, biases,
            an activation other than SiLU, or an unknown RoPE scaling.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"config.json model_type={mt!r} is not supported (Llama family: llama, mistral)")
    if cfg.get("sliding_window") not in (None, 0) and cfg.get("use_sliding_window", True):
        raise UnsupportedModelError(f"config.json sliding_window={cfg['sliding_window']} is not supported")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise UnsupportedModelError(f"config.json {field}=true is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json hidden_act={act!r} is not supported (silu)")
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    return ModelConfig(
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        rope_scaling=scaling,
    )
