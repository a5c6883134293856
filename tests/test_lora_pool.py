"""LoraPool unit tests on a tiny config: eviction order, pinned and in-batch protection, slot zeroing,
host-cache collisions, load refusals and the batched apply's maths."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
from lora_helpers import ALL, TINY, server_args, skip_without_kernel, tiny_pool, write_adapter

from gpu_worker.lora_cache import CacheKey, HostWeightCache, LoraCacheCollision
from gpu_worker.lora_pool import LoraPoolError


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    """Tiny adapters: u0..u5 (r=4, all modules), a full r=8 one and a q/v-only r=2 one."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    out = {f"u{i}": write_adapter(root / f"u{i}", r=4, seed=i) for i in range(6)}
    out["full8"] = write_adapter(root / "full8", r=8, alpha=16, seed=10)
    out["qv2"] = write_adapter(root / "qv2", r=2, alpha=4, targets=["q_proj", "v_proj"], seed=11)
    out["pattern"] = write_adapter(
        root / "pattern",
        r=4,
        alpha=8,
        seed=12,
        rank_pattern={"q_proj": 8, "down_proj": 2},
        alpha_pattern={"v_proj": 32},
        use_rslora=True,
    )
    return out


def load(pool, adapters, *names, pinned=()):
    for n in names:
        pool.load(n, n, str(adapters[n]), pinned=n in pinned)


# ----------------------------------------------------------------------------- eviction order


def test_lru_evicts_least_recently_used(adapters):
    pool = tiny_pool(slots=3, policy="lru", max_rank=4)
    load(pool, adapters, "u0", "u1", "u2", "u3", "u4")
    for u in ("u0", "u1", "u2"):
        pool.assign([u])
    assert pool.table() == {"u0": 0, "u1": 1, "u2": 2}
    pool.assign(["u0"])  # touch u0: u1 is now least recently used
    assert pool.order == ["u1", "u2", "u0"]
    assert pool.assign(["u3"]) == [1]  # took u1's slot
    assert pool.table() == {"u0": 0, "u3": 1, "u2": 2}
    assert pool.assign(["u4"]) == [2]  # then u2's
    assert pool.order == ["u0", "u3", "u4"]


def test_fifo_evicts_oldest_load_whatever_its_use(adapters):
    pool = tiny_pool(slots=3, policy="fifo", max_rank=4)
    load(pool, adapters, "u0", "u1", "u2", "u3", "u4")
    for u in ("u0", "u1", "u2"):
        pool.assign([u])
    pool.assign(["u0"])  # using u0 again does not save it under FIFO
    assert pool.assign(["u3"]) == [0]
    assert pool.table() == {"u3": 0, "u1": 1, "u2": 2}
    assert pool.assign(["u4"]) == [1]
    assert pool.order == ["u2", "u3", "u4"]


def test_free_slots_are_taken_lowest_first_and_base_needs_none(adapters):
    pool = tiny_pool(slots=3, max_rank=4)
    load(pool, adapters, "u0", "u1")
    assert pool.assign([None, "u1", None, "u0", "u1"]) == [-1, 1, -1, 0, 1]  # sorted: u0 then u1
    assert pool.assign([None]) == [-1]
    assert pool.prepare([None, None], [3, 1]) is None  # base-only batch: no LoRA work at all


@pytest.mark.parametrize("backend", ["torch", "cpu-sgmv"])
def test_unload_frees_slot_and_host_tier(adapters, backend):
    pool = tiny_pool(slots=2, max_rank=4, backend=backend)
    load(pool, adapters, "u0", "u1")
    pool.assign(["u0", "u1"])
    n_before = len(pool.cache)
    pool.unload("u0")
    assert pool.table() == {"u1": 1}
    assert "u0" not in pool.host and len(pool.cache) < n_before
    assert all(pool.slot_rank[0][layer][m] == 0 for layer in range(TINY.num_layers) for m in pool.targets)
    if pool.in_place:  # the kernel can no longer reach u0's freed buffers through slot 0
        assert all(int(t[:, 0].abs().sum()) == 0 for tab in (pool.a_tab, pool.b_tab) for t in tab.values())
    else:
        layers = range(TINY.num_layers)
        assert all(float(pool.A[layer][m][:4].abs().sum()) == 0 for layer in layers for m in pool.targets)
    with pytest.raises(LoraPoolError, match="uid u0 is not loaded on TP rank 0"):
        pool.assign(["u0"])
    pool.unload("u0")  # idempotent


