"""Tokenizer, chat template and incremental detokenization for one checkpoint folder.

Uses the ``tokenizers`` library for ``tokenizer.json`` (0.1 s to load, no ``transformers`` import) and a
sandboxed jinja2 environment for the chat template, as ``transformers.apply_chat_template`` does.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed; the message says which."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class TextCodec:
    """Encode prompts and decode outputs for the model in ``model_dir``.

    ``vocab_size`` is the model's (from config.json), which may exceed the tokenizer's own vocabulary.
    """

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "config.json").read_text())
        self.vocab_size = int(cfg["vocab_size"])
        tcfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        template = tcfg.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        self.special = {k: tcfg.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self._template = None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)
        self.max_token_chars = self._longest_token_chars()

    def _longest_token_chars(self) -> int:
        """Most characters of text one token can stand for (decoded, and as written in the vocab)."""
        n = self.tok.get_vocab_size(with_added_tokens=True)
        decoded = self.tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        longest = max((len(s) for s in decoded), default=1)
        return max(1, longest, max((len(s) for s in self.tok.get_vocab(with_added_tokens=True)), default=1))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text are recognised)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to ``messages`` with the generation prompt appended.

        Raises:
            ChatTemplateError: no template, or the template rejected the messages.
        """
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send text or input_ids instead")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors become a clear client error
            raise ChatTemplateError(f"chat template failed: {e}") from None


class IncrementalText:
    """Cumulative output text that never ends inside a multi-byte character still being generated."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.text = ""

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the cumulative text safe to show now (all of it when ``final``)."""
        self.ids.extend(new_ids)
        text = self.codec.decode(self.ids)
        if final or not text.endswith("\ufffd"):
            self.text = text
        return self.text
