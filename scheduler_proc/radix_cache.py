"""A radix tree of cached KV slots, keyed by adapter uid and then token ids (prefix caching).

The idea is RadixAttention's (SGLang, arXiv 2312.07104): finished (and partly prefilled) sequences leave their
KV in the pool, indexed by their token ids in a radix tree, so a later request that starts with the same tokens
attends over those slots instead of recomputing them. Loom's page size is one token, so any prefix length can
be shared.

Keys are structured, never joined strings: one tree per adapter **uid** (``None`` for the base model), then the
token ids. KV computed under one adapter is never matched by another adapter, by the base model, or by a new
adapter loaded under an old name (a new load mints a new uid).

Ownership: a slot is either free (in the :class:`~scheduler_proc.kv_allocator.SlotAllocator`), held by the
tree (a node's ``slots``), or held by one running request alone. Running requests *lock* the tree path they
read (a reference count on every node of the path); unlocked nodes are evicted least recently used first when
admission needs room, leaves first. Every TP rank holds its own shard of the same slots, so this scheduler-side
tree works at every TP size unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from scheduler_proc.kv_allocator import SlotAllocator


class RadixNode:
    """One edge of the tree: ``tokens[i]``'s KV lives in slot ``slots[i]`` (equal lengths).

    ``ref`` counts the running requests whose locked path runs through this node; ``dead`` marks a node of a
    dropped tree (its adapter was unloaded) that a request still reads: its slots are freed when ``ref`` drops
    to 0 instead of being kept for reuse.
    """

    __slots__ = ("parent", "children", "tokens", "slots", "ref", "last_used", "dead")

    def __init__(self, parent: RadixNode | None, tokens: list[int], slots: list[int], now: int) -> None:
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.tokens = tokens
        self.slots = slots
        self.ref = 0
        self.last_used = now
        self.dead = False

    @property
    def is_root(self) -> bool:
        """Whether this is an adapter's root (no tokens, never evicted or locked)."""
        return self.parent is None


