"""A padded, per-row copy of the decode rows' KV history, kept from one step to the next (CPU only).

Decode attention reads each row's whole history. From the paged cache that is a gather of ``rows x L`` token
slots per layer for K and for V, every step: at 32 rows of ~100 tokens on a 2-core CPU the gathers were 14% of
a bf16 step, as much as the attention kernel itself. Here each decode request keeps a row of a padded buffer
laid out as SDPA reads it (``[rows, kv_heads, L, head_dim]``); a request that was in the previous step, one
token shorter, only has its new token written. A request new to the mirror (just prefilled, re-admitted, or
after a step that failed) has its row filled by the same gather as before, so the mirror never holds anything
the paged cache does not; rows of requests that left are reused, and the last rows move into the holes so a
step's rows are always ``0..G-1``. Keys are request ids *and* ``req_idx``, so a finished request's row taken
by a new one can never match. The values are bit-identical copies, so attention results do not change.

GPUs keep the plain gather (cheap there, and device memory is better spent on the KV pool); so does a group
whose padded copy would exceed ``max_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIRROR_MAX_BYTES = 512 << 20  # all layers, K and V (--decode-mirror-mb); beyond this, gather as before
_ROWS_ALIGN = 8  # buffers grow in steps of this many rows and about ``_LEN_ALIGN`` positions, so growth is rare
_LEN_ALIGN = 64


@dataclass
class MirrorUse:
    """What one step does to the mirror, for a decode group whose member ``i`` reads mirror row ``i``.

    ``order`` (Python list): the group members (indices into the order given to :meth:`DecodeKVMirror.use`)
    in mirror-row order; the caller builds its group in this order. ``move_src``/``move_dst`` ``[M]`` int64:
    rows copied inside the mirror first (the last rows into holes). ``fill_rows`` ``[F]`` int64: rows whose
    whole history is gathered from the paged cache; ``fill_slots`` ``[F * L]`` int64 is their slot table,
    set by the caller. ``append_rows`` ``[A]`` int64: members (= rows) that only write their new token, at
    the ``[head_dim]`` vectors ``append_flat`` ``[A * kv_heads]`` of a buffer seen as ``[-1, head_dim]``;
    ``all_append``: every member appends (a steady step), so no selection is needed.
    """

    mirror: DecodeKVMirror
    order: list[int]
    move_src: torch.Tensor | None
    move_dst: torch.Tensor | None
    fill_rows: torch.Tensor | None
    append_rows: torch.Tensor | None
    append_flat: torch.Tensor | None
    all_append: bool
    fill_slots: torch.Tensor | None = None


class DecodeKVMirror:
    """K and V buffers ``[rows_cap, kv_heads, len_cap, head_dim]`` per layer, one row per decode request.

    Positions past a row's history always hold zeros or that request's own padding (zero-filled buffers, a
    filled row zeroed past its history, padding read from the cache's all-zero slot): masked attention still
    multiplies them by zero, and a previous occupant's inf there would make NaN. Not thread-safe; one per worker.
    """

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, device: torch.device, max_bytes: int = MIRROR_MAX_BYTES
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.device, self.max_bytes = device, max_bytes
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.dtype: torch.dtype | None = None
        self._valid: dict[tuple[str, int], tuple[int, int]] = {}  # key -> (row, length), after a completed step
        self._pending: dict[tuple[str, int], tuple[int, int]] = {}  # what they hold once the running step completes

    @property
    def rows_cap(self) -> int:
        """Rows the buffers hold (0 before the first use)."""
        return self.k[0].shape[0] if self.k else 0

    @property
    def len_cap(self) -> int:
        """Positions per row the buffers hold."""
        return self.k[0].shape[2] if self.k else 0

    def use(self, keys: list[tuple[str, int]], lengths: list[int], dtype: torch.dtype) -> MirrorUse | None:
        """Plan this step for a decode group of requests ``keys`` (``(rid, req_idx)``) whose histories are
        ``lengths`` tokens long including the new token; None when the group is too large to mirror.

        The mirror counts as invalid until :meth:`commit` after the step's forward completed.
        """
        n, lmax = len(keys), max(lengths)
        prev, self._valid = self._valid, {}
        if n > self.rows_cap or lmax > self.len_cap or dtype != self.dtype:
            rows_cap = -(-n // _ROWS_ALIGN) * _ROWS_ALIGN
            len_cap = -(-(lmax + _LEN_ALIGN // 2) // _LEN_ALIGN) * _LEN_ALIGN  # room to grow before the next resize
            size = torch.empty((), dtype=dtype).element_size()
            nbytes = 2 * self.num_layers * rows_cap * self.kv_heads * len_cap * self.head_dim * size
            self.release()
            if nbytes > self.max_bytes:
                return None
            shape = (rows_cap, self.kv_heads, len_cap, self.head_dim)
            self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
            self.dtype, prev = dtype, {}
        kept: dict[int, int] = {}  # member -> its row last step (it was there, one token shorter)
        for i, (key, length) in enumerate(zip(keys, lengths, strict=True)):
            old = prev.get(key)
            if old is not None and old[1] + 1 == length:
                kept[i] = old[0]
        row_of = [-1] * n
        for i, r in kept.items():
            if r < n:
                row_of[i] = r
        free = iter(sorted(set(range(n)) - set(row_of)))
        moves: list[tuple[int, int]] = []
        fills: list[int] = []
        for i in range(n):
            if row_of[i] < 0:
                row_of[i] = next(free)
                (moves.append((kept[i], row_of[i])) if i in kept else fills.append(row_of[i]))
        order = sorted(range(n), key=row_of.__getitem__)
        dev = self.device
        appends = sorted(row_of[i] for i in kept)
        append_rows = append_flat = None
        if appends:
            rows = torch.tensor(appends, dtype=torch.int64, device=dev)
            pos = torch.tensor([lengths[order[r]] - 1 for r in appends], dtype=torch.int64, device=dev)
            heads = torch.arange(self.kv_heads, device=dev)
            append_rows = rows
            append_flat = ((rows[:, None] * self.kv_heads + heads[None, :]) * self.len_cap + pos[:, None]).reshape(-1)
        self._pending = {keys[i]: (row_of[i], lengths[i]) for i in range(n)}

        def tensor(xs: list[int]) -> torch.Tensor | None:
            return torch.tensor(xs, dtype=torch.int64, device=dev) if xs else None

        return MirrorUse(
            self,
            order,
            tensor([s for s, _ in moves]),
            tensor([d for _, d in moves]),
            tensor(fills),
            append_rows,
            append_flat,
            len(appends) == n,
        )

    def forget(self, rids: set[str]) -> None:
        """Drop the rows of requests being (re)prefilled: a request re-admitted under its old id after a restart
        must never find its old row, even where its new length happens to be the old one plus one."""
        if rids and self._valid:
            self._valid = {k: v for k, v in self._valid.items() if k[0] not in rids}

    def commit(self) -> None:
        """The step's forward completed: the buffers now hold the planned rows' histories."""
        self._valid, self._pending = self._pending, {}

    def release(self) -> None:
        """Drop the buffers and every row (a step too large to mirror)."""
        self.k, self.v, self.dtype, self._valid, self._pending = [], [], None, {}, {}


def mirrored_kv(
    use: MirrorUse,
    layer: int,
    kc: torch.Tensor,
    vc: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's decode K and V ``[G, kv_heads, length, head_dim]`` (views of the mirror) for SDPA.

    ``kc``/``vc`` ``[slots, kv_heads, head_dim]``: the paged cache (this step's tokens already written);
    ``k_new``/``v_new`` ``[G, kv_heads, head_dim]``: this step's K/V of the group's members, in row order.
    """
    m = use.mirror
    g = k_new.shape[0]
    out = []
    for buf, cache, new in ((m.k[layer], kc, k_new), (m.v[layer], vc, v_new)):
        if use.move_src is not None:  # the last rows into the holes left by requests that are gone
            buf.index_copy_(0, use.move_dst, buf.index_select(0, use.move_src))
        if use.fill_rows is not None:
            hist = cache.index_select(0, use.fill_slots).view(-1, length, m.kv_heads, m.head_dim).transpose(1, 2)
            buf[:, :, :length].index_copy_(0, use.fill_rows, hist.to(buf.dtype))
            if length < buf.shape[2]:  # a previous occupant's values past the history (maybe inf) must not stay
                buf[:, :, length:].index_fill_(0, use.fill_rows, 0)
        if use.append_flat is not None:  # one index_copy_ of [head_dim] vectors: the cheapest write found
            rows = new if use.all_append else new.index_select(0, use.append_rows)
            buf.view(-1, m.head_dim).index_copy_(0, use.append_flat, rows.reshape(-1, m.head_dim).to(buf.dtype))
        out.append(buf[:g, :, :length])
    return out[0], out[1]
