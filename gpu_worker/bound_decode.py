"""A pure decode step's C kernels bound once for all layers: buffers and argument blocks made per step, not per call.

At one row a layer's C kernels (add + RMSNorm twice, rotary + KV write, decode attention, SiLU * up) each run in
1-10 us, while their checked Python wrappers (``gpu_worker.layer_ops``, ``gpu_worker.decode_attention``) spent
5-13 us per call on checks, allocations and argument packing: ~1 ms of a ~10 ms batch-1 step. Here everything
that is the same for every layer of a step is checked and packed once: the output buffers (reused by every
layer: each is consumed before the next layer writes it), the rotary tables, the KV slots, the slot table and
lengths. A call then checks only the tensor it is handed (dtype, shape, row stride) and sets its pointers.
The caches' and norm weights' addresses are taken per step (they are fixed tensors, but cheap to read again).
"""

from __future__ import annotations

import ctypes

import torch

from gpu_worker.kv_cache import KVCache
from gpu_worker.layer_ops import LayerOps


def _block(*vals: int) -> ctypes.Array:
    return (ctypes.c_int64 * len(vals))(*vals)


class BoundDecode:
    """One pure decode step (one new token per row, every row in one decode group) on the C kernels.

    ``x`` ``[G, n]`` is the residual stream (updated in place by :meth:`add_rms_norm`), fp32 or bf16 with
    contiguous rows; ``heads`` = (nq, nkv, d) local to this rank; ``ffn`` the local MLP width; ``cos``/``sin``
    ``[G, d]`` in ``x.dtype`` (``sin`` signed, see ``LlamaShard._rope``); ``out_slots`` ``[G]`` int64 each row's new
    KV slot; ``index`` ``[G, L]`` int64 each row's slot table and ``lengths`` ``[G]`` int64 (None: all ``L``) -- all
    already range-checked by the worker. The buffers it returns (``h``, the attention output, ``m``) are rewritten
    by the next call of the same method.

    Raises:
        ValueError: a layout the kernels do not take (the caller then runs the per-call wrappers).
    """

    def __init__(
        self,
        ops: LayerOps,
        attn_fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        x: torch.Tensor,
        heads: tuple[int, int, int],
        ffn: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        index: torch.Tensor,
        lengths: torch.Tensor | None,
        kv: KVCache,
        scale: float,
    ) -> None:
        nq, nkv, d = heads
        g, n = x.shape
        dt = x.dtype
        bf = int(dt == torch.bfloat16)
        if (
            dt not in (torch.float32, torch.bfloat16)
            or x.stride(1) != 1
            or cos.shape != (g, d)
            or not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == dt)
            or out_slots.shape != (g,)
            or index.dim() != 2
            or index.dtype != torch.int64
            or out_slots.dtype != torch.int64
            or index.shape[0] != g
            or (lengths is not None and lengths.shape != (g,))
            or kv.k[0].dtype != dt
        ):
            shapes = f"x {dt} {tuple(x.shape)}, cos {tuple(cos.shape)}, index {tuple(index.shape)}"
            raise ValueError(f"bound decode: {shapes}")
        self.lib, self.attn_fn, self.x, self.dtype, self.scale = ops.lib, attn_fn, x, dt, scale
        self.qkv_width, self.ffn, self.width = (nq + 2 * nkv) * d, ffn, n
        # kept alive here: the blocks hold their addresses
        lens = None if lengths is None else lengths.to(torch.int64).contiguous()
        self._keep = (cos, sin, out_slots.contiguous(), index.contiguous(), lens)
        slots, idx = self._keep[2], self._keep[3]
        self.h = torch.empty(g, n, dtype=dt)
        self.a = torch.empty(g, nq * d, dtype=dt)
        self.m = torch.empty(g, ffn, dtype=dt)
        self.k_ptr = [t.data_ptr() for t in kv.k]
        self.v_ptr = [t.data_ptr() for t in kv.v]
        ks1, ks2 = kv.k[0].stride(1), kv.k[0].stride(0)
        # layer_ops.c and decode_attention.c document these layouts (the wrappers pack the same values)
        self.norm_args = _block(g, n, x.data_ptr(), x.stride(0), 0, 0, 0, self.h.data_ptr(), n, bf)
        self.rope_args = _block(g, nq, nkv, d, 0, 0, cos.data_ptr(), sin.data_ptr(), 0, 0, slots.data_ptr(), bf)
        self.silu_args = _block(g, ffn, 0, 0, self.m.data_ptr(), ffn, bf)
        self.attn_args = _block(g, nq, nkv, d, index.shape[1], 0, 0, d, 0, 0, ks1, ks2, 0, 0, ks1, ks2,
                                0 if lens is None else lens.data_ptr(), self.a.data_ptr(), nq * d, d, bf,
                                idx.data_ptr())  # fmt: skip
        self.norm_addr = ctypes.addressof(self.norm_args)
        self.rope_addr = ctypes.addressof(self.rope_args)
        self.silu_addr = ctypes.addressof(self.silu_args)
        self.attn_addr = ctypes.addressof(self.attn_args)

    def _check(self, t: torch.Tensor, width: int, what: str) -> None:
        if t.dtype != self.dtype or t.stride(1) != 1 or t.shape[0] != self.x.shape[0] or t.shape[1] < width:
            raise ValueError(f"bound decode: {what} {t.dtype} {tuple(t.shape)} {tuple(t.stride())}")

    def add_rms_norm(self, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += delta`` in place (None: no add), then ``w * rms_norm(x)`` ``[G, n]`` (the shared ``h`` buffer);
        ``w`` ``[n]`` contiguous in ``x.dtype`` (the model's norm weights, checked when it was loaded)."""
        a = self.norm_args
        if delta is None:
            a[4] = a[5] = 0
        else:
            self._check(delta, self.width, "residual delta")
            a[4], a[5] = delta.data_ptr(), delta.stride(0)
        a[6] = w.data_ptr()
        if self.lib.loom_add_rms_norm(self.norm_addr, eps):
            raise ValueError(f"add_rms_norm refused width {self.width}")
        return self.h

    def rope_attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """Rotary on ``qkv`` ``[G, (nq + 2 nkv) d]``'s q and k in place, each row's k and v into its KV slot of
        ``layer``, then each row's query heads attending to its history -> ``[G, nq d]`` (the shared buffer)."""
        self._check(qkv, self.qkv_width, "qkv")
        q, qs = qkv.data_ptr(), qkv.stride(0)
        kp, vp = self.k_ptr[layer], self.v_ptr[layer]
        r = self.rope_args
        r[4], r[5], r[8], r[9] = q, qs, kp, vp
        if self.lib.loom_rope_store(self.rope_addr):
            raise ValueError("rope_store refused the step's head shape")
        a = self.attn_args
        a[5], a[6], a[8], a[12] = q, qs, kp, vp
        rc = self.attn_fn(self.attn_addr, self.scale)
        if rc == -2:
            raise MemoryError("C decode attention: no memory for the split histories' partial results")
        if rc:
            raise ValueError("C decode attention refused the step's lengths or shapes")
        return self.a

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` ``[G, ffn]`` (the shared ``m`` buffer) for ``gu`` ``[G, 2 ffn]`` = gate | up."""
        self._check(gu, 2 * self.ffn, "gate_up")
        s = self.silu_args
        s[2], s[3] = gu.data_ptr(), gu.stride(0)
        if self.lib.loom_silu_mul(self.silu_addr):
            raise ValueError(f"silu_mul refused width {self.ffn}")
        return self.m