# ----------------------------------------------------------------------------- protection


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_pinned_adapter_is_never_evicted(adapters, policy):
    pool = tiny_pool(slots=3, policy=policy, max_rank=4)
    load(pool, adapters, "u0", pinned=("u0",))
    assert pool.table() == {"u0": 0}  # a pinned adapter takes its slot at load
    load(pool, adapters, "u1", "u2", "u3", "u4", "u5")
    for step in range(12):
        batch = [f"u{1 + step % 5}", f"u{1 + (step + 2) % 5}"]
        pool.assign(batch if step % 3 else batch + ["u0"])
        assert pool.uid_slot["u0"] == 0
    with pytest.raises(LoraPoolError, match=r"batch needs 3 adapters \(12 rank rows\) .*, 4 pinned"):
        pool.assign(["u1", "u2", "u3"])  # needs every slot but u0 is pinned
    assert pool.uid_slot["u0"] == 0


def test_pinning_must_leave_a_free_slot(adapters):
    pool = tiny_pool(slots=3, max_rank=4)
    load(pool, adapters, "u0", "u1", pinned=("u0", "u1"))
    with pytest.raises(LoraPoolError, match="pinning it would leave no free slot of 3"):
        pool.load("u2", "u2", str(adapters["u2"]), pinned=True)
    assert "u2" not in pool.host and pool.table() == {"u0": 0, "u1": 1}


def test_adapters_of_the_batch_are_never_victims(adapters):
    pool = tiny_pool(slots=3, policy="lru", max_rank=4)
    load(pool, adapters, "u1", "u2", "u3", "u0")
    for u in ("u1", "u2", "u3"):
        pool.assign([u])
    # LRU victim would be u1, but u1 is in this batch; u0 sorts first, so it is placed before u1 is touched
    slots = pool.assign(["u1", "u0"])
    assert pool.table() == {"u1": 0, "u0": 1, "u3": 2}
    assert slots == [0, 1]


def test_batch_needing_more_than_all_slots_is_refused(adapters):
    pool = tiny_pool(slots=3, max_rank=4)
    load(pool, adapters, "u0", "u1", "u2", "u3")
    pool.assign(["u0", "u1", "u2"])
    with pytest.raises(
        LoraPoolError, match=r"batch needs 4 adapters \(16 rank rows\) but TP rank 0 has 3 slots of rank 4"
    ):
        pool.assign(["u0", "u1", "u2", "u3"])
    assert pool.table() == {"u0": 0, "u1": 1, "u2": 2}  # nothing was evicted by the refused batch


# ----------------------------------------------------------------------------- rank rows (unified paging)


def test_adapters_take_rank_rows_at_their_own_rank(adapters):
    """Two slots of rank 8 hold four rank-4 adapters in one batch (or two of rank 8); a victim's rows go to the
    next adapter, lowest gap first."""
    pool = tiny_pool(slots=2, max_rank=8)
    load(pool, adapters, "u0", "u1", "u2", "u3", "u4", "full8")
    assert pool.assign(["u3", "u2", None, "u1", "u0"]) == [3, 2, -1, 1, 0]
    assert pool.slot_start[:4] == [0, 4, 8, 12] and pool.slot_rows[:4] == [4, 4, 4, 4]
    with pytest.raises(LoraPoolError, match=r"batch needs 5 adapters \(20 rank rows\) but TP rank 0 has 2 slots"):
        pool.assign(["u0", "u1", "u2", "u3", "u4"])
    assert pool.table() == {"u0": 0, "u1": 1, "u2": 2, "u3": 3}  # the refused batch moved nothing
    assert pool.assign(["full8", "u4"]) == [0, 1]  # full8 takes u0's and u1's rows, u4 then u2's
    assert pool.table() == {"full8": 0, "u4": 1, "u3": 3}
    assert (pool.slot_start[0], pool.slot_rows[0], pool.slot_start[1]) == (0, 8, 8)


