"""The LoRA registry: the cluster's source of truth for which adapters exist, by name and uid.

A uid is minted per load (a uuid4; for ``--lora-paths`` adapters a deterministic uuid5 of name and path),
so reloading a name from a new path never reaches slots or caches keyed by the old uid. The *ref cache*
remembers every name ever loaded with its path, so an adapter evicted from the host tier or lost in a worker
restart is reloaded transparently the next time a request names it.

Every adapter name goes through one state machine, and every path (explicit load and unload, reload by a
request, host-tier eviction, failover restore, adoption and loss) changes a name only through its methods::

    gone/known --begin_load--> loading --finish_load--> loaded --begin_unload--> unloading --finish_unload--> gone
                                  (failed: back to gone/known)     (evict: ends known; restore: loaded -> loading)
    known --forget--> gone        gone/known --adopt--> loaded     loaded --lose--> gone     gone --remember--> known

``known`` is the ref cache: an adapter evicted from the host tier, not resident on the workers. While a name is
``loading`` or ``unloading`` its :class:`Transition` says why (``load``, ``reload``, ``restore``, ``unload``,
``evict``) and which uid is in flight, so the uids the workers may hold are always ones the registry tracks.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ipc.lora_config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraConfigError,
    adapter_name_problem,
    lora_rows,
    never_loaded_message,
    read_adapter_config,
)
from tokenizer_proc.registry_journal import JournalEntry, JournalRef, RegistrySnapshot

State = Literal["gone", "known", "loading", "loaded", "unloading"]
Kind = Literal["load", "reload", "restore", "unload", "evict"]
LOADING_KINDS = ("load", "reload", "restore")


class UnknownAdapter(LookupError):
    """A request named an adapter that no part of the cluster knows."""


class AdapterRefused(ValueError):
    """A load was refused before it reached the workers (bad path, outside --lora-root, bad config)."""


class ServerStopping(RuntimeError):
    """A load or unload was cut short, or refused, because this front door is draining, stopping or restarting
    (HTTP 503, ZMQ kind ``unavailable``): the ranks may still finish a command already sent."""


class IllegalTransition(RuntimeError):
    """A caller asked for a state change the name's current state does not allow (a bug, never a user error)."""


RETIRED_NAMES = 256  # uids of departed adapters the registry still names (see LoraRegistry.uid_names)


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


@dataclass
class Transition:
    """A change of one name in flight: why, and the adapter (uid) the workers are loading or dropping."""

    kind: Kind
    uid: str
    path: str
    pinned: bool
    rank: int
    content_hash: str = ""
    forget: bool = False  # the adapter was lost meanwhile: the name ends "gone" whatever the outcome

    @property
    def explicit(self) -> bool:
        """Whether a client asked for it (load/unload); reloads, restores and evictions are the cluster's own."""
        return self.kind in ("load", "unload")

    @property
    def state(self) -> State:
        """``loading`` or ``unloading``."""
        return "loading" if self.kind in LOADING_KINDS else "unloading"

    def describe(self, name: str) -> str:
        """What is happening to ``name``, for messages (``LoRA adapter a is being loaded``)."""
        what = {
            "load": "being loaded",
            "reload": "being reloaded for a request",
            "restore": "being restored on the workers",
            "unload": "being unloaded",
            "evict": "being evicted from host memory",
        }[self.kind]
        return f"LoRA adapter {name} is {what}"


