"""A GGUF file's tensor directory, parsed once by the ``gguf`` library and kept as a small JSON file.

``gguf.GGUFReader`` parses every metadata field, and the embedded model's tokenizer (49,152 tokens and their
merges as GGUF string arrays) takes it 7-8 s on this CPU: every worker start, every worker restart in a
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

_FORMAT = 1
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
    file cannot be read. A cache folder that cannot be written only costs the parse next time.
    """
    path = Path(path).resolve()
    st = path.stat()
    stamp = {"format": _FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    index = _index_path(path)
    records = None
    try:
        cached = json.loads(index.read_text())
        if {k: cached.get(k) for k in stamp} == stamp:
            records = cached["tensors"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if records is None:
        records = _parse(path)
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            tmp = index.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**stamp, "tensors": records}))
            os.replace(tmp, index)
        except OSError:
            pass
    mm = np.memmap(path, mode="r")
    return [
        GGUFTensor(r["name"], GGMLQuantizationType[r["type"]], tuple(r["shape"]), r["offset"], r["n_bytes"], mm)
        for r in records
    ]
