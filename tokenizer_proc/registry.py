"""The LoRA registry: the cluster's source of truth for which adapters exist, by name and uid.

A uid is minted per load (a uuid4; for ``--lora-paths`` adapters a deterministic uuid5 of name and path),
so reloading a name from a new path never reaches slots or caches keyed by the old uid. The *ref cache*
remembers every name ever loaded with its path, so an adapter evicted from the host tier or lost in a worker
restart is reloaded transparently the next time a request names it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from ipc.lora_config import LoraConfigError, never_loaded_message, read_adapter_config


class UnknownAdapter(LookupError):
    """A request named an adapter that no part of the cluster knows."""


class AdapterRefused(ValueError):
    """A load was refused before it reached the workers (bad path, outside --lora-root, bad config)."""


@dataclass
class Entry:
    """An adapter the registry holds (loaded on every rank's host tier)."""

    name: str
    uid: str
    path: str
    rank: int
    pinned: bool
    last_used: int = 0
    content_hash: str = ""  # sha256 of the files every rank read at the first load (restores check it)


def stable_uid(name: str, path: str) -> str:
    """Deterministic uid for start-up adapters (same name + path -> same uid in every run)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"loom-lora:{name}:{path}"))


class LoraRegistry:
    """Name -> adapter table plus the ref cache. Holds no sockets; the front door drives it."""

    def __init__(self, *, lora_root: str = "", max_lora_rank: int = 64, max_loaded: int = 0) -> None:
        self.root = Path(lora_root).resolve() if lora_root else None
        self.max_lora_rank = max_lora_rank
        self.max_loaded = max_loaded
        self.loaded: dict[str, Entry] = {}
        self.refs: dict[str, tuple[str, bool]] = {}  # name -> (path, pinned), kept after unload by eviction
        self._clock = 0

    def check_path(self, name: str, path: str) -> str:
        """Resolve ``path``; refuse it outside ``--lora-root`` or without a valid adapter config.

        Returns the resolved path. Raises AdapterRefused naming the adapter and the problem.
        """
        if not name or "/" in name:
            raise AdapterRefused(f"LoRA adapter name {name!r} must be non-empty and contain no '/'")
        p = Path(path).expanduser().resolve()
        if self.root is not None and not p.is_relative_to(self.root):
            raise AdapterRefused(f"LoRA adapter {name}: path {path} is outside the allowed root {self.root}")
        try:
            cfg = read_adapter_config(p, name)
        except LoraConfigError as e:
            raise AdapterRefused(str(e)) from None
        if cfg.max_rank() > self.max_lora_rank:
            raise AdapterRefused(
                f"LoRA adapter {name}: rank {cfg.max_rank()} exceeds --max-lora-rank {self.max_lora_rank}"
            )
        return str(p)

    def new_uid(self, name: str, path: str, deterministic: bool = False) -> str:
        """A fresh uid for a load of ``name`` from ``path``."""
        return stable_uid(name, path) if deterministic else str(uuid.uuid4())

    def add(self, name: str, uid: str, path: str, pinned: bool, content_hash: str = "") -> Entry:
        """Record a load every rank confirmed.

        Raises:
            LoraConfigError: the adapter's config can no longer be read (its folder changed meanwhile).
        """
        rank = read_adapter_config(Path(path), name).max_rank()
        e = Entry(name, uid, path, rank, pinned, self._tick(), content_hash)
        self.loaded[name] = e
        self.refs[name] = (path, pinned)
        return e

    def remove(self, name: str, forget: bool = True) -> Entry | None:
        """Drop ``name``; ``forget`` also drops it from the ref cache (an explicit unload)."""
        if forget:
            self.refs.pop(name, None)
        return self.loaded.pop(name, None)

    def lookup(self, name: str) -> Entry | None:
        """The loaded entry for ``name``, or None if only the ref cache knows it (reload needed).

        Raises:
            UnknownAdapter: ``Got LoRA adapter that has never been loaded: NAME`` with the loaded list.
        """
        e = self.loaded.get(name)
        if e is not None:
            e.last_used = self._tick()
            return e
        if name in self.refs:
            return None
        raise UnknownAdapter(never_loaded_message(name, list(self.loaded)))

    def eviction_victim(self) -> Entry | None:
        """Least recently used unpinned adapter when the host tier is over ``max_loaded`` (else None)."""
        if not self.max_loaded or len(self.loaded) < self.max_loaded:
            return None
        cands = sorted((e for e in self.loaded.values() if not e.pinned), key=lambda e: (e.last_used, e.uid))
        return cands[0] if cands else None

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
