"""The CPU segmented-LoRA kernel (``csrc/lora_sgmv.c``), built once per machine by :mod:`gpu_worker.native_build`.

No compiler, or a build or load that fails, only costs the fast path: :func:`load_sgmv` returns None (saying why)
and the pool keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_worker.bf16_gemm import Bf16GemmLinear
from gpu_worker.env_switch import switch_on
from gpu_worker.native_build import CSRC, load_kernel

SOURCE = CSRC / "lora_sgmv.c"
MAX_IN_DIM = 4096  # the kernel's per-thread row buffers; wider inputs use the torch path
BLOCK_COLS = 32  # output columns per block of an expand buffer (one 64-byte line of bf16 per rank)
TILE_PAD = 16 * 2 * BLOCK_COLS  # elements after an expand arena that AMX's 16-row tiles may read (zeros)


def packed_elems(fout: int, r: int, bf16: bool) -> int:
    """Elements :func:`pack_b` writes for ``[out, r]`` weights: column blocks of all r ranks (bf16: rank pairs)."""
    return -(-fout // BLOCK_COLS) * ((r + 1) // 2 * 2 if bf16 else r) * BLOCK_COLS


def b_row_elems(fout: int) -> int:
    """Elements one rank row takes in an expand arena (one rank of every column block, either dtype): an entry
    whose first rank row is ``start`` begins at element ``start * b_row_elems(fout)``."""
    return -(-fout // BLOCK_COLS) * BLOCK_COLS


def pack_b(b: torch.Tensor, dst: torch.Tensor) -> int:
    """Write expand weights ``b`` ``[..., out, r]`` into slot buffers ``dst`` ``[..., elems]`` in the kernel's
    layout (leading dims, e.g. layers, are packed independently); returns the elements used per matrix.

    The layout is column blocks of :data:`BLOCK_COLS`, each holding all r ranks (zero past ``out``): fp32
    j-major ``[nblocks, r, BLOCK_COLS]``; bf16 in rank pairs ``[nblocks, ceil(r / 2), BLOCK_COLS, 2]`` (the
    "VNNI" layout of AMX and vdpbf16ps; an odd r gets a zero rank).
    """
    *lead, fout, r = b.shape
    nb = -(-fout // BLOCK_COLS)
    bt = F.pad(b.transpose(-1, -2), (0, nb * BLOCK_COLS - fout))  # [..., r, nb * BLOCK_COLS]
    n = packed_elems(fout, r, dst.dtype == torch.bfloat16)
    if dst.dtype == torch.bfloat16:
        rp = (r + 1) // 2
        bt = F.pad(bt, (0, 0, 0, 2 * rp - r)).view(*lead, rp, 2, nb, BLOCK_COLS)
        k = len(lead)
        bt = bt.permute(*range(k), k + 2, k, k + 3, k + 1)
        dst[..., :n].view(*lead, nb, rp, BLOCK_COLS, 2).copy_(bt)
    else:
        dst[..., :n].view(*lead, nb, r, BLOCK_COLS).copy_(bt.view(*lead, r, nb, BLOCK_COLS).transpose(-3, -2))
    return n


def unpack_b(src: torch.Tensor, fout: int, r: int) -> torch.Tensor:
    """The ``[r, out]`` (i.e. ``B^T``) matrix that :func:`pack_b` wrote into ``src``."""
    nb = -(-fout // BLOCK_COLS)
    if src.dtype == torch.bfloat16:
        rp = (r + 1) // 2
        m = src[: nb * rp * 2 * BLOCK_COLS].view(nb, rp, BLOCK_COLS, 2).permute(1, 3, 0, 2)
        return m.reshape(2 * rp, nb * BLOCK_COLS)[:r, :fout]
    return src[: nb * r * BLOCK_COLS].view(nb, r, BLOCK_COLS).transpose(0, 1).reshape(r, nb * BLOCK_COLS)[:, :fout]


# loom_lora_sgmv takes one call block of 11 int64 (see the end of csrc/lora_sgmv.c): the call's x, x_bf16, out,
# out_stride (elements), out_bf16; the address of a (layer, fused projection)'s constant block (SgmvLayerArgs.block:
# in_dim, a_tab, b_tab, w_bf16, nmod, ranks, out_k, col_k); the step's tok (int64: the LoRA tokens' rows, grouped by
# slot), nseg, seg (int64 nseg x 3), u (fp32 scratch), u_stride
_ARGTYPES = [ctypes.c_void_p]


# why the last load_sgmv(cache_dir) has no kernel, or runs it single-threaded ("" = built with OpenMP)
LOAD_NOTES: dict[Path, str] = {}


# loom_lora_sgmv_gemm of the library load_sgmv(cache_dir) last loaded
_GEMM_ENTRY: dict[Path, ctypes._CFuncPtr] = {}  # type: ignore[name-defined]


@cache
def load_sgmv(cache_dir: Path) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The ``loom_lora_sgmv`` C function (argtypes set), building it into ``cache_dir`` on first use.

    A cached build is used only if its recorded sha256 matches (else it is rebuilt). Tries an OpenMP build,
    then a single-threaded one. Returns None when there is no C compiler or neither builds and loads; the
    reason (or the single-threaded fallback's) is logged as a warning and kept in ``LOAD_NOTES[cache_dir]``.
    """
    entries = {"loom_lora_sgmv": _ARGTYPES, "loom_lora_sgmv_gemm": _ARGTYPES}
    lib = load_kernel(SOURCE, cache_dir, "LoRA kernel", LOAD_NOTES, entries, logging.WARNING)
    if lib is None:
        _GEMM_ENTRY.pop(cache_dir, None)
        return None
    _GEMM_ENTRY[cache_dir] = lib.loom_lora_sgmv_gemm
    return lib.loom_lora_sgmv


