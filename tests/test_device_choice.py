"""``pick_device``: one CUDA device per TP rank, a clear refusal otherwise; ``resolve_dtype``'s ``auto`` per device
(CUDA faked: CI has no GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.worker import pick_device, resolve_dtype


def _fake_cuda(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_each_rank_gets_its_own_device(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    assert [pick_device("auto", r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert pick_device("cpu", 1) == torch.device("cpu")


def test_more_ranks_than_devices_is_refused_naming_both_counts(monkeypatch):
    _fake_cuda(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError) as e:
        pick_device("cuda", 1)
    assert str(e.value) == (
        "TP rank 1 needs its own CUDA device, but PyTorch sees 1 (CUDA_VISIBLE_DEVICES=3): use --tp-size 1 or less"
    )


def test_cuda_asked_for_without_a_device(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    assert pick_device("auto", 0) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="--device cuda: no CUDA device: PyTorch sees 0 .*use --device cpu"):
        pick_device("cuda", 0)


@pytest.mark.parametrize(
    ("saved", "device", "bf16", "want"),
    [
        ("float32", "cpu", True, torch.float32),
        ("float16", "cpu", True, torch.float32),
        ("bfloat16", "cpu", True, torch.bfloat16),
        ("float32", "cuda", True, torch.bfloat16),
        ("float32", "cuda", False, torch.float16),
        ("float16", "cuda", True, torch.float16),
        ("bfloat16", "cuda", True, torch.bfloat16),
    ],
)
def test_auto_dtype_per_device(tmp_path, monkeypatch, saved, device, bf16, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    (tmp_path / "config.json").write_text(json.dumps({"dtype": saved}))
    assert resolve_dtype("auto", str(tmp_path), torch.device(device)) == want
    assert resolve_dtype("float32", str(tmp_path), torch.device(device)) == torch.float32
    assert resolve_dtype("auto", str(tmp_path), torch.device(device), "gguf") == torch.bfloat16