@pytest.mark.parametrize("path", ["batched", "segments", "cpu-sgmv"])
def test_compaction_moves_slots_and_keeps_their_maths(adapters, monkeypatch, path):
    """Rows freed in two gaps too short for an adapter are joined by moving the slots to the front (no
    eviction); the moved slots' apply still equals a pool that never moved anything."""
    import gpu_worker.lora_pool as lp

    monkeypatch.setattr(lp.LoraBatch, "PAD_LIMIT", 1e9 if path == "batched" else -1e9)
    backend = "cpu-sgmv" if path == "cpu-sgmv" else "torch"
    pool = tiny_pool(slots=2, max_rank=8, backend=backend)
    ref = tiny_pool(slots=4, max_rank=8, backend=backend)
    load(pool, adapters, "u0", "u1", "u2", "u3", "full8")
    load(ref, adapters, "u1", "u3", "full8")
    pool.assign(["u0", "u1", "u2", "u3"])
    pool.unload("u0")
    pool.unload("u2")  # 8 rows free, as two gaps of 4
    uids, lens = ["u3", None, "full8", "u1", "u3"], [2, 1, 3, 1, 1]
    batch = pool.prepare(uids, lens)
    assert pool.table() == {"full8": 0, "u1": 1, "u3": 3}  # nothing evicted
    assert [pool.slot_start[s] for s in (1, 3, 0)] == [0, 4, 8]  # u1 and u3 moved to the front
    want = ref.prepare(uids, lens)
    g = torch.Generator().manual_seed(3)
    for fused, mods in lp.FUSED.items():
        fin = pool._local_dims(mods[0])[0]
        width = sum(pool._local_dims(m)[1] for m in mods)
        x = torch.randn(sum(lens), fin, generator=g)
        for layer in range(TINY.num_layers):
            got, exp = torch.zeros(sum(lens), width), torch.zeros(sum(lens), width)
            batch.add(layer, fused, x, got)
            want.add(layer, fused, x, exp)
            torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- slot contents


def _slot_clean_beyond(pool, s, layer, m, r):
    return (
        float(pool.a_matrix(layer, m, s)[r:].abs().sum()) == 0
        and float(pool.b_matrix(layer, m, s)[r:].abs().sum()) == 0
    )


@pytest.mark.parametrize("backend", ["torch", "cpu-sgmv"])
def test_takeover_by_fewer_modules_zeroes_the_rest(adapters, backend):
    pool = tiny_pool(slots=1, max_rank=8, backend=backend)
    load(pool, adapters, "full8", "qv2")
    pool.assign(["full8"])
    for layer in range(TINY.num_layers):
        assert all(pool.slot_rank[0][layer][m] == 8 for m in pool.targets)
        assert float(pool.a_matrix(layer, "k_proj", 0).abs().sum()) > 0
    pool.assign(["qv2"])  # evicts full8 from the only slot
    for layer in range(TINY.num_layers):
        for m in pool.targets:
            if m in ("q_proj", "v_proj"):
                assert pool.slot_rank[0][layer][m] == 2
                assert _slot_clean_beyond(pool, 0, layer, m, 2), f"rank residue in layer {layer} {m}"
            else:
                assert pool.slot_rank[0][layer][m] == 0
                assert _slot_clean_beyond(pool, 0, layer, m, 0), f"old weights left in layer {layer} {m}"


def _expected_delta(folder, layer, m, x, r, scale):
    from safetensors.torch import load_file

    t = load_file(str(folder / "adapter_model.safetensors"))
    block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    a = t[f"base_model.model.model.layers.{layer}.{block}.{m}.lora_A.weight"]
    b = t[f"base_model.model.model.layers.{layer}.{block}.{m}.lora_B.weight"]
    assert a.shape[0] == r
    return (x @ a.T @ b.T) * scale


