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


def make_shard_plan(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int, rank: int) -> ShardPlan:
    """Shard plan for ``rank`` of ``tp_size``: KV-head groups as evenly as they go, the FFN evenly.

    The FFN split stays even when the KV heads split unevenly: attention and the MLP are separated by an
    all-reduce, a barrier, so giving the rank with fewer heads more FFN columns cannot make up for its shorter
    attention; it only makes the other rank wait in the MLP as well. (An earlier "balanced" split that evened
    out the ranks' total GEMM work per token, 672/864 FFN columns for SmolLM2 at TP=2, ran 0-4% slower than
    768/768 in paired runs: ``bench/paired_clusters.py``.)

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
    return ShardPlan(rank=rank, tp_size=tp_size, q_heads=(kv[0] * group, kv[1] * group), kv_heads=kv, ffn=ffn)


def plan_for_model(cfg: ModelConfig, tp_size: int, rank: int) -> ShardPlan:
    """The shard plan every component uses for ``cfg`` (see :func:`make_shard_plan`)."""
    return make_shard_plan(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp_size, rank)
