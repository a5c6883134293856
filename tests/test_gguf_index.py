"""The cached GGUF tensor directory (ipc/gguf_index.py) against gguf's own reader, and when it is re-parsed."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

import ipc.gguf_index as gi
from ipc.model_source import embedded_gguf_path


@pytest.fixture()
def gguf_copy(tmp_path, monkeypatch):
    """A private copy of the embedded GGUF and an empty cache folder."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    dst = tmp_path / "model.gguf"
    shutil.copyfile(embedded_gguf_path(), dst)
    return dst


_PARSED: dict[str, list] = {}  # the embedded file's records, parsed once (a parse takes ~3 s here)


def _count_parses(monkeypatch) -> list[int]:
    """Count parses; every parse after the first returns the first one's records (the file never changes here)."""
    calls = [0]
    real = gi._parse

    def counting(path):
        calls[0] += 1
        if "records" not in _PARSED:
            _PARSED["records"] = real(path)
        return [dict(r) for r in _PARSED["records"]]

    monkeypatch.setattr(gi, "_parse", counting)
    return calls


def test_records_and_bytes_match_gguf_reader(gguf_copy, monkeypatch):
    calls = _count_parses(monkeypatch)
    first = gi.gguf_tensors(gguf_copy)
    cached = gi.gguf_tensors(gguf_copy)
    assert calls[0] == 1  # the second call read the JSON directory, not the file's metadata
    ref = GGUFReader(str(gguf_copy)).tensors
    assert len(ref) == len(first) == len(cached) > 0
    for r, a, b in zip(ref, first, cached, strict=True):
        for t in (a, b):
            assert (t.name, t.tensor_type, t.shape) == (r.name, r.tensor_type, tuple(int(n) for n in r.shape))
            assert (t.data_offset, t.n_bytes) == (int(r.data_offset), int(r.n_bytes))
            ref_data = np.asarray(r.data)
            assert t.data.dtype == ref_data.dtype, r.name
            assert np.array_equal(t.data.reshape(-1), ref_data.reshape(-1)), r.name


def test_a_changed_file_is_parsed_again(gguf_copy, monkeypatch):
    calls = _count_parses(monkeypatch)
    gi.gguf_tensors(gguf_copy)
    st = gguf_copy.stat()
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    gi.gguf_tensors(gguf_copy)
    assert calls[0] == 2
    # a damaged directory file (not JSON, not an object, records edited or cut, a bad type) is ignored, rewritten
    index = gi._index_path(gguf_copy.resolve())
    good = json.loads(index.read_text())
    damaged = [
        "{not json",
        "null",
        "[]",
        json.dumps({**good, "tensors": good["tensors"][:10]}),
        json.dumps({**good, "tensors": [{**good["tensors"][0], "type": "Q9_9"}] + good["tensors"][1:]}),
        json.dumps({k: v for k, v in good.items() if k != "digest"}),
    ]
    for n, text in enumerate(damaged):
        index.write_text(text)
        assert len(gi.gguf_tensors(gguf_copy)) == len(good["tensors"])
        assert calls[0] == 3 + n
        assert json.loads(index.read_text()) == good


def test_an_unwritable_cache_folder_only_costs_the_parse(gguf_copy, tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("x")
    monkeypatch.setenv("LOOM_CACHE_DIR", str(blocker))  # mkdir under a regular file fails
    calls = _count_parses(monkeypatch)
    a = gi.gguf_tensors(gguf_copy)
    b = gi.gguf_tensors(gguf_copy)
    assert calls[0] == 2 and [t.name for t in a] == [t.name for t in b]


def test_not_a_gguf_raises_value_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError):
        gi.gguf_tensors(bad)
