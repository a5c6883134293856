"""Host copies of adapter shards, keyed so that two different tensors can never share an entry.

A key names the adapter uid, layer, module, A/B and the TP shard (rank of size); each entry remembers its
shape and dtype, and a key that meets a different shape or dtype raises instead of silently serving the
wrong bytes. Host memory is pinned only where CUDA exists (pinning buys faster host-to-device copies).
"""

from __future__ import annotations

import msgspec
import torch


class CacheKey(msgspec.Struct, frozen=True, order=True):
    """Identity of one host tensor."""

    uid: str
    layer: int
    module: str  # a module (q_proj ...), or a fused projection (qkv ...) for "AF"
    which: str  # "A", "B", or for the C kernel read in place "AF" (a fused projection's A) / "BP" (B packed)
    tp_rank: int
    tp_size: int
    layers: int = 1  # the tensor stacks layers layer .. layer + layers - 1 on dim 0 (1: one layer's matrix)

    def __str__(self) -> str:
        where = f"layer {self.layer}" if self.layers == 1 else f"layers {self.layer}-{self.layer + self.layers - 1}"
        return f"({self.uid}, {where}, {self.module}.lora_{self.which}, tp {self.tp_rank}/{self.tp_size})"


class LoraCacheCollision(RuntimeError):
    """A cache key met a tensor of another shape or dtype (a bug upstream; never served)."""


class HostWeightCache:
    """``CacheKey -> tensor`` with shape/dtype checks on every put and get."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._t: dict[CacheKey, torch.Tensor] = {}
        self._by_uid: dict[str, set[CacheKey]] = {}  # so dropping an adapter does not scan every key

    def _check(self, key: CacheKey, cached: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if tuple(cached.shape) != tuple(shape) or cached.dtype != dtype:
            raise LoraCacheCollision(
                f"LoRA pinned weight cache key collision for {key}: cached shape={tuple(cached.shape)}, "
                f"dtype={cached.dtype}; new shape={tuple(shape)}, dtype={dtype}"
            )

    def put(self, key: CacheKey, t: torch.Tensor) -> torch.Tensor:
        """Store ``t`` (pinned on CUDA machines). Raises LoraCacheCollision if ``key`` holds another shape/dtype."""
        old = self._t.get(key)
        if old is not None:
            self._check(key, old, tuple(t.shape), t.dtype)
        host = t.contiguous()
        if self.pin and not host.is_pinned():
            host = host.pin_memory()
        self._t[key] = host
        self._by_uid.setdefault(key.uid, set()).add(key)
        return host

    def get(self, key: CacheKey, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor under ``key``, checked against the shape and dtype the caller expects."""
        t = self._t[key]
        self._check(key, t, shape, dtype)
        return t

    def drop_uid(self, uid: str) -> None:
        """Forget every tensor of adapter ``uid``."""
        for k in self._by_uid.pop(uid, ()):
            del self._t[k]

    def __len__(self) -> int:
        return len(self._t)
