"""Parse and check a PEFT LoRA ``adapter_config.json``; shared by the registry and every worker rank.

Fields that change the maths are either implemented (``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ``target_modules`` as a list, a regex or PEFT's ``"all-linear"``) or refused with an error
naming the field (``use_dora``, ``bias`` other than "none", ``modules_to_save``, ``fan_in_fan_out``, targets on
the vocabulary layers, ...). Training-only fields (dropout, most ``init_lora_weights``) and bookkeeping fields are
ignored; an init that rewrites the base weights (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA) is refused, since such an
adapter is only right on that rewritten base. Scaling is ``lora_alpha / r`` (Hu et al., LoRA, 2021) or
``lora_alpha / sqrt(r)`` with rsLoRA (Kalajdzievski, arXiv 2312.03732).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Union

import msgspec

LLAMA_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's shorthand (matched case-insensitively, as PEFT does): every linear layer except the output head. On a
# Llama that is exactly the seven per-layer linears of every layer.
ALL_LINEAR = "all-linear"
VOCAB_MODULES = ("lm_head", "embed_tokens")  # the vocabulary layers, which Loom never adapts
CONFIG_FILE = "adapter_config.json"
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"  # the base model's id when --served-model-name is not given
MODEL_ADAPTER_SEPARATOR = ":"  # a request's model may be ``BASE:ADAPTER``
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ADAPTER_NAME = 128  # characters
# LoRA pools allocate rank rows in units of this many ranks (even: bf16 expand weights are packed in rank pairs)
LORA_RANK_UNIT = 4


class LoraConfigError(ValueError):
    """The adapter's config is missing, malformed or asks for something Loom does not support."""


class LoraAdapterConfig(msgspec.Struct, frozen=True):
    """What Loom uses of a PEFT LoRA config."""

    name: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str]  # short module names it may touch (q_proj ...)
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_spec: Union[str, list[str]] = []  # target_modules as written (regex or names; "all-linear" expanded)
    exclude_spec: Union[str, list[str], None] = None  # exclude_modules as written
    layers_to_transform: list[int] | None = None

    def targets(self, module_path: str) -> bool:
        """Whether PEFT would put a LoRA layer on ``module_path`` given target_modules, exclude_modules and
        layers_to_transform (a tensor for any other module is refused at load, never silently applied)."""
        if not _spec_matches(self.target_spec, module_path):
            return False
        if self.exclude_spec and _spec_matches(self.exclude_spec, module_path):
            return False
        if self.layers_to_transform is not None:
            m = re.search(r"\.layers\.(\d+)\.", module_path)
            return m is not None and int(m.group(1)) in self.layers_to_transform
        return True

    def _pattern(self, patterns: dict, module_path: str):
        for pat, val in patterns.items():
            if re.fullmatch(rf"(.*\.)?(?:{pat})", module_path):
                return val
        return None

    def rank_for(self, module_path: str) -> int:
        """Rank of the module at ``module_path`` (e.g. ``model.layers.3.self_attn.q_proj``)."""
        r = self._pattern(self.rank_pattern, module_path)
        return int(r) if r is not None else self.r

    def scaling_for(self, module_path: str) -> float:
        """``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA) for the module, honouring the patterns."""
        r = self.rank_for(module_path)
        a = self._pattern(self.alpha_pattern, module_path)
        alpha = float(a) if a is not None else self.lora_alpha
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def max_rank(self, num_layers: int = 0) -> int:
        """Largest rank of any module it adapts in a Llama model of ``num_layers`` layers (the ranks its weights
        must have); with ``num_layers`` 0 (model unknown), ``r`` or any ``rank_pattern`` value, whichever is
        largest, which can overstate it (an ``r`` every module overrides, a pattern that matches nothing)."""
        paths = [module_path(i, m) for i in range(num_layers) for m in LLAMA_LORA_MODULES]
        ranks = [self.rank_for(p) for p in paths if self.targets(p)]
        return max(ranks) if ranks else max([self.r, *[int(v) for v in self.rank_pattern.values()]])


def module_path(layer: int, module: str) -> str:
    """PEFT's path of a Llama linear (``model.layers.3.self_attn.q_proj``), which the patterns match."""
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{block}.{module}"


