"""Load one TP rank's shard straight from a GGUF file, keeping quantised blocks quantised (``--quantization gguf``).

``Q4_0``/``Q4_1`` and ``Q8_0`` tensors are decoded from their blocks (no float weight matrix is ever built),
sliced for the rank (whole 32-weight blocks only), put back in Hugging Face's rotary row order (q/k), and
repacked once for the 4-bit CPU kernel (see ``gpu_worker.quant``). ``F32``/``F16``/``BF16`` tensors (norms,
unquantised matrices) load as dense tensors. The layout of the returned dict is that of
``gpu_worker.weights.load_shard``; matrices are ``Int4Linear`` (or dense tensors), a ``Q8_0`` LM head a
``Q8Linear`` where Loom's 8-bit kernels build, the embedding a ``GGUFEmbedding`` (rows read from the file on demand).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu_worker.quant import (
    GROUP,
    GGUFEmbedding,
    QuantizationError,
    decode_q4_blocks,
    decode_q8_0_blocks,
    int4_from_affine,
    int4_from_q8,
)
from gpu_worker.tp_plan import ShardPlan
from ipc.gguf_convert import _unpermute_rope_rows, hf_shape
from ipc.gguf_index import gguf_tensors
from ipc.model_config import ModelConfig

_DENSE = ("F32", "F16", "BF16")
_BLOCKS = ("Q4_0", "Q4_1", "Q8_0")


@dataclass
class _Part:
    """One matrix ``[N, K]`` as read: ``kind`` "q4" (q 0..15, scale, zero), "q8" (q int8, scale = d) or "dense"."""

    kind: str
    q: np.ndarray
    scale: np.ndarray | None = None
    zero: np.ndarray | None = None

    def rows(self, a: int, b: int) -> _Part:
        pick = lambda x: None if x is None else x[a:b]  # noqa: E731
        return _Part(self.kind, self.q[a:b], pick(self.scale), pick(self.zero))

    def cols(self, a: int, b: int, name: str) -> _Part:
        if self.kind == "dense":
            return _Part("dense", self.q[:, a:b])
        if a % GROUP or b % GROUP:
            raise QuantizationError(
                f"{name}: this TP rank's input columns {a}..{b} do not fall on {GROUP}-weight block edges; "
                "choose a --tp-size that splits the layer into whole blocks, or use --quantization none"
            )
        pick = lambda x: None if x is None else x[:, a // GROUP : b // GROUP]  # noqa: E731
        return _Part(self.kind, self.q[:, a:b], pick(self.scale), pick(self.zero))

    def unpermute(self, heads: int) -> _Part:
        f = lambda x: None if x is None else _unpermute_rope_rows(x, heads)  # noqa: E731
        return _Part(self.kind, f(self.q), f(self.scale), f(self.zero))


def _fuse(parts: list[_Part], dtype: torch.dtype, device: torch.device):
    """One linear for row-stacked parts: Int4Linear when they share a block kind, else a dense tensor."""
    kinds = {p.kind for p in parts}
    cat = lambda xs: torch.from_numpy(np.ascontiguousarray(np.concatenate(xs, axis=0)))  # noqa: E731
    if kinds == {"q4"}:
        return int4_from_affine(cat([p.q for p in parts]), cat([p.scale for p in parts]), cat([p.zero for p in parts]))
    if kinds == {"q8"}:
        return int4_from_q8(cat([p.q for p in parts]), cat([p.scale for p in parts]))
    if kinds == {"dense"}:
        return cat([p.q for p in parts]).to(device=device, dtype=dtype).contiguous()
    # mixed block kinds inside one fused projection (rare): dequantise the pieces of this one projection
    dense = [_dequant(p) for p in parts]
    return cat(dense).to(device=device, dtype=dtype).contiguous()


def _head(p: _Part, dtype: torch.dtype, device: torch.device):
    """The LM head: a ``Q8_0`` head on Loom's 8-bit kernels (:class:`gpu_worker.q8_linear.Q8Linear`: each weight read
    once) where they build on this CPU, else as :func:`_fuse` makes any linear (two 4-bit halves for ``Q8_0``)."""
    if p.kind == "q8" and device.type == "cpu":
        from gpu_worker.q8_linear import Q8Linear, load_q8
        from ipc.model_source import cache_root

        lib = load_q8(cache_root() / "kernels")
        if lib is not None:
            return Q8Linear(torch.from_numpy(np.ascontiguousarray(p.q)), torch.from_numpy(p.scale), lib)
    return _fuse([p], dtype, device)


def _dequant(p: _Part) -> np.ndarray:
    if p.kind == "dense":
        return p.q
    n = p.q.shape[0]
    q = p.q.astype(np.float32).reshape(n, -1, GROUP)
    zero = 0.0 if p.zero is None else p.zero[:, :, None]
    return (q * p.scale[:, :, None] + zero).reshape(n, -1)


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors = {t.name: t for t in gguf_tensors(path)}  # the directory is cached: no metadata parse

    def part(self, name: str, shape: tuple[int, ...]) -> _Part:
        t = self.tensors.get(name)
        if t is None:
            raise QuantizationError(f"{self.path.name} lacks tensor {name}")
        got = hf_shape(t)
        if got != shape:
            raise QuantizationError(f"tensor {name} has shape {list(got)}, the config implies {list(shape)}")
        kind = t.tensor_type.name
        raw = np.asarray(t.data)
        if kind in ("Q4_0", "Q4_1"):
            q, scale, zero = decode_q4_blocks(raw.reshape(shape[0], -1), kind)
            return _Part("q4", q, scale, zero)
        if kind == "Q8_0":
            q, d = decode_q8_0_blocks(raw.reshape(shape[0], -1))
            return _Part("q8", q, d)
        if kind == "BF16":  # numpy has no bf16: widen the 16 bits to the top of an fp32
            w = (raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            return _Part("dense", w.reshape(shape))
        if kind in _DENSE:
            return _Part("dense", raw.astype(np.float32).reshape(shape))
        raise QuantizationError(
            f"tensor {name} is {kind}; --quantization gguf keeps {', '.join(_BLOCKS)} blocks (and F32/F16/BF16 "
            "tensors) as they are: use --quantization int8 or none for this file"
        )

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        p = self.part(name, shape)
        return torch.from_numpy(np.ascontiguousarray(_dequant(p))).to(device=device, dtype=dtype).contiguous()


def _embedding(r: _Reader, dtype: torch.dtype, device: torch.device):
    t = r.tensors["token_embd.weight"]
    kind = t.tensor_type.name
    if kind in _BLOCKS and device.type == "cpu":
        rows = hf_shape(t)[0]
        return GGUFEmbedding(str(r.path), int(t.data_offset), rows, int(t.n_bytes) // rows, kind)
    return r.dense("token_embd.weight", hf_shape(t), dtype, device)


def load_gguf_shard(gguf: Path, cfg: ModelConfig, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> dict:
    """This rank's weights from ``gguf`` with ``Q4_0``/``Q4_1``/``Q8_0`` matrices kept in 4-bit-kernel form.

    Column-parallel qkv and gate_up keep this rank's output rows (any row split keeps whole blocks); row-parallel
    o and down keep its input columns, which must fall on 32-weight block edges. Embeddings, norms and the LM
    head are replicated. ``dtype`` is the dtype of activations, norms and dense tensors.

    Raises:
        QuantizationError: a tensor of a block type Loom does not repack, a shape that disagrees with the
            config, or a TP split through a block.
    """
    r = _Reader(gguf)
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q_rows = (plan.q_heads[0] * d, plan.q_heads[1] * d)
    kv_rows = (plan.kv_heads[0] * d, plan.kv_heads[1] * d)
    ffn = plan.ffn
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        q = r.part(p + "attn_q.weight", (hq * d, h)).unpermute(hq).rows(*q_rows)
        k = r.part(p + "attn_k.weight", (hkv * d, h)).unpermute(hkv).rows(*kv_rows)
        v = r.part(p + "attn_v.weight", (hkv * d, h)).rows(*kv_rows)
        gate = r.part(p + "ffn_gate.weight", (cfg.intermediate_size, h)).rows(*ffn)
        up = r.part(p + "ffn_up.weight", (cfg.intermediate_size, h)).rows(*ffn)
        o = r.part(p + "attn_output.weight", (h, hq * d)).cols(*q_rows, p + "attn_output.weight")
        down = r.part(p + "ffn_down.weight", (h, cfg.intermediate_size)).cols(*ffn, p + "ffn_down.weight")
        layers.append(
            {
                "input_norm": r.dense(p + "attn_norm.weight", (h,), dtype, device),
                "post_norm": r.dense(p + "ffn_norm.weight", (h,), dtype, device),
                "qkv": _fuse([q, k, v], dtype, device),
                "o": _fuse([o], dtype, device),
                "gate_up": _fuse([gate, up], dtype, device),
                "down": _fuse([down], dtype, device),
            }
        )
    emb = r.part("token_embd.weight", (cfg.vocab_size, h))
    head = emb if cfg.tie_word_embeddings else r.part("output.weight", (cfg.vocab_size, h))
    out = {
        "layers": layers,
        "embed": _embedding(r, dtype, device),
        "norm": r.dense("output_norm.weight", (h,), dtype, device),
        "lm_head": _head(head, dtype, device),
    }
    del r  # drop the file's memory map, so its pages leave this process's RSS
    return out
