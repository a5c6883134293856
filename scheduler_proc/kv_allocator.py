"""KV-cache accounting on the scheduler side: free token slots and free request rows."""

from __future__ import annotations


class OutOfSlots(RuntimeError):
    """More slots were asked for than are free (a scheduler bug: admission reserves ahead)."""


class SlotAllocator:
    """A free list of integer ids ``0..capacity-1`` handed out lowest-first-freed-last (LIFO, deterministic)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)

    @property
    def num_free(self) -> int:
        """How many ids are free."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` ids. Raises OutOfSlots when fewer are free."""
        if n > len(self._free):
            raise OutOfSlots(f"asked for {n} slots, {len(self._free)} free of {self.capacity}")
        out = [self._free.pop() for _ in range(n)]
        for i in out:
            self._used[i] = 1
        return out

    def free(self, ids: list[int]) -> None:
        """Return ids. Raises ValueError on a double free (it would corrupt another request's KV)."""
        for i in ids:
            if not self._used[i]:
                raise ValueError(f"slot {i} freed twice")
            self._used[i] = 0
            self._free.append(i)


class KVBudget:
    """Token-slot pool plus a reservation count, so admitted requests can always finish.

    A request is admitted only if ``prompt + max_new_tokens`` tokens can be reserved; its slots are then
    allocated as it grows. No running request is ever preempted for lack of KV.
    """

    def __init__(self, capacity: int) -> None:
        self.slots = SlotAllocator(capacity)
        self.reserved = 0  # tokens promised to running requests but not yet allocated

    def can_reserve(self, tokens: int) -> bool:
        """Whether ``tokens`` more can be promised."""
        return self.slots.num_free - self.reserved >= tokens

    def reserve(self, tokens: int) -> None:
        """Promise ``tokens`` (checked with :meth:`can_reserve` first)."""
        self.reserved += tokens

    def take(self, n: int) -> list[int]:
        """Allocate ``n`` previously reserved slots."""
        self.reserved -= n
        return self.slots.alloc(n)

    def release(self, slots: list[int], unused_reservation: int) -> None:
        """Free a finished request's slots and the part of its reservation it never used."""
        self.slots.free(slots)
        self.reserved -= unused_reservation
