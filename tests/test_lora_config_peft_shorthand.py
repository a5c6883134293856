"""PEFT's ``target_modules="all-linear"`` is served with PEFT's meaning (issue 9.8), adapters on the vocabulary
layers are refused saying why (tied embeddings), and non-float adapter tensors are refused naming their dtype.

What peft 0.21 writes: ``LoraConfig(target_modules="all-linear").save_pretrained`` keeps the string
``"all-linear"``; ``get_peft_model(...).save_pretrained`` writes the expanded names instead (full module paths
when fewer than 20 modules match, else PEFT's minimal suffixes such as ``"q_proj"``). All three forms must load
and match transformers + peft.
"""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
import torch
from lora_helpers import ALL, EOS, TINY, make_tiny_checkpoint, server_args, tiny_pool, write_adapter

from gpu_worker.lora_weights import LoraWeightsError
from ipc.lora_config import LoraConfigError, read_adapter_config
from ipc.messages import BatchReq, ForwardBatch, WorkerSampling


def _edit_config(folder, **fields):
    p = folder / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(fields)
    p.write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------- parsing the shorthand


@pytest.mark.parametrize("spelling", ["all-linear", "ALL-LINEAR", "All-Linear"])
def test_all_linear_targets_every_llama_linear(tmp_path, spelling):
    folder = write_adapter(tmp_path / "a", r=4, config_extra={"target_modules": spelling})
    c = read_adapter_config(folder, "al")
    assert c.target_modules == ALL
    for layer in (0, 1, 29):
        for m in ALL:
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            assert c.targets(f"model.layers.{layer}.{block}.{m}")
    assert not c.targets("lm_head") and not c.targets("model.embed_tokens")
    tiny_pool().load("u", "al", str(folder))  # every tensor write_adapter made is targeted


def test_all_linear_honours_exclude_modules_and_layers_to_transform(tmp_path):
    folder = write_adapter(tmp_path / "a", r=4, targets=["q_proj", "v_proj"])
    _edit_config(folder, target_modules="all-linear", exclude_modules=["k_proj"], layers_to_transform=[1])
    c = read_adapter_config(folder, "al")
    assert c.targets("model.layers.1.self_attn.q_proj")
    assert not c.targets("model.layers.1.self_attn.k_proj")  # excluded
    assert not c.targets("model.layers.0.self_attn.q_proj")  # not a transformed layer
    with pytest.raises(LoraWeightsError, match="layers.0.*does not target"):
        tiny_pool().load("u", "al", str(folder))  # its layer-0 tensors are outside what the config targets


def test_all_linear_inside_a_list_is_a_module_name_as_in_peft(tmp_path):
    folder = write_adapter(tmp_path / "a", r=4, config_extra={"target_modules": ["all-linear"]})
    with pytest.raises(LoraConfigError, match=r"target_modules=\['all-linear'\] is not supported"):
        read_adapter_config(folder, "al")


@pytest.mark.parametrize("field", ["target_modules", "exclude_modules"])
def test_an_invalid_regex_is_refused_by_field(tmp_path, field):
    folder = write_adapter(tmp_path / "a", r=4, config_extra={field: "(q_proj"})
    with pytest.raises(LoraConfigError, match=f"field {field} holds '\\(q_proj', not a valid regex"):
        read_adapter_config(folder, "bad")


def test_an_invalid_rank_pattern_regex_is_refused(tmp_path):
    folder = write_adapter(tmp_path / "a", r=4, config_extra={"rank_pattern": {"q_proj[": 2}})
    with pytest.raises(LoraConfigError, match="field rank_pattern holds .* not a valid regex"):
        read_adapter_config(folder, "bad")


# ----------------------------------------------------------------------------- vocabulary layers


@pytest.mark.parametrize(
    "tm", [["q_proj", "lm_head"], ["model.embed_tokens", "v_proj"], r".*(q_proj|lm_head)", r"model\.embed_tokens"]
)
@pytest.mark.parametrize("tied", [True, False, None])
def test_vocabulary_targets_are_refused_saying_why(tmp_path, tm, tied):
    folder = write_adapter(tmp_path / "a", r=4, targets=["q_proj"], config_extra={"target_modules": tm})
    with pytest.raises(LoraConfigError) as e:
        read_adapter_config(folder, "voc", tie_word_embeddings=tied)
    msg = str(e.value)
    assert msg.startswith("LoRA adapter voc: adapter_config.json field target_modules=") and "not supported" in msg
    assert "lm_head" in msg and "embed_tokens" in msg and "q_proj" in msg  # what is refused and what is allowed
    if tied:
        assert "the model ties its embeddings (tie_word_embeddings=true)" in msg
    elif tied is False:
        assert "tie" not in msg and "no LoRA slots for the vocabulary layers" in msg
    else:
        assert "tied embeddings" in msg


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(
    "key",
    [
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.lm_head.base_layer.weight",
        "base_model.model.model.embed_tokens.lora_embedding_A",
    ],
)
def test_vocabulary_tensors_are_refused_saying_why(tmp_path, tied, key):
    cfg = msgspec.structs.replace(TINY, tie_word_embeddings=tied)
    folder = write_adapter(tmp_path / "a", cfg, r=4, targets=["q_proj"], tensor_overrides={key: torch.zeros(4, 64)})
    pool = tiny_pool(cfg=cfg)
    with pytest.raises(LoraWeightsError) as e:
        pool.load("u", "voc", str(folder))
    msg = str(e.value)
    assert f"tensor {key} in adapter_model.safetensors adapts" in msg
    assert ("tie_word_embeddings=true" in msg) == tied
    assert pool.host == {}


