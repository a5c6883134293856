"""Config fields that choose modules/layers are enforced against the tensors, and host copies own their
memory (an adapter file rewritten after load changes nothing that is served)."""

from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import tiny_pool, write_adapter

from gpu_worker.lora_weights import LoraWeightsError
from ipc.lora_config import LoraConfigError


def _edit_config(folder, **fields):
    p = folder / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(fields)
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"layers_to_transform": [0]}, "layers.1"),
        ({"target_modules": ["q_proj"]}, "does not target"),
        ({"target_modules": ".*q_proj"}, "does not target"),
        ({"exclude_modules": ["down_proj"]}, "down_proj"),
    ],
)
def test_tensors_outside_the_configured_targets_are_refused(tmp_path, fields, needle):
    folder = write_adapter(tmp_path / "a", r=4)  # tensors for every module of every layer
    _edit_config(folder, **fields)
    pool = tiny_pool()
    with pytest.raises(LoraWeightsError) as e:
        pool.load("u", "edited", str(folder))
    msg = str(e.value)
    assert "edited" in msg and needle in msg and "adapter_config.json does not target" in msg
    assert pool.host == {} and len(pool.cache) == 0


@pytest.mark.parametrize("tm", [[], ".*nothing.*", 7])
def test_target_modules_matching_nothing_is_refused(tmp_path, tm):
    folder = write_adapter(tmp_path / "a", r=4)
    _edit_config(folder, target_modules=tm)
    with pytest.raises(LoraConfigError, match="target_modules"):
        tiny_pool().load("u", "bad", str(folder))


def test_consistent_layers_to_transform_loads(tmp_path):
    folder = write_adapter(tmp_path / "a", r=4)
    _edit_config(folder, layers_to_transform=[0, 1])  # TINY has 2 layers: every tensor is targeted
    pool = tiny_pool()
    pool.load("u", "ok", str(folder))
    assert "u" in pool.host


def test_rewriting_the_file_after_load_changes_nothing(tmp_path):
    folder = write_adapter(tmp_path / "a", r=4, seed=3)
    pool = tiny_pool(slots=1)
    pool.load("u", "a", str(folder))
    pool.assign(["u"])
    before = {m: pool.a_matrix(0, m, pool.table()["u"])[0].clone() for m in pool.targets}
    other = write_adapter(tmp_path / "b", r=4, seed=99)
    # rewrite in place (same inode), as save_pretrained/shutil.copy would, then truncate to garbage
    (folder / "adapter_model.safetensors").write_bytes((other / "adapter_model.safetensors").read_bytes())
    (folder / "adapter_model.safetensors").write_bytes(b"garbage")
    pool.load("v", "b", str(other))
    pool.assign(["v"])  # evicts u
    pool.assign(["u"])  # refills u's slot from the host copy, not from the (now garbage) file
    for m in pool.targets:
        assert torch.equal(pool.a_matrix(0, m, pool.table()["u"])[0], before[m])


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), 3e38], ids=["nan", "inf", "finite-overflow"])
def test_non_finite_or_overflowing_weights_are_refused_naming_the_pair(tmp_path, fill):
    """NaN, Inf, and finite values whose fp32 sum overflows (they would make the step's activations non-finite)
    are refused at load, naming the tensor pair; the message says which of these it can be."""
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    clean = write_adapter(tmp_path / "clean", r=4)
    from safetensors.torch import load_file

    b = load_file(str(clean / "adapter_model.safetensors"))[name]
    folder = write_adapter(tmp_path / "a", r=4, tensor_overrides={name: torch.full_like(b, fill)})
    pool = tiny_pool()
    why = "holds NaN or Inf, or values so large that their fp32 sum overflows"
    with pytest.raises(LoraWeightsError, match=why) as e:
        pool.load("u", "bad", str(folder))
    assert name in str(e.value) and "bad" in str(e.value)
    assert pool.host == {}


@pytest.mark.parametrize(
    ("fields", "module"),
    [({"lora_alpha": 1e300}, ""), ({"alpha_pattern": {"q_proj": 1e300}}, "q_proj")],
    ids=["alpha", "pattern"],
)
def test_a_scaling_that_overflows_the_slot_dtype_is_refused_at_load(tmp_path, fields, module):
    """The scaling (lora_alpha / r) is folded into B at load: a huge one would make every request for the adapter
    fail with non-finite logits, so the load is refused, naming the module and the limit."""
    folder = write_adapter(tmp_path / "a", r=4)
    _edit_config(folder, **fields)
    pool = tiny_pool()
    with pytest.raises(LoraWeightsError, match="times its scaling .* exceeds the largest float32 value") as e:
        pool.load("u", "big", str(folder))
    assert f"LoRA adapter big: lora_B of {module}" in str(e.value) and "lower lora_alpha" in str(e.value)
    assert pool.host == {}
    _edit_config(folder, lora_alpha=8, alpha_pattern={})  # a sane scaling of the same weights loads
    pool.load("u", "big", str(folder))


def test_an_a_whose_rank_disagrees_with_the_config_and_its_b_is_named(tmp_path):
    """lora_A [11, in] with r=8 and a correct lora_B [out, 8]: the error blames A's rank, not B's shape."""
    name = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    clean = write_adapter(tmp_path / "clean", r=8)
    from safetensors.torch import load_file

    a = load_file(str(clean / "adapter_model.safetensors"))[name]
    folder = write_adapter(tmp_path / "a", r=8, tensor_overrides={name: torch.zeros(11, a.shape[1])})
    with pytest.raises(LoraWeightsError) as e:
        tiny_pool().load("u", "bad", str(folder))
    assert f"tensor {name} has rank 11 but adapter_config.json (r / rank_pattern) says 8" in str(e.value)
