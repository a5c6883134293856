"""Transparent huge pages (2 MiB) for a CPU worker's large buffers: weights, KV cache, LoRA slot arenas.

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
import mmap
import sys
from collections.abc import Iterable
from functools import cache

import torch

from gpu_worker.env_switch import switch_on

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes of one x86-64 / arm64 (4 KiB granule) transparent huge page
MADV_HUGEPAGE = 14  # <linux/mman.h>
MIN_BYTES = HUGE  # smaller buffers cannot hold a whole huge page; they stay plain allocations


def enabled() -> bool:
    """True on Linux unless ``LOOM_HUGE_PAGES`` is ``0`` (or ``false``, ``off``, ``no``); any value that is
    neither on nor off is logged once as a warning and leaves huge pages on (:func:`env_switch.switch_on`)."""
    return sys.platform == "linux" and switch_on("LOOM_HUGE_PAGES")


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
    larger anonymous mapping of its own (up to 2 MiB more address space, never touched, so no more resident
    memory), unmapped when the last view of it goes.
    """
    size = torch.Size([shape] if isinstance(shape, int) else list(shape))
    mapped = _fresh_mapping(size, dtype, torch.device(device))
    return torch.empty(size, dtype=dtype, device=device) if mapped is None else mapped


def _fresh_mapping(size: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """:func:`empty`'s advised buffer, or None where it gives a plain ``torch.empty`` instead."""
    nbytes = size.numel() * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if device.type != "cpu" or nbytes < MIN_BYTES or not enabled() or madvise is None:
        return None
    # the advice covers the whole huge pages inside the buffer: a partial one past its end would be resident
    # in full once touched (up to 2 MiB more per buffer)
    span = nbytes // HUGE * HUGE
    # a fresh anonymous mapping, never touched: memory from malloc may be a reused, already-faulted heap chunk,
    # and advice does not change pages that exist (glibc serves up to 32 MiB from its heap once large blocks were
    # freed, as loading does). The tensor keeps the mapping alive; it is unmapped with the last view.
    try:
        raw = torch.frombuffer(
            mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8
        )
    except (OSError, ValueError):
        return None
    base = raw.data_ptr()
    skip = -base % HUGE
    if madvise(base + skip, span, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return raw[skip : skip + nbytes].view(dtype).view(size)


def zeros(shape: Iterable[int] | int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`empty`, all zeros. A fresh anonymous mapping already reads as zeros (the kernel zero-fills each page
    when it is first touched), so it is returned untouched: its pages, on 2 MiB pages as advised, become resident
    only as they are written. A worker's 1.5 GB fp32 KV cache took ~1 s of start-up to zero-fill, and held all of it
    resident from the start, however few tokens were ever cached. Other buffers are zero-filled."""
    size = torch.Size([shape] if isinstance(shape, int) else list(shape))
    mapped = _fresh_mapping(size, dtype, torch.device(device))
    return torch.zeros(size, dtype=dtype, device=device) if mapped is None else mapped


def _tensors(obj: object, found: list[torch.Tensor], depth: int = 0) -> None:
    """Strided CPU tensors reachable from ``obj`` through dicts, lists, tuples and (one level of) object
    attributes, e.g. the weights dict of :func:`gpu_worker.weights.load_shard` and its quantised linears, and the
    base tensor of every view among them (a base left behind would keep the old storage alive)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and obj.layout == torch.strided and not obj.is_mkldnn:
            found.append(obj)
            if obj._base is not None:
                _tensors(obj._base, found, depth)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, found, depth)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, found, depth)
    elif depth == 0 and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            _tensors(v, found, depth + 1)


def _regions(tensors: list[torch.Tensor]) -> list[tuple[int, int, list[torch.Tensor]]]:
    """The tensors grouped by the memory their storages span: ``(start, end, tensors)`` byte ranges, storages
    that overlap (views, tied weights, two ``from_numpy`` of one array) merged, so they keep sharing once moved."""
    spans = sorted(
        ((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t) for t in tensors), key=lambda x: x[:2]
    )
    out: list[tuple[int, int, list[torch.Tensor]]] = []
    for ptr, n, t in spans:
        if out and ptr < out[-1][1]:
            start, end, ts = out[-1]
            out[-1] = (start, max(end, ptr + n), [*ts, t])
        else:
            out.append((ptr, ptr + n, [t]))
    return out


def _movable(start: int, ts: list[torch.Tensor]) -> bool:
    """Whether ``set_`` can repoint all of a region's tensors: no autograd or inference tensors, and each one's
    place expressible in its own elements from the region's start."""
    return all(
        not t.requires_grad
        and not t.is_inference()
        and (t.untyped_storage().data_ptr() - start) % t.element_size() == 0
        for t in ts
    )


def move_to_huge_pages(root: object) -> int:
    """Copy every CPU tensor reachable from ``root`` (see :func:`_tensors`) into one huge-page buffer and point
    the tensors at it in place (``Tensor.set_``), so every holder of those tensor objects sees the new memory and
    the old storages are freed. Tensors sharing memory (views and their bases, tied weights, overlapping storages)
    keep sharing it. Returns the bytes moved: 0 when disabled, when too little is found, or when the buffer cannot
    be allocated (advice, never a requirement: the tensors then stay where they are). A region holding a tensor
    that needs autograd or is an inference tensor is left in place.

    Call it before anything records the tensors' ``data_ptr()`` (the worker does, right after loading). A view not
    reachable from ``root`` keeps its old storage alive: correct, since weights are read-only, but held twice.
    """
    if not enabled() or _madvise() is None:
        return 0
    found: list[torch.Tensor] = []
    _tensors(root, found)
    unique = list({id(t): t for t in found}.values())  # a tied weight is reachable twice: repoint it once
    regions = [(a, b, ts) for a, b, ts in _regions(unique) if _movable(a, ts)]
    total = sum(-(-(b - a) // 64) * 64 for a, b, _ in regions)
    if total < MIN_BYTES:
        return 0
    try:
        arena = empty(total, torch.uint8)
    except (RuntimeError, MemoryError) as e:
        log.warning("huge pages: no %d-byte buffer for the weights, left where they are (%s)", total, e)
        return 0
    new = arena.untyped_storage()
    off = arena.data_ptr() - new.data_ptr()  # the arena's own offset in its (larger) allocation, 64-byte aligned
    for start, end, ts in regions:
        dst = arena[off - arena.storage_offset() :]
        copied = set()
        for t in ts:  # each storage once; overlapping ones write the same bytes to the same place
            s = t.untyped_storage()
            if (s.data_ptr(), s.nbytes()) not in copied:
                copied.add((s.data_ptr(), s.nbytes()))
                at = s.data_ptr() - start
                dst[at : at + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
        for t in ts:  # repointed region by region, so each old storage is freed at once (peak: one region more)
            at = off + t.untyped_storage().data_ptr() - start
            t.set_(new, at // t.element_size() + t.storage_offset(), t.shape, t.stride())
        del ts, t, s
        off += -(-(end - start) // 64) * 64
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


def thp_mode() -> str:
    """The system's transparent-huge-page mode (``always``, ``madvise``, ``never``), or ``unknown``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def status() -> str:
    """One line for the logs: the system's THP mode and how much of this process is on huge pages."""
    if not enabled():
        return "huge pages off (LOOM_HUGE_PAGES=0)" if sys.platform == "linux" else "no huge pages on this OS"
    return f"THP mode {thp_mode()}, {anon_huge_bytes() / 1e6:.0f} MB of this process on huge pages"
