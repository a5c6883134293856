"""Every TP rank's pool must reach the same slot decisions whatever its PYTHONHASHSEED, and a divergence
must stop the scheduler with an error naming the ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from lora_helpers import TESTS, launch_cluster, patch_on_import, real_adapters, write_adapter

from ipc.messages import StepResult
from scheduler_proc.main import DivergenceError, check_digests

STEPS = 150


@pytest.fixture(scope="module")
def ten_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("ten")
    for i in range(10):
        write_adapter(root / f"ad{i:02d}", r=2 + (i % 3) * 2, alpha=8, seed=100 + i, targets=["q_proj", "down_proj"])
    return root


@pytest.fixture(scope="module")
def driver_runs(ten_adapters) -> dict[str, list[list[dict]]]:
    """``{run: [lines of process 1, lines of process 2]}``: the same streams in two processes whose
    PYTHONHASHSEED differs. Runs: seed 2 (LRU), seed 3 (FIFO), then seed 2 with a set-order assign."""
    procs = []
    for hashseed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        cmd = [sys.executable, str(TESTS / "lora_helpers.py"), str(ten_adapters), str(STEPS), "2", "3", "2-broken"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    runs: dict[str, list[list[dict]]] = {}
    for k, p in enumerate(procs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        for line in out.splitlines():
            x = json.loads(line)
            runs.setdefault(x["run"], [[], []])[k].append(x)
    return runs


def test_pools_agree_across_hash_seeds(driver_runs):
    """LRU and FIFO streams: identical slot tables and digests after every step, load and unload."""
    for run in ("2", "3"):
        a, b = driver_runs[run]
        assert len(a) >= STEPS
        for x, y in zip(a, b, strict=True):
            assert x == y, f"pools diverged at {x['i']} ({x['event']}): {x['table']} vs {y['table']}"
        # the stream really exercised the pool: loads/unloads, every slot, many different tables
        assert any(x["event"].startswith("unload") for x in a) and any(x["event"].startswith("load") for x in a)
        assert len({json.dumps(x["table"], sort_keys=True) for x in a}) > 20
        # rank rows: more adapters than the 3 slots at --max-lora-rank are resident at once
        assert {s for x in a for s in x["table"].values()} >= {0, 1, 2, 3}
    assert [x["digest"] for x in driver_runs["2"][0]] != [x["digest"] for x in driver_runs["3"][0]]


def test_set_order_assign_is_caught(driver_runs):
    """The check has teeth: iterating a set of uids (instead of sorting) diverges between hash seeds."""
    a, b = driver_runs["2-broken"]
    assert [x["digest"] for x in a] != [x["digest"] for x in b]


def test_check_digests_names_the_diverging_ranks():
    same = {r: StepResult(step=7, rank=r, next_ids=[], slot_digest="abc", slots={"u1": 0}) for r in range(3)}
    check_digests(same)  # agreement: no error
    bad = dict(same)
    bad[2] = StepResult(step=7, rank=2, next_ids=[], slot_digest="xyz", slots={"u1": 1})
    with pytest.raises(DivergenceError) as e:
        check_digests(bad)
    msg = str(e.value)
    assert "LoRA slot tables diverged at step 7" in msg
    assert "rank 0 has {'u1': 0}" in msg and "rank 2: {'u1': 1}" in msg
    assert "rank 1" not in msg


SABOTAGE = patch_on_import(
    "gpu_worker.lora_pool",
    textwrap.dedent(
        '''
    """Test-only hook: on TP rank $LOOM_TEST_SABOTAGE_RANK, LoraPool fills free slots from the highest index
    and refuses to load adapters whose name starts with "fail"."""
    import os

    _RANK = int(os.environ.get("LOOM_TEST_SABOTAGE_RANK", "-1"))


    def _patch(mod):
        orig = mod.LoraPool._ensure_slot
        orig_load = mod.LoraPool.load

        def load(self, uid, name, path, pinned=False, expect_hash="", data=None):
            if self.plan.rank == _RANK and name.startswith("fail"):
                raise mod.LoraPoolError(f"LoRA adapter {name}: sabotaged load on this rank")
            return orig_load(self, uid, name, path, pinned, expect_hash, data)

        mod.LoraPool.load = load

        def _ensure_slot(self, uid, protected):
            if self.plan.rank != _RANK or uid in self.uid_slot:
                return orig(self, uid, protected)
            hide = [i for i, u in enumerate(self.slot_uid) if u is None][:-1]
            for i in hide:
                self.slot_uid[i] = "__hidden__"
            try:
                return orig(self, uid, protected)
            finally:
                for i in hide:
                    self.slot_uid[i] = None

        mod.LoraPool._ensure_slot = _ensure_slot
    '''
    ),
)


@pytest.mark.slow
def test_one_rank_failing_and_diverging(tmp_path):
    """TP=2 where rank 1's pool (only) refuses some loads and picks slots differently: a load fails as a whole
    naming rank 1; a divergent step stops the scheduler and the client hears why."""
    from ipc.client import LoomError

    (tmp_path / "sitecustomize.py").write_text(SABOTAGE)
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")])),
        "LOOM_TEST_SABOTAGE_RANK": "1",
    }
    a = real_adapters()["r8-all"]
    # two slots on every backend (a pool that reads adapters in place has one per running request, plus one)
    args = ["--tp-size", "2", "--enable-lora", "--max-loras-per-batch", "2", "--max-running-requests", "1"]
    args += ["--lora-paths", f"a={a}"]
    with launch_cluster(args, env_extra=env) as cluster:
        with cluster.client(timeout_s=60) as c:
            # first, all-or-nothing loads: rank 1 refuses, rank 0 rolls back, the error names rank 1 only
            with pytest.raises(LoomError) as e:
                c.load_lora_adapter("fail-x", str(a))
            assert e.value.message == (
                "LoRA adapter fail-x failed to load: rank 1: LoRA adapter fail-x: sabotaged load on this rank"
            )
            assert [x["name"] for x in c.list_loras()] == ["a"]
            uid = next(x["uid"] for x in c.list_loras() if x["name"] == "a")
            # then a step with an adapter: the ranks put it in different slots
            assert c.generate("Hello", sampling_params={"max_new_tokens": 2, "temperature": 0})["output_ids"]
            with pytest.raises(LoomError) as e:
                c.generate("Hello", sampling_params={"max_new_tokens": 4, "temperature": 0}, lora_path="a")
        msg = e.value.message
        assert "LoRA slot tables diverged at step" in msg, msg
        # 2 slots of rank 8 = 16 rank rows = 4 slot entries of 4 rows: the sabotaged rank takes the last one
        assert f"rank 0 has {{'{uid}': 0}}" in msg and f"rank 1: {{'{uid}': 3}}" in msg, msg
        assert cluster.wait_exit(30) == 1  # the launcher noticed the scheduler's exit and stopped everything
        assert (
            "scheduler_proc exited with code 3 (a fatal error, see its log); stopping the cluster" in cluster.log_text()
        )
