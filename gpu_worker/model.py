"""Llama forward for one TP rank over a packed batch of prefill and decode tokens.

RMSNorm, rotary embeddings (HF ``rotate_half`` layout), grouped-query attention over the paged KV cache,
SwiGLU MLP, tied or separate LM head. Column-parallel qkv/gate_up and row-parallel o/down with one
all-reduce each (Megatron-LM). LoRA deltas enter through :class:`LoraApplier` (None = base only).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gpu_worker.bound_decode import BoundDecode
from gpu_worker.decode_attention import CDecodeAttention, DecodeAttention
from gpu_worker.decode_mirror import MirrorUse, mirrored_kv
from gpu_worker.kv_cache import KVCache
from gpu_worker.layer_ops import LayerOps
from gpu_worker.packed_linear import PackedLinear
from gpu_worker.prefill_attention import prefix_causal_attention, split_pays
from gpu_worker.q8_linear import Q8Linear
from gpu_worker.quant import QuantLinear
from gpu_worker.timing import agreed_choice, best_time
from gpu_worker.tp_plan import ShardPlan
from gpu_worker.vocab_parallel import head_rows, vocab_range
from ipc.model_config import ModelConfig
from ipc.model_source import cache_root

log = logging.getLogger(__name__)


class LoraApplier(Protocol):
    """Adds LoRA deltas for one step; built per batch by the LoRA pool."""

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``module``'s LoRA delta for input ``x [T, in_local]`` into ``out [T, out_local]`` in place.

        For row-parallel modules (o, down) ``out`` is the rank's partial sum before the all-reduce.
        """

    def mm_add(self, layer: int, module: str, x: torch.Tensor, w: object) -> torch.Tensor | None:
        """``x @ w.T`` with ``module``'s LoRA delta added, in one kernel call where the applier has one for the
        weight ``w`` (the values :meth:`add` gives after the product); None: multiply, then :meth:`add`."""


@dataclass
class DecodeGroup:
    """Decode rows (one new token each) attended together: one KV gather and one SDPA call.

    ``token_index`` ``[G]`` int64: the rows' token offsets in the step. ``kv_slots`` ``[G * L]`` int64: each
    row's KV slots for positions ``0..L-1`` (``L`` = the group's longest history), flattened row-major.
    ``mask`` ``[G, 1, 1, L]`` bool (True = attend), None when every row has exactly ``L`` positions.
    ``every_token``: the group is the whole step, ``token_index == arange(T)`` (a pure decode step).
    ``mirror``: read the history from the worker's :class:`~gpu_worker.decode_mirror.DecodeKVMirror` (the
    same values, kept across steps) instead of gathering it from the paged cache. ``lengths`` ``[G]`` int64: each
    row's history length (what ``mask`` says; None when ``mask`` is None), for the C decode attention.
    """

    token_index: torch.Tensor
    kv_slots: torch.Tensor
    length: int
    mask: torch.Tensor | None
    every_token: bool = False
    mirror: MirrorUse | None = None
    lengths: torch.Tensor | None = None


