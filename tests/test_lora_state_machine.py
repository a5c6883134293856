"""One state machine per adapter name (issue 9 item 6): concurrent LoRA admin calls, reloads by requests and
host-tier evictions on one name never leave the registry and the workers disagreeing.

- Unit races: :class:`LoraAdmin` against a fake scheduler whose TP ranks load and unload all-or-nothing (the
  scheduler's own :class:`LoraOps`), acking each command when the test says so.
- A stateful property test (hypothesis) drives random interleavings of load, unload, reload-by-request,
  eviction and rank failures against a serial model, at TP=1 and TP=2.
- Real clusters at TP=1 and TP=2 run the races of the issue and compare the registry with what the workers
  report after a scheduler restart (their host tiers, from their READY).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ipc.config import Endpoints, ServerArgs
from ipc.messages import (
    AdapterState,
    ClusterView,
    LoraLoadCmd,
    LoraOpAck,
    LoraOpResult,
    LoraSlotsQuery,
    LoraUnloadCmd,
    LostAdapter,
    WorkerLoraUnload,
)
from scheduler_proc.lora_ops import LoadedAdapter, LoraOps
from tokenizer_proc.lora_admin import LoraAdmin
from tokenizer_proc.registry import AdapterRefused, UnknownAdapter

ENDPOINTS = Endpoints("ipc:///nonexistent/f", "ipc:///nonexistent/s", "ipc:///nonexistent/t", "ipc:///x/w", "", "")
SLOTS = 3  # --max-loras-per-batch: at most 2 pinned adapters
MAX_LOADED = 2  # --max-loaded-loras


# ----------------------------------------------------------------------------- a fake scheduler + TP ranks


def write_adapter(folder: Path, rank: int = 8) -> Path:
    """A folder the front door accepts (it reads only ``adapter_config.json`` and checks the weights exist)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    (folder / "adapter_model.safetensors").write_bytes(b"never parsed by the front door")
    return folder.resolve()


class FakeCluster:
    """The scheduler and ``tp`` ranks as the front door sees them: commands queue until :meth:`complete`; each
    rank loads (refusing paths in ``broken`` and pins that would leave no slot, as ``LoraPool`` does) and unloads;
    the scheduler's :class:`LoraOps` makes every load all-or-nothing and rolls back failed ones."""

    def __init__(self, tp: int, slots: int = SLOTS) -> None:
        self.tp = tp
        self.slots = slots
        self.ops = LoraOps(tp)
        self.ranks: list[dict[str, tuple[str, bool]]] = [{} for _ in range(tp)]  # uid -> (name, pinned)
        self.queue: list[LoraLoadCmd | LoraUnloadCmd] = []
        self.sent: list[LoraLoadCmd | LoraUnloadCmd] = []  # everything ever received, in order
        self.broken: dict[str, set[int]] = {}  # path -> ranks that refuse to load it
        self.admin: LoraAdmin | None = None

    def send(self, msg: object) -> None:
        """The front door's ``send_to_scheduler``."""
        if isinstance(msg, LoraSlotsQuery):  # answered at once (slots do not matter here)
            self.admin.on_op_result(LoraOpResult(msg.op_id, True))
        elif isinstance(msg, (LoraLoadCmd, LoraUnloadCmd)):
            self.queue.append(msg)
            self.sent.append(msg)

    def _apply(self, rank: int, cmd: LoraLoadCmd | WorkerLoraUnload | LoraUnloadCmd) -> LoraOpAck:
        held = self.ranks[rank]
        if not isinstance(cmd, LoraLoadCmd):
            held.pop(cmd.uid, None)
            return LoraOpAck(cmd.op_id, rank, True)
        if cmd.uid in held:
            return LoraOpAck(cmd.op_id, rank, True, content_hash=f"h:{cmd.path}")
        if rank in self.broken.get(cmd.path, ()):
            return LoraOpAck(cmd.op_id, rank, False, f"LoRA adapter {cmd.name}: rank {rank} cannot read {cmd.path}")
        if cmd.pinned and sum(p for _, p in held.values()) + 1 >= self.slots:
            return LoraOpAck(cmd.op_id, rank, False, f"LoRA adapter {cmd.name}: pinning it would leave no free slot")
        held[cmd.uid] = (cmd.name, cmd.pinned)
        return LoraOpAck(cmd.op_id, rank, True, content_hash=f"h:{cmd.path}")

    def complete(self, i: int = 0) -> tuple[LoraLoadCmd | LoraUnloadCmd, LoraOpResult]:
        """Run queued command ``i`` on every rank and hand its result to the front door."""
        cmd = self.queue.pop(i)
        self.ops.start(cmd)
        result = None
        for r in range(self.tp):
            result, rollback = self.ops.on_ack(self._apply(r, cmd))
            for m in rollback:
                for rr in range(self.tp):
                    self._apply(rr, m)
        assert result is not None
        self.admin.on_op_result(result)
        return cmd, result

    def held(self) -> list[set[str]]:
        """Each rank's host tier (uids)."""
        return [set(h) for h in self.ranks]