def load_sgmv_gemm(cache_dir: Path) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``loom_lora_sgmv_gemm``: a projection's bf16 base GEMM (Loom's, :mod:`gpu_worker.bf16_gemm`) and its LoRA in
    one call, the GEMM's panels interleaved with the shrink (see :meth:`SgmvStep.mm_add`); None as
    :func:`load_sgmv`, or where ``LOOM_LORA_GEMM`` is 0 (an A/B switch: the two calls one after the other)."""
    if not switch_on("LOOM_LORA_GEMM"):
        return None
    return None if load_sgmv(cache_dir) is None else _GEMM_ENTRY.get(cache_dir)


class SgmvLayerArgs:
    """The constant arguments of one (layer, fused projection) call: where each slot's weights are, their ranks,
    the sub-modules' widths and column offsets.

    ``a_tab`` int64 ``[slots]`` holds the address of each slot's shrink rows ``[rows, in_dim]`` (row ``j * nmod + k``
    = rank ``j`` of sub-module ``k``, zero past that sub-module's rank, 16 readable rows after the last: AMX reads
    whole 16-row tiles); ``b_tab`` int64 ``[slots, nmod]`` the address of each sub-module's expand weights, written
    by :func:`pack_b` at the slot's rank and followed by at least :data:`TILE_PAD` readable finite elements. Both
    are kept current by their owner (the pool), as is ``ranks`` (int32 ``[slots, nmod]``, 0 = no weights there: the
    kernel never reads that slot's addresses). ``outs`` are the sub-modules' real widths, ``cols`` each one's first
    column in the fused output; ``dtype`` the weights' (fp32 or bf16). The tables, and every buffer they point into,
    must outlive this object.
    """

    def __init__(
        self,
        in_dim: int,
        dtype: torch.dtype,
        a_tab: torch.Tensor,
        b_tab: torch.Tensor,
        ranks: torch.Tensor,
        outs: list[int],
        cols: list[int],
    ) -> None:
        n = len(outs)
        self._keep = (a_tab, b_tab, ranks)
        self.in_dim = in_dim
        self.out_k = (ctypes.c_int64 * n)(*outs)
        self.col_k = (ctypes.c_int64 * n)(*cols)
        # the kernel's constant block for this call site (the arrays above are kept alive by this object)
        self.block = (ctypes.c_int64 * 8)(
            in_dim, a_tab.data_ptr(), b_tab.data_ptr(), int(dtype == torch.bfloat16), n, ranks.data_ptr(),
            ctypes.addressof(self.out_k), ctypes.addressof(self.col_k),
        )  # fmt: skip
        self.addr = ctypes.addressof(self.block)

    @classmethod
    def over_arena(
        cls,
        A: torch.Tensor,
        Bs: list[torch.Tensor],
        outs: list[int],
        ranks: torch.Tensor,
        cols: list[int],
        start: torch.Tensor,
    ) -> SgmvLayerArgs:
        """Arguments for slots packed back to back in one arena per buffer: slot ``s`` takes rank rows from
        ``start[s]`` (int64 ``[slots]``) in the fused shrink arena ``A`` ``[rows, in]`` and in the 1-D expand arenas
        ``Bs`` (from element ``start[s] * b_row_elems(out_k)``); the address tables are computed here."""
        nmod = len(Bs)
        esz = A.element_size()
        st = start.to(torch.int64)
        a_tab = A.data_ptr() + st * (nmod * A.shape[1] * esz)
        b_tab = torch.stack([b.data_ptr() + st * (b_row_elems(o) * esz) for b, o in zip(Bs, outs, strict=True)], 1)
        la = cls(A.shape[1], A.dtype, a_tab.contiguous(), b_tab.contiguous(), ranks, outs, cols)
        la._keep = (*la._keep, A, Bs)
        return la


KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_BF16_FLAG = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype flag of x and out


class SgmvStep:
    """One step's kernel calls: its LoRA tokens, segments and scratch, written once into a call block that each
    :meth:`add` completes with its activations (six values) before calling the kernel.

    ``tok`` int64 ``[P]`` lists the rows with an adapter grouped by slot (so each slot's weights are read once per
    call however its requests interleave with others), ``seg`` int64 ``[nseg, 3]`` holds ``(slot, p0, p1)``
    positions into ``tok``; ``u`` is fp32 scratch ``[P + 8, >= max_rank * nmod]`` whose rows past ``P`` are zero.
    All three are kept alive by this object. One caller at a time: the call block is shared by its calls (a
    worker's forward runs on one thread).

    Why a block per step: the worker makes 120 calls a step (30 layers x 4 fused projections), and packing the
    kernel's 18 arguments per call cost 2.8 us against 0.8 us for this (a hot loop on this 2-core Zen 4); in a
    64-row, 8-adapter decode step the LoRA's time outside the kernel went from 1.07-1.11 ms to 0.75-0.89 ms.
    """

    def __init__(
        self,
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        tok: torch.Tensor,
        seg: torch.Tensor,
        u: torch.Tensor,
        gemm_fn: ctypes._CFuncPtr | None = None,  # type: ignore[name-defined]
    ) -> None:
        self.fn = fn
        self.gemm_fn = gemm_fn  # loom_lora_sgmv_gemm (load_sgmv_gemm), for mm_add; None: mm_add declines
        self._keep = (tok, seg, u)
        step = (tok.data_ptr(), seg.shape[0], seg.data_ptr(), u.data_ptr(), u.stride(0))
        # [:6] written by each call; [11:14] by mm_add's (the GEMM's rows, columns and packed weight)
        self.head = (ctypes.c_int64 * 14)(0, 0, 0, 0, 0, 0, *step, 0, 0, 0)
        self.addr = ctypes.addressof(self.head)

    def add(self, la: SgmvLayerArgs, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[t, cols_k] += (x[t] @ A_k[s]^T) @ B_k[s]`` for each ``t = tok[p]``, ``p0 <= p < p1``, of every
        segment ``(s, p0, p1)``, through ``la``'s weights.

        ``x`` ``[T, in]`` and ``out`` ``[T, out_total]`` are CPU fp32/bf16 tensors; ``out`` must have contiguous
        rows (it is written in place); ``x`` is made contiguous if it is not.

        Raises ValueError for a dtype, width or ``out`` layout the kernel does not take.
        """
        xf, of = _BF16_FLAG.get(x.dtype), _BF16_FLAG.get(out.dtype)
        if xf is None or of is None or out.stride(1) != 1 or x.shape[1] != la.in_dim:
            raise ValueError(
                f"cpu-sgmv takes fp32/bf16 x [T, {la.in_dim}] and out with contiguous rows, got x {x.dtype} "
                f"{tuple(x.shape)}, out {out.dtype} strides {out.stride()}"
            )
        if not x.is_contiguous():
            x = x.contiguous()
        self.head[:6] = (x.data_ptr(), xf, out.data_ptr(), out.stride(0), of, la.addr)
        if self.fn(self.addr):
            raise ValueError(f"cpu-sgmv: input width {la.in_dim} over the kernel's {MAX_IN_DIM}")

    def mm_add(self, la: SgmvLayerArgs, x: torch.Tensor, w: object) -> torch.Tensor | None:
        """``x @ W^T`` with every segment's LoRA delta added, in one kernel call: the same values as ``w.mm(x)``
        followed by :meth:`add` (bit for bit), computed with the GEMM's panels between the shrink's items so that
        the adapters' reads overlap the GEMM's arithmetic. ``x`` ``[T, in]`` bf16; returns ``[T, N]`` bf16.

        Returns None, for the caller to multiply and :meth:`add` as usual, where it does not apply: no
        ``gemm_fn``, ``w`` not a :class:`~gpu_worker.bf16_gemm.Bf16GemmLinear`, ``x`` not bf16 or of another width.
        Raises ValueError for an input wider than the kernel's buffers.
        """
        if self.gemm_fn is None or not isinstance(w, Bf16GemmLinear) or x.dtype != torch.bfloat16:
            return None
        if x.shape[1] != la.in_dim or w.in_features != la.in_dim:
            return None
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty(x.shape[0], w.out_features, dtype=torch.bfloat16)
        self.head[:6] = (x.data_ptr(), 1, out.data_ptr(), out.stride(0), 1, la.addr)
        self.head[11:14] = (x.shape[0], w.out_features, w.wp.data_ptr())
        rc = self.gemm_fn(self.addr)
        if rc == -1:
            raise ValueError(f"cpu-sgmv: input width {la.in_dim} over the kernel's {MAX_IN_DIM}")
        return out if rc == 0 else None


def sgmv_add(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    la: SgmvLayerArgs,
    x: torch.Tensor,
    out: torch.Tensor,
    tok: torch.Tensor,
    seg: torch.Tensor,
    u: torch.Tensor,
) -> None:
    """One call of the kernel outside a step (:class:`SgmvStep` holds the arguments ``tok``, ``seg``, ``u``, and
    :meth:`SgmvStep.add` says what it computes and raises)."""
    SgmvStep(fn, tok, seg, u).add(la, x, out)


def _kernel_beats_torch(fn: ctypes._CFuncPtr, dtype: torch.dtype) -> tuple[bool, str]:  # type: ignore[name-defined]
    """Time one decode-shaped qkv apply (8 slots x 8 tokens, 576 wide, rank 32) both ways; fastest of 15."""
    from gpu_worker.timing import best_time

    n, tm, d, r, outs = 8, 8, 576, 32, (576, 192, 192)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n * tm, d, generator=g).to(dtype)
    out = torch.zeros(n * tm, sum(outs), dtype=dtype)
    a = (torch.randn(n, 3 * r, d, generator=g) * 0.05).to(dtype)
    bs = [(torch.randn(n, r, o, generator=g) * 0.05).to(dtype) for o in outs]
    ranks = torch.full((n, 3), r, dtype=torch.int32)
    start = torch.arange(n, dtype=torch.int64) * r
    arena = torch.cat([a.reshape(n * 3 * r, d), torch.zeros(16, d, dtype=dtype)])
    blocked = [torch.zeros(n * r * b_row_elems(o) + TILE_PAD, dtype=dtype) for o in outs]
    for b, pb, o in zip(bs, blocked, outs, strict=True):
        for s in range(n):
            pack_b(b[s].T, pb[s * r * b_row_elems(o) :])
    la = SgmvLayerArgs.over_arena(arena, blocked, list(outs), ranks, [0, outs[0], outs[0] + outs[1]], start)
    seg = torch.tensor([[s, s * tm, (s + 1) * tm] for s in range(n)], dtype=torch.int64)
    tok = torch.arange(n * tm)
    u = torch.zeros(n * tm + 8, 3 * r)

    def torch_apply(aa: torch.Tensor, bb: list[torch.Tensor]) -> None:
        uu = torch.bmm(x.to(aa.dtype).view(n, tm, d), aa.transpose(1, 2)).view(n, tm, r, 3)
        dd = torch.cat([torch.bmm(uu[:, :, :, k], bb[k]) for k in range(3)], dim=2)
        out.add_(dd.view(n * tm, -1).to(dtype))

    t_kernel = best_time(lambda: sgmv_add(fn, la, x, out, tok, seg, u), 15)
    t_torch = best_time(lambda: torch_apply(a, bs), 15)
    if dtype != torch.float32:  # the torch path may hold fp32 slots on CPUs with slow half GEMMs
        t_torch = min(t_torch, best_time(lambda: torch_apply(a.float(), [b.float() for b in bs]), 15))
    how = f"decode-shaped qkv apply: cpu-sgmv {t_kernel * 1e6:.0f} us, torch {t_torch * 1e6:.0f} us"
    return t_kernel < t_torch, how


def choose_backend(
    requested: str,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path,
    group: object | None = None,
    widest_in: int = 0,
) -> tuple[ctypes._CFuncPtr | None, str]:  # type: ignore[name-defined]
    """``--lora-backend`` resolved: the kernel function (None = the torch path) and a line saying why.

    ``auto`` takes the kernel on CPU when it builds and a start-up timing (cached per machine, like
    ``--quantization auto``) finds it faster; TP ranks vote so all use the same one. ``widest_in`` is the
    widest LoRA input on this rank. Raises RuntimeError for ``cpu-sgmv`` where the kernel cannot run (not a
    CPU, a dtype other than fp32/bf16, an input wider than ``MAX_IN_DIM``, no compiler).
    """
    if requested == "torch":
        return None, "--lora-backend torch"
    fn, how, threads = None, "", ""
    if device.type != "cpu" or dtype not in KERNEL_DTYPES or widest_in > MAX_IN_DIM:
        how = f"the C kernel does not apply: it runs on CPU, fp32/bf16, inputs <= {MAX_IN_DIM} wide (have {device}, "
        how += f"{dtype}, {widest_in})"
    else:
        fn = load_sgmv(cache_dir / "kernels")
        note = LOAD_NOTES.get(cache_dir / "kernels", "")
        how, threads = (f"the C kernel is unavailable: {note}", "") if fn is None else ("", f"; {note}" if note else "")
    if requested == "cpu-sgmv":
        if fn is None:
            raise RuntimeError(f"--lora-backend cpu-sgmv cannot serve here: {how}")
        return fn, f"--lora-backend cpu-sgmv{threads}"
    from gpu_worker.timing import agreed_choice

    key = f"{torch.__version__}|{dtype}|{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}"
    measure = None if fn is None else (lambda: _kernel_beats_torch(fn, dtype))
    # every rank votes, also one without the kernel, so all take the same path
    vote, measured, own = agreed_choice(cache_dir / "kernel-choice", "lora-sgmv-vs-torch", key, measure, group)
    faster = bool(vote)
    if fn is not None:
        how = measured + ("; another TP rank cannot use the kernel or measured it slower" if own and not faster else "")
    return (fn if faster else None), f"auto: {'cpu-sgmv' if faster else 'torch'} ({how}){threads if faster else ''}"