class RadixCache:
    """Prefix cache over the scheduler's KV slot pool.

    Args:
        slots: the pool's allocator; slots the tree lets go of (eviction, drop, clear, duplicates) are freed
            into it.

    Counters (tokens = slots, one token per slot): :attr:`cached_tokens` held by the tree (dead nodes still read
    by a request included), :attr:`locked_tokens` of those on a locked path, :attr:`evicted_tokens` freed by
    LRU eviction since start.
    """

    def __init__(self, slots: SlotAllocator) -> None:
        self._alloc = slots
        self._roots: dict[str | None, RadixNode] = {}
        self._clock = 0
        self.cached_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def evictable_tokens(self) -> int:
        """Slots eviction could free now (held by the tree, on no locked path)."""
        return self.cached_tokens - self.locked_tokens

    def root(self, uid: str | None) -> RadixNode:
        """The tree of adapter ``uid`` (``None``: the base model), created empty on first use."""
        node = self._roots.get(uid)
        if node is None:
            node = self._roots[uid] = RadixNode(None, [], [], self._tick())
        return node

    def match(self, uid: str | None, ids: list[int], limit: int) -> tuple[int, RadixNode, list[int]]:
        """The longest cached prefix of ``ids`` under adapter ``uid``, at most ``limit`` tokens.

        An edge matched part-way is split so the match ends on a node. Nothing is locked (see :meth:`lock`).

        Returns:
            ``(matched, node, slots)``: how many leading tokens matched, the node the match ends on (the
            adapter's root when 0), and the ``matched`` KV slots holding them, in order.
        """
        node = self.root(uid)
        slots: list[int] = []
        i = 0
        limit = min(limit, len(ids))
        while i < limit:
            child = node.children.get(ids[i])
            if child is None:
                break
            k = common_prefix(child.tokens, ids, i, limit)
            if k < len(child.tokens):
                child = self._split(child, k)
            slots.extend(child.slots)
            node = child
            i += k
        return i, node, slots

    # ------------------------------------------------------------------ locking
    def lock(self, node: RadixNode) -> None:
        """A request reads the path root -> ``node``: protect it from eviction and mark it recently used."""
        now = self._tick()
        while not node.is_root:
            if node.ref == 0:
                self.locked_tokens += len(node.slots)
            node.ref += 1
            node.last_used = now
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``; nodes of a dropped tree are freed once nobody reads them."""
        while not node.is_root:
            node.ref -= 1
            if node.ref < 0:
                raise RuntimeError("radix cache: a node was unlocked more often than locked")
            parent = node.parent
            if node.ref == 0:
                self.locked_tokens -= len(node.slots)
                if node.dead:
                    self._remove(node)
            node = parent

    # ------------------------------------------------------------------ insertion
    def extend_locked(self, node: RadixNode, tokens: list[int], slots: list[int]) -> RadixNode | None:
        """Hand a running request's newly computed KV to the tree while it keeps reading it.

        ``node`` is the end of the request's locked path and ``tokens``/``slots`` follow it directly. A new
        child holding them is created and locked (the request's lock moves down to it). Nothing changes (None
        is returned) when ``tokens`` is empty, ``node`` is dead, or another request already cached a sequence
        starting with ``tokens[0]`` there (the request then keeps its slots and inserts at finish).

        Raises:
            ValueError: ``tokens`` and ``slots`` differ in length.
        """
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        if not tokens or node.dead or tokens[0] in node.children:
            return None
        child = self._add_child(node, list(tokens), list(slots))
        child.ref = 1
        self.locked_tokens += len(slots)
        return child

    def insert(self, node: RadixNode, tokens: list[int], slots: list[int]) -> list[int]:
        """Cache ``tokens`` (KV in ``slots``) below ``node``; the tree takes the slots it did not hold yet.

        Returns:
            The slots of ``slots`` whose tokens the tree already held (the caller frees them), or all of them
            when ``node`` is dead.

        Raises:
            ValueError: ``tokens`` and ``slots`` differ in length.
        """
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        if node.dead:
            return list(slots)
        dups: list[int] = []
        i, n = 0, len(tokens)
        now = self._tick()
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                self._add_child(node, list(tokens[i:]), list(slots[i:]))
                return dups
            k = common_prefix(child.tokens, tokens, i, n)
            if k < len(child.tokens):
                child = self._split(child, k)
            dups.extend(slots[i : i + k])
            child.last_used = now
            node = child
            i += k
        return dups

    # ------------------------------------------------------------------ freeing
    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` slots (fewer if not enough are evictable), least recently used leaves first.

        Returns:
            Slots freed (whole nodes, so possibly more than asked).
        """
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += len(node.slots)
            self._remove(node)
            if not parent.is_root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.evicted_tokens += freed
        return freed

    def drop(self, uid: str | None) -> int:
        """Forget adapter ``uid``'s tree (it is being unloaded): free every node nobody reads now; nodes still
        read by running requests are freed when those finish, and are never matched or extended again.

        Returns:
            Slots freed now.
        """
        root = self._roots.pop(uid, None)
        if root is None:
            return 0
        freed = 0
        for node in reversed(list(self._subtree(root))):  # children before their parents
            if node.is_root:
                continue
            node.dead = True
            if node.ref == 0:
                freed += len(node.slots)
                self._remove(node)
        return freed

    def clear(self) -> int:
        """Forget every tree (the workers lost their KV). Locks are void: callers drop their node references.

        Returns:
            Slots freed.
        """
        freed = 0
        for root in list(self._roots.values()):
            for node in self._subtree(root):
                if not node.is_root:
                    self._alloc.free(node.slots)
                    freed += len(node.slots)
                    node.dead, node.ref, node.slots, node.tokens = True, 0, [], []
        self._roots.clear()
        self.cached_tokens = 0
        self.locked_tokens = 0
        return freed

    # ------------------------------------------------------------------ internals
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _add_child(self, parent: RadixNode, tokens: list[int], slots: list[int]) -> RadixNode:
        child = RadixNode(parent, tokens, slots, self._tick())
        parent.children[tokens[0]] = child
        self.cached_tokens += len(slots)
        return child

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after ``k`` tokens; return the new upper node (same locks, same age)."""
        upper = RadixNode(node.parent, node.tokens[:k], node.slots[:k], node.last_used)
        upper.ref, upper.dead = node.ref, node.dead
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.slots, node.parent = node.tokens[k:], node.slots[k:], upper
        upper.children[node.tokens[0]] = node
        return upper

    def _remove(self, node: RadixNode) -> None:
        """Free an unreferenced leaf's slots and unlink it."""
        parent = node.parent
        if parent.children.get(node.tokens[0]) is node:
            del parent.children[node.tokens[0]]
        self._alloc.free(node.slots)
        self.cached_tokens -= len(node.slots)
        node.slots, node.children = [], {}

    def _nodes(self) -> Iterator[RadixNode]:
        for root in self._roots.values():
            for node in self._subtree(root):
                if not node.is_root:
                    yield node

    @staticmethod
    def _subtree(root: RadixNode) -> Iterator[RadixNode]:
        """Every node below and including ``root``, parents before children."""
        stack = [root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def common_prefix(edge: list[int], ids: list[int], start: int, end: int) -> int:
    """How many leading tokens of ``edge`` equal ``ids[start:end]``."""
    n = min(len(edge), end - start)
    if edge[:n] == ids[start : start + n]:
        return n
    k = 0
    while k < n and edge[k] == ids[start + k]:
        k += 1
    return k
