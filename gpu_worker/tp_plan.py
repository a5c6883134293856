"""How a TP rank's shard of each layer is cut (Megatron-LM column/row split, attention by KV-head group).

Attention is split by KV-head *group*: each rank owns whole KV heads and the query heads that read them,
so no rank needs another's K/V. When the TP size does not divide the KV-head count the split is uneven
(the first ranks take one more group): SmolLM2 has 9 query / 3 KV heads, so at TP=2 rank 0 owns KV heads
0-1 with query heads 0-5 and rank 1 owns KV head 2 with query heads 6-8.
"""

from __future__ import annotations

import msgspec

from ipc.model_config import ModelConfig


class ShardPlan(msgspec.Struct, frozen=True):
    """Index ranges ``[start, end)`` (in heads or features) one rank owns."""

    rank: int
    tp_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]  # slice of intermediate_size

    @property
    def num_q_heads(self) -> int:
        """Query heads on this rank."""
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank."""
        return self.kv_heads[1] - self.kv_heads[0]


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


FFN_ALIGN = 32  # FFN cut points fall on multiples of this (a GGUF block is 32 weights along down_proj's input)


def _balanced_ffn(
    kv_splits: list[tuple[int, int]], group: int, head_dim: int, intermediate_size: int
) -> list[tuple[int, int]] | None:
    """FFN column ranges that even out each rank's GEMM work per token, or None where an even split must do.

    Per token a rank multiplies ``hidden * head_dim * 2 * (q_heads + kv_heads)`` weights in attention (q and o
    per query head, k and v per KV head) and ``3 * hidden * ffn`` in the MLP. An uneven KV-head split (SmolLM2's 3
    KV heads at TP=2: 6+2 heads against 3+1) leaves the rank with more heads doing more work, and the other waits
    at every all-reduce; giving it fewer FFN columns evens the totals (hidden cancels out).
    """
    tp = len(kv_splits)
    attn = [head_dim * 2 * ((b - a) * group + (b - a)) for a, b in kv_splits]
    target = (sum(attn) + 3 * intermediate_size) / tp
    cuts, acc = [0], 0.0
    for r in range(tp - 1):
        acc += max(0.0, (target - attn[r]) / 3)
        cuts.append(min(intermediate_size, max(cuts[-1], round(acc / FFN_ALIGN) * FFN_ALIGN)))
    cuts.append(intermediate_size)
    ranges = list(zip(cuts, cuts[1:], strict=False))
    if any(b - a < intermediate_size // (2 * tp) for a, b in ranges):
        return None  # tiny or odd shapes: keep every rank's MLP a fair size
    return ranges


def make_shard_plan(
    num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int, rank: int, head_dim: int = 0
) -> ShardPlan:
    """Shard plan for ``rank`` of ``tp_size``.

    With ``head_dim`` given, the FFN split evens out the ranks' GEMM work when the KV heads split unevenly
    (:func:`_balanced_ffn`); without it (or where that cannot apply) the FFN splits evenly.

    Raises:
        ValueError: ``tp_size`` exceeds the KV-head count (a rank would own no attention heads).
    """
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"bad TP rank {rank} of {tp_size}")
    if tp_size > num_kv_heads:
        raise ValueError(f"--tp-size {tp_size} exceeds the model's {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    kv = _split(num_kv_heads, tp_size, rank)
    ffn = _split(intermediate_size, tp_size, rank)
    if head_dim and tp_size > 1:
        kv_splits = [_split(num_kv_heads, tp_size, r) for r in range(tp_size)]
        ffn = (_balanced_ffn(kv_splits, group, head_dim, intermediate_size) or [ffn] * tp_size)[rank]
    return ShardPlan(rank=rank, tp_size=tp_size, q_heads=(kv[0] * group, kv[1] * group), kv_heads=kv, ffn=ffn)


def plan_for_model(cfg: ModelConfig, tp_size: int, rank: int) -> ShardPlan:
    """The shard plan every component uses for ``cfg`` (balanced FFN split; see :func:`make_shard_plan`)."""
    return make_shard_plan(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp_size, rank, head_dim=cfg.head_dim)