# ----------------------------------------------------------------------------- tensor dtypes


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("ab", ["A", "B"])
def test_non_float_tensors_are_refused_naming_the_dtype(tmp_path, dtype, ab):
    key = f"base_model.model.model.layers.1.mlp.up_proj.lora_{ab}.weight"
    shape = (4, 64) if ab == "A" else (128, 4)
    bad = (torch.randn(shape) * 50).to(dtype)
    folder = write_adapter(tmp_path / "a", r=4, tensor_overrides={key: bad})
    pool = tiny_pool()
    with pytest.raises(LoraWeightsError) as e:
        pool.load("u", "ints", str(folder))
    name = str(dtype).removeprefix("torch.")
    assert f"LoRA adapter ints: tensor {key} in adapter_model.safetensors has dtype {name}" in str(e.value)
    assert "must be floating point" in str(e.value)
    assert pool.host == {} and len(pool.cache) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_tensors_of_any_width_load(tmp_path, dtype):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    folder = write_adapter(tmp_path / "a", r=4, tensor_overrides={key: torch.randn(4, 64).to(dtype)})
    pool = tiny_pool()
    pool.load("u", "floats", str(folder))
    assert "u" in pool.host


# ----------------------------------------------------------------------------- parity with peft on a tiny Llama


def _tied_checkpoint(folder):
    """A 3-layer tiny Llama with tied embeddings: 21 linears, so peft shortens the expanded list to suffixes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.mark.parametrize("tied", [False, True], ids=["untied-2-layers", "tied-3-layers"])
def test_peft_all_linear_adapter_matches_peft(tmp_path, tied):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from gpu_worker.worker import Worker

    model_dir = _tied_checkpoint(tmp_path / "model") if tied else make_tiny_checkpoint(tmp_path / "model")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    spec = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    torch.manual_seed(7)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **spec))
    expanded, shorthand = tmp_path / "expanded", tmp_path / "shorthand"
    peft_model.save_pretrained(str(expanded))  # peft writes the expanded module names
    base = peft_model.unload()
    shorthand.mkdir()
    shutil.copy(expanded / "adapter_model.safetensors", shorthand)
    LoraConfig(**spec).save_pretrained(str(shorthand))  # peft writes the shorthand itself
    written = json.loads((expanded / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(written, list) and ("q_proj" in written if tied else "model.layers.1.mlp.up_proj" in written)
    assert json.loads((shorthand / "adapter_config.json").read_text())["target_modules"] == "all-linear"

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 3)]
    want = {}
    with torch.no_grad():
        for k, ids in enumerate(prompts):
            want[(None, k)] = base(torch.tensor([ids])).logits[0, -1].float()
    model = PeftModel.from_pretrained(base, str(shorthand)).eval()  # peft expands "all-linear" at load
    with torch.no_grad():
        for k, ids in enumerate(prompts):
            want[("expanded", k)] = want[("shorthand", k)] = model(torch.tensor([ids])).logits[0, -1].float()
    assert float((want[("shorthand", 0)] - want[(None, 0)]).abs().max()) > 1e-3  # the adapter changes the output

    args = server_args(
        model_dir, dtype="float32", enable_lora=True, max_loras_per_batch=3, max_lora_rank=4, max_total_tokens=256
    )
    worker = Worker(args)
    for t, folder in (("expanded", expanded), ("shorthand", shorthand)):
        worker.lora.load(f"uid-{t}", t, str(folder))
        assert sorted(worker.lora.host[f"uid-{t}"].ranks) == sorted(
            (i, m) for i in range(3 if tied else 2) for m in ALL
        )
    plan, rows, nxt = [], [], 0
    sp = WorkerSampling(0.0, 1.0, -1, None)
    for k, ids in enumerate(prompts):
        for t in (None, "expanded", "shorthand"):
            plan.append(BatchReq(f"{t}-{k}", len(plan), ids, 0, list(range(nxt, nxt + len(ids))), t and f"uid-{t}", sp))
            nxt += len(ids)
            rows.append((t, k))
    got = worker.forward_logits(ForwardBatch(1, plan))
    for i, key in enumerate(rows):
        err = float((got[i] - want[key]).abs().max())
        assert err < 1e-4, f"{key}: max |logit diff| {err:.2e}"


def test_peft_written_lm_head_adapter_is_refused_on_a_tied_model(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = _tied_checkpoint(tmp_path / "model")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM", init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(tmp_path / "lmh"))
    with pytest.raises(LoraConfigError, match=r"target_modules=\['lm_head'\].*tie_word_embeddings=true"):
        read_adapter_config(tmp_path / "lmh", "lmh", tie_word_embeddings=True)