@pytest.mark.parametrize("path", ["batched", "segments", "cpu-sgmv"])
@pytest.mark.parametrize("max_rank", [8, 32], ids=["max-rank-8", "max-rank-32"])
def test_batched_apply_matches_per_adapter_maths(adapters, monkeypatch, path, max_rank):
    """Mixed batch (base, full8, qv2, pattern, base) through LoraBatch.add equals x A^T B^T * scaling per row, on
    all three apply paths (torch batched, torch per segment, the C kernel), with adapters at and well below
    --max-lora-rank (the shrink runs at the batch's rank)."""
    import gpu_worker.lora_pool as lp
    from gpu_worker.lora_pool import FUSED

    monkeypatch.setattr(lp.LoraBatch, "PAD_LIMIT", 1e9 if path == "batched" else -1e9)
    pool = tiny_pool(slots=3, max_rank=max_rank, backend="cpu-sgmv" if path == "cpu-sgmv" else "torch")
    assert (pool.sgmv is not None) == (path == "cpu-sgmv")
    load(pool, adapters, "full8", "qv2", "pattern")
    uids = [None, "full8", "qv2", "pattern", None, "full8"]
    lens = [2, 3, 1, 2, 1, 2]
    batch = pool.prepare(uids, lens)
    assert (batch._batched is not None) == (path == "batched") or path == "cpu-sgmv"
    T = sum(lens)
    g = torch.Generator().manual_seed(0)
    scales = {
        "full8": lambda m: (8, 16 / 8),
        "qv2": lambda m: (2, 4 / 2),
        # rank_pattern q:8 down:2, alpha_pattern v:32, rsLoRA: alpha / sqrt(r)
        "pattern": lambda m: (
            {"q_proj": 8, "down_proj": 2}.get(m, 4),
            {"v_proj": 32.0}.get(m, 8.0) / math.sqrt({"q_proj": 8, "down_proj": 2}.get(m, 4)),
        ),
    }
    for fused, mods in FUSED.items():
        fin = pool._local_dims(mods[0])[0]
        widths = [pool._local_dims(m)[1] for m in mods]
        x = torch.randn(T, fin, generator=g)
        for layer in range(TINY.num_layers):
            out = torch.zeros(T, sum(widths))
            batch.add(layer, fused, x, out)
            want = torch.zeros_like(out)
            t = 0
            for u, n in zip(uids, lens, strict=True):
                col = 0
                for m, w in zip(mods, widths, strict=True):
                    if u is not None and not (u == "qv2" and m not in ("q_proj", "v_proj")):
                        r, sc = scales[u](m)
                        want[t : t + n, col : col + w] = _expected_delta(adapters[u], layer, m, x[t : t + n], r, sc)
                    col += w
                t += n
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "slots_fp32,backend",
    [(False, "torch"), (True, "torch"), (False, "cpu-sgmv")],
    ids=["bf16-slots", "fp32-slots", "cpu-sgmv"],
)
def test_bf16_apply_matches_fp32_apply(adapters, monkeypatch, slots_fp32, backend):
    """A bf16 model's apply (slots in bf16, or in fp32 as on CPUs with slow bf16 GEMMs, or the C kernel's bf16
    slots) tracks the fp32 maths, interleaved segments included, and leaves base rows untouched."""
    import gpu_worker.lora_pool as lp

    monkeypatch.setattr(lp, "measure_slot_dtype", lambda d, dev, group=None: torch.float32 if slots_fp32 else d)
    ref = tiny_pool(slots=3, max_rank=8, backend="torch")
    half = tiny_pool(slots=3, max_rank=8, dtype=torch.bfloat16, backend=backend)
    assert half.slot_dtype == (torch.float32 if slots_fp32 else torch.bfloat16)
    assert (half.sgmv is not None) == (backend == "cpu-sgmv")
    uids = ["full8", None, "qv2", "full8", "pattern"]
    lens = [3, 2, 1, 2, 4]
    for pool in (ref, half):
        load(pool, adapters, "full8", "qv2", "pattern")
    b_ref, b_half = ref.prepare(uids, lens), half.prepare(uids, lens)
    g = torch.Generator().manual_seed(1)
    for fused, mods in lp.FUSED.items():
        fin = ref._local_dims(mods[0])[0]
        width = sum(ref._local_dims(m)[1] for m in mods)
        x = torch.randn(sum(lens), fin, generator=g).bfloat16()
        base = torch.randn(sum(lens), width, generator=g).bfloat16()
        want, got = base.float(), base.clone()
        b_ref.add(1, fused, x.float(), want)
        b_half.add(1, fused, x, got)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
        assert torch.equal(got[3:5], base[3:5])  # the base request's rows


