"""Batched 4-bit GEMM in C (``csrc/int4_batch.c``), over the same packed weights as PyTorch's 4-bit kernel, on AMX
or, on CPUs without AMX, on AVX512-BF16 dot products, or on AVX2 fp32 FMAs.

PyTorch's ``_weight_int4pack_mm_for_cpu`` dequantises every weight again for every few rows of input, so a decode
batch of 32 costs it ~30x one row, and the 4-bit model was half as fast as bf16 at 32 concurrent requests. The C
kernels read PyTorch's packed layout in place (no second copy of the weights), so each call can take either kernel:
the C one from ``min_rows`` rows up, where a start-up timing (cached per machine, TP ranks agreeing) finds it faster.

- ``loom_int4_amx`` (Intel Sapphire Rapids and later) dequantises each 64-row block of the weight once per call into
  bf16 tiles and multiplies on AMX. It feeds AMX the fp32 weight ``(q - 8) * scale + zero`` as two bf16 parts (the
  weight rounded to bf16, then the remainder), so it keeps 16 bits of each weight: rounding the weight to bf16 once
  would make the 4-bit model's logits as far from the fp32 ones as the bf16 model's are (measured: max logit error
  1.00 against PyTorch's kernel's 0.85; the two parts give back 0.85).
- ``loom_int4_dot`` (AVX512-BF16 without AMX: AMD Zen 4 and later, Intel Cooper Lake) multiplies the integer codes
  ``q - 8`` (exact in bf16) with ``vdpbf16ps`` and applies each group's scale and zero to the group's sums
  (``csrc/group_dot.h``): the weights the blocks encode, at 1.125x a bf16 GEMM's vector instructions instead of
  the 2x two parts would cost on vector units.

- ``loom_int4_fma32`` / ``loom_int4_fma64`` (AVX2 and FMA, neither of the above: AMD Zen 1-3, Intel Haswell and
  later client parts) dequantise one group of a 32-row half to fp32 in L1 at a time and multiply with fp32 FMAs
  (``csrc/fma_gemm.h``). PyTorch packs 4-bit weights in 64-row blocks where its CPU capability is AVX-512 and in
  32-row blocks on AVX2 (:func:`torch_int4_block`, probed once), and this kernel reads either; the two above read
  64-row blocks only and are refused otherwise.

All accumulate in fp32; their products are within fp32 rounding of the fp32-dequantised weight's.

For a few rows (decode at batch 1 to a few), ``loom_int4_gemv512`` (AVX-512) and ``loom_int4_gemv_avx2_32``/``_64``
(AVX2 and FMA) stream the same packed weights once with one FMA per weight, the group's scale and zero factored out
of its sum (``csrc/int4_gemv.h``), where PyTorch's kernel spends a second FMA per weight on dequantising it. They take
over from PyTorch's kernel up to :class:`GemvKernel`'s ``max_rows``, measured once per machine like the batch
threshold.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from gpu_worker.native_build import CSRC, load_library
from gpu_worker.timing import agreed_choice, best_time

log = logging.getLogger(__name__)

SOURCE = CSRC / "int4_batch.c"
ROW_BLOCK = 64  # the C kernels need N_pad to be a whole number of 64 rows (PyTorch's largest packing block)
_I64, _I32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES = [_I64, _I64, _I64, _P, _I64, _I32, _P, _I64, _I32, _I64, _P, _P]
# the C entry points by instruction set, best first; a kernel not built in (or refused by the OS) returns rc 3
ISAS = {"AMX": "loom_int4_amx", "AVX512-BF16": "loom_int4_dot", "AVX2-FMA": "loom_int4_fma"}  # fma + the block
Q8_ENTRY = {
    "AMX": "loom_q8_amx",
    "AVX512-BF16": "loom_q8_dot",
    "AVX2-FMA": "loom_q8_fma",
}  # csrc/q8_linear.c's batch kernel on the same ISA
# the few-row GEMV entry points by instruction set, best first (AVX2-FMA: + the packing block, 32 or 64)
GEMV_ISAS = {"AVX-512": "loom_int4_gemv512", "AVX2-FMA": "loom_int4_gemv_avx2_"}
GEMV_NOTES: dict[Path, str] = {}  # why load_int4_gemv(cache_dir) found no GEMV, where it knows
NEVER = 1 << 30  # the batch threshold of a kernel never faster than PyTorch's (the TP ranks take the highest)

# why the last load_int4_batch(cache_dir) has no kernel, or runs it single-threaded ("" = built with OpenMP)
LOAD_NOTES: dict[Path, str] = {}


@dataclass(frozen=True)
class BatchKernel:
    """A C batch kernel and the batch size from which :class:`gpu_worker.quant.Int4Linear` uses it.

    Attributes:
        fn: the C function (``batch_mm``'s ``fn``). min_rows: the smallest batch it takes.
        isa: its instruction set, a key of :data:`ISAS` (the 8-bit head's batch kernel takes the same one).
    """

    fn: ctypes._CFuncPtr  # type: ignore[name-defined]
    min_rows: int
    isa: str


@dataclass(frozen=True)
class GemvKernel:
    """A C few-row GEMV and the largest batch for which :class:`gpu_worker.quant.Int4Linear` uses it.

    Attributes:
        fn: the C function (``batch_mm``'s ``fn``). max_rows: the largest batch it takes (smaller ones too).
        isa: its instruction set, a key of :data:`GEMV_ISAS`.
    """

    fn: ctypes._CFuncPtr  # type: ignore[name-defined]
    max_rows: int
    isa: str


def int4_layout(q: torch.Tensor, block: int) -> torch.Tensor:
    """``q [N, K]`` (codes 0..15, N a multiple of ``block``) as PyTorch's CPU 4-bit packing in ``block``-row blocks
    would write it, ``[N, K/2]`` uint8: byte j of (block b, input k) holds row ``b * block + j`` in its low nibble
    and row ``b * block + block / 2 + j`` in its high one (64 on AVX-512, 32 on AVX2)."""
    n, k = q.shape
    qb = q.to(torch.uint8).view(n // block, 2, block // 2, k)  # [blocks, low/high half, j, k]
    return (qb[:, 0] | (qb[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


@cache
def torch_int4_block() -> int:
    """Rows per block of PyTorch's CPU 4-bit packing on this machine: 64 (its AVX-512 layout), 32 (its AVX2 one), or
    0 for any other (e.g. its DEFAULT capability's, which pairs adjacent rows in a byte), which no C kernel reads.
    Found by packing a random probe weight and comparing it with :func:`int4_layout` byte for byte."""
    q = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for block in (64, 32):
        if packed.dtype == torch.uint8 and torch.equal(packed, int4_layout(q, block)):
            return block
    return 0


def capability() -> str:
    """PyTorch's CPU capability (``ATEN_CPU_CAPABILITY`` or detected), which decides its 4-bit packing."""
    return str(torch.backends.cpu.get_cpu_capability())


@cache
def load_int4_kernel(cache_dir: Path, isa: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C batch kernel for ``isa`` (a key of :data:`ISAS`; argtypes set), built into ``cache_dir`` on first use;
    None (the reason logged and kept in ``LOAD_NOTES[cache_dir]``) without a compiler, or where the CPU (or, for
    AMX, the OS) does not have that ISA."""
    lib, note = load_library(SOURCE, cache_dir)
    if lib is None:
        if LOAD_NOTES.get(cache_dir) != note:  # once, not once per ISA tried: the library serves them all
            log.info("4-bit batch kernels unavailable: %s", note)
        LOAD_NOTES[cache_dir] = note
        return None
    block = torch_int4_block()
    if block == 0 or (isa != "AVX2-FMA" and block != 64):
        what = f"in {block}-row blocks" if block else f"in a layout Loom does not know (CPU capability {capability()})"
        LOAD_NOTES[cache_dir] = f"PyTorch packs 4-bit weights {what} here, which the {isa} kernel does not read"
        log.info("4-bit %s batch kernel unavailable: %s", isa, LOAD_NOTES[cache_dir])
        return None
    fn = _entry(lib, ISAS[isa] + (str(block) if isa == "AVX2-FMA" else ""))
    if fn is None:
        LOAD_NOTES[cache_dir] = f"this CPU (or its OS) has no {isa}"
        log.info("4-bit %s batch kernel unavailable: %s", isa, LOAD_NOTES[cache_dir])
        return None
    LOAD_NOTES[cache_dir] = note
    if note:
        log.warning("4-bit %s batch kernel runs %s", isa, note)
    return fn


def _entry(lib: ctypes.CDLL, name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernel ``name`` of ``lib`` with its argtypes set, or None where one tiny call says its ISA is not built in
    (or, for AMX, that the OS refused the tiles)."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    # the tensors are named: a temporary's memory would be freed before the call
    x, w, sz = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(64, 16, dtype=torch.uint8), torch.zeros(1, 64, 2)
    try:
        batch_mm(fn, x, w, sz.to(torch.bfloat16), 64)
    except ValueError:
        return None
    return fn


@cache
def load_int4_gemv(cache_dir: Path) -> tuple[ctypes._CFuncPtr, str] | None:  # type: ignore[name-defined]
    """The best few-row GEMV (:data:`GEMV_ISAS`) this CPU runs over PyTorch's packing here, built into ``cache_dir``
    on first use, and its ISA; None without a compiler, a known packing, or AVX2 with FMA."""
    lib, note = load_library(SOURCE, cache_dir)
    block = torch_int4_block()
    if lib is None or block == 0:
        GEMV_NOTES[cache_dir] = note if lib is None else "PyTorch's 4-bit packing here is not one the GEMV reads"
        return None
    for isa, name in GEMV_ISAS.items():
        if isa == "AVX-512" and block != 64:
            continue
        fn = _entry(lib, name + (str(block) if isa == "AVX2-FMA" else ""))
        if fn is not None:
            return fn, isa
    return None


def load_int4_batch(cache_dir: Path) -> tuple[ctypes._CFuncPtr, str] | None:  # type: ignore[name-defined]
    """The best C batch kernel this CPU runs (:func:`load_int4_kernel` over :data:`ISAS` in order) and its ISA;
    None where there is none (the reason kept in ``LOAD_NOTES[cache_dir]``)."""
    for isa in ISAS:
        fn = load_int4_kernel(cache_dir, isa)
        if fn is not None:
            return fn, isa
    if LOAD_NOTES.get(cache_dir, "").startswith("this CPU"):
        LOAD_NOTES[cache_dir] = "this CPU (or its OS) has neither AMX bf16 tiles, AVX512-BF16 nor AVX2 with FMA"
    return None


def batch_mm(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    n_out: int,
) -> torch.Tensor:
    """``x [M, K]`` (fp32/bf16, CPU) times the packed 4-bit weight -> ``[M, n_out]`` in ``x.dtype``, on the C batch
    kernel ``fn`` (``loom_int4_amx``, ``loom_int4_dot`` or ``loom_int4_fma32``/``64``).

    ``packed`` ``[N_pad, K/2]`` uint8 and ``scales_zeros`` ``[K/32, N_pad, 2]`` bf16 are PyTorch's 4-bit CPU layout
    (``gpu_worker.quant.Int4Linear``); ``N_pad`` must be a multiple of :data:`ROW_BLOCK`.

    Raises:
        ValueError: a shape, layout or dtype the kernel does not take.
        MemoryError: the kernel's buffers could not be allocated.
    """
    n_pad, k = packed.shape[0], packed.shape[1] * 2
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[1] != k or n_pad % ROW_BLOCK:
        raise ValueError(f"int4 batch kernel: x {x.dtype} {tuple(x.shape)} for a [{n_pad}, {k}] weight")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], n_out, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    rc = fn(x.shape[0], n_pad, k, x.data_ptr(), x.stride(0), bf16, out.data_ptr(), n_out, bf16, n_out,
            packed.data_ptr(), scales_zeros.data_ptr())  # fmt: skip
    if rc == 2:
        raise MemoryError("int4 batch kernel: out of memory")
    if rc:
        raise ValueError(f"int4 batch kernel refused the call (rc {rc})")
    return out


MARGIN = 1.2  # the C kernel must be this much faster in the start-up timing: near the crossover, the rest of a
# step (and the other rank's threads) tips it either way, and a call measured alone flatters the C kernel


def _gate_weights(count: int) -> list:
    """``count`` distinct random 4-bit ``[1536, 576]`` weights (SmolLM2's gate half) for the start-up timings."""
    from gpu_worker.quant import GROUP, Int4Linear

    g = torch.Generator().manual_seed(0)
    n, k = 1536, 576
    return [
        Int4Linear(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // GROUP, generator=g) * 0.01,
                   torch.zeros(n, k // GROUP))
        for _ in range(count)
    ]  # fmt: skip


def _pair_times(fn: ctypes._CFuncPtr, mats: list, rows: int, g: torch.Generator) -> tuple[float, float]:  # type: ignore[name-defined]
    """Seconds for a random bf16 ``x [rows, 576]`` through every weight of ``mats`` on the C kernel ``fn`` and on
    PyTorch's 4-bit kernel, each the fastest of 5 passes."""
    x = torch.randn(rows, mats[0].in_features, generator=g).to(torch.bfloat16)
    t_c = best_time(lambda: [batch_mm(fn, x, w.packed, w.scales_zeros, w.out_features) for w in mats], 5)
    return t_c, best_time(lambda: [w.mm_torch(x) for w in mats], 5)


def _crossover(fn: ctypes._CFuncPtr, isa: str) -> tuple[int, str]:  # type: ignore[name-defined]
    """The smallest batch in 2, 4, 8, 16, 32 at which the C kernel beats PyTorch's by :data:`MARGIN` through 8
    distinct ``[1536, 576]`` weights (fastest of 5 passes each), 0 if none; and a line with the timings."""
    g, mats = torch.Generator().manual_seed(1), _gate_weights(8)
    parts = []
    for rows in (2, 4, 8, 16, 32):
        t_c, t_torch = _pair_times(fn, mats, rows, g)
        parts.append(f"{rows} rows: {isa} {t_c * 1e6:.0f} us, torch {t_torch * 1e6:.0f} us")
        if t_c * MARGIN < t_torch:
            return rows, f"from {rows} rows ({'; '.join(parts)})"
    return 0, f"never faster ({'; '.join(parts)})"


GEMV_MARGIN = 1.1  # the GEMV must be this much faster than PyTorch's kernel at a batch size to take it


def _gemv_rows(fn: ctypes._CFuncPtr, isa: str) -> tuple[int, str]:  # type: ignore[name-defined]
    """The largest batch in 1, 2, 4, 8 up to which the GEMV beats PyTorch's kernel by :data:`GEMV_MARGIN` at every
    size, through 24 distinct ``[1536, 576]`` weights (12 MB: a decode step streams its weights, so they should not
    all sit in cache; fastest of 5 passes each), 0 if not even at one row; and a line with the timings."""
    g, mats = torch.Generator().manual_seed(1), _gate_weights(24)
    parts, best = [], 0
    for rows in (1, 2, 4, 8):
        t_c, t_torch = _pair_times(fn, mats, rows, g)
        parts.append(f"{rows} rows: {isa} GEMV {t_c * 1e6:.0f} us, torch {t_torch * 1e6:.0f} us")
        if t_c * GEMV_MARGIN >= t_torch:
            break
        best = rows
    return best, "; ".join(parts)


def _choice_key(isa: str) -> str:
    """The cached timings' key: torch's version, the ISA and the kernels' source with every header beside it (an
    edit to either measures again)."""
    headers = b"".join(h.read_bytes() for h in sorted(SOURCE.parent.glob("*.h")))
    return f"{torch.__version__}|{isa}|{hashlib.sha256(SOURCE.read_bytes() + headers).hexdigest()[:16]}"


def choose_gemv_kernel(cache_dir: Path, group: object | None = None) -> tuple[GemvKernel | None, str]:
    """The C few-row GEMV and the largest batch it takes on this machine, or None (PyTorch's kernel below the batch
    kernel's threshold), with a line saying why. Measured once per machine and cached; TP ranks take the smallest
    ``max_rows`` among them (none if any rank lacks a GEMV)."""
    loaded = load_int4_gemv(cache_dir / "kernels")
    isa = loaded[1] if loaded is not None else ""
    measure = None if loaded is None else (lambda: _gemv_rows(loaded[0], isa))
    name, key = "int4-gemv-max-rows", _choice_key(isa)
    agreed, how, own = agreed_choice(cache_dir / "kernel-choice", name, key, measure, group)
    if loaded is None:
        how = f"unavailable: {GEMV_NOTES.get(cache_dir / 'kernels') or 'this CPU has no AVX2 with FMA'}"
    elif agreed != own:
        how += f"; another TP rank {'lacks it' if agreed == 0 else f'takes it up to {agreed} rows'}"
    if not agreed or loaded is None:
        return None, f"4-bit GEMV on PyTorch's kernel ({isa or 'C'} GEMV {how})"
    return GemvKernel(loaded[0], agreed, isa), f"4-bit batches of 1-{agreed} rows on the {isa} GEMV ({how})"


def choose_batch_kernel(cache_dir: Path, group: object | None = None) -> tuple[BatchKernel | None, str]:
    """The C batch kernel and its batch threshold for this machine, or None (PyTorch's kernel for every batch),
    with a line saying why. The threshold is measured once per machine and cached; TP ranks take the largest
    threshold among them (none if any rank lacks a kernel), so every rank switches kernels at the same batch
    size. (Ranks on CPUs of different ISAs would multiply the same weights on different kernels, equal to within
    fp32 rounding.)"""
    loaded = load_int4_batch(cache_dir / "kernels")
    isa = loaded[1] if loaded is not None else ""

    def measure() -> tuple[int, str]:
        assert loaded is not None
        rows, how = _crossover(loaded[0], isa)
        return rows or NEVER, how

    agreed, how, own = agreed_choice(
        cache_dir / "kernel-choice", "int4-batch-min-rows", _choice_key(isa), None if loaded is None else measure,
        group, highest=True, lacking=NEVER, normalize=lambda rows: rows or NEVER,  # 0: "never" in older files
    )  # fmt: skip
    rows = 0 if agreed == NEVER else agreed
    if loaded is None:
        how = f"unavailable: {LOAD_NOTES.get(cache_dir / 'kernels', '')}"
    elif agreed != own:
        how += f"; another TP rank {'lacks the kernel' if agreed == NEVER else f'needs {agreed} rows'}"
    if not rows or loaded is None:
        return None, f"4-bit batches on PyTorch's kernel ({isa or 'C'} batch kernel {how})"
    return BatchKernel(loaded[0], rows, isa), f"4-bit batches of {rows}+ rows on the {isa} kernel ({how})"
