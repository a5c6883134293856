"""Front-door counters and histograms that survive the front door's own restart.

The metrics live in the front door, so a ``kill -9`` of it (a failover drill) used to start every counter again
from zero, the failover counters included. Each scrape now writes the values it exposes to a file in the
cluster's private socket folder (removed with the cluster), and a restarted front door adds them to its own:
what a scraper has seen never goes back. Events after the last scrape before a crash are not counted.

Not carried: ``loom_process_restarts`` (the launcher's own absolute counts) and gauges (state, re-read). Slot
evictions are counted by the scheduler; :meth:`ClusterHealth.restore_evictions` carries those.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from tokenizer_proc.health import ClusterHealth

log = logging.getLogger(__name__)

STATE_FILE = "front-door-metrics.json"
NOT_CARRIED = frozenset({"loom_process_restarts", "loom_lora_slot_evictions"})
_CARRIED_TYPES = ("counter", "histogram")

Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


class CarryOver:
    """A collector exposing ``source``'s families with the previous front door's counters added.

    ``path``: the state file (None: nothing is carried or saved, e.g. in unit tests). ``health`` gets the slot
    eviction count back. Register it in a registry of its own; call :meth:`save` after each exposition.
    """

    def __init__(self, source: CollectorRegistry, path: Path | None, health: ClusterHealth) -> None:
        self.source, self.path, self.health = source, path, health
        self.carried: dict[str, dict[Key, float]] = {}  # family -> its samples' values
        self._exposed: list[Metric] = []
        if path is not None and path.is_file():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            state = json.loads(path.read_text())
            for family, name, labels, value in state["samples"]:
                self.carried.setdefault(family, {})[(name, tuple(sorted(labels.items())))] = float(value)
            total, incarnation, current = state["evictions"]
            self.health.restore_evictions(int(total), incarnation, int(current))
        except (OSError, ValueError, KeyError, TypeError) as e:  # a torn or foreign file: start from zero
            self.carried.clear()
            log.warning("front-door metrics of the previous incarnation not carried over (%s): %s", path, e)
            return
        n = sum(map(len, self.carried.values()))
        log.info("front-door metrics carried over from the previous incarnation (%d samples)", n)

    def describe(self) -> list[Metric]:
        """Nothing to describe ahead (so registering does not collect)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """``source``'s families, counters and histograms with the carried values added (and carried label sets
        this incarnation has not seen yet)."""
        exposed = []
        for fam in self.source.collect():
            carried = self.carried.get(fam.name) if fam.type in _CARRIED_TYPES else None
            if carried:
                fam = _add_carried(fam, carried)
            exposed.append(fam)
            yield fam
        self._exposed = exposed

    def save(self) -> None:
        """Write the counters and histograms of the last exposition (atomically: a crash leaves the old file)."""
        if self.path is None:
            return
        beat = self.health.beat
        state = {
            "samples": list(_samples(self._exposed)),
            "evictions": [
                self.health.slot_evictions,
                beat.incarnation if beat else None,
                beat.slot_evictions if beat else 0,
            ],
        }
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
        except OSError as e:  # the cluster is stopping (its folder is gone): nothing to keep
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.debug("front-door metrics not saved: %s", e)


def _add_carried(fam: Metric, carried: dict[Key, float]) -> Metric:
    """``fam`` with ``carried`` added to its samples, and the carried label sets it lacks appended."""
    out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
    seen = set()
    for s in fam.samples:
        key = (s.name, tuple(sorted(s.labels.items())))
        seen.add(key)
        out.add_sample(s.name, s.labels, s.value + carried.get(key, 0.0), s.timestamp, s.exemplar)
    for (name, labels), value in carried.items():
        if (name, labels) not in seen:
            out.add_sample(name, dict(labels), value)
    return out


def _samples(families: Iterable[Metric]) -> Iterator[list]:
    for fam in families:
        if fam.type in _CARRIED_TYPES and fam.name not in NOT_CARRIED:
            for s in fam.samples:
                yield [fam.name, s.name, s.labels, s.value]
