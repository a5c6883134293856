"""One TP rank's logic: model shard, KV cache, LoRA pool; turns a ForwardBatch plan into next tokens.

No sockets here (``gpu_worker.main`` owns them), so tests drive a Worker directly.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import torch

from gpu_worker import huge_pages
from gpu_worker.decode_mirror import DecodeKVMirror
from gpu_worker.kv_cache import KVCache, host_memory_available
from gpu_worker.logprobs import row_logprobs
from gpu_worker.model import DecodeGroup, LlamaShard, PrefillRow, StepInputs
from gpu_worker.packed_linear import pack_linears, packing_pays
from gpu_worker.sampling import is_greedy, sample_rows, sampling_param_error
from gpu_worker.tp_plan import plan_for_model
from gpu_worker.weights import load_shard, release_freed_memory
from ipc.config import ServerArgs
from ipc.messages import (
    ForwardBatch,
    LoraOpAck,
    RowLogprobs,
    StepResult,
    WorkerLoraLoad,
    WorkerLoraUnload,
    WorkerReady,
)
from ipc.model_config import ModelConfig, load_model_config
from ipc.model_source import cache_root, effective_quantization

log = logging.getLogger("gpu_worker")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_MAX_TOKENS = 32768


def pick_device(requested: str = "auto", rank: int = 0) -> torch.device:
    """CUDA device ``rank`` when CUDA exists (or is asked for), else CPU.

    One device per TP rank: NCCL refuses two ranks of a group on one GPU, and they would share its memory.

    Raises:
        RuntimeError: CUDA asked for and PyTorch sees no device, or ``rank`` is beyond the devices it sees.
    """
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if rank >= n:
        seen = f"PyTorch sees {n} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        if n == 0:
            raise RuntimeError(f"--device cuda: no CUDA device: {seen}; use --device cpu")
        raise RuntimeError(f"TP rank {rank} needs its own CUDA device, but {seen}: use --tp-size {n} or less")
    return torch.device("cuda", rank)


def resolve_dtype(requested: str, model_path: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (float16 becomes float32 on CPU; float32 becomes bfloat16 on CUDA, or
    float16 where the GPU has no bf16, as vLLM and SGLang serve), or bfloat16 for quantised weights (the CPU
    weight-only kernels take bf16 inputs); otherwise the named dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"--dtype {requested!r}: choose auto, float32, bfloat16 or float16")
        return _DTYPES[requested]
    if quantization != "none":
        return torch.bfloat16
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dt = _DTYPES.get(str(name), torch.float32)
    if device.type == "cpu":
        return torch.float32 if dt == torch.float16 else dt
    if dt == torch.float32:  # full precision buys nothing a served model needs, at twice the bytes per step
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dt


def kv_capacity_tokens(args: ServerArgs, cfg: ModelConfig, kv_heads: int, dtype: torch.dtype, device) -> int:
    """Token slots this rank's KV pool holds: ``--max-total-tokens``, or a memory-derived default."""
    if args.max_total_tokens > 0:
        return args.max_total_tokens
    per_tok = KVCache.bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = max(total * args.mem_fraction_static - used, per_tok * 1024)
        return int(budget // per_tok)
    return CPU_DEFAULT_MAX_TOKENS


class WorkerError(RuntimeError):
    """A step or LoRA command could not be carried out on this rank."""


class Worker:
    """One TP rank. ``group`` is the torch.distributed group (None at TP=1)."""

    def __init__(
        self, args: ServerArgs, rank: int = 0, group: object | None = None, device=None, epoch: int = 1
    ) -> None:
        self.args = args
        self.rank = rank
        self.epoch = epoch
        self.device = device if device is not None else pick_device(args.device, rank)
        self.incarnation = uuid.uuid4().hex
        self.steps_run = 0  # steps started in this epoch (READY says it: see scheduler_proc.health.FirstReady)
        self.cfg = load_model_config(args.model_path)
        self.plan = plan_for_model(self.cfg, args.tp_size, rank)
        self.quantization = self._choose_quantization(group)
        self.dtype = resolve_dtype(args.dtype, args.model_path, self.device, self.quantization)
        weights = load_shard(args.model_path, self.cfg, self.plan, self.dtype, self.device, self.quantization)
        self.model = LlamaShard(self.cfg, self.plan, weights, group)  # takes its vocabulary rows of the head
        self.packed_linears = self._pack_linears(weights, group)
        if self.device.type == "cpu":  # before any kernel records a weight's address
            moved = huge_pages.move_to_huge_pages(weights)
            how = huge_pages.status()
            log.info("rank %d: %.0f MB of weights moved to huge-page memory (%s)", rank, moved / 1e6, how)
        self._choose_int4_batch_kernel(group)
        self._choose_decode_attention(group)
        release_freed_memory()
        self.context_len = args.context_length or self.cfg.max_position_embeddings
        cap = kv_capacity_tokens(args, self.cfg, self.plan.num_kv_heads, self.dtype, self.device)
        need = cap * KVCache.bytes_per_token(self.cfg.num_layers, self.plan.num_kv_heads, self.cfg.head_dim, self.dtype)
        if self.device.type == "cpu" and epoch == 1:  # a replacement rank's peers hold their pages already
            self._check_kv_fits_host(cap, need)
        try:
            self.kv = KVCache(
                self.cfg.num_layers,
                cap,
                self.plan.num_kv_heads,
                self.cfg.head_dim,
                args.max_running_requests,
                self.context_len,
                self.dtype,
                self.device,
            )
        except (RuntimeError, MemoryError) as e:  # CPU allocator or CUDA OOM: say which setting asked for it
            raise WorkerError(
                f"the KV cache for {cap} tokens needs {need / 2**30:.1f} GiB on TP rank {rank} ({self.device}) and "
                f"could not be allocated: lower --max-total-tokens ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        # decode rows that stay the same from step to step read their KV history from a kept copy (CPU only); the
        # C decode attention reads the paged cache in place through the slot table instead, so needs none
        self.decode_mirror: DecodeKVMirror | None = None
        if self.device.type == "cpu" and args.decode_mirror_mb > 0 and self.model.decode_attn is None:
            self.decode_mirror = DecodeKVMirror(
                self.cfg.num_layers, self.plan.num_kv_heads, self.cfg.head_dim, self.device, args.decode_mirror_mb << 20
            )
        self.lora = None
        if args.enable_lora:
            from gpu_worker.lora_pool import LoraPool

            self.lora = LoraPool(args, self.cfg, self.plan, self.dtype, self.device, group)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(args.random_seed)

    def _check_kv_fits_host(self, cap: int, need: int) -> None:
        """Refuse, at start-up, a CPU KV pool that the host's memory cannot hold: its pages are taken only as tokens
        are written (``huge_pages.zeros``), so it would otherwise fail mid-serving, under the OOM killer. The TP
        ranks' pools share this host (the launcher starts them all here), so their sum is what must fit in
        ``MemAvailable`` + ``SwapFree``; every rank computes the same sum. Checked at the cluster's first start only:
        by the time a rank is replaced, its peers' pools hold pages that no longer count as available, and the size
        was accepted then. Raises WorkerError."""
        avail = host_memory_available()
        host = cap * sum(
            KVCache.bytes_per_token(self.cfg.num_layers, plan_for_model(self.cfg, self.args.tp_size, r).num_kv_heads,
                                    self.cfg.head_dim, self.dtype)
            for r in range(self.args.tp_size)
        )  # fmt: skip
        if avail is None or host <= avail:
            return
        on_host = f" ({host / 2**30:.1f} GiB with the other TP ranks on this host)" if self.args.tp_size > 1 else ""
        raise WorkerError(
            f"the KV cache for {cap} tokens needs {need / 2**30:.1f} GiB on TP rank {self.rank} ({self.device})"
            f"{on_host}, more than the {avail / 2**30:.1f} GiB of memory available: lower --max-total-tokens"
        )

    def _pack_linears(self, weights: dict, group: object | None) -> bool:
        """Hold the dense half-precision linears in Loom's bf16 GEMM panels (:meth:`_use_bf16_gemm`), else in
        oneDNN's blocked layout (``gpu_worker.packed_linear``), where a start-up measurement on this rank's own
        gate/up weight finds it faster, agreed by the TP ranks and kept like every start-up choice
        (:func:`gpu_worker.timing.agreed_choice`: a replacement group packs as the group it replaces did, so a
        failover does not change the rounding); logs the timings."""
        sample = weights["layers"][0].get("gate_up") if weights["layers"] else None
        if not isinstance(sample, torch.Tensor):
            return False  # quantised weights run their own kernels
        from gpu_worker.timing import agreed_choice

        if self._use_bf16_gemm(weights, sample, group):
            return True
        name, key = "packed-linears", f"{torch.__version__}|{sample.dtype}|{tuple(sample.shape)}"
        vote, how, own = agreed_choice(cache_root() / "kernel-choice", name, key, lambda: packing_pays(sample), group)
        pays = bool(vote)
        if own and not pays:
            how += "; not used: another TP rank found the plain product faster"
        if pays:
            pack_linears(weights)
        log.info("rank %d: packed bf16/fp16 linear weights %s", self.rank, how)
        return pays

    def _use_bf16_gemm(self, weights: dict, sample: torch.Tensor, group: object | None) -> bool:
        """Hold the dense bf16 linears in Loom's GEMM panels (``gpu_worker.bf16_gemm``) where the kernel builds and
        a start-up measurement on this rank's gate/up weight finds it faster than oneDNN's packed and the plain
        product, agreed by the TP ranks and kept like every start-up choice; logs the timings."""
        if self.device.type != "cpu" or sample.dtype != torch.bfloat16:
            return False
        import hashlib

        from gpu_worker.bf16_gemm import SOURCE, gemm_pays, load_gemm, use_gemm
        from gpu_worker.timing import agreed_choice

        fn = load_gemm(cache_root() / "kernels")
        key = f"{torch.__version__}|{tuple(sample.shape)}|{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}"
        measure = None if fn is None else (lambda: gemm_pays(sample, fn))
        vote, how, own = agreed_choice(cache_root() / "kernel-choice", "bf16-gemm", key, measure, group)
        if fn is None:
            how = "not used (the kernel does not build here)"
        elif own and not vote:
            how += "; not used: another TP rank cannot use it or measured it slower"
        log.info("rank %d: Loom's bf16 GEMM %s", self.rank, how)
        if not vote or fn is None:
            return False
        use_gemm(weights, fn)
        return True

    def _choose_decode_attention(self, group: object | None) -> None:
        """On CPU, decode attention on the C kernel (``gpu_worker.decode_attention``) where it is faster than SDPA
        on this machine (measured once, the same on every TP rank), and the fused layer ops
        (``gpu_worker.layer_ops``) where they build; logs the choices."""
        if self.device.type != "cpu":
            return
        if self.dtype not in (torch.float32, torch.bfloat16):  # the C kernels take fp32/bf16 activations only
            log.info("rank %d: decode attention on SDPA, layer ops on PyTorch (%s activations)", self.rank, self.dtype)
            return
        from gpu_worker.decode_attention import choose_decode_attention
        from gpu_worker.layer_ops import layer_ops

        self.model.decode_attn, how = choose_decode_attention(cache_root(), group)
        log.info("rank %d: %s", self.rank, how)
        ops, how = layer_ops(cache_root())
        if group is not None:  # every rank keeps an identical copy of the residual stream: the same ops on all
            import torch.distributed as dist

            vote = torch.tensor([int(ops is not None)])
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
            if ops is not None and not vote.item():
                ops, how = None, "layer ops on PyTorch (another TP rank has no C library)"
        self.model.layer_ops = ops
        log.info("rank %d: %s", self.rank, how)

    def _choose_int4_batch_kernel(self, group: object | None) -> None:
        """With 4-bit weights (``gguf``), set the batch size from which they multiply on the C batch kernel and up to
        which on the C GEMV (``gpu_worker.int4_batch``; measured once per machine, the same on every TP rank); logs
        the choices."""
        if self.quantization != "gguf":
            return
        if self.dtype not in (torch.float32, torch.bfloat16):  # the kernel takes fp32/bf16 activations only
            log.info("rank %d: 4-bit batches on PyTorch's kernel (%s activations)", self.rank, self.dtype)
            return
        from gpu_worker import quant
        from gpu_worker.int4_batch import choose_batch_kernel, choose_gemv_kernel

        quant.BATCH_KERNEL, how = choose_batch_kernel(cache_root(), group)
        log.info("rank %d: %s", self.rank, how)
        quant.GEMV_KERNEL, how = choose_gemv_kernel(cache_root(), group)
        log.info("rank %d: %s", self.rank, how)

    def _choose_quantization(self, group: object | None) -> str:
        """``--quantization`` with ``auto`` resolved: ``gguf`` for a GGUF model on CPU (launch.py has checked that
        its blocks and the TP split can be served) if the 4-bit kernel is faster at one row than the dense path on
        this machine (measured once, then cached), else ``none``. TP ranks vote (all must find it faster), so
        every rank holds the same kind of weights."""
        args = self.args
        q = effective_quantization(args.quantization, args.model_path, self.device.type)
        if args.quantization != "auto" or q != "gguf":
            return q
        from gpu_worker.quant import cached_int4_choice

        dense = resolve_dtype(args.dtype, args.model_path, self.device, "none")
        faster, how = cached_int4_choice(dense, cache_root() / "kernel-choice", group)
        choice = "gguf" if faster else "none"
        log.info("--quantization auto: %s (%s)", choice, how)
        return choice

    def ready(self) -> WorkerReady:
        """The READY message for the scheduler."""
        return WorkerReady(
            rank=self.rank,
            incarnation=self.incarnation,
            kv_capacity_tokens=self.kv.num_slots,
            loaded_uids=[] if self.lora is None else self.lora.host_uids(),
            epoch=self.epoch,
            adapters=[] if self.lora is None else self.lora.host_adapters(),
            lora_rows=0 if self.lora is None else self.lora.capacity,
            steps=self.steps_run,
        )

    def build_inputs(self, fb: ForwardBatch) -> StepInputs:
        """Record each request's new KV slots (and a cached prefix's, when sent) in ``req_to_token`` and pack the
        step's tensors.

        Raises:
            WorkerError: a row whose token, slot, prefix-slot or context counts do not add up.
        """
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        decode_rows: list[int] = []
        decode_tok: list[int] = []
        prefill_rows: list[PrefillRow] = []
        for b, r in enumerate(fb.reqs):
            n = len(r.input_ids)
            if n == 0 or n != len(r.out_slots):
                raise WorkerError(f"request {r.rid}: {n} tokens but {len(r.out_slots)} KV slots")
            if r.prefix_len + n > self.context_len:
                raise WorkerError(f"request {r.rid}: {r.prefix_len + n} tokens exceed context {self.context_len}")
            for ids_ in (r.out_slots, r.prefix_slots):  # min/max in C: this runs for every token of every step
                if ids_ and (min(ids_) < 0 or max(ids_) >= self.kv.num_slots):
                    bad = min(ids_) if min(ids_) < 0 else max(ids_)
                    raise WorkerError(f"request {r.rid}: KV slot {bad} outside 0..{self.kv.num_slots - 1}")
            if r.prefix_slots:  # a prefix from the scheduler's prefix cache: point the row at its slots
                if len(r.prefix_slots) != r.prefix_len:
                    raise WorkerError(f"request {r.rid}: {len(r.prefix_slots)} prefix slots for {r.prefix_len}")
                self.kv.req_to_token[r.req_idx, : r.prefix_len] = torch.tensor(
                    r.prefix_slots, dtype=torch.int64, device=dev
                )
            self.kv.req_to_token[r.req_idx, r.prefix_len : r.prefix_len + n] = torch.tensor(
                r.out_slots, dtype=torch.int64, device=dev
            )
            if n == 1 and r.prefix_len > 0:
                decode_rows.append(b)
                decode_tok.append(len(ids))
            elif r.prefix_len == 0:
                prefill_rows.append(PrefillRow(len(ids), n, None, None))
            else:
                total = r.prefix_len + n
                mask = torch.ones(n, total, dtype=torch.bool, device=dev).tril(r.prefix_len)[None, None]
                prefill_rows.append(PrefillRow(len(ids), n, self.kv.req_to_token[r.req_idx, :total], mask))
            ids.extend(r.input_ids)
            pos.extend(range(r.prefix_len, r.prefix_len + n))
            slots.extend(r.out_slots)
            last.append(len(ids) - 1)
        if self.decode_mirror is not None and len(decode_rows) < len(fb.reqs):
            decoding = set(decode_rows)
            self.decode_mirror.forget({r.rid for b, r in enumerate(fb.reqs) if b not in decoding})
        groups = self._decode_groups(fb, decode_rows, decode_tok)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            out_slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            ext_lens=[len(r.input_ids) for r in fb.reqs],
            decode_groups=groups,
            last_token_index=torch.tensor(last, dtype=torch.int64, device=dev),
            every_token_last=len(ids) == len(fb.reqs),
            prefill_rows=prefill_rows,
        )

    @staticmethod
    def _length_groups(fb: ForwardBatch, rows: list[int]) -> list[list[int]]:
        """Indices into ``rows`` in groups of similar history length (sorted, so every rank groups alike); see
        :meth:`_decode_groups`."""
        groups: list[list[int]] = []
        real = 0
        for i in sorted(range(len(rows)), key=lambda i: fb.reqs[rows[i]].prefix_len):
            n = fb.reqs[rows[i]].prefix_len + 1
            if groups:
                g = groups[-1]
                if n * (len(g) + 1) <= 1.25 * (real + n) + 64 * (len(g) + 1):
                    g.append(i)
                    real += n
                    continue
            groups.append([i])
            real = n
        return groups

    def _decode_groups(self, fb: ForwardBatch, rows: list[int], tok: list[int]) -> list[DecodeGroup]:
        """Split decode rows into groups of similar history length (sorted, so every rank groups alike).

        A group grows while its padded size (rows x longest history) stays within 1.25x its real tokens plus
        64 per row, so a 4,000-token request does not make 63 short ones gather and attend 4,000 positions.
        The C decode attention over the paged cache reads each row's own length whatever the group's, so there
        all rows form one group in plan order (one call per layer; a pure decode step binds its kernels once).
        """
        dev = self.device
        if self.model.decode_attn is not None and self.decode_mirror is None:
            groups = [list(range(len(rows)))] if rows else []
        else:
            groups = self._length_groups(fb, rows)
        out: list[DecodeGroup] = []
        for g in groups:
            mirror = None
            if len(groups) == 1 and self.decode_mirror is not None:  # the usual steady state: one group
                dtype = torch.float32 if len(g) >= self.model.upcast_min_rows else self.dtype
                reqs = [fb.reqs[rows[i]] for i in g]
                keys = [(r.rid, r.req_idx) for r in reqs]
                mirror = self.decode_mirror.use(keys, [r.prefix_len + 1 for r in reqs], dtype)
                if mirror is not None:
                    g = [g[i] for i in mirror.order]  # member i reads mirror row i
            lens = [fb.reqs[rows[i]].prefix_len + 1 for i in g]
            lmax = max(lens)
            req_rows = torch.tensor([fb.reqs[rows[i]].req_idx for i in g], device=dev)
            kv_slots = self.kv.req_to_token[req_rows, :lmax]
            mask = lt = None
            if min(lens) != lmax:
                lt = torch.tensor(lens, device=dev)
                valid = torch.arange(lmax, device=dev)[None, :] < lt[:, None]  # [G, L]
                mask = valid[:, None, None, :]
                # padding reads the all-zero slot, never a stale slot another request may have filled with inf
                kv_slots = kv_slots.masked_fill(~valid, self.kv.null_slot)
            kv_slots = kv_slots.reshape(-1)
            if kv_slots.numel() and (int(kv_slots.min()) < 0 or int(kv_slots.max()) > self.kv.null_slot):
                raise WorkerError(f"a decode row's KV slots leave the cache (0..{self.kv.null_slot})")
            index = torch.tensor([tok[i] for i in g], dtype=torch.int64, device=dev)
            every = len(groups) == 1 and len(g) == len(fb.reqs) and [tok[i] for i in g] == list(range(len(g)))
            if mirror is not None and mirror.fill_rows is not None:
                mirror.fill_slots = kv_slots.view(len(g), lmax).index_select(0, mirror.fill_rows).reshape(-1)
            out.append(DecodeGroup(index, kv_slots, lmax, mask, every, mirror, lt))
        return out

    def forward_logits(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the plan and return last-token logits ``[B, vocab]`` fp32 in plan order (also used by tests; at TP > 1
        on the shared-memory reducer only rank 0's are whole, see ``LlamaShard.forward``).

        The scheduler orders each plan by adapter, so each adapter's tokens form one segment; a plan that is
        not ordered is still exact (:class:`~gpu_worker.lora_pool.LoraBatch` gathers a slot's tokens).
        """
        _, logits = self._forward(fb, greedy=False)
        assert logits is not None
        return logits

    def _forward(self, fb: ForwardBatch, greedy: bool) -> tuple[list[int] | None, torch.Tensor | None]:
        """Run the plan: ``(None, logits)`` as :meth:`forward_logits`, or with ``greedy`` (TP > 1, every row takes
        the argmax) ``(tokens, None)`` from ``LlamaShard.forward_greedy`` unless a row's logits need inspecting."""
        s = self.build_inputs(fb)
        applier = None
        if self.lora is not None:
            applier = self.lora.prepare([r.lora_uid for r in fb.reqs], s.ext_lens)
        elif any(r.lora_uid is not None for r in fb.reqs):
            raise WorkerError("a request names a LoRA adapter but LoRA is not enabled (--enable-lora)")
        if greedy:
            tokens, logits = self.model.forward_greedy(s, self.kv, applier)
        else:
            tokens, logits = None, self.model.forward(s, self.kv, applier)
        if self.decode_mirror is not None and any(g.mirror is not None for g in s.decode_groups):
            self.decode_mirror.commit()  # only now: a step that raised leaves the mirror invalid
        return tokens, logits

    def _all_greedy(self, fb: ForwardBatch) -> bool:
        """Whether this step can take ``forward_greedy``: TP > 1 and every row greedy with valid sampling values and
        no logprobs (the same answer on every rank: it reads only the plan)."""
        return self.args.tp_size > 1 and all(
            is_greedy(r.sampling) and sampling_param_error(r.sampling) is None and r.logprobs < 0 for r in fb.reqs
        )

    def step(self, fb: ForwardBatch) -> StepResult:
        """Run one step; rank 0 samples one token per request (other ranks return no tokens).

        At TP > 1 a step whose rows are all greedy takes each row's argmax over the ranks' vocabulary columns
        without gathering the logits (``LlamaShard.forward_greedy``): the same tokens, less work on rank 0.
        """
        self.steps_run += 1
        if self._all_greedy(fb):
            tokens, logits = self._forward(fb, greedy=True)
        else:
            tokens, logits = None, self.forward_logits(fb)
        next_ids: list[int] = []
        row_errors: dict[int, str] = {}
        logprobs: dict[int, RowLogprobs] = {}
        if self.rank == 0 and tokens is not None:
            next_ids = tokens
        elif self.rank == 0:
            assert logits is not None
            out = sample_rows(logits, [r.sampling for r in fb.reqs], [r.output_len for r in fb.reqs], self._gen)
            next_ids, row_errors = out.tokens, out.errors
            if any(r.logprobs >= 0 for r in fb.reqs):
                logprobs = row_logprobs(logits, next_ids, [r.logprobs for r in fb.reqs])
        digest, table = ("", {}) if self.lora is None else self.lora.digest()
        return StepResult(
            step=fb.step,
            rank=self.rank,
            next_ids=next_ids,
            row_errors=row_errors,
            logprobs=logprobs,
            slot_digest=digest,
            slots=table,
            epoch=self.epoch,
        )

    def load_lora(self, msg: WorkerLoraLoad, data: bytes | None = None) -> LoraOpAck:
        """Load an adapter into this rank's host tier; the ack carries the error text on failure. ``data``: the
        weights file's bytes, read already (:mod:`gpu_worker.lora_reader`); None reads them here."""
        if self.lora is None:
            return LoraOpAck(
                msg.op_id, self.rank, False, "LoRA is not enabled (start with --enable-lora)", epoch=self.epoch
            )
        try:
            content_hash = self.lora.load(msg.uid, msg.name, msg.path, msg.pinned, msg.content_hash, data)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the scheduler as text
            return LoraOpAck(msg.op_id, self.rank, False, str(e), epoch=self.epoch)
        rows = self.lora.rows_of(msg.uid)
        return LoraOpAck(msg.op_id, self.rank, True, content_hash=content_hash, epoch=self.epoch, rows=rows)

    def unload_lora(self, msg: WorkerLoraUnload) -> LoraOpAck:
        """Drop an adapter from this rank (idempotent)."""
        if self.lora is not None:
            self.lora.unload(msg.uid)
        return LoraOpAck(msg.op_id, self.rank, True, epoch=self.epoch)