def stable_uid(name: str, path: str) -> str:
    """Deterministic uid for start-up adapters (same name + path -> same uid in every run)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"loom-lora:{name}:{path}"))


class LoraRegistry:
    """Name -> adapter table, the ref cache and each name's transition in flight. Holds no sockets and never
    waits: the front door's :class:`~tokenizer_proc.lora_admin.LoraAdmin` drives it.

    Storage: ``loaded`` holds the entries of ``loaded`` names (and of names being restored, which keep serving
    their uid); ``refs`` holds (path, pinned) of every name not forgotten; ``transitions`` the busy names.
    """

    def __init__(
        self,
        *,
        lora_root: str = "",
        base_dir: str = "",
        max_lora_rank: int = 64,
        max_loaded: int = 0,
        max_slots: int = 0,
        tie_word_embeddings: bool | None = None,
        served_model_name: str = "",
        num_layers: int = 0,
    ) -> None:
        self.served_model_name = served_model_name  # no adapter may take the base model's id
        self.tied = tie_word_embeddings  # names the reason when an adapter targets lm_head / embed_tokens
        self.num_layers = num_layers  # the model's, so an adapter's rank is the largest it really has (0: unknown)
        self.base_dir = Path(base_dir) if base_dir else None  # relative paths are relative to it (launch.py's cwd)
        self.root = self._absolute(lora_root).resolve() if lora_root else None
        self.max_lora_rank = max_lora_rank
        self.max_loaded = max_loaded
        self.max_slots = max_slots  # --max-loras-per-batch: pinned adapters must leave one slot free (0 = unchecked)
        self.loaded: dict[str, Entry] = {}
        self.refs: dict[str, tuple[str, bool]] = {}  # name -> (path, pinned), kept after unload by eviction
        self.transitions: dict[str, Transition] = {}
        # uid -> name of adapters that left the registry lately: a heartbeat sent before they left still lists them
        self._retired: OrderedDict[str, str] = OrderedDict()
        self._clock = 0
        self.on_change: Callable[[], None] | None = None  # after each settled change (the front door's journal)

    # ------------------------------------------------------------------ queries
    def state(self, name: str) -> State:
        """The name's state: ``gone``, ``known`` (ref cache only), ``loading``, ``loaded`` or ``unloading``."""
        t = self.transitions.get(name)
        if t is not None:
            return t.state
        if name in self.loaded:
            return "loaded"
        return "known" if name in self.refs else "gone"

    def busy(self, name: str) -> Transition | None:
        """The transition of ``name`` in flight, if any."""
        return self.transitions.get(name)

    def tracked_uids(self) -> set[str]:
        """Every uid the workers may hold: loaded ones and those of transitions in flight."""
        return {e.uid for e in self.loaded.values()} | {t.uid for t in self.transitions.values()}

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
        raise self.unknown(name)

    def unknown(self, name: str) -> UnknownAdapter:
        """The never-loaded error for ``name``, listing the loaded adapters."""
        return UnknownAdapter(never_loaded_message(name, list(self.loaded)))

    def check_adapter(self, name: str, path: str) -> tuple[str, int]:
        """Resolve ``path``; refuse it outside ``--lora-root`` or without a valid adapter config.

        Returns the resolved path and the adapter's largest rank. Raises AdapterRefused naming the adapter and
        the problem (a bad name: see :func:`~ipc.lora_config.adapter_name_problem`).
        """
        problem = adapter_name_problem(name, self.served_model_name)
        if problem is not None:
            raise AdapterRefused(problem)
        if not path.strip():
            raise AdapterRefused(f"LoRA adapter {name}: the path is empty (give the adapter's folder)")
        if "\x00" in path:
            raise AdapterRefused(f"LoRA adapter {name}: path {path!r} contains a NUL character")
        try:
            return self._check_path(name, path)
        except OSError as e:  # a name too long for the file system, a loop of links, no permission
            why = f"path {path[:200]!r} cannot be used: {e.strerror or e}"
            raise AdapterRefused(f"LoRA adapter {name}: {why}") from None

    def _check_path(self, name: str, path: str) -> tuple[str, int]:
        p = self._absolute(path).resolve()
        if self.root is not None and not p.is_relative_to(self.root):
            where = "" if str(p) == path else f" (resolves to {p})"
            raise AdapterRefused(f"LoRA adapter {name}: path {path}{where} is outside the allowed root {self.root}")
        if self.root is not None:  # a file inside the folder may still be a link to elsewhere
            for f in (CONFIG_FILE, WEIGHTS_FILE):
                target = (p / f).resolve()
                if not target.is_relative_to(self.root):
                    raise AdapterRefused(
                        f"LoRA adapter {name}: {p / f} links to {target}, outside the allowed root {self.root}"
                    )
        try:
            cfg = read_adapter_config(p, name, tie_word_embeddings=self.tied)
        except LoraConfigError as e:
            raise AdapterRefused(str(e)) from None
        rank = cfg.max_rank(self.num_layers)
        if rank > self.max_lora_rank:
            raise AdapterRefused(
                f"LoRA adapter {name}: rank {rank} exceeds --max-lora-rank {self.max_lora_rank} (the server's pools "
                "hold that rank at most; restart it with a larger --max-lora-rank, which otherwise defaults to the "
                "largest rank among --lora-paths)"
            )
        return str(p), rank

    def _absolute(self, path: str) -> Path:
        p = Path(path).expanduser()
        return self.base_dir / p if self.base_dir is not None and not p.is_absolute() else p

    def pin_refusal(self, name: str, pinned: bool, rank: int = 0) -> str | None:
        """Why pinning ``name`` (largest rank ``rank``) must be refused, or None: the pinned adapters' rank rows
        (:func:`~ipc.lora_config.lora_rows`) must leave room for one adapter at ``--max-lora-rank`` in the
        ``--max-loras-per-batch`` slots' rows. The ranks refuse the same (counting the ranks the weights really
        have, which the config's largest can only overstate); asking first means a refused pin never evicts
        anything."""
        if not pinned or not self.max_slots:
            return None
        held = {n: e.rank for n, e in self.loaded.items() if e.pinned}
        held |= {n: t.rank for n, t in self.transitions.items() if t.pinned}
        held.pop(name, None)
        slot = lora_rows(self.max_lora_rank)
        rows = sum(lora_rows(r) for r in held.values()) + lora_rows(rank or self.max_lora_rank)
        if rows + slot <= self.max_slots * slot:
            return None
        return (
            f"LoRA adapter {name}: pinning it would leave no free slot of {self.max_slots} for other adapters "
            f"(pinned: {sorted(held)}; they would hold {rows} of {self.max_slots * slot} rank rows, and an adapter "
            f"at --max-lora-rank {self.max_lora_rank} needs {slot})"
        )

    def eviction_victim(self, keep: str | None = None) -> Entry | None:
        """The least recently used unpinned, idle adapter other than ``keep`` while the host tier holds more than
        ``max_loaded`` adapters (else None)."""
        if not self.max_loaded or len(self.loaded) <= self.max_loaded:
            return None
        cands = [e for n, e in self.loaded.items() if not e.pinned and n != keep and n not in self.transitions]
        return min(cands, key=lambda e: (e.last_used, e.uid), default=None)

    def new_uid(self, name: str, path: str, deterministic: bool = False) -> str:
        """A fresh uid for a load of ``name`` from ``path``."""
        return stable_uid(name, path) if deterministic else str(uuid.uuid4())

    def uid_names(self) -> dict[str, str]:
        """uid -> adapter name for every adapter loaded, loading or unloading, and the last
        :data:`RETIRED_NAMES` that left (metrics name the uids a scheduler heartbeat lists)."""
        names = dict(self._retired)
        names.update((t.uid, n) for n, t in self.transitions.items())
        names.update((e.uid, n) for n, e in self.loaded.items())
        return names

    def _retire(self, uid: str, name: str) -> None:
        self._retired[uid] = name
        self._retired.move_to_end(uid)
        while len(self._retired) > RETIRED_NAMES:
            self._retired.popitem(last=False)

    # ------------------------------------------------------------------ transitions
    def _expect(self, name: str, allowed: tuple[State, ...], what: str) -> State:
        st = self.state(name)
        if st not in allowed:
            raise IllegalTransition(f"LoRA adapter {name}: cannot {what} while {st}")
        return st

    def begin_load(self, name: str, uid: str, path: str, pinned: bool, rank: int, kind: Kind = "load") -> Transition:
        """gone/known -> loading: ``uid`` is on its way to the workers (an explicit load or a reload)."""
        if kind not in ("load", "reload"):
            raise IllegalTransition(f"LoRA adapter {name}: {kind} is not a load")
        self._expect(name, ("gone", "known"), kind)
        t = self.transitions[name] = Transition(kind, uid, path, pinned, rank)
        return t

    def begin_restore(self, name: str) -> Transition:
        """loaded -> loading under the same uid (the workers lost it); requests keep resolving to that uid."""
        self._expect(name, ("loaded",), "restore")
        e = self.loaded[name]
        t = self.transitions[name] = Transition("restore", e.uid, e.path, e.pinned, e.rank, e.content_hash)
        return t

    def finish_load(self, name: str, ok: bool, content_hash: str = "") -> Entry | None:
        """loading -> loaded (``ok``), or back where it was (a failed load or reload: gone/known; a failed or
        lost restore: gone). Returns the loaded entry, or None."""
        t = self.transitions.get(name)
        if t is None or t.state != "loading":
            raise IllegalTransition(f"LoRA adapter {name}: no load in flight")
        del self.transitions[name]
        if not ok or t.forget:
            self._retire(t.uid, name)
        if t.kind == "restore":
            if ok and not t.forget:
                return self.loaded[name]
            self.loaded.pop(name, None)
            self.refs.pop(name, None)
            self._changed()
            return None
        if not ok:
            return None
        e = Entry(name, t.uid, t.path, t.rank, t.pinned, self._tick(), content_hash)
        self.loaded[name] = e
        self.refs[name] = (t.path, t.pinned)
        self._changed()
        return e

    def begin_unload(self, name: str, evict: bool = False) -> Transition:
        """loaded -> unloading: new requests no longer get its uid (an eviction's wait for it to end)."""
        self._expect(name, ("loaded",), "evict" if evict else "unload")
        e = self.loaded.pop(name)
        t = Transition("evict" if evict else "unload", e.uid, e.path, e.pinned, e.rank, e.content_hash)
        self.transitions[name] = t
        self._changed()
        return t

    def finish_unload(self, name: str) -> State:
        """unloading -> gone (an explicit unload, or an adapter lost meanwhile) or known (an eviction)."""
        t = self.transitions.get(name)
        if t is None or t.state != "unloading":
            raise IllegalTransition(f"LoRA adapter {name}: no unload in flight")
        del self.transitions[name]
        self._retire(t.uid, name)
        if t.kind == "unload" or t.forget:
            self.refs.pop(name, None)
        self._changed()
        return self.state(name)

    def forget(self, name: str) -> None:
        """known -> gone: drop a name only the ref cache knows."""
        self._expect(name, ("known",), "forget")
        del self.refs[name]
        self._changed()

    def adopt(self, name: str, uid: str, path: str, pinned: bool, content_hash: str) -> Entry:
        """gone/known -> loaded: an adapter the workers hold (a restarted front door rebuilds its registry).

        Raises:
            LoraConfigError: the adapter's config can no longer be read.
        """
        self._expect(name, ("gone", "known"), "adopt")
        rank = read_adapter_config(Path(path), name, tie_word_embeddings=self.tied).max_rank(self.num_layers)
        e = Entry(name, uid, path, rank, pinned, self._tick(), content_hash)
        self.loaded[name] = e
        self.refs[name] = (path, pinned)
        self._changed()
        return e

    def remember(self, name: str, path: str, pinned: bool) -> None:
        """gone -> known: a name the ref cache held before this front door restarted (reloaded when requested)."""
        self._expect(name, ("gone",), "remember")
        self.refs[name] = (path, pinned)
        self._changed()

    def lose(self, name: str, uid: str) -> None:
        """Adapter ``uid`` could not be restored after a worker restart: the name ends ``gone`` (at once, or
        when its transition in flight for that uid ends). A newer load of the name is never touched."""
        t = self.transitions.get(name)
        if t is not None:
            if t.uid == uid:
                t.forget = True
            return
        e = self.loaded.get(name)
        if e is None or e.uid == uid:
            if e is not None:
                self._retire(e.uid, name)
            self.loaded.pop(name, None)
            self.refs.pop(name, None)
            self._changed()

    def snapshot(self) -> RegistrySnapshot:
        """The settled adapters: every ``loaded`` entry (restores included: they keep their uid) and every ``known``
        name, sorted by name; names in a load or unload are left out."""
        loaded = [JournalEntry(n, e.uid, e.path, e.pinned, e.content_hash) for n, e in sorted(self.loaded.items())]
        known = [JournalRef(n, *self.refs[n]) for n in sorted(self.refs) if self.state(n) == "known"]
        return RegistrySnapshot(loaded, known)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
