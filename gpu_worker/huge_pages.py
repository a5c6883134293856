"""Transparent huge pages (2 MiB) for a CPU worker's large buffers: weights, KV cache, LoRA arenas.

Why: a decode step streams every weight from memory once. On 4 KiB pages each page costs a TLB miss and the
hardware prefetchers stop at every page boundary; on 2 MiB pages neither happens. Measured on the 2-core Xeon
(AMX class), one 270 MB fp32 ``sum``: 18.2-19.0 GB/s on 4 KiB pages, 23.8-24.1 GB/s on 2 MiB pages.
Linux's THP setting is often ``madvise`` (so on this machine): memory gets huge pages only where the program asks,
with ``madvise(MADV_HUGEPAGE)``, before the memory is first touched. This module asks.

It is advice, never a requirement: on another OS, with THP set to ``never``, or when the kernel finds no free
2 MiB page, the buffers are ordinary memory and everything works the same. ``LOOM_HUGE_PAGES=0`` turns it off
(for A/B measurements). GPU tensors are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable
from functools import cache

import torch

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes of one x86-64 / arm64 (4 KiB granule) transparent huge page
MADV_HUGEPAGE = 14  # <linux/mman.h>
MIN_BYTES = HUGE  # smaller buffers cannot hold a whole huge page; they stay plain allocations


def enabled() -> bool:
    """True on Linux unless ``LOOM_HUGE_PAGES=0``."""
    return sys.platform == "linux" and os.environ.get("LOOM_HUGE_PAGES", "1") != "0"


@cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def empty(shape: Iterable[int] | int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` whose memory starts on a 2 MiB boundary and is advised
    ``MADV_HUGEPAGE`` before anything touches it, for CPU buffers of at least :data:`MIN_BYTES` (others, and any
    failed advice, give a plain ``torch.empty``). The returned tensor is contiguous; it is a view of a slightly
    larger allocation (up to 2 MiB more address space, never touched, so no more resident memory).
    """
    size = torch.Size([shape] if isinstance(shape, int) else list(shape))
    nbytes = size.numel() * torch.empty((), dtype=dtype).element_size()
    device = torch.device(device)
    madvise = _madvise()
    if device.type != "cpu" or nbytes < MIN_BYTES or not enabled() or madvise is None:
        return torch.empty(size, dtype=dtype, device=device)
    # the advice covers the whole huge pages inside the buffer: a partial one past its end would be resident
    # in full once touched (up to 2 MiB more per buffer)
    span = nbytes // HUGE * HUGE
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    base = raw.data_ptr()
    skip = -base % HUGE
    if madvise(base + skip, span, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return raw[skip : skip + nbytes].view(dtype).view(size)


def zeros(shape: Iterable[int] | int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`empty`, zero-filled (the first touch, so the advice applies)."""
    return empty(shape, dtype, device).zero_()


def _tensors(obj: object, found: list[torch.Tensor], depth: int = 0) -> None:
    """Strided CPU tensors reachable from ``obj`` through dicts, lists, tuples and (one level of) object
    attributes, e.g. the weights dict of :func:`gpu_worker.weights.load_shard` and its quantised linears."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and obj.layout == torch.strided and not obj.is_mkldnn:
            found.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, found, depth)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, found, depth)
    elif depth == 0 and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            _tensors(v, found, depth + 1)


def move_to_huge_pages(root: object) -> int:
    """Copy every CPU tensor reachable from ``root`` (see :func:`_tensors`) into one huge-page buffer and point
    the tensors at it in place (``Tensor.set_``), so every holder of those tensor objects sees the new memory and
    the old storages are freed. Tensors sharing a storage (views, tied weights) keep sharing it. Returns the bytes
    moved (0 when disabled or nothing is large enough).

    Call it before anything records the tensors' ``data_ptr()`` (the worker does, right after loading), and only
    on tensors whose other views are reachable too: a view left out keeps the old storage alive (correct, since
    weights are read-only, but it doubles that storage's memory).
    """
    if not enabled() or _madvise() is None:
        return 0
    found: list[torch.Tensor] = []
    _tensors(root, found)
    groups: dict[int, dict[int, torch.Tensor]] = {}  # storage address -> the tensors on it, each object once
    for t in found:
        groups.setdefault(t.untyped_storage().data_ptr(), {})[id(t)] = t
    total = sum(-(-next(iter(ts.values())).untyped_storage().nbytes() // 64) * 64 for ts in groups.values())
    if total < MIN_BYTES:
        return 0
    arena = empty(total, torch.uint8)
    new = arena.untyped_storage()
    off = arena.data_ptr() - new.data_ptr()  # the arena's own offset in its (larger) allocation, 64-byte aligned
    for ts in groups.values():
        old = next(iter(ts.values())).untyped_storage()
        n = old.nbytes()
        arena[off - arena.storage_offset() :][:n].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        for t in ts.values():  # rebound storage by storage, so each old one is freed at once (peak: one storage more)
            t.set_(new, off // t.element_size() + t.storage_offset(), t.shape, t.stride())
        del old, ts
        off += -(-n // 64) * 64
    return total


def anon_huge_bytes() -> int:
    """Bytes of this process's anonymous memory on huge pages (``AnonHugePages`` of /proc/self/smaps_rollup);
    0 where that file does not exist."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def status() -> str:
    """One line for the logs: the system's THP mode and how much of this process is on huge pages."""
    if not enabled():
        return "huge pages off (LOOM_HUGE_PAGES=0)" if sys.platform == "linux" else "no huge pages on this OS"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = "unknown"
    return f"THP mode {mode}, {anon_huge_bytes() / 1e6:.0f} MB of this process on huge pages"