def lora_rows(rank: int) -> int:
    """Rank rows an adapter of (largest) rank ``rank`` takes in a LoRA pool: ``rank`` rounded up to
    :data:`LORA_RANK_UNIT`. Worker pools and the scheduler's admission both count with it, so a batch the
    scheduler admits always fits the pools."""
    return -(-max(rank, 1) // LORA_RANK_UNIT) * LORA_RANK_UNIT


def _spec_matches(spec: Union[str, list[str]], module_path: str) -> bool:
    # PEFT: a string is a regex full-matched against the module path; a list matches a name or a dotted suffix
    if isinstance(spec, str):
        return re.fullmatch(spec, module_path) is not None
    return any(module_path == t or module_path.endswith("." + t) for t in spec)


def vocab_refusal(tie_word_embeddings: bool | None) -> str:
    """Why an adapter on ``lm_head`` / ``embed_tokens`` is refused, for a model that does (``True``), does not
    (``False``) or may (``None``: the caller does not know the model) tie its input and output embeddings."""
    only = f"adapters may target only the per-layer linears {list(LLAMA_LORA_MODULES)}"
    if tie_word_embeddings:
        return (
            "the model ties its embeddings (tie_word_embeddings=true): embed_tokens and lm_head are one shared "
            "[vocab, hidden] tensor, and an adapter on either would make the input and output sides differ, "
            f"which Loom's single shared vocabulary tensor cannot serve; {only}"
        )
    if tie_word_embeddings is None:
        return (
            "Loom never adapts the vocabulary layers (on a model with tied embeddings, such as the default "
            "SmolLM2, embed_tokens and lm_head are one shared tensor, so an adapter on either would make the input "
            f"and output sides differ); {only}"
        )
    return f"Loom has no LoRA slots for the vocabulary layers (embed_tokens, lm_head); {only}"


def _compile(name: str, field: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise LoraConfigError(
            f"LoRA adapter {name}: {CONFIG_FILE} field {field} holds {pattern!r}, not a valid regex: {e}"
        ) from None


def _sample_paths(module: str) -> list[str]:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return [module] + [f"model.layers.{i}.{block}.{module}" for i in range(128)]


# init_lora_weights values whose peft initialisation rewrites the base layer's weight (peft/tuners/lora/layer.py:
# PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA): such an adapter is only right on that changed base
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


def _refuse(name: str, field: str, value: object, why: str) -> LoraConfigError:
    return LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field {field}={value!r} is not supported: {why}")


def read_adapter_file(folder: str | Path, fname: str, name: str, root: str | Path | None = None) -> bytes:
    """The bytes of ``folder/fname``, read through one file descriptor.

    With ``root`` (``--lora-root``), the file that descriptor opened, every link followed, must lie inside it:
    the front door checks the path before it sends a load, but a folder swapped for a link between that check
    and a worker's read must not make the worker serve weights from outside (a new-user trial did that). The
    check is on the open file itself (``/proc/self/fd``; elsewhere the resolved path must be the same inode),
    so nothing can change between the check and the read.

    Raises:
        LoraConfigError: naming the adapter and the file: missing, not a regular file, outside ``root``, or
            unreadable.
    """
    path = Path(folder) / fname
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in must not block the worker
    except OSError as e:
        raise LoraConfigError(f"LoRA adapter {name}: cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoraConfigError(f"LoRA adapter {name}: {path} is not a regular file")
        if root is not None:
            real = _opened_path(fd, path, st)
            top = Path(root).resolve()
            if real is None or not real.is_relative_to(top):
                where = f"resolves to {real}" if real is not None else "changed while it was opened"
                raise LoraConfigError(f"LoRA adapter {name}: {path} {where}, outside the allowed root {top}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError as e:
        raise LoraConfigError(f"LoRA adapter {name}: cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _opened_path(fd: int, path: Path, st: os.stat_result) -> Path | None:
    """The path of the file open as ``fd`` (links resolved), or None when it cannot be told for certain."""
    proc = Path(f"/proc/self/fd/{fd}")
    try:
        return Path(os.readlink(proc))
    except OSError:
        real = path.resolve()
        try:
            same = os.stat(real)
        except OSError:
            return None
        return real if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino) else None


def _check_weights_file(folder: Path, name: str) -> None:
    """Raise LoraConfigError unless ``folder/adapter_model.safetensors`` is a regular file."""
    path = folder / WEIGHTS_FILE
    if path.is_file():
        return
    if path.exists():
        raise LoraConfigError(f"LoRA adapter {name}: {path} is not a regular file")
    extra = " (.bin/pickle weights are never opened)" if (folder / "adapter_model.bin").exists() else ""
    raise LoraConfigError(f"LoRA adapter {name}: {path} is missing{extra}")


def read_adapter_config(
    folder: str | Path,
    name: str,
    *,
    tie_word_embeddings: bool | None = None,
    raw_bytes: bytes | None = None,
) -> LoraAdapterConfig:
    """Read ``folder/adapter_config.json``.

    ``target_modules`` may be a list of names or dotted suffixes, a regex full-matched against module paths, or
    PEFT's ``"all-linear"`` (any case): every linear layer but the output head, i.e. all seven per-layer Llama
    linears. ``tie_word_embeddings`` (the base model's, when the caller knows it) only shapes the wording of
    the refusal of ``lm_head`` / ``embed_tokens`` targets. ``raw_bytes``: the config file's content when the
    caller read it already (a worker reads it once, inside ``--lora-root``, and hashes and parses those bytes).

    Raises:
        LoraConfigError: naming the adapter and the file or field: missing folder or files, bad JSON, a
            non-LoRA ``peft_type``, a bad ``r``/``lora_alpha``, an invalid regex, a target that matches no
            module or a vocabulary layer (lm_head, embed_tokens), or an unsupported field.
    """
    d = Path(folder)
    cfg_path = d / CONFIG_FILE
    if not d.is_dir():
        raise LoraConfigError(f"LoRA adapter {name}: {d} is not a folder")
    if not cfg_path.is_file():
        what = "is not a regular file" if cfg_path.exists() else "is missing"
        raise LoraConfigError(f"LoRA adapter {name}: {cfg_path} {what}")
    try:
        raw = json.loads((read_adapter_file(d, CONFIG_FILE, name) if raw_bytes is None else raw_bytes).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraConfigError(f"LoRA adapter {name}: {cfg_path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise LoraConfigError(f"LoRA adapter {name}: {cfg_path} must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(name, "peft_type", peft_type, "only LoRA adapters are served")
    if raw.get("use_dora"):
        raise _refuse(name, "use_dora", True, "DoRA's magnitude vector is not implemented")
    if raw.get("bias", "none") != "none":
        raise _refuse(name, "bias", raw.get("bias"), "adapter biases are not implemented")
    if raw.get("modules_to_save"):
        raise _refuse(name, "modules_to_save", raw["modules_to_save"], "full replacement modules are not served")
    if raw.get("fan_in_fan_out"):
        raise _refuse(name, "fan_in_fan_out", True, "Llama linears store weights as [out, in]")
    for field in (
        "layer_replication",
        "target_parameters",
        "trainable_token_indices",
        "lora_bias",
        "use_qalora",
        "alora_invocation_tokens",  # activated LoRA: applies only after invocation tokens
        "arrow_config",
        "use_bdlora",
    ):
        if raw.get(field):
            raise _refuse(name, field, raw[field], "changes the model in a way Loom does not implement")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise _refuse(
            name, "init_lora_weights", init,
            "peft applies this adapter to base weights it changes on load (W minus the initial adapter), and Loom "
            "serves the unchanged base; convert it to a plain LoRA adapter first (peft's save_pretrained with "
            "path_initial_model_for_weight_conversion)",
        )  # fmt: skip
    r = raw.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field r={r!r} must be a positive integer")
    alpha = raw.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        why = f"{CONFIG_FILE} field lora_alpha={alpha!r} must be a positive number"
        raise LoraConfigError(f"LoRA adapter {name}: {why}")
    rslora = raw.get("use_rslora", False)
    if rslora is not None and not isinstance(rslora, bool):  # bool("false") is True: a string would flip the scaling
        raise LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field use_rslora={rslora!r} must be true or false")
    tm = raw.get("target_modules")
    if isinstance(tm, str) and tm.lower() == ALL_LINEAR:
        tm = list(LLAMA_LORA_MODULES)  # PEFT expands the shorthand the same way when it loads the adapter
        targets = list(LLAMA_LORA_MODULES)
    elif isinstance(tm, str):
        rx = _compile(name, "target_modules", tm)
        vocab = [p for p in ("lm_head", "model.embed_tokens") if rx.fullmatch(p)]
        if vocab:
            raise _refuse(name, "target_modules", tm, f"it matches {vocab}: {vocab_refusal(tie_word_embeddings)}")
        targets = [m for m in LLAMA_LORA_MODULES if any(rx.fullmatch(p) for p in _sample_paths(m))]
    elif isinstance(tm, list) and all(isinstance(m, str) for m in tm):
        targets = sorted({m.split(".")[-1] for m in tm}, key=lambda m: (m not in LLAMA_LORA_MODULES, m))
    else:
        raise LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field target_modules={tm!r} must be a list or regex")
    if not targets:
        raise LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field target_modules={tm!r} matches no module")
    exclude = raw.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, (str, list)):
        raise LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field exclude_modules={exclude!r} is malformed")
    if isinstance(exclude, str):
        _compile(name, "exclude_modules", exclude)
    ltt = raw.get("layers_to_transform")
    if isinstance(ltt, int) and not isinstance(ltt, bool):
        ltt = [ltt]
    if ltt is not None and not (isinstance(ltt, list) and all(isinstance(i, int) for i in ltt)):
        raise LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field layers_to_transform={ltt!r} is malformed")
    vocab = [m for m in targets if m in VOCAB_MODULES]
    if vocab:
        raise _refuse(name, "target_modules", vocab, vocab_refusal(tie_word_embeddings))
    unknown = [m for m in targets if m not in LLAMA_LORA_MODULES]
    if unknown:
        raise _refuse(
            name, "target_modules", unknown, f"the model's adapter-able modules are {list(LLAMA_LORA_MODULES)}"
        )
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    for field, pat in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        kinds = int if field == "rank_pattern" else (int, float)  # a rank of 8.5 is not a rank
        if not isinstance(pat, dict) or any(isinstance(v, bool) or not isinstance(v, kinds) or not v > 0
                                            for v in pat.values()):  # fmt: skip
            what = "integers" if field == "rank_pattern" else "numbers"
            raise LoraConfigError(f"LoRA adapter {name}: {CONFIG_FILE} field {field} must map patterns to {what} > 0")
        for key in pat:
            _compile(name, field, rf"(.*\.)?(?:{key})")
    # checked after the config, so that a folder with a broken config and no weights names the config first:
    # the file the user has and must fix before the weights matter
    _check_weights_file(d, name)
    return LoraAdapterConfig(
        name=name,
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(rslora),
        target_modules=targets,
        rank_pattern={str(k): int(v) for k, v in rank_pattern.items()},
        alpha_pattern={str(k): float(v) for k, v in alpha_pattern.items()},
        target_spec=tm,
        exclude_spec=exclude or None,
        layers_to_transform=ltt,
    )


def adapter_content_hash(
    folder: str | Path, name: str, weights: bytes | None = None, config: bytes | None = None
) -> str:
    """sha256 (hex) of an adapter's ``adapter_config.json`` and ``adapter_model.safetensors`` bytes.

    Recorded at an adapter's first load, so that a restore after a worker restart can tell whether the folder
    still holds the same adapter (same uid, same weights) or was changed or removed since. ``weights``: the
    weights file's content, when the caller read it already (so the hash covers the very bytes it loads).
    ``config``: the config file's content, likewise.

    Raises:
        LoraConfigError: a file is missing or unreadable (naming the adapter and the file).
    """
    h = hashlib.sha256()
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        path = Path(folder) / fname
        h.update(fname.encode() + b"\0")
        given = weights if fname == WEIGHTS_FILE else config
        if given is not None:
            h.update(given)
            continue
        try:
            with path.open("rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
        except OSError as e:
            raise LoraConfigError(f"LoRA adapter {name}: cannot read {path}: {e.strerror or e}") from None
    return h.hexdigest()


def adapter_name_problem(name: str, served_model_name: str = "") -> str | None:
    """Why ``name`` cannot name a LoRA adapter (None: it can), as a message naming the adapter and the problem.

    Every entry point that loads adapters (HTTP ``/load_lora_adapter``, ZMQ ``LoadLoraReq``, ``--lora-paths``)
    checks names through this one function, so a request's ``model`` always names one thing: a name must be
    non-empty, have no leading or trailing whitespace, contain no ``/`` and no ``:`` (the ``BASE:ADAPTER``
    separator), no ``,`` and no non-printable characters, not be ``.`` or ``..``, be at most
    ``MAX_ADAPTER_NAME`` characters, and differ from the served model's name (the base model's id).
    """
    if not name.strip():
        return f"LoRA adapter name {name!r} is empty or only whitespace; give the adapter a name"
    if name != name.strip():
        return f"LoRA adapter name {name!r} has leading or trailing whitespace"
    if "/" in name:
        return f"LoRA adapter name {name!r} contains '/'"
    if len(name) > MAX_ADAPTER_NAME:
        return f"LoRA adapter name {name[:40]!r}... is {len(name)} characters long; at most {MAX_ADAPTER_NAME}"
    if name in (".", ".."):
        return f"LoRA adapter name {name!r} is a path step: URLs such as /v1/models/{name} could not name it"
    if "," in name:  # commas join names in the vllm:lora_requests_info labels gateways parse
        return f"LoRA adapter name {name!r} contains ','"
    bad = next((c for c in name if not c.isprintable()), None)
    if bad is not None:  # control and invisible characters break logs and make look-alike names
        return f"LoRA adapter name {name!r} contains the non-printable character U+{ord(bad):04X}"
    if MODEL_ADAPTER_SEPARATOR in name:
        return (
            f"LoRA adapter name {name!r} contains {MODEL_ADAPTER_SEPARATOR!r}, which separates BASE:ADAPTER in a "
            "request's model"
        )
    if served_model_name and name == served_model_name:
        return (
            f"LoRA adapter name {name!r} is the served model's name (the base model's id): a request's model "
            "could not tell them apart; choose another name"
        )
    return None


def never_loaded_message(name: str, loaded: list[str]) -> str:
    """The error for a request naming an adapter the cluster cannot serve (SGLang's wording)."""
    return f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {sorted(loaded)}"
