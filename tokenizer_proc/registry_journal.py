"""The LoRA registry written to the cluster's socket folder, so a front door restarted after the workers also lost
their adapters can still restore them.

A restarted front door rebuilds its registry from what the workers hold (:meth:`LoraAdmin.on_cluster_view`
adopts those adapters). When the front door, the scheduler and every TP rank die together (one ``kill -9`` of
each in a drill, or a host-wide OOM kill), nothing holds the adapters any more: without this file every adapter,
the ``--lora-paths`` ones included, was gone and requests for them failed as never loaded. The front door now
rewrites this file (atomically) after every change of its registry; the next incarnation reads it at start and,
at its first cluster view, carries over the adapters the workers lack when their files still hash as at their
first load (``LoraAdmin._carry_over``), so they are restored under the same uids (changed or vanished files: the
adapter is reported lost and its requests fail as never loaded). The file lives in the cluster's private socket
folder, removed with the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import msgspec

log = logging.getLogger("tokenizer")

JOURNAL_FILE = "lora-registry.json"


class JournalEntry(msgspec.Struct):
    """An adapter loaded on every rank: name, uid, folder, pinned, and the sha256 of its files at the first load."""

    name: str
    uid: str
    path: str
    pinned: bool
    content_hash: str


class JournalRef(msgspec.Struct):
    """A name only the ref cache knows (evicted from the host tier): reloaded from ``path`` when a request names it."""

    name: str
    path: str
    pinned: bool


class RegistrySnapshot(msgspec.Struct):
    """The registry's settled adapters (names in a load or unload are left out: the workers' view decides them)."""

    loaded: list[JournalEntry] = []
    known: list[JournalRef] = []


class RegistryJournal:
    """Reads and writes :class:`RegistrySnapshot` at ``path`` (None: a registry without a cluster folder, e.g. in
    unit tests; nothing is written or read)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def save(self, snap: RegistrySnapshot) -> None:
        """Replace the file atomically (a crash leaves the previous one); a folder already removed (the cluster is
        stopping) is not an error."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_bytes(msgspec.json.encode(snap))
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.debug("LoRA registry journal not saved: %s", e)

    def read(self) -> RegistrySnapshot | None:
        """The last snapshot, or None when there is none; a torn or foreign file is logged and ignored."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=RegistrySnapshot)
        except (OSError, msgspec.DecodeError) as e:
            log.error("LoRA registry journal %s unreadable, not used: %s", self.path, e)
            return None