def test_tp_shards_of_a_pool_add_up_to_the_whole(adapters):
    """At TP=2, column modules split B's rows and row modules split A's columns; the shards rebuild TP=1."""
    whole = tiny_pool(slots=1)
    load(whole, adapters, "u0")
    whole.assign(["u0"])
    parts = []
    for rank in range(2):
        p = tiny_pool(slots=1, tp_size=2, rank=rank)
        load(p, adapters, "u0")
        p.assign(["u0"])
        parts.append(p)
    for m in whole.targets:
        if m in ("o_proj", "down_proj"):
            cat_a = torch.cat([p.a_matrix(1, m, 0) for p in parts], dim=1)
            torch.testing.assert_close(cat_a, whole.a_matrix(1, m, 0))
            for p in parts:
                torch.testing.assert_close(p.b_matrix(1, m, 0), whole.b_matrix(1, m, 0))
        else:
            cat_b = torch.cat([p.b_matrix(1, m, 0) for p in parts], dim=1)
            torch.testing.assert_close(cat_b, whole.b_matrix(1, m, 0))


# ----------------------------------------------------------------------------- host cache


COLLISION = re.compile(
    r"LoRA pinned weight cache key collision for \(u, layer 0, q_proj\.lora_A, tp 0/1\): "
    r"cached shape=\(4, 64\), dtype=torch\.float32; new shape=\((?P<new_shape>[^)]*)\), dtype=(?P<new_dtype>\S+)$"
)


def test_cache_collision_on_shape_and_dtype():
    cache = HostWeightCache(pin=False)
    key = CacheKey("u", 0, "q_proj", "A", 0, 1)
    cache.put(key, torch.zeros(4, 64))
    cache.put(key, torch.ones(4, 64))  # same shape and dtype: a plain overwrite
    with pytest.raises(LoraCacheCollision) as e:
        cache.put(key, torch.zeros(8, 64))
    m = COLLISION.match(str(e.value))
    assert m and m["new_shape"] == "8, 64" and m["new_dtype"] == "torch.float32", str(e.value)
    with pytest.raises(LoraCacheCollision) as e:
        cache.put(key, torch.zeros(4, 64, dtype=torch.bfloat16))
    m = COLLISION.match(str(e.value))
    assert m and m["new_shape"] == "4, 64" and m["new_dtype"] == "torch.bfloat16", str(e.value)
    with pytest.raises(LoraCacheCollision, match=r"new shape=\(2, 64\)"):
        cache.get(key, (2, 64), torch.float32)
    # keys that differ in the TP shard (or uid, module, A/B) are different entries, never collisions
    cache.put(CacheKey("u", 0, "q_proj", "A", 1, 2), torch.zeros(4, 32))
    cache.put(CacheKey("v", 0, "q_proj", "A", 0, 1), torch.zeros(8, 64))
    # a stack of layers 0-1 is another entry than layer 0's matrix, and names its layers
    stacked = CacheKey("u", 0, "q_proj", "A", 0, 1, layers=2)
    cache.put(stacked, torch.zeros(2, 4, 64))
    assert len(cache) == 4 and str(stacked) == "(u, layers 0-1, q_proj.lora_A, tp 0/1)"
    with pytest.raises(LoraCacheCollision, match=r"layers 0-1.*new shape=\(4, 64\)"):
        cache.get(stacked, (4, 64), torch.float32)
    cache.drop_uid("u")
    assert len(cache) == 1
    cache.drop_uid("u")  # idempotent
    assert len(cache) == 1


