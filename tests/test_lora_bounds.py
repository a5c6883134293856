"""bench/lora_bounds.py counts weights as transformers and peft do, and its ceilings follow from those counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from lora_bounds import adapter_params, base_linear_params, batch_bounds  # noqa: E402
from lora_helpers import real_adapters, real_model_path  # noqa: E402

from ipc.model_config import load_model_config  # noqa: E402


def test_base_weights_match_transformers_linear_count() -> None:
    """The 7 linears of every layer plus the (tied) LM head, as counted from transformers' own modules."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mp = real_model_path()
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(mp))
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert base_linear_params(load_model_config(mp)) == linears


@pytest.mark.parametrize("name", ["r8-all", "r32-qv", "r64-all"])
def test_adapter_weights_match_peft(name: str) -> None:
    """peft's own count of the adapter's LoRA parameters on the base model equals the file header's count."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = real_adapters()[name]
    base = AutoModelForCausalLM.from_pretrained(real_model_path(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert adapter_params(folder) == lora


def test_ceilings_from_counts() -> None:
    """Rows pay per row (FLOPs); adapters are read once per step however many rows use them (bytes)."""
    cfg = load_model_config(real_model_path())
    base = base_linear_params(cfg)
    counts = {"a": base // 10, "b": base // 5}
    rows = ["a", "a", "a", None, "b", None]
    got = batch_bounds(cfg, counts, rows)
    assert got["lora_weights"] == counts["a"] + counts["b"]
    assert got["flop"] == pytest.approx(6 * base / (6 * base + 3 * counts["a"] + counts["b"]))
    assert got["byte"] == pytest.approx(base / (base + counts["a"] + counts["b"]))
    assert batch_bounds(cfg, counts, [None, None]) == {"flop": 1.0, "byte": 1.0, "lora_weights": 0.0,
                                                       "base_weights": float(base)}  # fmt: skip
    with pytest.raises(KeyError):
        batch_bounds(cfg, counts, ["c"])


def test_adapter_params_refuses_a_broken_header(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops")
    with pytest.raises(ValueError, match="header is not JSON"):
        adapter_params(tmp_path)
    with pytest.raises(FileNotFoundError):
        adapter_params(tmp_path / "missing")
