"""adapter_config.json parsing: scaling maths, patterns, refused fields; the --lora-paths flag forms."""

from __future__ import annotations

import json
import math

import pytest
from lora_helpers import write_adapter

from ipc.lora_config import LoraConfigError, read_adapter_config


def _cfg(tmp_path, **config_extra):
    folder = write_adapter(tmp_path / "a", r=8, alpha=16, targets=["q_proj", "v_proj"], config_extra=config_extra)
    return read_adapter_config(folder, "ad")


def test_scaling_plain_rslora_and_patterns(tmp_path):
    c = _cfg(tmp_path)
    assert c.scaling_for("model.layers.0.self_attn.q_proj") == 2.0 and c.max_rank() == 8
    c = _cfg(tmp_path, use_rslora=True)
    assert c.scaling_for("model.layers.0.self_attn.q_proj") == pytest.approx(16 / math.sqrt(8))
    c = _cfg(
        tmp_path,
        rank_pattern={"layers.3.self_attn.q_proj": 2, "q_proj": 4},
        alpha_pattern={"v_proj": 40},
    )
    assert c.rank_for("model.layers.3.self_attn.q_proj") == 2  # the first matching key wins (as in PEFT)
    assert c.rank_for("model.layers.13.self_attn.q_proj") == 4  # "layers.3" must not match "layers.13"
    assert c.rank_for("model.layers.1.self_attn.v_proj") == 8
    assert c.scaling_for("model.layers.1.self_attn.v_proj") == 5.0  # 40 / 8
    assert c.scaling_for("model.layers.3.self_attn.q_proj") == 8.0  # 16 / 2
    assert c.max_rank() == 8


def test_max_rank_counts_the_modules_it_adapts_when_the_model_is_known(tmp_path):
    """Without the model, the config's largest number; with it, the largest rank a targeted module has: an ``r``
    every targeted module overrides, or a pattern that matches no module, does not count."""
    c = _cfg(tmp_path, rank_pattern={"q_proj": 4, "v_proj": 6, "o_proj": 96})  # o_proj is not targeted
    assert c.max_rank() == 96
    assert c.max_rank(num_layers=30) == 6
    c = _cfg(tmp_path, rank_pattern={"layers.2.self_attn.q_proj": 12}, layers_to_transform=[0, 1])
    assert c.max_rank() == 12 and c.max_rank(num_layers=30) == 8  # layer 2 is not transformed


def test_regex_target_modules_and_ignored_fields(tmp_path):
    c = _cfg(
        tmp_path,
        target_modules=r".*\.layers\.[01]\.(self_attn\.k_proj|mlp\.up_proj)",
        lora_dropout=0.3,
        init_lora_weights="gaussian",
        some_future_bookkeeping_field={"x": 1},
    )
    assert sorted(c.target_modules) == ["k_proj", "up_proj"]


@pytest.mark.parametrize(
    "field,value,text",
    [
        ("use_dora", True, "field use_dora=True is not supported: DoRA"),
        ("bias", "all", "field bias='all' is not supported"),
        ("bias", "lora_only", "field bias='lora_only' is not supported"),
        ("modules_to_save", ["lm_head"], "field modules_to_save=['lm_head'] is not supported"),
        ("fan_in_fan_out", True, "field fan_in_fan_out=True is not supported"),
        ("peft_type", "IA3", "field peft_type='IA3' is not supported"),
        ("layer_replication", [[0, 4]], "field layer_replication=[[0, 4]] is not supported"),
        ("trainable_token_indices", [5], "field trainable_token_indices=[5] is not supported"),
        ("lora_bias", True, "field lora_bias=True is not supported"),
        ("target_modules", ["q_proj", "lm_head"], "field target_modules=['lm_head'] is not supported"),
        ("r", 0, "field r=0 must be a positive integer"),
        ("lora_alpha", -1, "field lora_alpha=-1 must be a positive number"),
        ("lora_alpha", "16", "field lora_alpha='16' must be a positive number"),
        ("lora_alpha", True, "field lora_alpha=True must be a positive number"),
        ("rank_pattern", {"q_proj": 0}, "field rank_pattern must map patterns to integers > 0"),
        ("rank_pattern", {"q_proj": 8.5}, "field rank_pattern must map patterns to integers > 0"),
        ("alpha_pattern", {"q_proj": True}, "field alpha_pattern must map patterns to numbers > 0"),
        ("r", True, "field r=True must be a positive integer"),
        ("use_rslora", "false", "field use_rslora='false' must be true or false"),
        ("use_rslora", 1, "field use_rslora=1 must be true or false"),
        ("init_lora_weights", "pissa", "field init_lora_weights='pissa' is not supported: peft applies"),
        ("init_lora_weights", "pissa_niter_4", "path_initial_model_for_weight_conversion"),
        ("init_lora_weights", "OLoRA", "field init_lora_weights='OLoRA' is not supported"),
        ("init_lora_weights", "loftq", "field init_lora_weights='loftq' is not supported"),
        ("init_lora_weights", "corda", "field init_lora_weights='corda' is not supported"),
    ],
)
def test_fields_that_change_the_maths_are_refused(tmp_path, field, value, text):
    with pytest.raises(LoraConfigError) as e:
        _cfg(tmp_path, **{field: value})
    assert str(e.value).startswith("LoRA adapter ad: adapter_config.json field") and text in str(e.value)