@dataclass
class PrefillRow:
    """A row attended on its own: ``new_tokens`` queries at token ``offset`` of the step.

    ``kv_slots`` ``[prefix + new]`` int64 and ``mask`` ``[1, 1, new, prefix + new]`` bool (causal past the prefix)
    when the row has a cached prefix; both None for a whole prompt (causal SDPA over the new tokens). Made once
    per step, not per layer.
    """

    offset: int
    new_tokens: int
    kv_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class StepInputs:
    """Tensors for one forward step (``T`` packed tokens, ``B`` requests in plan order).

    input_ids, positions, out_slots: ``[T]`` int64. ``ext_lens``: new tokens per request (Python list). Requests
    with one new token and a non-empty prefix are attended in ``decode_groups`` (rows of similar length, so that
    padding stays small); the rest, ``prefill_rows``, one by one. Everything here is made once per step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    ext_lens: list[int]
    decode_groups: list[DecodeGroup]
    last_token_index: torch.Tensor  # [B] offset of each request's last token
    prefill_rows: list[PrefillRow] = field(default_factory=list)
    every_token_last: bool = False  # T == B (a pure decode step): logits for every row, no gather


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` fp32, with llama3 scaling when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type") == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back, then scaled (same order as HF Llama; ``F.rms_norm`` without a weight
    is the fp32 part in one call)."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _bf16_upcast_threshold(sample: torch.Tensor, group: object | None = None) -> int:
    """Rows from which a bf16 matmul is faster done in fp32 (upcast per call), or a huge number if never.

    Measured once per machine at start-up and agreed by the TP ranks of ``group`` (never, if any rank finds the
    upcast slower; :func:`gpu_worker.timing.agreed_choice`): CPUs without native bf16 (e.g. AVX2-only) run bf16
    GEMM several times slower than converting to fp32 first once a batch has more than a few rows; GPUs and
    bf16-capable CPUs do not.
    """
    never = 1 << 62
    if sample.device.type != "cpu" or sample.dtype != torch.bfloat16:
        return never

    def measure() -> tuple[int, str]:
        w = torch.randn(1024, 576, dtype=torch.bfloat16)
        x = torch.randn(32, 576, dtype=torch.bfloat16)
        native = best_time(lambda: x @ w.T, 5)
        upcast = best_time(lambda: (x.float() @ w.float().T).to(torch.bfloat16), 5)
        how = f"32 x 576 by 576 x 1024: bf16 {native * 1e6:.0f} us, fp32 upcast {upcast * 1e6:.0f} us"
        return (8 if upcast < 0.7 * native else never), how

    key = f"{torch.__version__}|bf16-upcast"
    rows, how, _ = agreed_choice(
        cache_root() / "kernel-choice", "bf16-upcast-min-rows", key, measure, group, highest=True
    )
    log.info("bf16 matmuls %s (%s)", "stay bf16" if rows == never else f"of {rows}+ rows run in fp32", how)
    return rows


class LlamaShard:
    """One TP rank's Llama. ``weights`` comes from :func:`gpu_worker.weights.load_shard`.

    At TP > 1 the rank keeps only its vocabulary rows of the LM head: ``weights["lm_head"]`` is replaced in the
    caller's dict by those rows (views, see :mod:`gpu_worker.vocab_parallel`).
    """

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, weights: dict, group: object | None = None) -> None:
        self.cfg = cfg
        self.plan = plan
        self.w = weights
        self.group = group
        self.tp = plan.tp_size
        self.nq, self.nkv, self.d = plan.num_q_heads, plan.num_kv_heads, cfg.head_dim
        self.ffn_local = plan.ffn[1] - plan.ffn[0]
        norm = weights["norm"]  # always a dense tensor in the activation dtype, also when weights are quantised
        self.dtype = norm.dtype
        self.inv_freq = rope_inv_freq(cfg).to(norm.device)
        self.upcast_min_rows = _bf16_upcast_threshold(norm, group)
        # the C decode attention (gpu_worker.decode_attention) where the worker found it faster than SDPA
        self.decode_attn: DecodeAttention | None = None
        # the small per-layer operations fused in C (gpu_worker.layer_ops), set by the worker on CPU
        self.layer_ops: LayerOps | None = None
        self._norms_bindable: bool | None = None  # see _bind_decode
        # vocab-parallel head at TP > 1: this rank's rows only (views), joined by one all-reduce per step
        self.vocab = cfg.vocab_size
        self.vocab_lo, self.vocab_hi = vocab_range(cfg.vocab_size, self.tp, plan.rank)
        if self.tp > 1:
            weights["lm_head"] = head_rows(weights["lm_head"], self.vocab_lo, self.vocab_hi)
        # the TP all-reduce (in place, sum over ranks); a same-host shared-memory reducer may replace it
        self.all_reduce_fn: Callable[[torch.Tensor], None] | None = None
        # (part [B, my vocab rows], every rank's vocab span) -> rank 0: logits [B, vocab]; others: their part.
        # Set where the ranks can gather (the same-host shared-memory reducer); else the head's columns are
        # joined by an all-reduce of a zero-filled [B, vocab] tensor.
        self.gather_logits_fn: Callable[[torch.Tensor, list[tuple[int, int]]], torch.Tensor] | None = None
        self.vocab_spans = [vocab_range(cfg.vocab_size, self.tp, r) for r in range(self.tp)]
        if self.tp > 1:
            self.all_reduce_fn = lambda t: dist.all_reduce(t, group=group)

    def _mm_lora(self, x: torch.Tensor, w: object, lora: LoraApplier | None, layer: int, module: str) -> torch.Tensor:
        """``x @ w.T`` plus ``module``'s LoRA delta where ``lora`` is given: one fused call where the applier has
        one for this weight, else :meth:`_mm` and then ``lora.add``."""
        if lora is not None:
            out = lora.mm_add(layer, module, x, w)
            if out is not None:
                return out
        out = self._mm(x, w)  # type: ignore[arg-type]
        if lora is not None:
            lora.add(layer, module, x, out)
        return out

    def _mm(self, x: torch.Tensor, w: torch.Tensor | QuantLinear | PackedLinear) -> torch.Tensor:
        """``x @ w.T``; on CPUs without fast bf16 GEMM, batches of many rows compute in fp32.

        ``w`` is a dense ``[N, K]`` tensor, or a quantised (``gpu_worker.quant``) or prepacked
        (``gpu_worker.packed_linear``) linear that runs its own kernel.
        """
        if not isinstance(w, torch.Tensor):
            return w.mm(x)
        if x.shape[0] >= self.upcast_min_rows:
            return (x.float() @ w.float().T).to(x.dtype)
        return x @ w.T

    def _head(self, last: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits, ``[B, rows of its head]`` fp32. An 8-bit head
        (``Q8Linear``) writes its fp32 sums as they are; other heads' outputs (in ``last.dtype``) are cast."""
        head = self.w["lm_head"]
        if isinstance(head, Q8Linear):
            return head.mm(last, out_dtype=torch.float32)
        return self._mm(last, head).float()

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.all_reduce_fn is not None:
            self.all_reduce_fn(t)
        return t

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` ``[T, 1, head_dim]``: ``rotate_half(x) * sin == x.roll(d/2) * signed_sin``.

        ``rotate_half(x) = cat(-x2, x1)`` and ``roll(x, d/2) = cat(x2, x1)``, so moving the sign onto ``sin``
        gives the same products bit for bit in three tensor ops instead of six.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        sin = freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]

    def _attention(self, s: StepInputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, layer: int):
        """q ``[T, nq, d]``, k/v ``[T, nkv, d]`` (already written to the cache) -> ``[T, nq*d]``."""
        t, width = q.shape[0], self.nq * self.d
        if not s.prefill_rows and len(s.decode_groups) == 1 and s.decode_groups[0].every_token:
            return self._decode_attention(s.decode_groups[0], q, k, v, kv, layer).reshape(t, width)  # pure decode
        out = torch.empty_like(q)
        for r in s.prefill_rows:
            out[r.offset : r.offset + r.new_tokens] = self._extend_attention(r, q, k, v, kv, layer)
        for g in s.decode_groups:
            out[g.token_index] = self._decode_attention(g, q, k, v, kv, layer)
        return out.reshape(t, width)

    def _extend_attention(
        self, r: PrefillRow, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, layer: int
    ) -> torch.Tensor:
        """A prefill row's new tokens attending causally to themselves (and its cached prefix) -> ``[ext, nq, d]``."""
        offset, ext = r.offset, r.new_tokens
        qb = q[offset : offset + ext].transpose(0, 1)  # [nq, ext, d]
        if r.kv_slots is None:
            kb, vb = k[offset : offset + ext], v[offset : offset + ext]
        else:
            kb, vb = kv.k[layer].index_select(0, r.kv_slots), kv.v[layer].index_select(0, r.kv_slots)
            prefix = kb.shape[0] - ext
            if split_pays(qb.device, qb.dtype, prefix, ext):  # a long chunk after a cached prefix: no mask
                ob = prefix_causal_attention(
                    qb, kb.transpose(0, 1), vb.transpose(0, 1), prefix, 1.0 / math.sqrt(self.d)
                )
                return ob.transpose(0, 1)
        ob = F.scaled_dot_product_attention(
            qb[None],
            kb.transpose(0, 1)[None],
            vb.transpose(0, 1)[None],
            attn_mask=r.mask,
            is_causal=r.mask is None,
            scale=1.0 / math.sqrt(self.d),
            enable_gqa=True,
        )
        return ob[0].transpose(0, 1)

    def _decode_attention(
        self, g: DecodeGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, layer: int
    ) -> torch.Tensor:
        """A decode group's one new token per row attending to each row's history -> ``[G, nq, d]`` (row order).

        On the C kernel (``self.decode_attn``) without a mirror, the history is read in place from the paged cache
        through the group's slot table; otherwise from the decode mirror or a gather, for the C kernel or SDPA.
        """
        kc, vc = kv.k[layer], kv.v[layer]
        n = g.token_index.shape[0]
        scale = 1.0 / math.sqrt(self.d)
        fast = self.decode_attn is not None and q.dtype in (torch.float32, torch.bfloat16)
        lengths = g.lengths
        if fast and lengths is None and g.mask is not None:  # a prefix mask built by hand (tests): its lengths
            lengths = g.mask[:, 0, 0, :].sum(-1)
        if fast and g.mirror is None:
            qr = q if g.every_token else q[g.token_index]
            return self.decode_attn(qr, kc, vc, lengths, scale, g.kv_slots.view(n, g.length))
        qd = (q if g.every_token else q[g.token_index])[:, :, None, :]  # [G, nq, 1, d]
        if g.mirror is not None:
            kn, vn = (k, v) if g.every_token else (k[g.token_index], v[g.token_index])
            kd, vd = mirrored_kv(g.mirror, layer, kc, vc, kn, vn, g.length)
            qd = qd.to(kd.dtype)
        else:  # index_select copies whole [nkv, d] rows; advanced indexing (kc[table]) is several times slower
            kd = kc.index_select(0, g.kv_slots).view(n, g.length, self.nkv, self.d).transpose(1, 2)
            vd = vc.index_select(0, g.kv_slots).view(n, g.length, self.nkv, self.d).transpose(1, 2)
            if n >= self.upcast_min_rows:  # slow bf16 kernels on this CPU: attend in fp32
                qd, kd, vd = qd.float(), kd.float(), vd.float()
        if fast and qd.dtype in (torch.float32, torch.bfloat16):
            return self.decode_attn(qd[:, :, 0, :], kd, vd, lengths, scale).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale, enable_gqa=True)
        return od[:, :, 0, :].to(q.dtype)

    def _layers(
        self,
        s: StepInputs,
        kv: KVCache,
        lora: LoraApplier | None,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ops: LayerOps | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer with a call per operation (any step): -> (``x``, the last layer's MLP output not yet added)."""
        cfg, nq, nkv, d = self.cfg, self.nq, self.nkv, self.d
        pending = None  # the previous layer's MLP output, added to x by the next layer's norm
        for i, lw in enumerate(self.w["layers"]):
            if ops is not None:
                h = ops.add_rms_norm(x, pending, lw["input_norm"], cfg.rms_norm_eps)  # x += pending in place
            else:
                x = x if pending is None else x + pending
                h = rms_norm(x, lw["input_norm"], cfg.rms_norm_eps)
            qkv = self._mm_lora(h, lw["qkv"], lora, i, "qkv")
            if ops is not None and qkv.stride(1) == 1:  # rotary in place on q and k, then K/V into the cache
                ops.rope_store(qkv, (nq, nkv, d), cos[:, 0], sin[:, 0], kv.k[i], kv.v[i], s.out_slots)
                q = qkv[:, : nq * d].view(-1, nq, d)
                k = qkv[:, nq * d : (nq + nkv) * d].view(-1, nkv, d)
            else:  # rotary on q and k together (adjacent in qkv): [T, nq + nkv, d]
                qk = qkv[:, : (nq + nkv) * d].view(-1, nq + nkv, d)
                qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
                q, k = qk[:, :nq], qk[:, nq:]
            v = qkv[:, (nq + nkv) * d :].view(-1, nkv, d)
            if ops is None or qkv.stride(1) != 1:
                kv.k[i].index_copy_(0, s.out_slots, k)
                kv.v[i].index_copy_(0, s.out_slots, v)
            a = self._attention(s, q, k, v, kv, i)
            o = self._mm_lora(a, lw["o"], lora, i, "o")
            o = self._all_reduce(o)
            if ops is not None and o.stride(1) == 1:
                h = ops.add_rms_norm(x, o, lw["post_norm"], cfg.rms_norm_eps)
            else:
                x = x + o
                h = rms_norm(x, lw["post_norm"], cfg.rms_norm_eps)
            gu = self._mm_lora(h, lw["gate_up"], lora, i, "gate_up")
            if ops is not None and gu.stride(1) == 1:
                m = ops.silu_mul(gu, self.ffn_local)
            else:
                gate, up = gu.split([self.ffn_local, self.ffn_local], dim=-1)
                m = F.silu(gate) * up
            dn = self._mm_lora(m, lw["down"], lora, i, "down")
            pending = self._all_reduce(dn)
        return x, pending

    def _bind_decode(
        self, s: StepInputs, kv: KVCache, x: torch.Tensor, ops: LayerOps | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> BoundDecode | None:
        """The step's C kernels bound for all layers (:mod:`gpu_worker.bound_decode`) when it is a pure decode step
        on the C layer ops and C decode attention over the paged cache; else None (per-call path)."""
        if ops is None or not isinstance(self.decode_attn, CDecodeAttention) or s.prefill_rows:
            return None
        if len(s.decode_groups) != 1:
            return None
        g = s.decode_groups[0]
        if not g.every_token or g.mirror is not None or (g.lengths is None and g.mask is not None):
            return None
        if self._norms_bindable is None:  # once: every norm weight a contiguous vector in the activation dtype
            norms = [lw[k] for lw in self.w["layers"] for k in ("input_norm", "post_norm")]
            self._norms_bindable = all(isinstance(t, torch.Tensor) and t.is_contiguous() and t.dtype == self.dtype
                                       for t in norms)  # fmt: skip
        if not self._norms_bindable or x.dtype != self.dtype:
            return None
        n = g.token_index.shape[0]
        try:
            return BoundDecode(ops, self.decode_attn.fn, x, (self.nq, self.nkv, self.d), self.ffn_local, cos[:, 0],
                               sin[:, 0], s.out_slots, g.kv_slots.view(n, g.length), g.lengths, kv,
                               1.0 / math.sqrt(self.d))  # fmt: skip
        except ValueError:
            return None

    def _layers_bound(self, b: BoundDecode, lora: LoraApplier | None) -> torch.Tensor:
        """Every layer of a pure decode step on the bound C kernels (the same operations as :meth:`_layers`, in
        place on ``b.x``) -> the last layer's MLP output, not yet added."""
        eps = self.cfg.rms_norm_eps
        pending = None
        for i, lw in enumerate(self.w["layers"]):
            h = b.add_rms_norm(pending, lw["input_norm"], eps)
            qkv = self._mm_lora(h, lw["qkv"], lora, i, "qkv")
            a = b.rope_attend(i, qkv)
            o = self._mm_lora(a, lw["o"], lora, i, "o")
            h = b.add_rms_norm(self._all_reduce(o), lw["post_norm"], eps)
            gu = self._mm_lora(h, lw["gate_up"], lora, i, "gate_up")
            m = b.silu_mul(gu)
            dn = self._mm_lora(m, lw["down"], lora, i, "down")
            pending = self._all_reduce(dn)
        return pending

    @torch.inference_mode()
    def forward(self, s: StepInputs, kv: KVCache, lora: LoraApplier | None = None) -> torch.Tensor:
        """Run one step; write new K/V to ``s.out_slots``; return last-token logits ``[B, vocab]`` fp32 (where the
        TP ranks gather the vocab-parallel head's columns, ``gather_logits_fn``, only rank 0 gets them all: the
        others get their own columns)."""
        return self._logits(self._last_hidden(s, kv, lora))

    @torch.inference_mode()
    def forward_greedy(
        self, s: StepInputs, kv: KVCache, lora: LoraApplier | None = None
    ) -> tuple[list[int] | None, torch.Tensor | None]:
        """:meth:`forward` for a step whose rows all take the argmax, at TP > 1: ``(tokens [B], None)``, or
        ``(None, logits)`` exactly as :meth:`forward` returns them when some row's largest logit is not finite
        (NaN, +inf, or every value -inf: the sampler then names what is wrong with the full row).

        Each rank takes the max and first argmax of its own vocabulary columns, and one all-reduce of a
        ``[B, 2 * tp]`` float64 tensor (each rank fills its two columns, zeros elsewhere: ``x + 0`` is exact, so
        every rank holds every rank's pair) replaces gathering ``[B, vocab]`` fp32 logits on rank 0 and rank 0's
        max over all of them. The largest value wins, the lowest vocabulary span on ties: the first maximal index,
        as ``torch.max`` over the whole row picks. Every rank sees the same pairs, so all take the same branch.
        """
        if self.tp == 1:
            raise ValueError("forward_greedy is for TP > 1 (one rank's logits are already whole)")
        last = self._last_hidden(s, kv, lora)
        part = self._own_columns(last)
        pairs = torch.zeros(len(last), 2 * self.tp, dtype=torch.float64)
        me = self.plan.rank
        if part.shape[-1]:
            row_max, arg = part.max(-1)
            pairs[:, 2 * me] = row_max.double()
            pairs[:, 2 * me + 1] = (arg + self.vocab_lo).double()
        else:
            pairs[:, 2 * me] = float("-inf")
        pairs = self._all_reduce(pairs)
        maxes, ids = pairs[:, 0::2], pairs[:, 1::2]
        best = maxes.max(-1)
        if not bool(best.values.isfinite().all()):
            return None, self._gather_logits(last, part)
        # the first span whose max equals the row's max (spans ascend with the rank)
        first = (maxes == best.values[:, None]).to(torch.int8).argmax(-1)
        return ids.gather(1, first[:, None]).squeeze(1).long().tolist(), None

    def _last_hidden(self, s: StepInputs, kv: KVCache, lora: LoraApplier | None) -> torch.Tensor:
        """The layers of one step (K/V written to ``s.out_slots``); the final-normed hidden state of each row's
        last token, ``[B, hidden]`` in the activation dtype."""
        cfg, w, d = self.cfg, self.w, self.d
        emb = w["embed"]
        x = F.embedding(s.input_ids, emb) if isinstance(emb, torch.Tensor) else emb.rows(s.input_ids, self.dtype)
        cos, sin = self._rope(s.positions, x.dtype)
        ops = self.layer_ops
        if ops is not None and not (ops.takes(x, cfg.hidden_size) and d % 32 == 0 and self.ffn_local % 16 == 0):
            ops = None
        bound = self._bind_decode(s, kv, x, ops, cos, sin)
        if bound is not None:
            pending = self._layers_bound(bound, lora)
        else:
            x, pending = self._layers(s, kv, lora, x, cos, sin, ops)
        if pending is not None:
            x = x + pending
        last = x if s.every_token_last else x[s.last_token_index]
        return rms_norm(last, w["norm"], cfg.rms_norm_eps)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` fp32 of the normed last hidden states ``[B, hidden]`` (see :meth:`forward`)."""
        if self.tp == 1:
            return self._head(last)
        return self._gather_logits(last, self._own_columns(last))

    def _own_columns(self, last: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits, ``[B, vocab_hi - vocab_lo]`` fp32 (zero wide for a rank
        whose span is empty)."""
        return self._head(last) if self.vocab_hi > self.vocab_lo else last.new_zeros(len(last), 0).float()

    def _gather_logits(self, last: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """Join the ranks' vocabulary columns ``part`` (:meth:`_own_columns`) into logits: whole on rank 0 where
        ``gather_logits_fn`` gathers them, whole on every rank through the all-reduce otherwise."""
        if self.gather_logits_fn is not None:  # only rank 0 samples: it gathers the other ranks' vocab columns
            return self.gather_logits_fn(part.contiguous(), self.vocab_spans)
        logits = last.new_zeros(last.shape[0], self.vocab, dtype=torch.float32)
        if part.shape[-1]:
            logits[:, self.vocab_lo : self.vocab_hi] = part
        return self._all_reduce(logits)
