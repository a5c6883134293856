"""Per-rank LoRA memory pool: host tier, device slots (``--max-loras-per-batch``; on CPU read in place), eviction,
batched apply.

Every TP rank runs its own pool and must reach the same decisions: a batch's adapter uids are always handled
in sorted order (``None`` = base needs no slot), free slots are taken lowest first, and victims come from an
explicit order list (LRU: least recently used first; FIFO: oldest load first), never from iterating a set
or a str-keyed dict, whose order differs between processes with different ``PYTHONHASHSEED``. After each
step the pool's digest (slot table + order) goes to the scheduler, which stops on any mismatch.

The batched apply follows Punica's SGMV idea (arXiv 2310.18547): tokens sharing a slot form contiguous
segments; each segment does shrink (``x @ A^T``, rank r) then expand (``@ B^T``) at its own rank, so no
adapter is padded to the largest rank and base-only segments cost nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

import torch

from gpu_worker import huge_pages
from gpu_worker.lora_cache import CacheKey, HostWeightCache
from gpu_worker.lora_kernel import (
    TILE_PAD,
    SgmvLayerArgs,
    SgmvStep,
    choose_backend,
    load_sgmv_gemm,
    pack_b,
    packed_elems,
    unpack_b,
)
from gpu_worker.lora_reader import read_weights_file
from gpu_worker.lora_weights import module_dims, read_adapter, shard_range
from gpu_worker.timing import agreed_choice, best_time
from gpu_worker.tp_plan import ShardPlan
from ipc.config import ServerArgs
from ipc.lora_config import (
    CONFIG_FILE,
    LLAMA_LORA_MODULES,
    LORA_RANK_UNIT,
    WEIGHTS_FILE,
    adapter_content_hash,
    lora_rows,
    read_adapter_config,
    read_adapter_file,
)
from ipc.messages import AdapterState
from ipc.model_config import ModelConfig
from ipc.model_source import cache_root

log = logging.getLogger(__name__)

# fused base projections -> (sub-module, index of its block in the fused output)
FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_FUSED = {m: f for f, mods in FUSED.items() for m in mods}


class LoraPoolError(RuntimeError):
    """The pool cannot serve a batch or a load (not loaded, all slots pinned or in use, over the limits)."""


@dataclass
class HostAdapter:
    """An adapter in this rank's host tier: its (layer, module) -> rank map and its runs (module, first layer,
    layers, rank); tensors live in the cache: one entry per run for A and B (slots copied from them), or, read in
    place, one shrink buffer per fused projection and one expand buffer per module (:meth:`LoraPool._kernel_layout`)."""

    uid: str
    name: str
    pinned: bool
    ranks: dict[tuple[int, str], int]
    content_hash: str = ""
    path: str = ""
    rows: int = 0  # rank rows it takes in a slot (:func:`lora_rows` of its largest rank)
    runs: list[tuple[str, int, int, int]] = field(default_factory=list)
    # read in place (the C kernel): rank rows per layer of each fused projection's shrink buffer, and packed
    # elements per layer of each module's expand buffer (see LoraPool._kernel_layout)
    a_rows: dict[str, int] = field(default_factory=dict)
    b_elems: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rows = lora_rows(max(self.ranks.values(), default=0))


class LoraPool:
    """Slots and host tier of one TP rank.

    Where the C kernel serves (``--lora-backend cpu-sgmv``, CPUs), the device *is* host memory, so nothing is
    copied: each host-tier adapter keeps its weights in the kernel's layout (:meth:`_kernel_layout`) and a slot is
    only an entry of per-layer address tables (``a_tab``, ``b_tab``) pointing into them. A slot then costs no
    memory and placing an adapter costs microseconds, so the pool has one per request a batch can hold plus
    those pinned adapters may take (``--max-loras-per-batch - 1 + --max-running-requests`` adapters at
    ``--max-lora-rank``; pins are bounded by ``--max-loras-per-batch`` as everywhere): LoRA never limits how many
    adapters a CPU batch mixes, only the host tier (``--max-loaded-loras``) does.

    Otherwise (the torch path, GPUs) slots are memory: ``--max-loras-per-batch`` x ``--max-lora-rank`` rank rows
    per layer and target module (as many adapters at the largest rank), shared by adapters at their own rank: an
    adapter takes :func:`lora_rows` (its largest rank, rounded up to :data:`LORA_RANK_UNIT`) consecutive rank rows,
    so twice as many adapters of half the largest rank fit (S-LoRA's unified paging, arXiv 2311.03285, with rank
    rows as pages). A *slot* is an entry of that arena: ``slot_start[s]`` (its first rank row) and ``slot_rows[s]``.
    When no gap is long enough but enough rows are free, the entries are compacted to the front (in place,
    keeping their slot numbers); the scheduler admits a batch only if its adapters' rows fit, so a batch always
    finds room.

    Device buffers per layer and target module: ``A [rows, in_local]`` (views of one fused arena per
    projection, rank-major: row ``(start + j) * nmod + k`` holds rank j of sub-module k, then 16 zero rows) and
    ``B`` as ``[rows + 1, out_local]`` (scaling folded into B; the last row stays zero).
    ``slot_rank[s][layer][module]`` is the rank the slot's occupant has there, 0 where it has no weights; a
    slot's rows past that rank are zero (written on placement), so nothing of a previous occupant can leak.
    ``rank_tab[fused]`` holds the same ranks as int32 ``[layers, slots, sub-modules]``, for the kernel with
    ``a_tab[fused]`` (int64 ``[layers, slots]``) and ``b_tab[fused]`` (int64 ``[layers, slots, sub-modules]``).
    Read in place, rank rows are only bookkeeping (the same allocator, so the slot table, the eviction order and
    the digest behave alike on every backend); no arena exists.
    """

    def __init__(
        self, args: ServerArgs, cfg: ModelConfig, plan: ShardPlan, dtype: torch.dtype, device: torch.device, group=None
    ) -> None:
        self.cfg, self.plan, self.dtype, self.device = cfg, plan, dtype, device
        self.max_rank = args.max_lora_rank
        # --lora-root, checked again on every file a load opens (the front door checked the path before sending)
        self.root = args.lora_root or None
        self.slot_size = lora_rows(self.max_rank)  # rank rows of one adapter at --max-lora-rank
        self.policy = args.lora_eviction_policy
        if self.policy not in ("lru", "fifo"):
            raise ValueError(f"--lora-eviction-policy {self.policy!r}: choose lru or fifo")
        unknown = sorted(set(args.lora_target_modules) - set(LLAMA_LORA_MODULES))
        if unknown:  # launch.py refuses them first; never drop one silently (no adapter could then load)
            raise ValueError(f"--lora-target-modules: unknown modules {unknown}; choose from {LLAMA_LORA_MODULES}")
        self.targets = [m for m in LLAMA_LORA_MODULES if m in (args.lora_target_modules or LLAMA_LORA_MODULES)]
        self.cache = HostWeightCache()
        widest = max(self._local_dims(m)[0] for m in LLAMA_LORA_MODULES)
        self.sgmv, how = choose_backend(args.lora_backend, dtype, device, cache_root(), group, widest)
        log.info("LoRA backend on TP rank %d: %s", plan.rank, how)
        self.in_place = self.sgmv is not None  # the kernel reads the host tier where it is (see the class doc)
        # the same kernel with a projection's base GEMM (Loom's bf16 GEMM) in the same call, for LoraBatch.mm_add
        self.sgmv_gemm = load_sgmv_gemm(cache_root() / "kernels") if self.in_place and dtype == torch.bfloat16 else None
        # adapters at --max-lora-rank that fit: the memory budget, or (read in place, where slots cost nothing) one
        # per running request plus those pinned adapters may hold (all of --max-loras-per-batch's but one), so
        # no batch ever waits for a slot
        self.n_slots = args.max_loras_per_batch + (args.max_running_requests - 1 if self.in_place else 0)
        self.pin_rows = args.max_loras_per_batch * self.slot_size  # pins leave one adapter's rows of these free
        if self.in_place and self.n_slots > args.max_loras_per_batch:
            log.info(
                "LoRA adapters are read in place from the host tier: a batch may mix up to %d of them "
                "(--max-running-requests; --max-loras-per-batch %d bounds device slots where weights are copied)",
                self.n_slots,
                args.max_loras_per_batch,
            )
        self.capacity = self.n_slots * self.slot_size  # rank rows per arena
        self.n_entries = self.capacity // LORA_RANK_UNIT  # most adapters resident at once
        # the kernel reads bf16 weights at full speed on any CPU; the torch path may need fp32 slots
        self.slot_dtype = dtype if self.in_place else measure_slot_dtype(dtype, device, group)
        self.host: dict[str, HostAdapter] = {}
        self.slot_uid: list[str | None] = [None] * self.n_entries
        self.slot_start = [0] * self.n_entries
        self.slot_rows = [0] * self.n_entries
        self.uid_slot: dict[str, int] = {}
        self.order: list[str] = []  # uids in slots, eviction order (first = next victim)
        self.local_dims = {m: self._local_dims(m) for m in LLAMA_LORA_MODULES}  # (in, out) on this rank
        self.slot_rank = [
            [dict.fromkeys(self.targets, 0) for _ in range(cfg.num_layers)] for _ in range(self.n_entries)
        ]
        # A of the targeted sub-modules of one fused projection share one arena, rank-major: row j*M + k of a
        # slot holds rank j of sub-module k (M sub-modules), so one GEMM over the first r*M rows shrinks all of
        # them at the batch's rank r, not at --max-lora-rank
        self.fused_targets = {f: [m for m in mods if m in self.targets] for f, mods in FUSED.items()}
        # one tensor per fused projection (A) and module (B) holds every layer's arena, so moving or zeroing
        # a slot's rows is one op per buffer, not one per layer; the per-layer lists hold views of them
        self.A_all: dict[str, torch.Tensor] = {}
        self.B_all: dict[str, torch.Tensor] = {}
        for f, mods in self.fused_targets.items():
            if not mods or self.in_place:
                continue
            # 16 zero rows after each arena: AMX's 16-row shrink tiles may read past the last slot, and the
            # torch path's gathers read them for padding
            # on huge pages (CPU): a decode step streams every slot's weights, like the model's
            self.A_all[f] = huge_pages.zeros(
                (cfg.num_layers, self.capacity * len(mods) + 16, self._local_dims(mods[0])[0]), self.slot_dtype, device
            )
            for m in mods:
                shape = (cfg.num_layers, *self._b_shape(self._local_dims(m)[1]))
                self.B_all[m] = huge_pages.zeros(shape, self.slot_dtype, device)
        self.A_fused: list[dict[str, torch.Tensor]] = []
        self.A: list[dict[str, torch.Tensor]] = []  # views of A_fused: [capacity, in_local] per module
        self.B: list[dict[str, torch.Tensor]] = []
        for layer in range(cfg.num_layers if self.A_all else 0):
            af_l, a_l, b_l = {}, {}, {}
            for f, mods in self.fused_targets.items():
                if not mods:
                    continue
                af_l[f] = af = self.A_all[f][layer]
                per_rank = af[: self.capacity * len(mods)].view(self.capacity, len(mods), -1)
                for k, m in enumerate(mods):
                    a_l[m] = per_rank[:, k]  # [capacity, in] (strided view)
                    b_l[m] = self.B_all[m][layer]
            self.A_fused.append(af_l)
            self.A.append(a_l)
            self.B.append(b_l)
        self.rank_tab = {
            f: torch.zeros(cfg.num_layers, self.n_entries, len(mods), dtype=torch.int32)
            for f, mods in self.fused_targets.items()
            if mods
        }
        self.cols = {f: self._fused_cols(f) for f in self.rank_tab}
        # read in place: per layer, the address of each slot's shrink rows and of each sub-module's expand weights
        tabs = self.rank_tab if self.in_place else {}
        self.a_tab = {f: torch.zeros(cfg.num_layers, self.n_entries, dtype=torch.int64) for f in tabs}
        self.b_tab = {f: torch.zeros(t.shape, dtype=torch.int64) for f, t in tabs.items()}
        self.sgmv_args: list[dict[str, SgmvLayerArgs]] = []
        if self.in_place:
            for layer in range(cfg.num_layers):
                self.sgmv_args.append(
                    {
                        f: SgmvLayerArgs(
                            self.local_dims[self.fused_targets[f][0]][0],
                            self.slot_dtype,
                            self.a_tab[f][layer],
                            self.b_tab[f][layer],
                            self.rank_tab[f][layer],
                            [self.local_dims[m][1] for m in self.fused_targets[f]],
                            [c for _, _, c in self.cols[f]],
                        )
                        for f in self.rank_tab
                    }
                )

    def _b_shape(self, fout: int) -> tuple[int, ...]:
        """An expand arena's shape: ``[capacity + 1, out]`` rank rows (the last one zero)."""
        return (self.capacity + 1, fout)

    def a_matrix(self, layer: int, m: str, s: int) -> torch.Tensor:
        """Slot ``s``'s shrink weights of ``m`` as ``[slot_rows[s], in_local]`` (rows past its rank zero)."""
        if not self.in_place:
            return self.A[layer][m][self.slot_start[s] : self.slot_start[s] + self.slot_rows[s]]
        f = MODULE_FUSED[m]
        mods = self.fused_targets[f]
        out = torch.zeros(self.slot_rows[s], self.local_dims[m][0], dtype=self.slot_dtype)
        ad = self.host.get(self.slot_uid[s] or "")
        if ad is not None and f in ad.a_rows:
            rows = ad.a_rows[f]
            a = self._host_a(ad, f)[: self.cfg.num_layers * rows * len(mods)]
            out[:rows] = a.view(self.cfg.num_layers, rows, len(mods), -1)[layer, :, mods.index(m)]
        return out

    def b_matrix(self, layer: int, m: str, s: int) -> torch.Tensor:
        """Slot ``s``'s expand weights of ``m`` as ``[slot_rows[s], out_local]`` (scaling folded in), either layout.

        Read in place, rows past the slot's rank are the rest of that layer's packed region (zero unless something
        else was written there)."""
        n = self.slot_rows[s]
        if not self.in_place:
            return self.B[layer][m][self.slot_start[s] : self.slot_start[s] + n]
        fout, r = self.local_dims[m][1], self.slot_rank[s][layer][m]
        ad = self.host.get(self.slot_uid[s] or "")
        if ad is None or m not in ad.b_elems:
            return torch.zeros(n, fout, dtype=self.slot_dtype)
        k = ad.b_elems[m]
        b = self._host_b(ad, m)[layer * k : (layer + 1) * k]
        used = unpack_b(b, fout, r)
        left = float(b[packed_elems(fout, r, b.dtype == torch.bfloat16) :].abs().sum())
        rest = torch.zeros(n - r, fout, dtype=b.dtype)
        if left and n > r:  # anything past the occupant's weights shows up in the rows past its rank
            rest[0, 0] = left
        return torch.cat([used, rest])

    def _fused_cols(self, fused: str) -> list[tuple[int, str, int]]:
        """(index in the fused A buffer, sub-module, first output column) of each targeted sub-module."""
        mods = self.fused_targets[fused]
        cols, col = [], 0
        for m in FUSED[fused]:
            if m in mods:
                cols.append((mods.index(m), m, col))
            col += self.local_dims[m][1]
        return cols

    def _local_dims(self, module: str) -> tuple[int, int]:
        fin, fout = module_dims(self.cfg, module)
        lo, hi = shard_range(self.cfg, self.plan, module)
        if module in ("o_proj", "down_proj"):
            return hi - lo, fout
        return fin, hi - lo

    # ------------------------------------------------------------------ host tier
    def host_uids(self) -> list[str]:
        """uids in this rank's host tier, sorted."""
        return sorted(self.host)

    def host_adapters(self) -> list[AdapterState]:
        """The host tier's adapters (uid, name, path, pinned, content hash), sorted by uid."""
        return [
            AdapterState(a.uid, a.name, a.path, a.pinned, a.content_hash, a.rows) for _, a in sorted(self.host.items())
        ]

    def rows_of(self, uid: str) -> int:
        """Rank rows adapter ``uid`` (in the host tier) takes in a slot."""
        return self.host[uid].rows

    def load(
        self, uid: str, name: str, path: str, pinned: bool = False, expect_hash: str = "", data: bytes | None = None
    ) -> str:
        """Validate and read an adapter into the host tier (a pinned one also takes a slot now).

        Returns the sha256 of the adapter files (:func:`adapter_content_hash`). ``expect_hash`` (a restore
        after a worker restart) refuses files whose content changed since the first load. ``data``: the weights
        file's bytes when the caller read them already (:mod:`gpu_worker.lora_reader`, off the step loop);
        None reads the file here.

        Raises LoraConfigError / LoraWeightsError / LoraPoolError naming the problem; nothing is kept then.
        """
        if uid in self.host:
            return self.host[uid].content_hash
        if data is None:
            data = read_weights_file(path, self.root)
        if data is None:  # unreadable, or outside --lora-root: read again to say which
            data = read_adapter_file(path, WEIGHTS_FILE, name, self.root)
        config = read_adapter_file(path, CONFIG_FILE, name, self.root)  # read once: hashed and parsed
        content_hash = adapter_content_hash(path, name, data, config)
        if expect_hash and content_hash != expect_hash:
            raise LoraPoolError(
                f"LoRA adapter {name}: the files in {path} changed since it was first loaded "
                f"(sha256 {content_hash[:12]}… != {expect_hash[:12]}…)"
            )
        acfg = read_adapter_config(path, name, tie_word_embeddings=self.cfg.tie_word_embeddings, raw_bytes=config)
        weights = read_adapter(path, name, acfg, self.cfg, self.plan, self.max_rank, self.dtype, data)
        extra = sorted({run.module for run in weights} - set(self.targets))
        if extra:
            raise LoraPoolError(f"LoRA adapter {name} targets {extra}, outside --lora-target-modules {self.targets}")
        ranks = {(layer, run.module): run.r for run in weights for layer in run.layers}
        rows = lora_rows(max(ranks.values(), default=0))
        if pinned and self._pinned_rows() + rows + self.slot_size > self.pin_rows:
            slots = self.pin_rows // self.slot_size
            raise LoraPoolError(
                f"LoRA adapter {name}: pinning it would leave no free slot of {slots} for other adapters "
                f"(pinned adapters would hold {self._pinned_rows() + rows} of {self.pin_rows} rank rows, and an "
                f"adapter at --max-lora-rank {self.max_rank} needs {self.slot_size})"
            )
        tp = (self.plan.rank, self.plan.tp_size)
        runs = [(run.module, run.first, len(run.layers), run.r) for run in weights]
        ad = HostAdapter(uid, name, pinned, ranks, content_hash, str(path), runs=runs)
        try:
            if self.in_place:
                self._kernel_layout(ad, weights)
            else:
                for run in weights:
                    n = len(run.layers)
                    self.cache.put(CacheKey(uid, run.first, run.module, "A", *tp, n), run.a)
                    self.cache.put(CacheKey(uid, run.first, run.module, "B", *tp, n), run.b)
        except Exception:
            self.cache.drop_uid(uid)
            raise
        self.host[uid] = ad
        if pinned:
            self._ensure_slot(uid, protected=())
        return content_hash

    def _kernel_layout(self, ad: HostAdapter, weights: list) -> None:
        """Keep ``ad``'s weights (``lora_weights.LoraRun``s) in the host tier in the layout the kernel reads in place.

        Per fused projection ``f``, one shrink buffer ``[layers * rows * nmod + 16, in_local]``: layer ``l``'s rows
        from ``l * rows * nmod``, row ``j * nmod + k`` = rank ``j`` of targeted sub-module ``k`` (zero past its rank),
        ``rows`` the adapter's largest rank there; 16 zero rows end it (AMX reads whole tiles). Per module, one
        expand buffer ``[layers * elems + TILE_PAD]``: layer ``l`` from ``l * elems``, packed by ``pack_b`` at that
        layer's rank, ``elems`` the packed size at the module's largest rank, zeros after. Both go to the cache
        (keys ``AF`` / ``BP`` over all layers), which checks shape and dtype on every later read.

        All of them are views of one zeroed arena per adapter, each starting on a 64-byte line, and the arena is on
        huge pages where it holds one (:mod:`gpu_worker.huge_pages`): a decode step streams every adapter in the
        batch, and on 4 KiB pages each page costs a TLB miss and stops the hardware prefetchers (one arena, not a
        buffer each, so a rank-8 adapter's ~5 MB gets huge pages too).
        """
        tp = (self.plan.rank, self.plan.tp_size)
        layers, bf16 = self.cfg.num_layers, self.slot_dtype == torch.bfloat16
        line = 64 // torch.empty((), dtype=self.slot_dtype).element_size()  # elements per 64-byte line
        a_runs = {f: [run for run in weights if MODULE_FUSED[run.module] == f] for f in self.fused_targets}
        a_rows = {f: max(run.r for run in runs) for f, runs in a_runs.items() if runs}
        b_mods = sorted({run.module for run in weights})
        b_elems = {m: packed_elems(self.local_dims[m][1], max(r.r for r in weights if r.module == m), bf16)
                   for m in b_mods}  # fmt: skip
        sizes = [(layers * rows * len(self.fused_targets[f]) + 16) * self.local_dims[FUSED[f][0]][0]
                 for f, rows in a_rows.items()]  # fmt: skip
        sizes += [layers * b_elems[m] + TILE_PAD for m in b_mods]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + -(-n // line) * line)
        arena = huge_pages.zeros(starts[-1], self.slot_dtype)
        views = iter(arena[s : s + n] for s, n in zip(starts, sizes, strict=False))
        for f, rows in a_rows.items():
            mods, fin = self.fused_targets[f], self.local_dims[FUSED[f][0]][0]
            a = next(views).view(-1, fin)
            per = a[: layers * rows * len(mods)].view(layers, rows, len(mods), fin)
            for run in a_runs[f]:
                per[run.first : run.first + len(run.layers), : run.r, mods.index(run.module)] = run.a
            ad.a_rows[f] = rows
            self.cache.put(CacheKey(ad.uid, 0, f, "AF", *tp, layers), a)
        for m in b_mods:
            b = next(views)
            per_layer = b[: layers * b_elems[m]].view(layers, b_elems[m])
            for run in (run for run in weights if run.module == m):
                pack_b(run.b.to(self.slot_dtype), per_layer[run.first : run.first + len(run.layers)])
            ad.b_elems[m] = b_elems[m]
            self.cache.put(CacheKey(ad.uid, 0, m, "BP", *tp, layers), b)

    def _host_a(self, ad: HostAdapter, f: str) -> torch.Tensor:
        """``ad``'s in-place shrink buffer of fused projection ``f`` (see :meth:`_kernel_layout`)."""
        shape = (self.cfg.num_layers * ad.a_rows[f] * len(self.fused_targets[f]) + 16, self.local_dims[FUSED[f][0]][0])
        return self.cache.get(CacheKey(ad.uid, 0, f, "AF", self.plan.rank, self.plan.tp_size, self.cfg.num_layers),
                              shape, self.slot_dtype)  # fmt: skip

    def _host_b(self, ad: HostAdapter, m: str) -> torch.Tensor:
        """``ad``'s in-place expand buffer of module ``m`` (see :meth:`_kernel_layout`)."""
        shape = (self.cfg.num_layers * ad.b_elems[m] + TILE_PAD,)
        return self.cache.get(CacheKey(ad.uid, 0, m, "BP", self.plan.rank, self.plan.tp_size, self.cfg.num_layers),
                              shape, self.slot_dtype)  # fmt: skip

    def unload(self, uid: str) -> None:
        """Drop an adapter from its slot and the host tier (idempotent)."""
        s = self.uid_slot.pop(uid, None)
        if s is not None:
            self.order.remove(uid)
            self.slot_uid[s] = None
            self._clear_slot(s)
        self.host.pop(uid, None)
        self.cache.drop_uid(uid)

    # ------------------------------------------------------------------ slots
    def _pinned_rows(self) -> int:
        return sum(a.rows for a in self.host.values() if a.pinned)

    def _rows_all(self, start: int, n: int) -> list[torch.Tensor]:
        """Rank rows ``start .. start + n`` of every buffer, all layers at once (views)."""
        out = []
        for f, a in self.A_all.items():
            nmod = len(self.fused_targets[f])
            out.append(a[:, start * nmod : (start + n) * nmod])
        for b in self.B_all.values():
            out.append(b[:, start : start + n])
        return out

    def _zero_region(self, start: int, n: int) -> None:
        """Zero rank rows ``start .. start + n`` of every arena."""
        for v in self._rows_all(start, n):
            v.zero_()

    def _set_ranks(self, s: int, ranks: dict[tuple[int, str], int]) -> None:
        """Slot ``s`` holds rank ``ranks[(layer, module)]`` (0 where missing) in every layer and target module."""
        for layer in range(self.cfg.num_layers):
            for m in self.targets:
                self.slot_rank[s][layer][m] = ranks.get((layer, m), 0)
        for f, tab in self.rank_tab.items():  # one tensor write per projection, not one per (layer, module)
            rows = [[ranks.get((layer, m), 0) for m in self.fused_targets[f]] for layer in range(self.cfg.num_layers)]
            tab[:, s] = torch.tensor(rows, dtype=torch.int32)

    def _clear_slot(self, s: int) -> None:
        """Empty slot ``s``: its rows are zeroed (read in place: its addresses cleared) and it holds no ranks."""
        self._zero_region(self.slot_start[s], self.slot_rows[s])
        self._set_ranks(s, {})
        for f in self.a_tab:
            self.a_tab[f][:, s] = 0
            self.b_tab[f][:, s] = 0
        self.slot_uid[s] = None
        self._place(s, 0, 0)

    def _place(self, s: int, start: int, rows: int) -> None:
        """Slot ``s`` holds rank rows ``start .. start + rows``."""
        self.slot_start[s], self.slot_rows[s] = start, rows

    def _write_slot(self, s: int, uid: str) -> None:
        """Copy ``uid``'s shards into slot ``s`` (placed, rows zeroed); modules it lacks get rank 0.

        One copy per run of layers for A and one for B (typically two per target module), not per layer. Read in
        place, nothing is copied: the slot's address tables point at the host tier's buffers."""
        ad = self.host[uid]
        tp = (self.plan.rank, self.plan.tp_size)
        nb = self.device.type == "cuda"
        start = self.slot_start[s]
        self._set_ranks(s, ad.ranks)
        if self.in_place:
            layer = torch.arange(self.cfg.num_layers, dtype=torch.int64)
            for f, mods in self.fused_targets.items():
                if f not in ad.a_rows:
                    continue
                a = self._host_a(ad, f)
                self.a_tab[f][:, s] = a.data_ptr() + layer * a[: ad.a_rows[f] * len(mods)].nbytes
                for k, m in enumerate(mods):
                    if m in ad.b_elems:
                        b = self._host_b(ad, m)
                        self.b_tab[f][:, s, k] = b.data_ptr() + layer * (ad.b_elems[m] * b.element_size())
            return
        for m, first, n, r in ad.runs:
            fin, fout = self._local_dims(m)
            f = MODULE_FUSED[m]
            mods = self.fused_targets[f]
            a = self.cache.get(CacheKey(uid, first, m, "A", *tp, n), (n, r, fin), self.dtype)
            arena = self.A_all[f][first : first + n, : self.capacity * len(mods)]
            arena.view(n, self.capacity, len(mods), fin)[:, start : start + r, mods.index(m)].copy_(a, non_blocking=nb)
            b = self.cache.get(CacheKey(uid, first, m, "B", *tp, n), (n, fout, r), self.dtype)
            self.B_all[m][first : first + n, start : start + r].copy_(b.transpose(1, 2), non_blocking=nb)

    def _gap(self, need: int) -> int | None:
        """First rank row of the lowest gap of ``need`` free rows, or None."""
        pos = 0
        for st, n in sorted((self.slot_start[s], self.slot_rows[s]) for s in self.uid_slot.values()):
            if st - pos >= need:
                return pos
            pos = st + n
        return pos if self.capacity - pos >= need else None

    def _compact(self) -> None:
        """Move every slot's rows to the front, in order of place (slot numbers stay): one gap at the end."""
        pos = 0
        for st, s in sorted((self.slot_start[s], s) for s in self.uid_slot.values()):
            n = self.slot_rows[s]
            if st != pos:
                for dst, src in zip(self._rows_all(pos, n), self._rows_all(st, n), strict=True):
                    dst.copy_(src.clone())  # the two ranges may overlap
                self._place(s, pos, n)
            pos += n
        self._zero_region(pos, self.capacity - pos)

    def _evict(self, uid: str) -> None:
        s = self.uid_slot.pop(uid)
        self.order.remove(uid)
        self._clear_slot(s)

    def _ensure_slot(self, uid: str, protected: tuple[str, ...] | list[str]) -> int:
        s = self.uid_slot.get(uid)
        if s is not None:
            if self.policy == "lru":
                self.order.remove(uid)
                self.order.append(uid)
            return s
        need = self.host[uid].rows  # callers check that uid is in the host tier
        start = self._gap(need)
        while start is None:
            if self.capacity - sum(self.slot_rows) >= need:
                self._compact()
                start = self._gap(need)
                break
            victim = next((u for u in self.order if u not in protected and not self.host[u].pinned), None)
            if victim is None:
                raise LoraPoolError(
                    f"all {self.n_slots} LoRA slots on TP rank {self.plan.rank} hold pinned or in-batch adapters "
                    f"(adapter {self.host[uid].name} needs {need} of {self.capacity} rank rows)"
                )
            self._evict(victim)
            start = self._gap(need)
        s = self.slot_uid.index(None)
        self.slot_uid[s] = uid
        self._place(s, start, need)
        self._write_slot(s, uid)
        self.uid_slot[uid] = s
        self.order.append(uid)
        return s

    def assign(self, uids: list[str | None]) -> list[int]:
        """Give every distinct adapter of a batch a slot; return each request's slot (-1 = base).

        The distinct uids are visited in sorted order, and none of them can evict another one of the batch.
        Raises LoraPoolError when their rank rows and the pinned adapters' exceed the pool (nothing moves then).
        """
        needed = sorted({u for u in uids if u is not None})
        for u in needed:
            if u not in self.host:
                raise LoraPoolError(f"LoRA adapter uid {u} is not loaded on TP rank {self.plan.rank}")
        rows = sum(self.host[u].rows for u in needed)
        pinned = sum(a.rows for u, a in self.host.items() if a.pinned and u not in needed)
        if rows + pinned > self.capacity:
            raise LoraPoolError(
                f"batch needs {len(needed)} adapters ({rows} rank rows) but TP rank {self.plan.rank} has "
                f"{self.n_slots} slots of rank {self.slot_size} ({self.capacity} rank rows, {pinned} pinned)"
            )
        for u in needed:
            self._ensure_slot(u, protected=needed)
        return [-1 if u is None else self.uid_slot[u] for u in uids]

    def prepare(self, uids: list[str | None], ext_lens: list[int]) -> LoraBatch | None:
        """Slots for this step's requests and their token segments; None for a base-only batch."""
        slots = self.assign(uids)
        if all(s < 0 for s in slots):
            return None
        segs: list[tuple[int, int, int]] = []  # (slot, token start, token end), merged when adjacent
        t = 0
        for s, n in zip(slots, ext_lens, strict=True):
            if s >= 0:
                if segs and segs[-1][0] == s and segs[-1][2] == t:
                    segs[-1] = (s, segs[-1][1], t + n)
                else:
                    segs.append((s, t, t + n))
            t += n
        return LoraBatch(self, segs, t)

    def table(self) -> dict[str, int]:
        """uid -> slot for every occupied slot."""
        return {u: s for s, u in enumerate(self.slot_uid) if u is not None}

    def digest(self) -> tuple[str, dict[str, int]]:
        """Hash of (slot table, slot places, eviction order) and the table itself, for the cross-rank check."""
        state = json.dumps(
            {"slots": self.slot_uid, "start": self.slot_start, "order": self.order}, separators=(",", ":")
        )
        return hashlib.sha256(state.encode()).hexdigest()[:16], self.table()


class LoraBatch:
    """The LoRA work of one step: segments of tokens sharing a slot. Implements ``model.LoraApplier``.

    Two ways to run the same maths, chosen per step:

    - **Batched** (decode-like steps, where segments are short and similar): the tokens of the batch's n slots
      are gathered into a padded ``[n, Tmax, in]`` block, their A rows out of the arena into ``[n, r * M, in]``
      (rows past a slot's size read the zero rows after the arena), and one ``bmm`` shrinks all slots through
      the stacked A of every targeted sub-module; one ``bmm`` per sub-module expands at the batch's largest
      rank for it into a padded delta block, and one ``index_select`` hands every token its row back. The op
      count no longer grows with the number of adapters (on CPU a small GEMM costs tens of microseconds of
      fixed overhead, which dominated mixed batches).
    - **Per segment** (a long prefill next to short segments would make the padding costly): per segment and
      fused projection, one shrink GEMM over the stacked A, then one ``addmm_`` per sub-module straight into
      the output columns at the adapter's own rank (Punica's SGMV idea, arXiv 2310.18547).

    Padding rows read token 0 and are never handed back (base tokens read an all-zero row); padded rank columns
    are zero in A and B (slots zero them on write), so both ways give the same result.

    On CPU with ``--lora-backend`` cpu-sgmv (``auto`` picks it where measured faster) neither runs: one call
    of the C kernel (``gpu_worker/lora_kernel.py``) per layer and fused projection does every segment's shrink
    and expand, in fp32 accumulation, straight into ``out``.
    """

    PAD_LIMIT = 2.0  # batched only while padded rows <= this many times the real LoRA rows

    def __init__(self, pool: LoraPool, segments: list[tuple[int, int, int]], num_tokens: int = 0) -> None:
        self.pool = pool
        self.segments = segments
        self.num_tokens = num_tokens or max((t1 for _, _, t1 in segments), default=0)
        self._batched: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        per_slot: dict[int, list[int]] = {}
        for s, t0, t1 in segments:
            per_slot.setdefault(s, []).extend(range(t0, t1))
        real = sum(len(v) for v in per_slot.values())
        if per_slot and real and pool.sgmv is None:
            n = len(per_slot)
            tmax = max(len(v) for v in per_slot.values())
            if n * tmax <= self.PAD_LIMIT * real + 8:
                src = [0] * (n * tmax)  # token each padded row reads (0 for padding)
                pos = [n * tmax] * self.num_tokens  # each token's padded row (n*tmax: the zero row, base tokens)
                for i, sl in enumerate(sorted(per_slot)):
                    toks = per_slot[sl]
                    src[i * tmax : i * tmax + len(toks)] = toks
                    for j, tok in enumerate(toks):
                        pos[tok] = i * tmax + j
                dev = pool.device
                self._batched = (n, tmax, torch.tensor(src, device=dev), torch.tensor(pos, device=dev))
        self._slots = sorted(per_slot)
        self._rows_idx: dict[int, torch.Tensor] = {}  # nmod -> the batched path's gather rows (see _arena_rows)
        self._sgmv: SgmvStep | None = None  # the C kernel's token list and segments (by slot), and scratch
        if pool.sgmv is not None and per_slot:
            tok, seg = [], []
            for s in self._slots:
                seg.append((s, len(tok), len(tok) + len(per_slot[s])))
                tok.extend(per_slot[s])
            # fp32 shrink results; the kernel's padded token blocks read the zero rows at the end
            u = torch.zeros(len(tok) + 8, pool.max_rank * max(map(len, FUSED.values())))
            self._sgmv = SgmvStep(pool.sgmv, torch.tensor(tok), torch.tensor(seg), u, pool.sgmv_gemm)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[t0:t1, cols] += (x[t0:t1] @ A[s,:r]^T) @ B[s,:,:r]^T`` per segment and sub-module.

        ``x`` is ``[T, in_local]``, ``out`` ``[T, out_local]`` (the fused projection's output; for row layers
        the rank's partial sum before the all-reduce, which is exact because the expand is linear).
        """
        p = self.pool
        if self._sgmv is not None:
            la = p.sgmv_args[layer].get(fused)
            if la is not None:
                self._sgmv.add(la, x, out)
            return
        if fused not in p.rank_tab:
            return
        cols = p.cols[fused]
        if self._batched is not None:
            self._add_batched(layer, fused, cols, x, out)
        else:
            self._add_segments(layer, fused, cols, x, out)

    def mm_add(self, layer: int, fused: str, x: torch.Tensor, w: object) -> torch.Tensor | None:
        """``x @ w.T`` plus :meth:`add`'s delta, in one call of the C kernel with the base GEMM where ``w`` is
        Loom's bf16 GEMM weight (:meth:`lora_kernel.SgmvStep.mm_add`: the same values, the adapters' reads under
        the GEMM's arithmetic); None otherwise, for the caller to multiply and :meth:`add`."""
        if self._sgmv is None:
            return None
        la = self.pool.sgmv_args[layer].get(fused)
        return None if la is None else self._sgmv.mm_add(la, x, w)

    def _arena_rows(self, nmod: int) -> torch.Tensor:
        """int64 ``[n, R * nmod]``: row ``j`` of the batch's ``i``-th slot in an arena of ``nmod`` sub-modules
        (``R`` the largest slot size of the batch); rows past a slot's size point at the zero row after the arena.
        With ``nmod`` = 1 it indexes B's rank rows (whose zero row is row ``capacity``)."""
        idx = self._rows_idx.get(nmod)
        if idx is None:
            p = self.pool
            big = max(p.slot_rows[s] for s in self._slots) * nmod
            j = torch.arange(big)
            rows = [
                torch.where(j < p.slot_rows[s] * nmod, p.slot_start[s] * nmod + j, p.capacity * nmod)
                for s in self._slots
            ]
            idx = self._rows_idx[nmod] = torch.stack(rows).to(p.device)
        return idx

    def _add_batched(self, layer: int, fused: str, cols: list, x: torch.Tensor, out: torch.Tensor) -> None:
        p = self.pool
        n, tmax, src, pos = self._batched  # type: ignore[misc]
        ranks = [max(p.slot_rank[s][layer][m] for s in self._slots) for _, m, _ in cols]
        rmax = max(ranks)
        if not rmax:
            return
        af = p.A_fused[layer][fused]
        nmod = len(p.fused_targets[fused])
        xs = x.index_select(0, src)
        if xs.dtype != af.dtype:
            xs = xs.to(af.dtype)
        a = af.index_select(0, self._arena_rows(nmod)[:, : rmax * nmod].reshape(-1)).view(n, rmax * nmod, -1)
        u = torch.bmm(xs.view(n, tmax, -1), a.transpose(1, 2)).view(n, tmax, rmax, nmod)
        # every slot's delta lands in its padded row of ``d`` (the last row stays zero for base tokens); one
        # gather by ``pos`` then brings each token its own row: index_add_ into the tokens' rows was 10x slower
        d = torch.zeros(n * tmax + 1, out.shape[1], dtype=af.dtype, device=out.device)
        d3 = d[:-1].view(n, tmax, -1)
        for (k, m, c), r in zip(cols, ranks, strict=True):
            if r:
                bm = p.B[layer][m]
                b = bm.index_select(0, self._arena_rows(1)[:, :r].reshape(-1)).view(n, r, -1)  # [n, r, out_m]
                torch.bmm(u[:, :, :r, k], b, out=d3[:, :, c : c + b.shape[2]])
        out += d.index_select(0, pos)

    def _add_segments(self, layer: int, fused: str, cols: list, x: torch.Tensor, out: torch.Tensor) -> None:
        p = self.pool
        af = p.A_fused[layer][fused]
        nmod = len(p.fused_targets[fused])
        # slots in fp32 under a bf16 model (slow small bf16 GEMMs on this CPU): cast x once and accumulate
        # every segment's delta in one fp32 buffer, added to ``out`` once, instead of casting per segment
        same = x.dtype == af.dtype
        xs_all = x if same else x.to(af.dtype)
        acc = out if same else torch.zeros(out.shape, dtype=af.dtype, device=out.device)
        touched = False
        for s, t0, t1 in self.segments:
            ranks = [p.slot_rank[s][layer][m] for _, m, _ in cols]
            rmax = max(ranks)
            if not rmax:
                continue
            st = p.slot_start[s]
            a = af[st * nmod : (st + rmax) * nmod]
            u = (xs_all[t0:t1] @ a.T).view(-1, rmax, nmod)  # every sub-module's shrink at once
            for (k, m, c), r in zip(cols, ranks, strict=True):
                if r:
                    b = p.B[layer][m][st : st + r]  # [r, out_m]
                    acc[t0:t1, c : c + b.shape[1]].addmm_(u[:, :r, k], b)
                    touched = True
        if touched and not same:
            out += acc


def measure_slot_dtype(dtype: torch.dtype, device: torch.device, group: object | None = None) -> torch.dtype:
    """The dtype LoRA slots hold: the serving dtype, or fp32 on a CPU whose half-precision GEMMs are slow.

    Measured once per machine at start-up on a decode-shaped batched apply (8 slots x 8 tokens, 576 wide, rank 32
    for two sub-modules) and agreed by the TP ranks of ``group`` (fp32 if any rank finds it faster;
    :func:`gpu_worker.timing.agreed_choice`): CPUs without native bf16/fp16 (e.g. AVX2 only) run these several
    times slower than fp32 plus the casts; CPUs with AVX-512 bf16 or AMX read half the bytes and win. GPUs
    always keep ``dtype``.
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype

    def measure() -> tuple[int, str]:
        x = torch.randn(64, 576, dtype=dtype)
        a = torch.randn(8, 64, 576, dtype=dtype)
        b = torch.randn(8, 576, 32, dtype=dtype)

        def apply(xx: torch.Tensor, aa: torch.Tensor, bb: torch.Tensor) -> torch.Tensor:
            u = torch.bmm(xx.to(aa.dtype).view(8, 8, 576), aa.transpose(1, 2))
            return torch.bmm(u[:, :, :32], bb.transpose(1, 2)).view(64, 576).to(dtype)

        af, bf = a.float(), b.float()
        native = best_time(lambda: apply(x, a, b), 15)
        upcast = best_time(lambda: apply(x, af, bf), 15)
        return int(upcast < 0.7 * native), f"batched apply: {dtype} {native * 1e6:.0f} us, fp32 {upcast * 1e6:.0f} us"

    key = f"{torch.__version__}|{dtype}"
    fp32, how, _ = agreed_choice(cache_root() / "kernel-choice", "lora-slots-fp32", key, measure, group, highest=True)
    log.info("LoRA slots hold %s (%s)", "fp32" if fp32 else dtype, how)
    return torch.float32 if fp32 else dtype