def test_lora_paths_flag_forms():
    from launch import build_parser

    ns = build_parser().parse_args(
        [
            "--enable-lora",
            "--lora-paths",
            "a=/x/y",
            "/p/q/named-by-folder",
            json.dumps({"lora_name": "pin", "lora_path": "/z", "pinned": True}),
        ]
    )
    got = [(s.name, s.path, s.pinned) for s in ns.lora_paths]
    assert got == [("a", "/x/y", False), ("named-by-folder", "/p/q/named-by-folder", False), ("pin", "/z", True)]


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--enable-lora", "--max-loras-per-batch", "0"], "--max-loras-per-batch 0: LoRA needs at least one slot"),
        (["--max-total-tokens", "1"], "--max-total-tokens 1: the KV cache must hold at least 16 tokens"),
        (["--context-length", "-5"], "--context-length -5: must be 0 (the default) or positive"),
        (["--batch-wait-ms", "-1"], "--batch-wait-ms -1: must be 0 (no wait) to 1000 ms"),
        (["--batch-wait-ms", "nan"], "--batch-wait-ms nan: must be 0 (no wait) to 1000 ms"),
    ],
)
def test_sizing_flags_no_server_could_use_exit_2_naming_the_flag(flags, text, caplog):
    """They used to start a server that refuses every request (--max-total-tokens 1) or a worker that crashed
    with an internal error (--max-loras-per-batch 0)."""
    from launch import main

    assert main(flags) == 2
    assert text in caplog.text


def test_a_name_given_twice_in_lora_paths_stops_launch_naming_it(tmp_path):
    from launch import FlagError, build_parser, to_server_args

    a = write_adapter(tmp_path / "a", r=4, targets=["q_proj"])
    ns = build_parser().parse_args(["--enable-lora", "--lora-paths", f"x={a}", f"x={a}"])
    with pytest.raises(FlagError, match="--lora-paths: the name 'x' is given twice"):
        to_server_args(ns)


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
        (["o_proj,down_proj"], ["o_proj", "down_proj"]),
        (["v_proj,", "q_proj", "v_proj"], ["v_proj", "q_proj"]),
        (["all-linear"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ],
)
def test_lora_target_modules_by_spaces_or_commas(argv, want):
    """A comma list used to be taken as one unknown name and dropped, leaving no module any adapter could target."""
    from launch import build_parser

    assert build_parser().parse_args(["--lora-target-modules", *argv]).lora_target_modules == want


@pytest.mark.parametrize(
    ("argv", "text"), [(["q_proj", "o_prj"], "unknown module 'o_prj'"), ([","], "no module given")]
)
def test_an_unknown_lora_target_module_is_a_flag_error(argv, text, capsys):
    from launch import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--lora-target-modules", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--lora-target-modules: {text}; choose from q_proj" in err


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ('{"lora_name": "a"', "is not valid JSON"),
        ('{"lora_name": "a"}', "missing required field `lora_path`"),
        ('{"lora_name": "a", "lora_path": "/x", "path": "/x"}', "unknown field `path`"),
        ('{"lora_name": "a", "lora_path": "/x", "pinned": "false"}', "Expected `bool`, got `str` - at `$.pinned`"),
        ("[1]", "Expected `object`, got `array`"),
        ("c=", "the adapter's path is empty"),
    ],
)
def test_bad_json_in_lora_paths_is_a_flag_error_naming_the_value(value, text, capsys):
    """It used to end in a traceback or argparse's 'invalid parse_lora_path value' (an internal name); "pinned":
    "false" counted as pinned, unknown keys were ignored, "[1]" was taken for a path and "c=" for the cwd."""
    from launch import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--enable-lora", "--lora-paths", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --lora-paths" in err and text in err and "parse_lora_path" not in err


def test_lora_paths_without_enable_lora_exits_2(tmp_path, caplog):
    from launch import main

    a = write_adapter(tmp_path / "a", r=4, targets=["q_proj"])
    assert main(["--lora-paths", f"x={a}"]) == 2
    assert "--lora-paths needs --enable-lora" in caplog.text


def test_launch_infers_rank_and_targets_from_initial_adapters(tmp_path):
    from launch import build_parser, infer_lora_defaults

    a = write_adapter(tmp_path / "a", r=4, targets=["q_proj"], rank_pattern={"q_proj": 12})
    b = write_adapter(tmp_path / "b", r=8, targets=["down_proj", "v_proj"])
    ns = build_parser().parse_args(["--enable-lora", "--lora-paths", f"a={a}", f"b={b}"])
    assert infer_lora_defaults(ns) == (12, ["q_proj", "v_proj", "down_proj"])
    ns = build_parser().parse_args(["--enable-lora", "--max-lora-rank", "32", "--lora-paths", f"a={a}"])
    assert infer_lora_defaults(ns) == (32, ["q_proj"])


def test_a_folder_or_fifo_in_place_of_a_file_is_named_as_such(tmp_path):
    import os

    folder = write_adapter(tmp_path / "a", r=8, alpha=16, targets=["q_proj"])
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.safetensors").mkdir()
    with pytest.raises(LoraConfigError, match="adapter_model.safetensors is not a regular file"):
        read_adapter_config(folder, "ad")
    (folder / "adapter_model.safetensors").rmdir()
    (folder / "adapter_config.json").rename(folder / "cfg.json")
    os.mkfifo(folder / "adapter_config.json")
    with pytest.raises(LoraConfigError, match="adapter_config.json is not a regular file"):
        read_adapter_config(folder, "ad")


def test_a_broken_config_is_named_before_missing_weights(tmp_path):
    """A folder whose config is broken and whose weights are missing names the config first (the file to fix)."""
    folder = write_adapter(tmp_path / "a", r=8, targets=["q_proj"])
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraConfigError, match="adapter_config.json is not valid JSON"):
        read_adapter_config(folder, "a")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}))
    with pytest.raises(LoraConfigError, match="adapter_model.safetensors is missing"):
        read_adapter_config(folder, "a")