def test_pool_slot_write_checks_cached_shape(adapters):
    pool = tiny_pool(slots=2, backend="torch")
    load(pool, adapters, "u0")
    runs = pool.host["u0"].runs
    i = next(i for i, run in enumerate(runs) if run[0] == "q_proj")
    m, first, n, r = runs[i]
    assert (first, n, r) == (0, TINY.num_layers, 4)  # one run: every layer at rank 4
    runs[i] = (m, first, n, 3)  # a bookkeeping bug: the cache holds rank 4
    with pytest.raises(LoraCacheCollision, match=r"collision for \(u0, layers 0-1, q_proj\.lora_A, tp 0/1\)"):
        pool.assign(["u0"])


def test_in_place_slot_checks_cached_shape(adapters):
    """Read in place, a slot's addresses come from cache entries checked against the shape the bookkeeping expects."""
    pool = tiny_pool(slots=2, backend="cpu-sgmv")
    load(pool, adapters, "u0")
    assert pool.in_place and pool.A_all == {}  # no arena: the host tier is what the kernel reads
    pool.host["u0"].a_rows["qkv"] = 3  # a bookkeeping bug: the cache holds rank 4
    with pytest.raises(LoraCacheCollision, match=r"collision for \(u0, layers 0-1, qkv\.lora_AF, tp 0/1\)"):
        pool.assign(["u0"])


def test_in_place_adapter_is_one_aligned_arena_on_huge_pages(adapters, monkeypatch):
    """Read in place, an adapter's shrink and expand buffers are disjoint views of one arena, each on a 64-byte
    line, the arena on a 2 MiB boundary (advised huge pages; the threshold lowered so a tiny adapter qualifies)."""
    from gpu_worker import huge_pages

    skip_without_kernel()
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    monkeypatch.setenv("LOOM_HUGE_PAGES", "1")
    pool = tiny_pool(slots=2, backend="cpu-sgmv")
    load(pool, adapters, "pattern")
    bufs = sorted((t for k, t in pool.cache._t.items() if k.uid == "pattern"), key=lambda t: t.data_ptr())
    assert len(bufs) == 4 + 7  # shrink: qkv, o, gate_up, down; expand: the seven modules
    assert len({t.untyped_storage().data_ptr() for t in bufs}) == 1
    assert bufs[0].data_ptr() % huge_pages.HUGE == 0 or sys.platform != "linux"
    for a, b in zip(bufs, bufs[1:], strict=False):
        assert a.data_ptr() % 64 == 0 and a.data_ptr() + a.numel() * a.element_size() <= b.data_ptr()


def test_in_place_pool_has_a_slot_per_running_request(adapters):
    """Read in place, slots cost no memory: one per running request plus the pins' allowance (all of
    --max-loras-per-batch but one); the torch path keeps --max-loras-per-batch slots."""
    from gpu_worker.lora_pool import LoraPool
    from gpu_worker.tp_plan import plan_for_model

    skip_without_kernel()
    plan = plan_for_model(TINY, 1, 0)
    for backend, slots in (("cpu-sgmv", 6), ("torch", 2)):
        args = server_args(enable_lora=True, max_loras_per_batch=2, max_running_requests=5, max_lora_rank=4,
                           lora_target_modules=list(ALL), lora_backend=backend)  # fmt: skip
        pool = LoraPool(args, TINY, plan, torch.float32, torch.device("cpu"))
        assert pool.n_slots == slots
        names = [f"u{i}" for i in range(5)]
        load(pool, adapters, *names)
        if backend == "cpu-sgmv":  # five adapters in one batch beside a pinned one, nothing evicted
            pool.load("pin", "pin", str(adapters["u5"]), pinned=True)
            assert pool.assign(names) == [1, 2, 3, 4, 5]
            with pytest.raises(LoraPoolError, match="pinning it would leave no free slot of 2"):
                pool.load("pin2", "pin2", str(adapters["qv2"]), pinned=True)
        else:
            with pytest.raises(LoraPoolError, match="batch needs 5 adapters"):
                pool.assign(names)


