"""Dense half-precision linear weights kept in oneDNN's blocked layout (CPU only), when measured faster.

A plain ``x @ W.T`` in bf16 on CPU hands oneDNN a row-major ``W``; the AMX / AVX-512-bf16 kernels want it in a
blocked layout, which costs a reorder of the weight's bytes on each call. Reordering once at load
(``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's CPU weight prepacking uses under ``freezing``)
and calling ``torch.ops.mkldnn._linear_pointwise`` skips that: 1.3-1.9x faster here for the model's shapes at
1-64 rows (2-core Xeon with AMX, medians of noisy runs). The values are the same weights; only the rounding
order inside the GEMM may differ from the plain path (bf16 is not bit-stable across batch shapes anyway).

The choice is measured at start-up on the rank's own weights (:func:`packing_pays`), never assumed: CPUs without
oneDNN bf16/fp16 support, CUDA and fp32 keep plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.timing import best_time

# the batch size oneDNN plans the blocked layout for; any row count works with it (64 measured best here, and
# its products matched the plain path bit for bit at 1-200 rows)
_BATCH_HINT = 64


class PackedLinear:
    """``x @ W.T`` for a dense ``[N, K]`` bf16/fp16 weight held in oneDNN's blocked layout.

    Attributes:
        packed: the reordered weight (an opaque ``torch._mkldnn`` tensor of ``N x K`` values).
        out_features: N. in_features: K.
    """

    def __init__(self, w: torch.Tensor) -> None:
        """Reorder ``w [N, K]`` (bf16 or fp16, CPU). Raises RuntimeError if oneDNN refuses it."""
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _BATCH_HINT)

    @property
    def nbytes(self) -> int:
        """Bytes of weight values held (the blocked layout holds the same count)."""
        return self.out_features * self.in_features * torch.empty((), dtype=self.dtype).element_size()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` in the weight's dtype -> ``[M, N]`` in the same dtype."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def _supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def packing_pays(w: torch.Tensor, rows: tuple[int, ...] = (1, 32)) -> tuple[bool, str]:
    """Whether :class:`PackedLinear` beats the plain product for weight ``w [N, K]`` on this machine.

    Times both at each of ``rows`` (fastest of 7 calls each) and asks for the packed form to be faster at every
    row count. Returns ``(pays, how)``, ``how`` naming the timings for the log. Never raises: an unsupported
    dtype/device or a oneDNN error means "no".
    """
    if not _supported(w.dtype, w.device):
        return False, f"not used ({w.dtype} on {w.device.type}: no oneDNN {w.dtype} GEMM here)"
    try:
        p = PackedLinear(w)
        parts, pays = [], True
        for m in rows:
            x = torch.randn(m, w.shape[1], dtype=w.dtype)
            plain = best_time(lambda x=x: x @ w.T, 7)
            packed = best_time(lambda x=x: p.mm(x), 7)
            pays = pays and packed < plain
            parts.append(f"{m} rows: plain {plain * 1e6:.0f} us, packed {packed * 1e6:.0f} us")
    except RuntimeError as e:
        return False, f"not used (oneDNN refused: {e})"
    return pays, ("used" if pays else "not used") + " (" + "; ".join(parts) + ")"


def pack_linears(
    weights: dict,
    names: tuple[str, ...] = ("qkv", "o", "gate_up", "down"),
    make: Callable[[torch.Tensor], object] = PackedLinear,
    fits: Callable[[torch.Tensor], bool] = lambda w: True,
) -> int:
    """Replace every layer's dense ``names`` weights and a dense ``weights["lm_head"]`` that ``fits`` takes with
    ``make(w)`` (by default :class:`PackedLinear`; ``gpu_worker.bf16_gemm.use_gemm`` passes its own), in place.

    Quantised linears and anything not a dense tensor are left as they are. Returns how many were packed. A tied
    LM head (the embedding table, or a TP rank's rows of it) is packed as a copy, since the embedding lookup
    keeps reading the plain table: that holds those rows twice (SmolLM2 in bf16: 57 MB more at TP=1), for a
    vocabulary GEMM 1.5-2.4x faster (measured here at 1 and 32 rows; at batch 1 it is a fifth of a step).
    """
    n = 0
    head = weights.get("lm_head")
    if isinstance(head, torch.Tensor) and fits(head):
        weights["lm_head"] = make(head)
        n += 1
    for lw in weights["layers"]:
        for k in names:
            w = lw.get(k)
            if isinstance(w, torch.Tensor) and fits(w):
                lw[k] = make(w)
                n += 1
    return n
