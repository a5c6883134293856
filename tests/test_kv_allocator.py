"""SlotAllocator and KVBudget: allocation order, frees, double frees, exhaustion, reservations."""

from __future__ import annotations

import pytest

from scheduler_proc.kv_allocator import KVBudget, OutOfSlots, SlotAllocator


def test_alloc_hands_out_distinct_ids_lowest_first():
    a = SlotAllocator(8)
    assert a.num_free == 8
    first = a.alloc(3)
    assert first == [0, 1, 2]
    second = a.alloc(5)
    assert sorted(first + second) == list(range(8))
    assert a.num_free == 0


def test_free_returns_ids_for_reuse():
    a = SlotAllocator(4)
    ids = a.alloc(4)
    a.free(ids[1:3])
    assert a.num_free == 2
    again = a.alloc(2)
    assert sorted(again) == sorted(ids[1:3])
    assert a.num_free == 0


def test_alloc_zero_is_a_no_op():
    a = SlotAllocator(2)
    assert a.alloc(0) == []
    assert a.num_free == 2


def test_exhaustion_raises_and_takes_nothing():
    a = SlotAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfSlots, match="asked for 2 slots, 1 free of 4"):
        a.alloc(2)
    assert a.num_free == 1  # a failed alloc must not leak slots
    assert a.alloc(1) == [3]


def test_double_free_is_refused():
    a = SlotAllocator(4)
    ids = a.alloc(2)
    a.free(ids)
    with pytest.raises(ValueError, match="freed twice"):
        a.free([ids[0]])
    assert a.num_free == 4


def test_freeing_a_never_allocated_slot_is_refused():
    a = SlotAllocator(4)
    a.alloc(1)
    with pytest.raises(ValueError, match="slot 3 freed twice"):
        a.free([3])
    assert a.num_free == 3


def test_double_free_within_one_call_is_refused():
    a = SlotAllocator(4)
    ids = a.alloc(2)
    with pytest.raises(ValueError):
        a.free([ids[0], ids[0]])


def test_budget_reservation_accounting():
    kv = KVBudget(10)
    assert kv.can_reserve(10) and not kv.can_reserve(11)
    kv.reserve(6)
    assert kv.can_reserve(4) and not kv.can_reserve(5)
    slots = kv.take(4)  # allocate 4 of the 6 promised
    assert len(slots) == 4 and kv.reserved == 2 and kv.slots.num_free == 6
    assert kv.can_reserve(4) and not kv.can_reserve(5)
    kv.release(slots, unused_reservation=2)
    assert kv.reserved == 0 and kv.slots.num_free == 10
    assert kv.can_reserve(10)