# ----------------------------------------------------------------------------- load refusals (tiny)


def test_failed_load_keeps_nothing(adapters, tmp_path):
    pool = tiny_pool(slots=2, max_rank=4)
    with pytest.raises(ValueError, match=r"LoRA adapter big: tensor .*lora_A.weight has rank 8 > --max-lora-rank 4"):
        pool.load("big", "big", str(adapters["full8"]))
    assert not pool.host and len(pool.cache) == 0 and pool.table() == {}
    narrow = tiny_pool(slots=2, targets=["q_proj", "v_proj"])
    with pytest.raises(LoraPoolError, match=r"LoRA adapter u0 targets \[.*'k_proj'.*\], outside --lora-target-modules"):
        narrow.load("u0", "u0", str(adapters["u0"]))
    assert not narrow.host and len(narrow.cache) == 0


def test_an_unknown_target_module_is_refused_not_dropped():
    """The pool used to drop a name it did not know: ``o_proj,down_proj`` as one name left no target at all, and
    every adapter was then refused as targeting modules outside ``[]``."""
    from gpu_worker.lora_pool import LoraPool
    from gpu_worker.tp_plan import plan_for_model

    args = server_args(enable_lora=True, lora_target_modules=["q_proj", "o_proj,down_proj"], lora_backend="torch")
    with pytest.raises(ValueError, match=r"unknown modules \['o_proj,down_proj'\]"):
        LoraPool(args, TINY, plan_for_model(TINY, 1, 0), torch.float32, torch.device("cpu"))


def test_worker_refuses_files_outside_the_lora_root_whatever_the_path_says(tmp_path):
    """The front door checks a path against --lora-root before it sends a load, but a folder swapped for a link
    after that check must not make a worker read from outside: each file's open descriptor is checked."""
    import os

    from gpu_worker.lora_reader import AdapterReader
    from ipc.lora_config import LoraConfigError
    from ipc.messages import WorkerLoraLoad

    root, outside = tmp_path / "root", tmp_path / "outside"
    write_adapter(root / "inside", r=4, seed=1)
    write_adapter(outside / "evil", r=4, seed=2)
    (root / "swapped").symlink_to(outside / "evil")  # as if swapped in after the front door's check
    write_adapter(root / "halfway", r=4, seed=3)
    (root / "halfway" / "adapter_model.safetensors").unlink()
    (root / "halfway" / "adapter_model.safetensors").symlink_to(outside / "evil" / "adapter_model.safetensors")
    write_adapter(root / "fifo", r=4, seed=4)
    (root / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(root / "fifo" / "adapter_config.json")  # must be refused, never block the worker

    pool = tiny_pool()
    pool.root = str(root)
    pool.load("ok", "ok", str(root / "inside"))
    for name in ("swapped", "halfway"):
        with pytest.raises(LoraConfigError, match=f"{name}/adapter_.* resolves to .*outside the allowed root"):
            pool.load(name, name, str(root / name))
        assert name not in pool.host
    with pytest.raises(LoraConfigError, match="adapter_config.json is not a regular file"):
        pool.load("fifo", "fifo", str(root / "fifo"))

    reader = AdapterReader(str(root))  # the worker's off-loop read hands back nothing for an outside file
    try:
        reader.submit(WorkerLoraLoad(1, "u1", "swapped", str(root / "swapped")))
        reader.submit(WorkerLoraLoad(2, "u2", "inside", str(root / "inside")))
        (_, swapped), (_, inside) = reader.drain()
        assert swapped is None and inside == (root / "inside" / "adapter_model.safetensors").read_bytes()
    finally:
        reader.close()

    open_pool = tiny_pool()  # without --lora-root links are followed as before
    open_pool.load("swapped", "swapped", str(root / "swapped"))
