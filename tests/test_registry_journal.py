"""The front door's registry journal: every settled change of the LoRA registry is written to the cluster folder, and a
restarted front door seeds its registry from it (names, uids, paths, pins, content hashes; evicted names as the ref
cache), reporting adapters whose folders no longer read as lost."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

from lora_helpers import DUMMY_ENDPOINTS, real_adapters, server_args

from ipc.config import Endpoints
from ipc.lora_config import adapter_content_hash
from tokenizer_proc.lora_admin import LoraAdmin
from tokenizer_proc.registry import LoraRegistry
from tokenizer_proc.registry_journal import JOURNAL_FILE, JournalEntry, JournalRef, RegistryJournal, RegistrySnapshot


def _admin(folder) -> LoraAdmin:
    import msgspec

    eps: Endpoints = msgspec.structs.replace(DUMMY_ENDPOINTS, socket_dir=str(folder))
    args = msgspec.structs.replace(server_args(enable_lora=True, max_lora_rank=64), endpoints=eps)
    return LoraAdmin(args, lambda cmd: None, SimpleNamespace(adapters_lost=0), num_layers=30)


def _load(reg: LoraRegistry, name: str, path, pinned: bool = False, content_hash: str = "h") -> str:
    uid = reg.new_uid(name, str(path))
    reg.begin_load(name, uid, str(path), pinned, 8)
    reg.finish_load(name, ok=True, content_hash=content_hash)
    return uid


def test_each_settled_change_is_written_and_read_back(tmp_path):
    ad = real_adapters()
    admin = _admin(tmp_path)
    reg, journal = admin.registry, admin.journal
    assert journal.read() is None  # nothing written before the first change
    ua = _load(reg, "a", ad["r8-all"], content_hash="ha")
    ub = _load(reg, "b", ad["r32-qv"], pinned=True, content_hash="hb")
    _load(reg, "e", ad["r16-attn"])
    reg.begin_unload("e", evict=True)  # host-tier eviction: e stays in the ref cache ("known")
    reg.finish_unload("e")
    snap = journal.read()
    assert snap == RegistrySnapshot(
        [JournalEntry("a", ua, str(ad["r8-all"]), False, "ha"), JournalEntry("b", ub, str(ad["r32-qv"]), True, "hb")],
        [JournalRef("e", str(ad["r16-attn"]), False)],
    )
    reg.begin_unload("a")  # an explicit unload leaves the journal as soon as it starts
    assert [e.name for e in journal.read().loaded] == ["b"]
    reg.finish_unload("a")
    reg.lose("b", ub)
    assert journal.read() == RegistrySnapshot([], [JournalRef("e", str(ad["r16-attn"]), False)])
    assert (tmp_path / JOURNAL_FILE).is_file() and not list(tmp_path.glob("*.tmp"))


def test_a_restarted_front_door_carries_over_what_the_workers_lack_and_reports_changed_files(tmp_path):
    ad = real_adapters()
    doomed, changed = tmp_path / "doomed", tmp_path / "changed"
    shutil.copytree(ad["r16-attn"], doomed)
    shutil.copytree(ad["r8-all"], changed)
    old = _admin(tmp_path)
    ua = _load(old.registry, "a", ad["r8-all"], pinned=True, content_hash=adapter_content_hash(ad["r8-all"], "a"))
    _load(old.registry, "c", doomed, content_hash=adapter_content_hash(doomed, "c"))
    _load(old.registry, "x", changed, content_hash=adapter_content_hash(changed, "x"))
    uh = _load(old.registry, "h", ad["r32-qv"], content_hash="whatever")
    _load(old.registry, "e", ad["r32-qv"])
    old.registry.begin_unload("e", evict=True)
    old.registry.finish_unload("e")
    shutil.rmtree(doomed)
    (changed / "adapter_config.json").write_text((changed / "adapter_config.json").read_text() + " ")

    new = _admin(tmp_path)
    new.seed_from_journal()
    assert new.registry.loaded == {}  # nothing is taken before the workers' view says what they hold
    new._carry_over(new._carried, held={uh})  # the workers still hold h: adopted by the view's own checks
    reg = new.registry
    assert [reg.state(n) for n in ("a", "c", "x", "h", "e")] == ["loaded", "gone", "gone", "gone", "known"]
    e = reg.loaded["a"]
    assert (e.uid, e.path, e.pinned, e.rank) == (ua, str(ad["r8-all"]), True, 8)
    assert new.health.adapters_lost == 2  # c (folder gone) and x (files changed)
    # the carried-over registry is journalled again, so a second restart does not report c and x twice
    assert [x.name for x in new.journal.read().loaded] == ["a"]


def test_a_torn_journal_is_ignored(tmp_path):
    (tmp_path / JOURNAL_FILE).write_text('{"loaded": [{"name": "a"')
    assert RegistryJournal(tmp_path / JOURNAL_FILE).read() is None
    admin = _admin(tmp_path)
    admin.seed_from_journal()
    assert admin._carried is None and admin.registry.loaded == {} and admin.health.adapters_lost == 0


def test_without_a_cluster_folder_nothing_is_written(tmp_path):
    journal = RegistryJournal(None)
    journal.save(RegistrySnapshot())
    assert journal.read() is None
