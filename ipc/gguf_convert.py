"""Convert a Llama-architecture GGUF file into an fp32 Hugging Face checkpoint folder.

Reads the file with the ``gguf`` package, dequantises every tensor with ``gguf.quants.dequantize`` to fp32,
undoes llama.cpp's rotary row order in ``q_proj`` / ``k_proj``, writes ``model.safetensors`` with
``safetensors``, ``config.json`` / ``generation_config.json`` from the ``llama.*`` metadata, and the tokenizer
files (``ipc.gguf_tokenizer``). No ``transformers`` or ``torch`` import.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from ipc.gguf_tokenizer import GGUFTokenizerError, special_token_ids, tokenizer_files

# GGUF tensor types Loom dequantises (all with gguf's own numpy routines).
SUPPORTED_TYPES = tuple(
    GGMLQuantizationType[n]
    for n in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFConvertError(ValueError):
    """The GGUF is readable but not convertible (architecture, tensor type, metadata); the message says why."""


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a GGUF tensor, or None for a tensor a Llama checkpoint does not have.

    ``token_embd.weight`` -> ``model.embed_tokens.weight``; ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        module = _LAYER_NAMES.get(parts[2])
        if module is not None:
            return f"model.layers.{int(parts[1])}.{module}.weight"
    return None


def metadata_getter(reader: GGUFReader) -> Callable[[str], Any]:
    """``meta(key)``: the value of a GGUF metadata key (python scalars, strings or lists), None if absent."""

    def meta(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    return meta


def llama_config(meta: Callable[[str], Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` from the ``llama.*`` metadata.

    Args:
        meta: the metadata getter of ``metadata_getter``.
        shapes: GGUF tensor name -> shape in Hugging Face order (``[out, in]``). The vocabulary size is the
            rows of ``token_embd.weight``; no ``output.weight`` means tied embeddings.

    Raises:
        GGUFConvertError: the architecture is not ``llama``, a required key or the embedding is missing, or
            the metadata asks for something Loom does not implement (RoPE scaling, experts, unequal key /
            value head sizes).
    """
    arch = meta("general.architecture")
    if arch != "llama":
        raise GGUFConvertError(
            f"general.architecture={arch!r} is not supported (only 'llama'); "
            "pass a Hugging Face checkpoint folder of a Llama-family model instead"
        )

    def need(key: str) -> Any:
        value = meta(f"llama.{key}")
        if value is None:
            raise GGUFConvertError(f"the GGUF lacks the metadata key llama.{key}")
        return value

    if "token_embd.weight" not in shapes:
        raise GGUFConvertError("the GGUF has no token_embd.weight tensor, so it is not a Llama model")
    scaling = meta("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFConvertError(f"llama.rope.scaling.type={scaling!r} is not supported (no RoPE scaling)")
    if meta("llama.expert_count"):
        raise GGUFConvertError(f"llama.expert_count={meta('llama.expert_count')} is not supported (dense models only)")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta("llama.attention.key_length") or hidden // heads)
    if int(meta("llama.attention.value_length") or head_dim) != head_dim:
        raise GGUFConvertError("llama.attention.value_length differs from key_length, which Loom does not support")
    theta = float(meta("llama.rope.freq_base") or 10000.0)
    ids = special_token_ids(meta)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("llama.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "vocab_size": int(shapes["token_embd.weight"][0]),
        "tie_word_embeddings": "output.weight" not in shapes,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": "float32",
    }
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("padding", "pad_token_id"),
        ("unknown", "unk_token_id"),
    ):
        if name in ids:
            cfg[key] = ids[name]
    return cfg


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order of a q/k weight ``[n_heads * head_dim, in]`` (fp32, same shape).

    llama.cpp stores each head's rows interleaved (pairs ``(i, i + head_dim/2)`` adjacent, the GGML rotary
    layout); Hugging Face Llama keeps the two halves apart (``rotate_half``). Each head's rows go from
    ``[half, 2]`` order back to ``[2, half]``.
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def hf_shape(t: ReaderTensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in Hugging Face / numpy order (GGUF lists dimensions innermost first)."""
    return tuple(int(n) for n in reversed(t.shape))


def check_tensors(reader: GGUFReader) -> None:
    """Raise GGUFConvertError for a tensor of an unsupported type or one a Llama checkpoint does not have."""
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFConvertError(
                f"tensor {t.name} is quantised as {t.tensor_type.name}, which Loom cannot dequantise "
                f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)}); re-quantise the model to one of these "
                "(e.g. llama.cpp's llama-quantize ... Q8_0) or pass a Hugging Face checkpoint folder"
            )
        if hf_tensor_name(t.name) is None:
            raise GGUFConvertError(
                f"tensor {t.name} has no counterpart in a Llama checkpoint, so this is not a plain Llama "
                "model; pass a Hugging Face checkpoint folder instead"
            )


def llama_tensors(reader: GGUFReader, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, fp32 array)`` per tensor, shaped as in Hugging Face (``[out, in]`` for matrices).

    Call ``check_tensors`` first. q_proj and k_proj rows are put back in Hugging Face's rotary order.
    """
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(hf_shape(t))
        if name.endswith("q_proj.weight"):
            w = _unpermute_rope_rows(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rope_rows(w, cfg["num_key_value_heads"])
        yield name, w


def open_gguf(gguf: Path) -> GGUFReader:
    """Parse ``gguf``'s header, metadata and tensor table (the data stays memory-mapped).

    Raises:
        GGUFConvertError: the file is truncated or its header is malformed.
    """
    try:
        return GGUFReader(str(gguf))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, struct errors, ...
        raise GGUFConvertError(
            f"not a valid GGUF file (truncated or corrupt: {e}); download or export it again"
        ) from None


def convert_gguf_file(gguf: Path, out_dir: Path) -> None:
    """Write the fp32 Hugging Face checkpoint of ``gguf`` into ``out_dir`` (atomic: a temp folder is renamed).

    The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32, Hugging Face
    names and row order), ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` (when the GGUF
    has one) and ``loom_source.json`` (``{"gguf": absolute path, "converter": "ipc.gguf_convert"}``).

    Raises:
        GGUFConvertError: not a valid GGUF, not a Llama, an unsupported tensor type or tokenizer.
        OSError: ``out_dir``'s parent cannot be written.
    """
    reader = open_gguf(gguf)
    meta = metadata_getter(reader)
    cfg = llama_config(meta, {t.name: hf_shape(t) for t in reader.tensors})
    check_tensors(reader)
    try:
        tok_files = tokenizer_files(meta)
    except GGUFTokenizerError as e:
        raise GGUFConvertError(str(e)) from None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        tensors = {}
        for name, w in tqdm(llama_tensors(reader, cfg), total=len(reader.tensors), desc=f"converting {gguf.name}"):
            tensors[name] = w
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        files = {
            **tok_files,
            "config.json": json.dumps(cfg, indent=2) + "\n",
            "generation_config.json": json.dumps(gen, indent=2) + "\n",
            "loom_source.json": json.dumps({"gguf": str(gguf.resolve()), "converter": __name__}) + "\n",
        }
        for fname, text in files.items():
            (tmp / fname).write_text(text, encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
