"""The worker's paged KV cache: token-slot tensors per layer and the request -> token-slot table.

The scheduler owns the accounting (which slots are free, which request row is used); the worker owns the
tensors. Page size is one token, so a request's KV lives in any free slots (no fragmentation).
"""

from __future__ import annotations

import torch

from gpu_worker import huge_pages


class KVCache:
    """K and V tensors, each ``[num_slots, kv_heads_local, head_dim]`` per layer, plus ``req_to_token``.

    ``req_to_token[req_idx, pos]`` (int64, ``[max_running, context_len]``) is the slot holding position
    ``pos`` of the request in row ``req_idx``.

    The tensors hold one slot more than ``num_slots``: ``null_slot`` (= ``num_slots``) stays all zeros, is never
    handed out, and is what padded positions of a decode group read. A padded position that read some other
    request's slot could meet an infinite K or V there (an adapter whose activations overflow), and a mask's
    zero weight times inf is NaN: another request's output would fail.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        max_running: int,
        context_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.null_slot = num_slots
        shape = (num_slots + 1, kv_heads, head_dim)
        # huge pages on CPU: decode attention streams each request's history from here (gpu_worker.huge_pages)
        self.k = [huge_pages.zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [huge_pages.zeros(shape, dtype, device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros(max_running, context_len, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token slot costs on one rank (K and V, all layers)."""
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def host_memory_available() -> int | None:
    """Bytes the kernel could still give this process: ``MemAvailable`` plus ``SwapFree`` from /proc/meminfo
    (None where there is no such file). The CPU KV cache's pages become resident only as tokens are written
    (``huge_pages.zeros``), so a pool larger than this would not fail when allocated but mid-serving, under the
    OOM killer; the worker checks it at start-up instead."""
    try:
        with open("/proc/meminfo") as f:
            fields = {k: v for k, _, v in (line.partition(":") for line in f)}
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError, IndexError):
        return None
