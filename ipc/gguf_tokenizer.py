"""Rebuild a Hugging Face tokenizer folder (``tokenizer.json`` and friends) from a GGUF file's metadata.

GGUF keeps the tokenizer as ``tokenizer.ggml.*`` keys: the token strings (index = id), their types, the BPE
merges, the special-token ids and the chat template. Loom supports byte-level BPE tokenizers
(``tokenizer.ggml.model = "gpt2"``), the kind SmolLM2, GPT-2 and StarCoder use, and writes them with the
``tokenizers`` library, without ``transformers``.

The pre-tokenizer is the GPT-2 byte-level split for every supported ``tokenizer.ggml.pre``. That is what
``transformers`` 5 wrote for the embedded SmolLM2 (Loom's earlier converter), so token ids stay identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# tokenizer.ggml.pre values whose pre-tokenizer is the GPT-2 byte-level regex split.
GPT2_STYLE_PRE = ("default", "gpt-2", "gpt2", "smollm", "starcoder")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_SPECIAL_IDS = ("bos", "eos", "padding", "unknown")
_SPECIAL_NAMES = {"bos": "bos_token", "eos": "eos_token", "padding": "pad_token", "unknown": "unk_token"}


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing or of a kind Loom cannot rebuild; the message names the key."""


def special_token_ids(meta: Callable[[str], Any]) -> dict[str, int]:
    """``{"bos": id, "eos": id, "padding": id, "unknown": id}`` for the ids the GGUF declares (others left out).

    ``meta(key)`` returns the value of a GGUF metadata key, or None when the file lacks it.
    """
    ids = {}
    for name in _SPECIAL_IDS:
        value = meta(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            ids[name] = int(value)
    return ids


def build_tokenizer(meta: Callable[[str], Any]) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from the ``tokenizer.ggml.*`` metadata.

    Args:
        meta: ``meta(key)`` returns the value of a GGUF metadata key (lists for arrays), or None if absent.

    Raises:
        GGUFTokenizerError: the tokenizer is not byte-level BPE, its pre-tokenizer is unknown, or the
            token / merge lists are missing or malformed.
    """
    kind = meta("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "convert the model to a Hugging Face folder yourself and pass that folder as --model-path"
        )
    pre = meta("tokenizer.ggml.pre") or "default"
    if pre not in GPT2_STYLE_PRE:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre={pre!r} is not supported (known: {', '.join(GPT2_STYLE_PRE)}); "
            "convert the model to a Hugging Face folder yourself and pass that folder as --model-path"
        )
    tokens = meta("tokenizer.ggml.tokens")
    merges = meta("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFTokenizerError("the GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m in merges if m.count(" ") != 1), None)
    if bad is not None:
        raise GGUFTokenizerError(f"tokenizer.ggml.merges holds {bad!r}, which is not two tokens split by a space")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.tokens holds the same token twice")

    bpe = models.BPE(
        vocab=vocab,
        merges=pairs,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    add_prefix = bool(meta("tokenizer.ggml.add_space_prefix") or False)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [
        AddedToken(tokens[i], special=t != _USER_DEFINED, normalized=False)
        for i, t in enumerate(types)
        if t in (_UNKNOWN, _CONTROL, _USER_DEFINED)
    ]
    if added:
        tok.add_tokens(added)
    return tok


def _post_processor(meta: Callable[[str], Any], tokens: list[str]) -> processors.TemplateProcessing:
    """BOS / EOS added around each sequence as ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say."""
    ids = special_token_ids(meta)
    bos = [tokens[ids["bos"]]] if meta("tokenizer.ggml.add_bos_token") and "bos" in ids else []
    eos = [tokens[ids["eos"]]] if meta("tokenizer.ggml.add_eos_token") and "eos" in ids else []
    second = [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    added = [(tokens[ids[k]], ids[k]) for k, on in (("bos", bos), ("eos", eos)) if on]
    return processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *second],
        special_tokens=list(dict.fromkeys(added)),
    )


def tokenizer_files(meta: Callable[[str], Any]) -> dict[str, str]:
    """File name -> text of the tokenizer files of a Hugging Face checkpoint folder.

    Always ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens by text, readable by
    ``transformers.AutoTokenizer``); ``chat_template.jinja`` when the GGUF has ``tokenizer.chat_template``.

    Raises:
        GGUFTokenizerError: as ``build_tokenizer``, or a special-token id outside the vocabulary.
    """
    tok = build_tokenizer(meta)
    tokens = meta("tokenizer.ggml.tokens")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, i in special_token_ids(meta).items():
        if not 0 <= i < len(tokens):
            raise GGUFTokenizerError(
                f"tokenizer.ggml.{name}_token_id={i} is outside the {len(tokens)}-token vocabulary"
            )
        config[_SPECIAL_NAMES[name]] = tokens[i]
    config["add_bos_token"] = bool(meta("tokenizer.ggml.add_bos_token") or False)
    config["add_eos_token"] = bool(meta("tokenizer.ggml.add_eos_token") or False)
    config["clean_up_tokenization_spaces"] = False
    files = {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
    }
    template = meta("tokenizer.chat_template")
    if isinstance(template, str) and template:
        files["chat_template.jinja"] = template
    return files
