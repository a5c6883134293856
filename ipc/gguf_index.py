"""A GGUF file's tensor directory, parsed once by the ``gguf`` library and kept as a small JSON file.

``gguf.GGUFReader`` parses every metadata field, and the embedded model's tokenizer (49,152 tokens and their
merges as GGUF string arrays) takes it 3.5 s on this CPU: every worker start, every worker restart in a
failover and every ``launch.py`` paid that for the 272 tensor records it actually needs. The directory (name,
type, shape, byte range) is cached under ``$LOOM_CACHE_DIR/gguf-index/``, keyed by the file's resolved path and
checked against its size and modification time, so a replaced file is parsed again. Torch-free (``launch.py``
uses it before any process starts).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from ipc.model_source import cache_root

_FORMAT = 2
_NUMPY = {"F32": np.float32, "F16": np.float16}  # other types (blocks, BF16) are raw bytes, as GGUFReader gives


@dataclass
class GGUFTensor:
    """One tensor record: ``shape`` in GGUF order (innermost first, like ``gguf.ReaderTensor.shape``),
    ``data_offset`` the absolute byte offset in the file, ``n_bytes`` its size in bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    _file: np.memmap = field(repr=False)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, mapped from the file (read-only): float32/float16 for F32/F16, else uint8."""
        raw = self._file[self.data_offset : self.data_offset + self.n_bytes]
        return raw.view(_NUMPY.get(self.tensor_type.name, np.uint8))


def _digest(records: list[dict]) -> str:
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()


def _index_path(path: Path) -> Path:
    return cache_root() / "gguf-index" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.json"


def _parse(path: Path) -> list[dict]:
    return [
        {
            "name": t.name,
            "type": t.tensor_type.name,
            "shape": [int(n) for n in t.shape],
            "offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        for t in GGUFReader(str(path)).tensors
    ]


def gguf_tensors(path: str | Path) -> list[GGUFTensor]:
    """The tensors of the GGUF at ``path``, from the cached directory when it matches the file.

    Raises what ``gguf.GGUFReader`` raises for a file that is not a valid GGUF (ValueError), and OSError when the
    file cannot be read. A directory file that is missing, stale (size, mtime), edited (its records no longer
    match their digest) or damaged in any way is ignored and rewritten; a cache folder that cannot be written
    only costs the parse next time.
    """
    path = Path(path).resolve()
    st = path.stat()
    stamp = {"format": _FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    index = _index_path(path)
    mm = np.memmap(path, mode="r")
    try:
        cached = json.loads(index.read_text())
        if not isinstance(cached, dict) or {k: cached.get(k) for k in stamp} != stamp:
            raise ValueError("stale")
        if cached.get("digest") != _digest(cached["tensors"]):  # edited or cut: the records are not the parse's
            raise ValueError("damaged")
        return _tensors(cached["tensors"], mm)
    except Exception:  # noqa: BLE001 - missing, stale or damaged in any way: parse the file again
        pass
    records = _parse(path)
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**stamp, "digest": _digest(records), "tensors": records}))
        os.replace(tmp, index)
    except OSError:
        pass
    return _tensors(records, mm)


def _tensors(records: list[dict], mm: np.memmap) -> list[GGUFTensor]:
    """Records -> tensors; raises on any malformed record or a byte range outside the file."""
    out = []
    for r in records:
        t = GGUFTensor(
            str(r["name"]), GGMLQuantizationType[r["type"]], tuple(int(n) for n in r["shape"]), int(r["offset"]),
            int(r["n_bytes"]), mm,
        )  # fmt: skip
        if t.data_offset < 0 or t.n_bytes < 0 or t.data_offset + t.n_bytes > mm.shape[0]:
            raise ValueError(f"tensor {t.name}: bytes {t.data_offset}+{t.n_bytes} outside the file")
        out.append(t)
    if not out:
        raise ValueError("no tensors")
    return out
