"""gpu_worker.huge_pages: buffers on 2 MiB pages where Linux allows, weights moved there without changing a value."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from gpu_worker import huge_pages as hp


@pytest.fixture(autouse=True)
def _huge_pages_on(monkeypatch):
    """These tests are about the feature itself: an environment that turned it off must not fail them."""
    monkeypatch.delenv("LOOM_HUGE_PAGES", raising=False)


def test_empty_is_aligned_and_small_buffers_stay_plain():
    t = hp.zeros((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.is_contiguous() and t.shape == (3, 1 << 20) and t.dtype == torch.float32
    assert not t.any()
    if sys.platform == "linux":
        assert t.data_ptr() % hp.HUGE == 0
    small = hp.empty(100, torch.bfloat16)
    assert small.shape == (100,) and small.dtype == torch.bfloat16


def _vma(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``addr``: its fields, VmFlags included."""
    entry: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                lo, hi = (int(v, 16) for v in head.split("-"))
                if inside:
                    break
                inside = lo <= addr < hi
            elif inside:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry


_NO_THP = sys.platform != "linux" or hp.thp_mode() in ("never", "unknown")


@pytest.mark.skipif(_NO_THP, reason="no transparent huge pages here")
def test_advised_buffer_is_its_own_mapping_marked_for_huge_pages():
    """The buffer is a fresh mapping advised MADV_HUGEPAGE ("hg" in its VmFlags). Whether the kernel then finds
    free 2 MiB pages depends on the machine's memory, so only the advice itself is required here."""
    t = hp.zeros(16 << 20, torch.uint8)
    vma = _vma(t.data_ptr())
    flags = vma.get("VmFlags", "").split()
    assert "hg" in flags, f"no MADV_HUGEPAGE on the buffer's mapping: {vma}"
    # private: shared anonymous memory is shmem, whose huge pages follow another setting (shmem_enabled)
    assert "sh" not in flags, f"the buffer's mapping is shared: {vma}"
    del t


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("LOOM_HUGE_PAGES", "0")
    assert not hp.enabled()
    w = {"a": torch.randn(1 << 20)}
    ptr = w["a"].data_ptr()
    assert hp.move_to_huge_pages(w) == 0 and w["a"].data_ptr() == ptr
    assert "off" in hp.status() or sys.platform != "linux"


@pytest.mark.parametrize("value", ["false", "OFF", " no "])
def test_other_spellings_of_off_turn_it_off(monkeypatch, value):
    monkeypatch.setenv("LOOM_HUGE_PAGES", value)
    assert not hp.enabled()


def test_an_unknown_value_warns_and_leaves_it_on(monkeypatch, caplog):
    monkeypatch.setenv("LOOM_HUGE_PAGES", "disabled")
    with caplog.at_level(logging.WARNING, logger=hp.log.name):
        assert hp.enabled() == (sys.platform == "linux")
    assert "LOOM_HUGE_PAGES='disabled'" in caplog.text


class _Quantised:
    def __init__(self) -> None:
        self.packed = torch.randint(0, 255, (3000, 700), dtype=torch.uint8)
        self.scales = torch.randn(3000, 22).to(torch.bfloat16)
        self.out_features = 3000


@pytest.mark.skipif(sys.platform != "linux", reason="moves only where madvise exists")
def test_move_keeps_values_views_and_ties():
    """Dense weights, a view and a dtype view of one storage, a tied pair, a quantised linear's attributes and
    nested lists all keep their values and their sharing; the old storages are released."""
    emb = torch.randn(4000, 576)
    lm_head = emb  # tied weights: one tensor object twice
    rows = emb[100:300]  # a view (like a TP rank's vocabulary rows)
    as_int = emb.view(torch.int32)[7:9]
    q = _Quantised()
    w = {"embed": emb, "lm_head": lm_head, "rows": rows, "bits": as_int, "layers": [{"q": q, "n": torch.ones(576)}]}
    want = {
        "embed": emb.clone(),
        "rows": rows.clone(),
        "bits": as_int.clone(),
        "packed": q.packed.clone(),
        "scales": q.scales.clone(),
    }
    old = emb.untyped_storage().data_ptr()
    moved = hp.move_to_huge_pages(w)
    assert moved >= emb.numel() * 4 + q.packed.numel()
    assert emb.untyped_storage().data_ptr() != old
    assert torch.equal(emb, want["embed"]) and w["lm_head"] is emb
    assert torch.equal(rows, want["rows"]) and torch.equal(as_int, want["bits"])
    assert torch.equal(q.packed, want["packed"]) and torch.equal(q.scales, want["scales"])
    assert q.out_features == 3000 and torch.equal(w["layers"][0]["n"], torch.ones(576))
    shared = {t.untyped_storage().data_ptr() for t in (emb, rows, as_int, q.packed, q.scales)}
    assert len(shared) == 1  # one arena
    emb[100, 0] = 42.0  # a view still sees writes through its base: the sharing survived the move
    assert rows[0, 0].item() == 42.0


@pytest.mark.skipif(sys.platform != "linux", reason="moves only where madvise exists")
def test_move_takes_a_views_unreachable_base_along():
    """A weight that is a view of a base nothing else holds (a full-width slice at TP=1, a TP rank's head rows):
    the base moves too, so no old storage stays alive beside the new copy."""
    q = torch.ones(1024, 2048, dtype=torch.int8)
    w = {"down": q[:, 0:2048].contiguous()}  # a full-width slice: .contiguous() returns the view itself
    assert w["down"]._base is q
    del q
    assert hp.move_to_huge_pages(w) > 0
    v = w["down"]
    assert v._base.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert v.data_ptr() % hp.HUGE == 0 and bool((v == 1).all())


@pytest.mark.skipif(sys.platform != "linux", reason="moves only where madvise exists")
def test_move_keeps_overlapping_storages_shared():
    """Distinct storages over one memory (two from_numpy of one array, at the same start with different sizes or
    at different starts) are moved as one region: every value is kept and writes still reach all of them."""
    np = pytest.importorskip("numpy")
    arr = np.arange(1 << 20, dtype=np.float32)
    head, full, tail = torch.from_numpy(arr[:16]), torch.from_numpy(arr), torch.from_numpy(arr[5:])
    other = torch.full((1 << 18,), -1.0)
    w = {"head": head, "full": full, "tail": tail, "other": other}
    assert hp.move_to_huge_pages(w) > 0
    assert torch.equal(full, torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(head, full[:16]) and torch.equal(tail, full[5:]) and bool((other == -1).all())
    full[7] = 1234.0
    assert head[7].item() == 1234.0 and tail[2].item() == 1234.0


def test_move_leaves_autograd_tensors_and_is_only_advice():
    """A tensor that needs autograd (an nn.Parameter) stays where it is, with no error; the rest still moves."""
    p = torch.nn.Parameter(torch.randn(1 << 20))
    plain = torch.randn(1 << 20)
    ptr = p.data_ptr()
    w = {"p": p, "plain": plain}
    moved = hp.move_to_huge_pages(w)
    assert p.data_ptr() == ptr
    if sys.platform == "linux":
        assert moved == plain.numel() * 4 and plain.data_ptr() % hp.HUGE == 0
