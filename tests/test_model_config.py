"""config.json validation: the real SmolLM2 config parses; unsupported architectures are refused by field."""

from __future__ import annotations

import json

import pytest

from ipc.model_config import UnsupportedModelError, load_model_config


@pytest.fixture
def base_config(model_path) -> dict:
    return json.loads((model_path / "config.json").read_text())


def write_config(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_smollm2_config_facts(model_path):
    cfg = load_model_config(model_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (576, 30, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size) == (1536, 49152)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == [2]
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"model_type": "qwen2"}, "model_type='qwen2'"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}}, "llama3"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, base_config, change, field):
    cfg = {**base_config, **change}
    with pytest.raises(UnsupportedModelError) as e:
        load_model_config(write_config(tmp_path, cfg))
    assert field in str(e.value)


def test_missing_model_type_is_refused(tmp_path, base_config):
    cfg = dict(base_config)
    del cfg["model_type"]
    with pytest.raises(UnsupportedModelError, match="model_type"):
        load_model_config(write_config(tmp_path, cfg))


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": None},
        {"sliding_window": 0},
        {"sliding_window": 4096, "use_sliding_window": False},
        {"model_type": "mistral", "sliding_window": None},
    ],
)
def test_harmless_variants_are_accepted(tmp_path, base_config, change):
    load_model_config(write_config(tmp_path, {**base_config, **change}))


def test_llama3_rope_scaling_is_accepted(tmp_path, base_config):
    rope = {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = load_model_config(write_config(tmp_path, {**base_config, "rope_parameters": rope}))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0


def test_legacy_rope_scaling_key_is_read(tmp_path, base_config):
    cfg = dict(base_config)
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 12345.0
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="rope_type='dynamic'"):
        load_model_config(write_config(tmp_path, cfg))
    cfg["rope_scaling"] = None
    assert load_model_config(write_config(tmp_path, cfg)).rope_theta == 12345.0