def make_admin(tp: int = 1, max_loaded: int = MAX_LOADED) -> tuple[LoraAdmin, FakeCluster]:
    args = ServerArgs(
        model_path="/nonexistent",
        endpoints=ENDPOINTS,
        enable_lora=True,
        max_loaded_loras=max_loaded,
        max_loras_per_batch=SLOTS,
        max_lora_rank=8,  # the adapters' rank: each takes a whole slot's rank rows, as the model counts
    )
    cluster = FakeCluster(tp)
    admin = LoraAdmin(args, cluster.send, SimpleNamespace(adapters_lost=0))
    cluster.admin = admin
    return admin, cluster


def settle(loop: asyncio.AbstractEventLoop, rounds: int = 200) -> None:
    """Run every callback that is ready, and the ones those make ready (nothing here waits on a clock)."""
    for _ in range(rounds):
        loop.run_until_complete(asyncio.sleep(0))
        if not getattr(loop, "_ready", True):  # CPython's queue of ready callbacks; else run all rounds
            return


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task (and those their cancellation starts), then close ``loop``."""
    for _ in range(5):
        tasks = asyncio.all_tasks(loop)
        if not tasks:
            break
        for t in tasks:
            t.cancel()
        settle(loop, 5)
    loop.close()


def outcome(task: asyncio.Task) -> tuple[str, Any]:
    """("ok", AdminOut message or uid) | ("refused"/"unknown"/"error", message) | ("pending", None)."""
    if not task.done():
        return "pending", None
    e = task.exception()
    if e is None:
        r = task.result()
        return "ok", getattr(r, "message", r)
    kind = "refused" if isinstance(e, AdapterRefused) else "unknown" if isinstance(e, UnknownAdapter) else "error"
    return kind, str(e)


class Harness:
    """A LoraAdmin + FakeCluster on a private event loop, for the unit races."""

    def __init__(self, tmp: Path, tp: int = 1, max_loaded: int = MAX_LOADED) -> None:
        self.loop = asyncio.new_event_loop()
        self.admin, self.cluster = make_admin(tp, max_loaded)
        self.paths = {n: str(write_adapter(tmp / n)) for n in ("a", "b", "c")}

    def start(self, coro) -> asyncio.Task:
        task = self.loop.create_task(coro)
        settle(self.loop)
        return task

    def complete(self, i: int = 0) -> LoraOpResult:
        _, res = self.cluster.complete(i)
        settle(self.loop)
        return res

    def drain(self) -> None:
        while self.cluster.queue:
            self.complete(0)

    def load(self, name: str, pinned: bool = False) -> asyncio.Task:
        return self.start(self.admin.load_adapter(name, self.paths[name], pinned))

    def loaded(self) -> dict[str, str]:
        return {n: e.uid for n, e in self.admin.registry.loaded.items()}

    def assert_agree(self) -> None:
        """Quiescent: every rank holds exactly the registry's adapters, and so does the scheduler's table."""
        assert not self.cluster.queue
        want = set(self.loaded().values())
        assert self.cluster.held() == [want] * self.cluster.tp
        assert set(self.cluster.ops.loaded) == want

    def close(self) -> None:
        close_loop(self.loop)


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def h(request, tmp_path):
    harness = Harness(tmp_path, tp=request.param)
    yield harness
    harness.close()


# ----------------------------------------------------------------------------- unit races


def test_two_loads_of_one_new_name_one_wins_the_other_changes_nothing(h):
    first, second = h.load("a"), h.load("a")
    assert outcome(second) == (
        "refused",
        "LoRA adapter a is being loaded by another call; this load changed nothing",
    )
    assert len(h.cluster.sent) == 1  # only one uid ever went to the workers
    h.drain()
    assert outcome(first) == ("ok", "loaded a")
    h.assert_agree()
    unload = h.start(h.admin.unload_adapter("a"))
    h.drain()
    assert outcome(unload) == ("ok", "unloaded a")
    h.assert_agree()
    assert h.cluster.held() == [set()] * h.cluster.tp


def test_two_unloads_the_loser_is_told_what_happens(h):
    h.load("a")
    h.drain()
    first = h.start(h.admin.unload_adapter("a"))
    second = h.start(h.admin.unload_adapter("a"))
    assert outcome(second) == (
        "refused",
        "LoRA adapter a is being unloaded by another call; this unload changed nothing",
    )
    h.drain()
    assert outcome(first) == ("ok", "unloaded a")
    h.assert_agree()


def test_load_during_unload_and_unload_during_load_are_refused(h):
    load = h.load("a")
    unload = h.start(h.admin.unload_adapter("a"))
    assert outcome(unload) == ("refused", "LoRA adapter a is being loaded by another call; this unload changed nothing")
    h.drain()
    assert outcome(load) == ("ok", "loaded a")
    unload = h.start(h.admin.unload_adapter("a"))
    again = h.load("a")
    assert outcome(again) == ("refused", "LoRA adapter a is being unloaded by another call; this load changed nothing")
    h.drain()
    assert outcome(unload) == ("ok", "unloaded a")
    h.assert_agree()


def _evict_a(h: Harness, max_loaded: int = 1) -> None:
    """--max-loaded-loras 1: load a, then b (which evicts a to the ref cache)."""
    h.admin.registry.max_loaded = max_loaded
    h.load("a")
    h.drain()
    h.load("b")
    h.drain()
    assert h.admin.registry.state("a") == "known" and h.admin.registry.state("b") == "loaded"
    h.assert_agree()


def test_unload_racing_a_reload_waits_for_it_then_unloads(h):
    _evict_a(h)
    req = h.start(h.admin.resolve_adapter("a"))  # starts the reload
    assert h.admin.registry.state("a") == "loading"
    unload = h.start(h.admin.unload_adapter("a"))
    assert outcome(unload) == ("pending", None)  # waits for the reload instead of "not resident; forgotten"
    h.drain()
    kind, uid = outcome(req)
    assert kind == "ok" and len(uid) == 36  # the request got the reloaded adapter (its unload waits for it)
    assert outcome(unload) == ("ok", "unloaded a")
    assert h.admin.registry.state("a") == "gone" and "a" not in h.loaded()
    h.assert_agree()
    late = h.start(h.admin.resolve_adapter("a"))
    assert outcome(late)[0] == "unknown" and "never been loaded: a" in outcome(late)[1]


def test_explicit_load_racing_a_reload_leaves_no_orphan(h):
    _evict_a(h)
    req = h.start(h.admin.resolve_adapter("a"))
    load = h.load("a")
    h.drain()
    assert outcome(load) == ("refused", "LoRA adapter a is already loaded; unload it first")
    assert outcome(req) == ("ok", h.loaded()["a"])
    h.assert_agree()


def test_requests_share_one_reload_and_its_failure(h):
    _evict_a(h)
    h.cluster.broken[h.paths["a"]] = {h.cluster.tp - 1}
    reqs = [h.start(h.admin.resolve_adapter("a")) for _ in range(3)]
    assert len([c for c in h.cluster.queue if isinstance(c, LoraLoadCmd)]) == 1
    h.drain()
    for r in reqs:
        kind, msg = outcome(r)
        assert kind == "refused" and msg.startswith("LoRA adapter a failed to load: rank"), msg
    assert h.admin.registry.state("a") == "known"  # the ref cache still knows it: a later request retries
    h.assert_agree()


def test_a_reload_whose_files_are_gone_fails_as_never_loaded_and_forgets_the_name(h):
    """Found by a new-user trial: it failed as a bad request ("... is not a folder") and stayed listed."""
    import shutil

    _evict_a(h)
    shutil.rmtree(h.paths["a"])
    kind, msg = outcome(h.start(h.admin.resolve_adapter("a")))
    assert kind == "unknown" and "never been loaded" in msg and "a" in msg and "b" in msg, msg
    assert h.admin.registry.state("a") == "gone" and not h.cluster.queue  # nothing was sent
    h.assert_agree()


def test_refused_pin_evicts_nothing(h):
    h.admin.registry.max_loaded = 1
    h.paths["p2"] = h.paths["b"]
    h.load("a", pinned=True)
    h.drain()
    h.load("c", pinned=True)  # 2 of 3 slots pinned: the most allowed
    h.drain()
    before = h.loaded()
    refused = h.start(h.admin.load_adapter("b", h.paths["b"], True))
    assert outcome(refused) == (
        "refused",
        "LoRA adapter b: pinning it would leave no free slot of 3 for other adapters (pinned: ['a', 'c']; they "
        "would hold 24 of 24 rank rows, and an adapter at --max-lora-rank 8 needs 8)",
    )
    assert not h.cluster.queue and h.loaded() == before
    h.assert_agree()


def test_failed_load_evicts_nothing(h):
    h.admin.registry.max_loaded = 1
    h.load("a")
    h.drain()
    h.cluster.broken[h.paths["b"]] = {0}
    bad = h.load("b")
    h.drain()
    assert outcome(bad)[0] == "refused" and "rank 0 cannot read" in outcome(bad)[1]
    assert h.admin.registry.state("a") == "loaded"
    h.assert_agree()


def _view(h: Harness, incarnation: str, restarted: bool = True) -> None:
    """The scheduler reports what the ranks hold (rank 0's host tier), as after a restart."""
    held = [
        AdapterState(uid, name, h.admin.registry.refs.get(name, ("", False))[0], pinned, "")
        for uid, (name, pinned) in sorted(h.cluster.ranks[0].items())
    ]

    async def deliver() -> None:
        h.admin.on_cluster_view(ClusterView(incarnation, 1, held), restarted, lambda: 0)

    h.start(deliver())


def test_a_restore_keeps_the_uid_and_explicit_calls_wait_for_it(h):
    h.load("a")
    h.drain()
    uid = h.loaded()["a"]
    for r in h.cluster.ranks:  # the TP group was replaced while the scheduler was down: the ranks hold nothing
        r.clear()
    h.cluster.ops.loaded.clear()
    _view(h, "sched-2")
    assert h.admin.registry.state("a") == "loading"
    restore = h.cluster.queue[-1]
    assert isinstance(restore, LoraLoadCmd) and restore.uid == uid and restore.content_hash
    req = h.start(h.admin.resolve_adapter("a"))
    assert outcome(req) == ("ok", uid)  # the scheduler queues it until the restore is done
    unload = h.start(h.admin.unload_adapter("a"))
    assert outcome(unload) == ("pending", None)
    h.drain()
    assert outcome(unload) == ("ok", "unloaded a")
    h.assert_agree()


def test_an_adapter_lost_during_its_restore_ends_gone_and_counts_once(h):
    h.load("a")
    h.drain()
    uid = h.loaded()["a"]
    for r in h.cluster.ranks:
        r.clear()
    h.cluster.ops.loaded.clear()
    _view(h, "sched-2")
    h.admin.on_lost([LostAdapter(uid, "a", "its folder is gone")])
    h.cluster.broken[h.paths["a"]] = {0}
    h.drain()
    assert h.admin.registry.state("a") == "gone" and h.admin.health.adapters_lost == 1
    h.assert_agree()


def test_a_restarted_front_door_adopts_what_the_workers_hold_and_unloads_strays(h):
    from ipc.lora_config import adapter_content_hash

    good = adapter_content_hash(h.paths["a"], "a")
    for r in h.cluster.ranks:
        r.update({"u1": ("a", False), "u2": ("a", False), "u3": ("b", False)})
    for u, n in (("u1", "a"), ("u2", "a"), ("u3", "b")):
        h.cluster.ops.loaded[u] = LoadedAdapter(u, n, h.paths[n], False, "")
    view = [
        AdapterState("u1", "a", h.paths["a"], False, good),
        AdapterState("u2", "a", h.paths["a"], False, good),  # an orphan of the same name
        AdapterState("u3", "b", h.paths["b"], False, "another content"),  # its files changed
    ]

    async def deliver() -> None:
        h.admin.on_cluster_view(ClusterView("sched-1", 1, view), False, lambda: 0)

    h.start(deliver())
    assert h.loaded() == {"a": "u1"} and h.admin.health.adapters_lost == 2
    assert sorted(c.uid for c in h.cluster.queue) == ["u2", "u3"]
    h.drain()
    h.assert_agree()


def test_a_load_in_flight_at_a_scheduler_restart_is_resent(h):
    load = h.load("a")
    h.cluster.queue.clear()  # the old scheduler died before it sent it to the ranks
    _view(h, "sched-2")
    assert [type(c).__name__ for c in h.cluster.queue] == ["LoraLoadCmd"]
    h.drain()
    assert outcome(load) == ("ok", "loaded a")
    h.assert_agree()


# ----------------------------------------------------------------------------- the serial model


@dataclass
class Call:
    """One admin call or request the machine started, and what the model says it must end with."""

    kind: str  # load | unload | request
    name: str
    task: asyncio.Task
    path: str = ""
    pinned: bool = False
    expect: tuple[str, Any] | None = None  # None: still running


@dataclass
class Busy:
    """A transition in flight in the model."""

    kind: str  # load | reload | unload | evict
    path: str
    pinned: bool
    uid: str | None  # learnt from the command the front door sent
    call: Call | None = None  # the explicit call that began it
    loader: Loader | None = None  # evict: the load that asked for it


@dataclass
class Loader:
    """A finished load that still evicts over capacity before its call returns."""

    name: str
    uid: str
    call: Call | None


@dataclass
class Name:
    """One adapter name in the model: settled state plus what is in flight and who waits."""

    state: str = "gone"  # gone | known | loaded
    path: str = ""
    pinned: bool = False
    uid: str = ""
    busy: Busy | None = None
    waiters: list[Call] = field(default_factory=list)


class Model:
    """A serial specification of the admin: each decision is atomic; waits are FIFO per name."""

    def __init__(self, names: list[str], bad_paths: set[str], max_loaded: int, slots: int) -> None:
        self.names = {n: Name() for n in names}
        self.bad = bad_paths
        self.max_loaded = max_loaded
        self.slots = slots
        self.expected_cmds: list[tuple[str, str]] = []  # ("load", name) | ("unload", name)

    # -------------------------------------------------------------- views
    def resident(self) -> list[str]:
        """Names the registry lists as loaded (settled loaded, no unload/eviction in flight)."""
        return sorted(n for n, m in self.names.items() if m.state == "loaded" and m.busy is None)

    def pinned_held(self, name: str) -> set[str]:
        out = {n for n, m in self.names.items() if m.state == "loaded" and m.pinned}
        out |= {n for n, m in self.names.items() if m.busy is not None and m.busy.pinned}
        out.discard(name)
        return out

    def victims(self, keep: str) -> list[str]:
        if len(self.resident()) <= self.max_loaded:
            return []
        return [n for n in self.resident() if n != keep and not self.names[n].pinned]

    def never_loaded(self, name: str) -> str:
        return f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {self.resident()}"

    # -------------------------------------------------------------- decisions
    def decide(self, c: Call) -> None:
        m = self.names[c.name]
        if c.kind in ("load", "unload"):
            if m.busy is not None:
                if m.busy.kind in ("load", "unload"):
                    event(f"{c.kind} refused: {m.busy.kind} in flight")
                    what = "loaded" if m.busy.kind == "load" else "unloaded"
                    c.expect = ("refused", f"LoRA adapter {c.name} is being {what} by another call; this {c.kind}")
                else:
                    event(f"{c.kind} waits for a {m.busy.kind}")
                    m.waiters.append(c)
                return
        if c.kind == "load":
            if m.state == "loaded":
                c.expect = ("refused", f"LoRA adapter {c.name} is already loaded; unload it first")
            elif c.path in self.bad:
                c.expect = ("refused", f"LoRA adapter {c.name}: {c.path} is not a folder")
            elif c.pinned and len(self.pinned_held(c.name)) + 1 >= self.slots:
                event("pin refused")
                c.expect = ("refused", f"LoRA adapter {c.name}: pinning it would leave no free slot")
            else:
                m.busy = Busy("load", c.path, c.pinned, None, c)
                self.expected_cmds.append(("load", c.name))
        elif c.kind == "unload":
            if m.state == "gone":
                c.expect = ("unknown", self.never_loaded(c.name))
            elif m.state == "known":
                m.state = "gone"
                c.expect = ("ok", f"{c.name} was not resident; forgotten")
            else:
                m.busy = Busy("unload", m.path, m.pinned, m.uid, c)
                self.expected_cmds.append(("unload", c.name))
        else:  # a request
            if m.busy is not None:
                event(f"request during a {m.busy.kind}")
                if m.busy.kind == "unload":
                    c.expect = ("unknown", self.never_loaded(c.name))
                else:
                    m.waiters.append(c)
            elif m.state == "loaded":
                c.expect = ("ok", m.uid)
            elif m.state == "known":
                event("request starts a reload")
                m.busy = Busy("reload", m.path, m.pinned, None)
                self.expected_cmds.append(("load", c.name))
                m.waiters.append(c)
            else:
                c.expect = ("unknown", self.never_loaded(c.name))

    def wake(self, name: str, request_error: str | None) -> None:
        m = self.names[name]
        waiters, m.waiters = m.waiters, []
        for c in waiters:
            if c.kind == "request" and request_error is not None:
                event("a request gets its reload's failure")
                c.expect = ("refused", request_error)
            else:
                self.decide(c)

    def continue_loader(self, ld: Loader, sent: list) -> None:
        """After a load (or one of its evictions) ended: evict the next victim (the front door's choice among the
        legal ones, taken from ``sent``), or the load's call returns."""
        victims = self.victims(ld.name)
        if not victims:
            if ld.call is not None:
                ld.call.expect = ("ok", f"loaded {ld.name}")
            return
        uids = {self.names[v].uid: v for v in victims}
        cmd = next((c for c in sent if isinstance(c, LoraUnloadCmd) and c.uid in uids), None)
        assert cmd is not None, f"over capacity after loading {ld.name} but none of {victims} was evicted: {sent}"
        sent.remove(cmd)
        event(f"eviction (pinned loaded: {any(m.pinned and m.state == 'loaded' for m in self.names.values())})")
        m = self.names[uids[cmd.uid]]
        m.busy = Busy("evict", m.path, m.pinned, m.uid, loader=ld)

    # -------------------------------------------------------------- what the front door sent and got back
    def on_cmd(self, cmd: LoraLoadCmd | LoraUnloadCmd) -> None:
        if isinstance(cmd, LoraLoadCmd):
            assert ("load", cmd.name) in self.expected_cmds, f"unexpected load {cmd}"
            self.expected_cmds.remove(("load", cmd.name))
            b = self.names[cmd.name].busy
            assert b is not None and b.kind in ("load", "reload") and b.uid is None
            assert (cmd.path, cmd.pinned) == (b.path, b.pinned)
            b.uid = cmd.uid
            return
        owner = next((n for n, m in self.names.items() if m.busy and m.busy.uid == cmd.uid), None)
        assert owner is not None and ("unload", owner) in self.expected_cmds, f"unexpected unload {cmd}"
        self.expected_cmds.remove(("unload", owner))

    def on_result(self, cmd: LoraLoadCmd | LoraUnloadCmd, ok: bool, error: str, sent: list) -> None:
        """The front door got ``cmd``'s result; ``sent`` holds what it sent since (evictions are taken out)."""
        name = next(n for n, m in self.names.items() if m.busy and m.busy.uid == cmd.uid)
        m = self.names[name]
        b = m.busy
        m.busy = None
        if b.kind in ("load", "reload"):
            if not ok:
                err = f"LoRA adapter {name} failed to load: {error}"
                if b.call is not None:
                    b.call.expect = ("refused", err)
                self.wake(name, err if b.kind == "reload" else None)
                return
            m.state, m.path, m.pinned, m.uid = "loaded", b.path, b.pinned, b.uid
            self.continue_loader(Loader(name, b.uid, b.call), sent)
            self.wake(name, None)
        elif b.kind == "unload":
            m.state = "gone"
            b.call.expect = ("ok", f"unloaded {name}")
            self.wake(name, None)
        else:
            m.state = "known"
            self.continue_loader(b.loader, sent)
            self.wake(name, None)


NAMES = ["a", "b", "c"]


class AdminStateMachine(RuleBasedStateMachine):
    """Random interleavings of admin calls, requests, acks and rank failures against :class:`Model`."""

    TP = 1

    def __init__(self) -> None:
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        self.paths = [str(write_adapter(tmp / f"p{i}")) for i in range(3)] + [str(tmp / "missing")]
        self.loop = asyncio.new_event_loop()
        self.admin, self.cluster = make_admin(self.TP, MAX_LOADED)
        self.model = Model(NAMES, {self.paths[3]}, MAX_LOADED, SLOTS)
        self.calls: list[Call] = []
        self.seen = 0

    @initialize(
        max_loaded=st.sampled_from([1, 2]),
        preload=st.lists(st.tuples(st.sampled_from(NAMES), st.booleans()), min_size=1, max_size=4),
    )
    def preload(self, max_loaded: int, preload: list[tuple[str, bool]]) -> None:
        """--max-loaded-loras 1 or 2, and some adapters loaded (pinned or not) before the interleavings."""
        self.admin.registry.max_loaded = self.model.max_loaded = max_loaded
        for i, (name, pinned) in enumerate(preload):
            self.load(name, i % 3, pinned)
            self.drain()

    def teardown(self) -> None:
        close_loop(self.loop)
        self._tmp.cleanup()

    def _new_cmds(self) -> list:
        settle(self.loop)
        out = self.cluster.sent[self.seen :]
        self.seen = len(self.cluster.sent)
        return out

    def _observe(self, sent: list) -> None:
        for cmd in sent:
            self.model.on_cmd(cmd)
        assert not self.model.expected_cmds, f"the front door did not send {self.model.expected_cmds}"

    def _start(self, kind: str, name: str, coro, path: str = "", pinned: bool = False) -> None:
        c = Call(kind, name, self.loop.create_task(coro), path, pinned)
        self.calls.append(c)
        sent = self._new_cmds()
        self.model.decide(c)
        self._observe(sent)

    @rule(name=st.sampled_from(NAMES), path=st.sampled_from([0, 1, 2, 0, 1, 2, 3]), pinned=st.booleans())
    def load(self, name: str, path: int, pinned: bool) -> None:
        p = self.paths[path]
        self._start("load", name, self.admin.load_adapter(name, p, pinned), p, pinned)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        self._start("unload", name, self.admin.unload_adapter(name))

    @rule(name=st.sampled_from(NAMES))
    def request(self, name: str) -> None:
        self._start("request", name, self.admin.resolve_adapter(name))

    @precondition(lambda self: bool(self.cluster.queue))
    @rule(i=st.integers(0, 7))
    def ack(self, i: int) -> None:
        cmd, res = self.cluster.complete(i % len(self.cluster.queue))
        sent = self._new_cmds()
        self.model.on_result(cmd, res.ok, res.error, sent)
        self._observe(sent)

    @rule(
        calls=st.lists(
            st.tuples(st.sampled_from(["load", "pin", "unload", "request"]), st.sampled_from(NAMES)),
            min_size=2,
            max_size=4,
        ),
        same=st.booleans(),
    )
    def race(self, calls: list[tuple[str, str]], same: bool) -> None:
        """Several calls at the same instant (none answered in between), on one name or on several."""
        for i, (kind, name) in enumerate(calls):
            name = calls[0][1] if same else name
            if kind in ("load", "pin"):
                self.load(name, i % 3, kind == "pin")
            else:
                getattr(self, kind)(name)

    @precondition(lambda self: any(m.state == "known" and not m.busy for m in self.model.names.values()))
    @rule(rank=st.integers(0, 1), n=st.integers(1, 3))
    def reload_fails(self, rank: int, n: int) -> None:
        """The files of an evicted adapter became unreadable on a rank; ``n`` requests name it."""
        name, m = next((n, m) for n, m in self.model.names.items() if m.state == "known" and not m.busy)
        self.cluster.broken.setdefault(m.path, set()).add(rank % self.TP)
        for _ in range(n):
            self.request(name)

    @rule()
    def drain(self) -> None:
        """Answer every command, oldest first (and the ones that sends), until none is left."""
        while self.cluster.queue:
            self.ack(0)

    @rule(path=st.integers(0, 2), rank=st.integers(0, 1), broken=st.booleans())
    def break_rank(self, path: int, rank: int, broken: bool) -> None:
        ranks = self.cluster.broken.setdefault(self.paths[path], set())
        (ranks.add if broken else ranks.discard)(rank % self.TP)

    @rule()
    def list_adapters(self) -> None:
        task = self.loop.create_task(self.admin.list_adapters())
        settle(self.loop)
        assert [a.name for a in task.result().adapters] == self.model.resident()

    @invariant()
    def outcomes_match_the_model(self) -> None:
        for c in self.calls:
            got = outcome(c.task)
            if c.expect is None:
                assert got == ("pending", None), f"{c.kind} {c.name}: model says running, got {got}"
            elif c.expect[0] == "refused":
                assert got[0] == "refused" and got[1].startswith(c.expect[1]), f"{c.kind} {c.name}: {got} != {c.expect}"
            else:
                assert got == c.expect, f"{c.kind} {c.name}: {got} != {c.expect}"

    @invariant()
    def registry_matches_the_model(self) -> None:
        reg = self.admin.registry
        for n, m in self.model.names.items():
            want = m.busy.kind if m.busy else m.state
            want = {"load": "loading", "reload": "loading", "unload": "unloading", "evict": "unloading"}.get(want, want)
            assert reg.state(n) == want, f"{n}: registry {reg.state(n)}, model {want}"
            if m.state == "loaded" and m.busy is None:
                e = reg.loaded[n]
                assert (e.uid, e.path, e.pinned) == (m.uid, m.path, m.pinned)

    @invariant()
    def workers_hold_only_tracked_uids(self) -> None:
        tracked = self.admin.registry.tracked_uids()
        held = self.cluster.held()
        assert all(h == held[0] for h in held), f"ranks differ: {held}"  # all-or-nothing
        assert held[0] <= tracked, f"untracked uids on the workers: {held[0] - tracked}"
        if not self.cluster.queue:  # quiescent: exactly the registry's adapters, as the scheduler also says
            want = {e.uid for e in self.admin.registry.loaded.values()}
            assert held[0] == want and set(self.cluster.ops.loaded) == want
            assert not self.admin.registry.transitions


class AdminStateMachineTP2(AdminStateMachine):
    """The same at TP=2 (a rank's refusal rolls the load back on the other)."""

    TP = 2


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
TestAdminStateMachineTP1 = AdminStateMachine.TestCase
TestAdminStateMachineTP1.settings = SETTINGS
TestAdminStateMachineTP2 = AdminStateMachineTP2.TestCase
TestAdminStateMachineTP2.settings = SETTINGS


# ----------------------------------------------------------------------------- real clusters (TP=1, TP=2)


def _at_once(*jobs) -> list[tuple[str, Any]]:
    """Run each job (a callable, optionally after a delay: ``(seconds, callable)``) in its own thread, all
    released together; returns ("ok", value) or ("error", message) per job."""
    from ipc.client import LoomError

    barrier = threading.Barrier(len(jobs))
    out: list[tuple[str, Any]] = [("error", "did not run")] * len(jobs)

    def run(i: int, job) -> None:
        delay, fn = job if isinstance(job, tuple) else (0.0, job)
        barrier.wait()
        time.sleep(delay)
        try:
            out[i] = ("ok", fn())
        except LoomError as e:
            out[i] = ("error", e.message)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def _workers_hold(h, after: int, timeout_s: float = 120.0) -> list[str]:
    """Kill the scheduler; its successor rebuilds the adapter table from every rank's READY (their host tiers)
    and the front door logs the view. Returns the "name:uid" the workers hold."""
    from loom_helpers import _find_children

    _find_children(h)
    os.kill(h.children["scheduler_proc"], signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(r"cluster view of scheduler \w+: the workers hold (\[.*\])")
    while time.monotonic() < deadline:
        views = pattern.findall(h.log()[after:])
        if views:
            return ast.literal_eval(views[-1])
        time.sleep(0.2)
    raise AssertionError(f"no cluster view after the scheduler restart:\n{h.log()[-4000:]}")


def _mk(c, name: str, path: Path):
    return lambda: c.load_lora_adapter(name, str(path))["uid"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_races_on_a_real_cluster_leave_registry_and_workers_agreeing(tmp_path, tp):
    """The races of issue 9 item 6 on a real cluster with --max-loaded-loras 1: loads, unloads and a reload by a
    request racing each other; afterwards the workers hold exactly the registry's adapters."""
    from loom_helpers import launch_cluster
    from lora_helpers import real_adapters

    from ipc.client import LoomClient

    ads = real_adapters()
    flags = ["--tp-size", str(tp), "--enable-lora", "--max-loaded-loras", "1", "--max-loras-per-batch", "2"]
    flags += ["--max-lora-rank", "64", "--max-total-tokens", "2048"]
    with launch_cluster(tmp_path / "cluster", *flags) as h, LoomClient(h.endpoint, timeout_s=120) as admin:
        one, two = LoomClient(h.endpoint, timeout_s=120), LoomClient(h.endpoint, timeout_s=120)

        def names() -> list[str]:
            return [x["name"] for x in admin.list_loras()]

        def request_a() -> list[int]:
            return one.generate("Hi", sampling_params={"max_new_tokens": 2, "temperature": 0}, lora_path="a")[
                "output_ids"
            ]

        try:
            # two loads of one new name at the same instant: one uid, and the loser says why
            res = _at_once(_mk(one, "x", ads["r64-all"]), _mk(two, "x", ads["r8-all"]))
            assert sorted(k for k, _ in res) == ["error", "ok"], res
            assert next(m for k, m in res if k == "error") in (
                "LoRA adapter x is being loaded by another call; this load changed nothing",
                "LoRA adapter x is already loaded; unload it first",
            ), res
            # two unloads while a request still uses x (the unload waits for it): the loser is told what happens
            sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
            stream = one.generate("Once", sampling_params=sp, stream=True, lora_path="x")
            next(stream)
            res = _at_once(lambda: admin.unload_lora_adapter("x"), lambda: two.unload_lora_adapter("x"))
            assert sorted(res, key=lambda r: r[0]) == [
                ("error", "LoRA adapter x is being unloaded by another call; this unload changed nothing"),
                ("ok", {"message": "unloaded x"}),
            ], res
            assert len(list(stream)[-1]["output_ids"]) == 40
            for i in range(3):
                # --max-loaded-loras 1: b evicts a; a request for a reloads it while an unload of a races it
                admin.load_lora_adapter("a", str(ads["r8-all"]))
                admin.load_lora_adapter("b", str(ads["r16-attn"]))
                assert names() == ["b"]
                unload = (0.005 * i, lambda: two.unload_lora_adapter("a")["message"])
                (gk, gv), (uk, uv) = _at_once(request_a, unload)
                assert uk == "ok" and uv in ("unloaded a", "a was not resident; forgotten"), (uk, uv)
                if uv == "unloaded a":  # it waited for the reload, whose request still ran
                    assert gk == "ok" and len(gv) == 2, (gk, gv)
                else:  # the unload came first: the request finds no a
                    assert gk == "error" and "never been loaded: a" in gv, (gk, gv)
                assert "a" not in names()
                # an explicit load racing the reload: it waits for it and says a is loaded (or it came first)
                admin.load_lora_adapter("a", str(ads["r8-all"]))
                admin.load_lora_adapter("b", str(ads["r16-attn"]))
                load = (0.005 * i, lambda: two.load_lora_adapter("a", str(ads["r8-all"]))["message"])
                (gk, gv), (lk, lv) = _at_once(request_a, load)
                assert gk == "ok", gv
                assert (lk, lv) in (("ok", "loaded a"), ("error", "LoRA adapter a is already loaded; unload it first"))
                admin.unload_lora_adapter("b")  # evicted by a's reload: "forgotten"
                admin.unload_lora_adapter("a")
            admin.load_lora_adapter("keep", str(ads["r32-qv"]))
            registry = sorted(f"{x['name']}:{x['uid']}" for x in admin.list_loras())
            assert [r.split(":")[0] for r in registry] == ["keep"]
            assert _workers_hold(h, len(h.log())) == registry, h.log()[-4000:]
            for line in ("rebuilt from the workers", "is no longer valid and is unloaded"):
                assert line not in h.log(), h.log()[-4000:]
        finally:
            one.close()
            two.close()
