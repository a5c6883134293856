"""Against one running TP=1 cluster: bad adapters are refused at load with a message naming the adapter and
the bad file/tensor/field (and the server keeps serving); unknown names; dynamic load, unload, list."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from lora_helpers import REPO, generate_many, greedy, launch_cluster, peft_reference, real_adapters, until_eos
from safetensors.torch import load_file, save_file

from ipc.client import LoomError

pytestmark = pytest.mark.slow

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
V29 = "base_model.model.model.layers.29.self_attn.v_proj"


def _small(src, dst, *, config: dict | None = None, tensors: dict | None = None, drop: tuple = ()):
    """A copy of ``src`` that keeps only layer 0 q_proj and layer 29 v_proj, with edits."""
    dst.mkdir(parents=True)
    t = load_file(str(src / "adapter_model.safetensors"))
    keep = {k: v for k, v in t.items() if k.startswith((Q0 + ".", V29 + "."))}
    keep.update(tensors or {})
    for k in drop:
        keep.pop(k)
    save_file({k: v.contiguous() for k, v in keep.items()}, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj"]
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The --lora-root folder: a good adapter, a rank-32 one and every kind of broken adapter."""
    ads = real_adapters()
    src = ads["r8-all"]
    root = tmp_path_factory.mktemp("lora-root")
    shutil.copytree(src, root / "good")
    _small(src, root / "small")
    shutil.copytree(ads["r32-qv"], root / "rank32")
    (root / "no-config").mkdir()
    shutil.copy(src / "adapter_model.safetensors", root / "no-config")
    (root / "no-weights").mkdir()
    shutil.copy(src / "adapter_config.json", root / "no-weights")
    (root / "bin-only").mkdir()
    shutil.copy(src / "adapter_config.json", root / "bin-only")
    (root / "bin-only" / "adapter_model.bin").write_bytes(b"\x80\x04 pickle bytes that must never be opened")
    _small(src, root / "zero-bytes")
    (root / "zero-bytes" / "adapter_model.safetensors").write_bytes(b"")
    _small(src, root / "truncated")
    data = (root / "truncated" / "adapter_model.safetensors").read_bytes()
    (root / "truncated" / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    a = load_file(str(src / "adapter_model.safetensors"))[f"{Q0}.lora_A.weight"]
    _small(src, root / "bad-shape", tensors={f"{Q0}.lora_A.weight": torch.cat([a, a[:, :3]], dim=1)})
    big = torch.zeros(32, 576)
    _small(src, root / "rank-lie", tensors={f"{Q0}.lora_A.weight": big, f"{Q0}.lora_B.weight": torch.zeros(576, 32)})
    fc = "base_model.model.model.layers.0.mlp.fc1"
    _small(src, root / "bad-module-tensor", tensors={f"{fc}.lora_A.weight": a, f"{fc}.lora_B.weight": a.T})
    _small(src, root / "bad-layer", tensors={k.replace("layers.29.", "layers.30."): v for k, v in _v29(src).items()})
    _small(src, root / "unpaired", drop=(f"{V29}.lora_B.weight",))
    _small(src, root / "bad-module-config", config={"target_modules": ["q_proj", "fc1"]})
    _small(src, root / "dora", config={"use_dora": True})
    _small(src, root / "save", config={"modules_to_save": ["lm_head"]})
    _small(src, root / "bad-json")
    (root / "bad-json" / "adapter_config.json").write_text("{not json")
    return root


def _v29(src):
    t = load_file(str(src / "adapter_model.safetensors"))
    return {k: v for k, v in t.items() if k.startswith(V29 + ".")}


@pytest.fixture(scope="module")
def cluster(root):
    args = ["--enable-lora", "--lora-root", str(root), "--max-lora-rank", "16", "--max-loras-per-batch", "2"]
    with launch_cluster(args + ["--lora-paths", f"good={root / 'good'}"]) as c:
        yield c


@pytest.fixture
def client(cluster):
    with cluster.client(timeout_s=120) as c:
        yield c


def _refused(client, name, path) -> str:
    with pytest.raises(LoomError) as e:
        client.load_lora_adapter(name, str(path))
    return e.value.message


# (case, folder under root, expected substrings beyond the adapter's name)
CASES = [
    ("missing-folder", "does-not-exist", ["does-not-exist is not a folder"]),
    ("missing-config", "no-config", ["no-config/adapter_config.json is missing"]),
    ("missing-weights", "no-weights", ["no-weights/adapter_model.safetensors is missing"]),
    ("bin-only", "bin-only", ["bin-only/adapter_model.safetensors is missing", ".bin/pickle weights are never opened"]),
    ("zero-bytes", "zero-bytes", ["zero-bytes/adapter_model.safetensors is empty (0 bytes)"]),
    ("truncated", "truncated", ["truncated/adapter_model.safetensors is not a readable safetensors file"]),
    ("bad-shape", "bad-shape", [f"tensor {Q0}.lora_A.weight has shape [8, 579], expected [r, 576]"]),
    ("rank-config", "rank32", ["rank 32 exceeds --max-lora-rank 16"]),
    ("rank-tensor", "rank-lie", [f"tensor {Q0}.lora_A.weight has rank 32 but adapter_config.json"]),
    ("module-config", "bad-module-config", ["field target_modules=['fc1'] is not supported"]),
    (
        "module-tensor",
        "bad-module-tensor",
        ["layers.0.mlp.fc1.lora_A.weight targets module fc1, which the model lacks"],
    ),
    ("layer", "bad-layer", ["layers.30.self_attn.v_proj.lora_A.weight targets layer 30; the model has 30"]),
    ("unpaired", "unpaired", ["layer 29 v_proj has no lora_B weight"]),
    ("dora", "dora", ["field use_dora=True is not supported"]),
    ("modules-to-save", "save", ["field modules_to_save=['lm_head'] is not supported"]),
    ("bad-json", "bad-json", ["bad-json/adapter_config.json is not valid JSON"]),
]


@pytest.mark.parametrize("case,folder,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_adapter_refused_and_server_keeps_serving(client, root, case, folder, expected):
    name = f"x-{case}"
    msg = _refused(client, name, root / folder)
    assert f"LoRA adapter {name}" in msg, msg
    for e in expected:
        assert e in msg, msg
    assert name not in [a["name"] for a in client.list_loras()]
    with pytest.raises(LoomError, match=f"never been loaded: {name}"):
        client.generate("Hi", sampling_params=greedy(1), lora_path=name)


def test_path_outside_root_refused(client, root, tmp_path):
    shutil.copytree(real_adapters()["r8-all"], tmp_path / "elsewhere")
    msg = _refused(client, "outside", tmp_path / "elsewhere")
    assert f"LoRA adapter outside: path {tmp_path / 'elsewhere'} is outside the allowed root" in msg, msg
    # textually under the root, but ".." leads out of it
    msg = _refused(client, "dotdot", root / ".." / tmp_path.relative_to(root.parent) / "elsewhere")
    assert "LoRA adapter dotdot: path" in msg and "is outside the allowed root" in msg, msg
    assert f"(resolves to {tmp_path / 'elsewhere'})" in msg, msg  # the path the check really refused


def test_symlink_escaping_root_refused(client, root, tmp_path):
    shutil.copytree(real_adapters()["r8-all"], tmp_path / "target")
    (root / "escape").symlink_to(tmp_path / "target")
    try:
        msg = _refused(client, "escape", root / "escape")
        assert "LoRA adapter escape: path" in msg and "is outside the allowed root" in msg, msg
    finally:
        (root / "escape").unlink()


def test_file_link_escaping_root_refused(client, root, tmp_path):
    """The folder is inside the root, but its weights file links to a file outside it."""
    shutil.copytree(real_adapters()["r8-all"], tmp_path / "outside")
    (root / "filelink").mkdir()
    try:
        shutil.copyfile(tmp_path / "outside" / "adapter_config.json", root / "filelink" / "adapter_config.json")
        (root / "filelink" / "adapter_model.safetensors").symlink_to(tmp_path / "outside" / "adapter_model.safetensors")
        msg = _refused(client, "filelink", root / "filelink")
        assert "adapter_model.safetensors links to" in msg and "outside the allowed root" in msg, msg
    finally:
        shutil.rmtree(root / "filelink")


def test_server_still_serves_after_refusals(client):
    for case, folder, _ in CASES:  # every refusal again, back to back, then real work
        with pytest.raises(LoomError):
            client.load_lora_adapter(f"again-{case}", f"/nonexistent/{folder}")
    ids = peft_reference()["input_ids"]["raw_fox"]
    base = client.generate(input_ids=ids, sampling_params=greedy(4))
    good = client.generate(input_ids=ids, sampling_params=greedy(4), lora_path="good")
    assert len(base["output_ids"]) == 4 and len(good["output_ids"]) == 4
    assert base["output_ids"] != good["output_ids"]
    assert good["meta_info"]["lora_path"] == "good"
    assert client.health()["message"] == "ok"


def test_unknown_adapter_lists_loaded_ones(client):
    with pytest.raises(LoomError) as e:
        client.generate("Hi", sampling_params=greedy(2), lora_path="nobody")
    assert e.value.kind == "not_found"
    assert "Got LoRA adapter that has never been loaded: nobody" in e.value.message
    loaded = sorted(a["name"] for a in client.list_loras())
    assert f"All loaded adapters: {loaded}" in e.value.message and "good" in loaded


def test_dynamic_load_generate_unload(cluster, client, root):
    ref = peft_reference()
    info = client.load_lora_adapter("dyn", str(root / "small"))
    assert info["rank"] == 8 and len(info["uid"]) == 36
    with pytest.raises(LoomError, match="LoRA adapter dyn is already loaded; unload it first"):
        client.load_lora_adapter("dyn", str(root / "good"))
    # the same folder as "good" under a new name: a new uid, the same (peft-verified) tokens
    info2 = client.load_lora_adapter("dyn2", str(root / "good"))
    good_uid = next(a["uid"] for a in client.list_loras() if a["name"] == "good")
    assert info2["uid"] != good_uid
    prompts = ("raw_fox", "chat_france")
    outs = generate_many(
        cluster.endpoint,
        [{"input_ids": ref["input_ids"][p], "sampling_params": greedy(12), "lora_path": "dyn2"} for p in prompts]
        + [{"input_ids": ref["input_ids"]["raw_fox"], "sampling_params": greedy(12), "lora_path": "dyn"}],
    )
    for p, out in zip(prompts, outs, strict=False):
        assert until_eos(out["output_ids"]) == until_eos(ref["greedy"][f"r8-all|{p}"], 12)
    assert len(outs[2]["output_ids"]) == 12 and outs[2]["output_ids"] != outs[0]["output_ids"]
    assert client.unload_lora_adapter("dyn")["message"] == "unloaded dyn"
    client.unload_lora_adapter("dyn2")
    for name in ("dyn", "dyn2"):
        with pytest.raises(LoomError) as e:
            client.generate("Hi", sampling_params=greedy(2), lora_path=name)
        assert f"Got LoRA adapter that has never been loaded: {name}" in e.value.message
        assert "All loaded adapters: ['good']" in e.value.message
    # a name can be loaded again after an unload (with a fresh uid)
    again = client.load_lora_adapter("dyn", str(root / "small"))
    assert again["uid"] != info["uid"]
    client.unload_lora_adapter("dyn")


def test_unload_unknown_name_fails(client):
    """Over ZMQ the error's kind is ``not_found``, as the HTTP API's 404 says (it was ``bad_request``)."""
    with pytest.raises(LoomError, match="Got LoRA adapter that has never been loaded: ghost") as e:
        client.unload_lora_adapter("ghost")
    assert e.value.kind == "not_found"
    with pytest.raises(LoomError, match="/nonexistent") as e:  # a refused load stays a bad request
        client.load_lora_adapter("ghost2", "/nonexistent")
    assert e.value.kind == "bad_request"
    with pytest.raises(LoomError, match="LoRA adapter name is empty") as e:  # as a load of "" is refused
        client.unload_lora_adapter("")
    assert e.value.kind == "bad_request"


def test_adapters_script_lists_name_uid_path_rank_pinned_slots(cluster, client, root):
    client.load_lora_adapter("pin", str(root / "small"), pinned=True)
    try:
        client.generate("Hi", sampling_params=greedy(1), lora_path="good")  # a step refreshes the slot tables
        rows = {a["name"]: a for a in client.list_loras()}
        assert rows["pin"]["pinned"] is True and rows["good"]["pinned"] is False
        assert set(rows["pin"]["slots"]) == {"rank 0"} and set(rows["good"]["slots"]) == {"rank 0"}
        assert rows["pin"]["slots"]["rank 0"] != rows["good"]["slots"]["rank 0"]
        script = [sys.executable, str(REPO / "scripts" / "adapters.py"), "--endpoint", cluster.endpoint]
        text = subprocess.run(script + ["list"], capture_output=True, text=True, timeout=60, check=True).stdout
        header, *lines = text.strip().splitlines()
        for col in ("name", "uid", "rank", "pinned", "slots", "path"):
            assert col in header
        by_name = {line.split()[0]: line for line in lines}
        for name in ("good", "pin"):
            r = rows[name]
            line = by_name[name]
            assert r["uid"] in line and r["path"] in line and f" {r['rank']} " in line
            assert str(r["pinned"]) in line and f"rank 0: slot {r['slots']['rank 0']}" in line
        js = subprocess.run(script + ["--json", "list"], capture_output=True, text=True, timeout=60, check=True)
        assert {a["name"]: a for a in json.loads(js.stdout)} == rows
        bad = subprocess.run(script + ["load", "nope", str(root / "dora")], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "LoRA adapter nope" in bad.stderr and "use_dora" in bad.stderr
        ok = subprocess.run(script + ["load", "via-script", str(root / "small")], capture_output=True, text=True)
        assert ok.returncode == 0 and json.loads(ok.stdout)["rank"] == 8
        gen = [sys.executable, str(REPO / "scripts" / "generate.py"), "--endpoint", cluster.endpoint, "--json"]
        out = subprocess.run(
            gen + ["--text", "Hi", "--max-new-tokens", "3", "--lora", "via-script"], capture_output=True, text=True
        )
        assert out.returncode == 0 and json.loads(out.stdout)["meta_info"]["lora_path"] == "via-script"
        ok = subprocess.run(script + ["unload", "via-script"], capture_output=True, text=True)
        assert ok.returncode == 0 and "unloaded via-script" in ok.stdout
        out = subprocess.run(gen + ["--text", "Hi", "--lora", "via-script"], capture_output=True, text=True)
        assert out.returncode == 1 and "never been loaded: via-script" in out.stderr
    finally:
        client.unload_lora_adapter("pin")


def _stream(client, adapter: str, n: int):
    """Start a streaming greedy request of ``n`` tokens (EOS ignored) and wait until it runs."""
    it = client.generate(
        "Once upon a time",
        sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        lora_path=adapter,
        stream=True,
    )
    next(it)
    return it


def _finish(it) -> dict:
    return list(it)[-1]


def test_pinned_load_while_running_requests_hold_every_slot(cluster, client, root):
    """Both slots busy with running requests, then a pinned load: it waits for room; nothing running fails."""
    client.load_lora_adapter("s1", str(root / "small"))
    try:
        with cluster.client() as c1, cluster.client() as c2:
            a, b = _stream(c1, "good", 10), _stream(c2, "s1", 10)
            client.load_lora_adapter("pin2", str(root / "small"), pinned=True)
            assert len(_finish(a)["output_ids"]) == 10 and len(_finish(b)["output_ids"]) == 10
        out = client.generate("Hi", sampling_params=greedy(2), lora_path="pin2")
        assert len(out["output_ids"]) == 2
        assert {a["name"]: a["pinned"] for a in client.list_loras()}["pin2"] is True
    finally:
        client.unload_lora_adapter("pin2")
        client.unload_lora_adapter("s1")


def test_unload_waits_for_in_flight_requests(cluster, client, root):
    client.load_lora_adapter("busy", str(root / "small"))
    with cluster.client() as c1:
        it = _stream(c1, "busy", 10)
        assert client.unload_lora_adapter("busy")["message"] == "unloaded busy"  # returns once it finished
        res = _finish(it)
    assert len(res["output_ids"]) == 10 and res["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(LoomError, match="never been loaded: busy"):
        client.generate("Hi", sampling_params=greedy(2), lora_path="busy")


def test_host_tier_eviction_and_transparent_reload():
    """--max-loaded-loras 2: a third load evicts the least recently used unpinned adapter from host memory; a
    request naming it reloads it transparently (and its output still matches peft)."""
    ads, ref = real_adapters(), peft_reference()
    ids = ref["input_ids"]["raw_fox"]
    args = ["--enable-lora", "--max-loaded-loras", "2", "--max-loras-per-batch", "2", "--max-lora-rank", "32"]
    args += ["--lora-paths", f"a={ads['r8-all']}", f"b={ads['r16-attn']}"]
    with launch_cluster(args) as cluster, cluster.client() as c:
        c.generate(input_ids=ids, sampling_params=greedy(1), lora_path="b")  # a is now least recently used
        c.load_lora_adapter("q", str(ads["r32-qv"]))
        assert sorted(x["name"] for x in c.list_loras()) == ["b", "q"]
        # two concurrent requests name the evicted a: one reload serves both (and evicts b)
        outs = generate_many(cluster.endpoint, [{"input_ids": ids, "sampling_params": greedy(8), "lora_path": "a"}] * 2)
        for out in outs:
            assert until_eos(out["output_ids"]) == until_eos(ref["greedy"]["r8-all|raw_fox"], 8)
        rows = {x["name"]: x for x in c.list_loras()}
        assert sorted(rows) == ["a", "q"]
        uid_a = rows["a"]["uid"]
        out = c.generate(input_ids=ids, sampling_params=greedy(8), lora_path="b")
        assert until_eos(out["output_ids"]) == until_eos(ref["greedy"]["r16-attn|raw_fox"], 8)
        rows = {x["name"]: x["uid"] for x in c.list_loras()}
        assert rows == {"a": uid_a, "b": rows["b"]}  # q was least recently used; a stayed resident


def test_pins_count_rank_rows_not_slots():
    """Two slots of rank 64 (128 rank rows) pin a rank-4 and a rank-48 adapter (4 + 48 rows leave 76, room for
    one adapter at rank 64); a rank-64 pin next to the rank-4 one would not leave it."""
    from tokenizer_proc.registry import Entry, LoraRegistry

    reg = LoraRegistry(max_lora_rank=64, max_slots=2)
    reg.loaded["p1"] = Entry("p1", "uid-1", "/a/p1", 4, True)
    assert reg.pin_refusal("p2", True, 4) is None
    assert reg.pin_refusal("p2", True, 48) is None
    msg = reg.pin_refusal("p2", True, 64)
    assert msg == (
        "LoRA adapter p2: pinning it would leave no free slot of 2 for other adapters (pinned: ['p1']; they would "
        "hold 68 of 128 rank rows, and an adapter at --max-lora-rank 64 needs 64)"
    )
    assert reg.pin_refusal("p2", False, 64) is None  # unpinned loads are never refused for room


def test_metrics_name_adapters_being_unloaded_not_their_uids():
    """vLLM's ``lora_requests_info`` names the adapters of the scheduler's last heartbeat: one being unloaded (its
    requests still run) or just gone (the heartbeat predates it) is named, not shown as its uid."""
    from types import SimpleNamespace

    from ipc.messages import SchedulerBeat
    from tokenizer_proc.metrics import DoorCollector
    from tokenizer_proc.registry import Entry, LoraRegistry

    reg = LoraRegistry()
    reg.loaded["a"] = Entry("a", "uid-a", "/x/a", 8, False)
    reg.loaded["b"] = Entry("b", "uid-b", "/x/b", 8, False)
    beat = SchedulerBeat("inc", 1, [], {}, running_lora_uids=["uid-a", "uid-b"], waiting_lora_uids=["uid-c"])
    door = SimpleNamespace(registry=reg, health=SimpleNamespace(beat=beat, beat_wall_time=1.0),
                           args=SimpleNamespace(max_loras_per_batch=4))  # fmt: skip
    collector = DoorCollector.__new__(DoorCollector)
    collector.door = door

    def labels() -> dict[str, str]:
        return collector._lora_info().samples[0].labels

    reg.begin_unload("a")
    assert labels()["running_lora_adapters"] == "a,b"
    reg.finish_unload("a")
    assert labels()["running_lora_adapters"] == "a,b"
    assert labels()["waiting_lora_adapters"] == "uid-c"  # a uid the registry never had stays as it is


def test_a_refused_start_up_adapter_stops_launch_in_one_line(tmp_path):
    """A pin that --max-loras-per-batch 1 cannot hold: launch exits non-zero naming the flag and the adapter, and
    the front door logs it without the Python traceback it used to print first."""
    a = real_adapters()["r8-all"]
    spec = json.dumps({"lora_name": "p", "lora_path": str(a), "pinned": True})
    cmd = [sys.executable, str(REPO / "launch.py"), "--zmq-endpoint", f"ipc://{tmp_path}/front.sock"]
    cmd += ["--quantization", "none", "--enable-lora", "--max-loras-per-batch", "1", "--lora-paths", spec]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    assert "--lora-paths p: LoRA adapter p: pinning it would leave no free slot of 1" in log, log
    assert "Traceback" not in log, log
    assert not (tmp_path / "front.sock").exists()
