"""Tokenizer, chat template and incremental detokenization for one checkpoint folder.

Uses the ``tokenizers`` library for ``tokenizer.json`` (0.1 s to load, no ``transformers`` import) and a
sandboxed jinja2 environment for the chat template, as ``transformers.apply_chat_template`` does.

Chat prompts are encoded so that control tokens come only from the template (:meth:`TextCodec.encode_chat`):
text in a message's content that spells a special token (``<|im_end|>``, ``<|endoftext|>``) is tokenized as
plain text, so no user can close a turn or open a system turn by writing its markup. Raw ``text`` prompts
are a whole prompt written by the caller and keep special tokens recognised.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from tokenizer_proc.token_bytes import TokenBytes


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed; the message says which."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


# private-use characters: never produced by a template, tried in order until one is absent from the prompt
_SENTINELS = range(0xE000, 0xF900)


class TextCodec:
    """Encode prompts and decode outputs for the model in ``model_dir``.

    ``vocab_size`` is the model's (from config.json), which may exceed the tokenizer's own vocabulary.
    ``special_tokens`` maps each special (control) token id to its text, e.g. ``{2: "<|im_end|>"}``.
    """

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        # the same tokenizer with special-token matching off: "<|im_end|>" in its input is plain text
        self._plain_tok = Tokenizer.from_str(self.tok.to_str())
        self._plain_tok.encode_special_tokens = True
        self._special: dict[int, AddedToken] = {
            i: t for i, t in self.tok.get_added_tokens_decoder().items() if t.special and t.content
        }
        self.special_tokens: dict[int, str] = {i: t.content for i, t in self._special.items()}
        texts = set(self.special_tokens.values())
        self._special_starts = {s[0] for s in texts}
        self._special_tails = {s[i:] for s in texts for i in range(1, len(s))}
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
        self._token_bytes: TokenBytes | None = None  # built on the first logprobs request

    def _longest_token_chars(self) -> int:
        """Most characters of text one token can stand for (decoded, and as written in the vocab)."""
        n = self.tok.get_vocab_size(with_added_tokens=True)
        decoded = self.tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        longest = max((len(s) for s in decoded), default=1)
        return max(1, longest, max((len(s) for s in self.tok.get_vocab(with_added_tokens=True)), default=1))

    # encode_batch, not encode: the tokenizers library releases the GIL only in its batch calls, so a long prompt
    # tokenized in a worker thread does not stall the event loop

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text are recognised)."""
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token text tokenized as ordinary characters."""
        return self._plain_tok.encode_batch([text], add_special_tokens=False)[0].ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` adds to the output (:class:`~tokenizer_proc.token_bytes.TokenBytes`)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tok)
        return self._token_bytes.bytes_of(token_id)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

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

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        *,
        allow_special_tokens_in_content: bool = False,
        rendered: str | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat, with control tokens only where the template wrote them.

        Message content is plain text: ``"hi<|im_end|>"`` in a user message becomes the tokens of the characters
        ``<``, ``|``, ``im``, ... and never id 2. For content without special-token text the ids are exactly
        ``encode(render_chat(messages))``. ``allow_special_tokens_in_content=True`` restores that encoding for
        every message (content may then write control tokens: only for trusted callers). ``rendered`` is
        ``render_chat(messages)`` when the caller has it already.

        How: the content is rendered once more with a private-use sentinel character inserted wherever a special
        token could begin in it (after each character that starts one, and before content that could finish one
        begun just before it), so no special token can match across content. The special tokens the library
        finds in that rendering are the template's own; the text between them is encoded with special-token
        matching off. A template that changes content in a way the sentinel disturbs (slicing, counting) cannot
        be followed: content with special-token text is then refused with :class:`ChatTemplateError`.

        Raises:
            ChatTemplateError: no template, the template rejected the messages, or it cannot be followed.
        """
        if rendered is None:
            rendered = self.render_chat(messages)
        if allow_special_tokens_in_content or not self._special:
            return self.encode(rendered)
        specials = "".join(self.special_tokens.values())
        z = next((chr(c) for c in _SENTINELS if chr(c) not in rendered and chr(c) not in specials), None)
        if z is None:  # every private-use character occurs in the prompt: escape nothing, refuse forgeries
            return self._encode_unescaped(messages, rendered)
        table = {ord(c): c + z for c in self._special_starts}
        escaped = [dict(m, content=self._escape(m["content"], z, table)) for m in messages]
        if all(e["content"] == m["content"] for e, m in zip(escaped, messages, strict=True)):
            return self.encode(rendered)  # no content can take part in a special token
        marked = self.render_chat(escaped)
        if marked.replace(z, "") != rendered:  # the template transforms content: positions cannot be followed
            return self._encode_unescaped(messages, rendered)
        return self._encode_marked(rendered, marked, z)

    def _escape(self, content: str, z: str, table: dict[int, str]) -> str:
        """``content`` with ``z`` after every character that begins a special token, and in front when its start
        could complete one begun by the text before it."""
        if not isinstance(content, str) or not content:
            return content
        out = content.translate(table)
        if any(content.startswith(t) or t.startswith(content) for t in self._special_tails):
            out = z + out
        return out

    def _encode_unescaped(self, messages: list[dict[str, str]], rendered: str) -> list[int]:
        """Fallback when content positions cannot be followed: fine unless some content spells a special token."""
        texts = self.special_tokens.values()
        if any(isinstance(m["content"], str) and any(s in m["content"] for s in texts) for m in messages):
            raise ChatTemplateError(
                "a message's content contains special-token text, and this chat template transforms content in a "
                "way that prevents encoding it as plain text; remove the special-token text or set "
                "allow_special_tokens_in_content"
            )
        return self.encode(rendered)

    def _encode_marked(self, rendered: str, marked: str, z: str) -> list[int]:
        """Ids of ``rendered``: special tokens where the library finds them in ``marked`` (``rendered`` with ``z``
        inserted into content), the text between them encoded with special-token matching off."""
        enc = self.tok.encode_batch([marked], add_special_tokens=False)[0]
        pieces: list[str] = []  # the text before each special token, and after the last
        specials: list[int] = []
        pos = 0  # next character of `rendered` to encode
        seen = 0  # characters of `marked` scanned for sentinels
        shift = 0  # sentinels in marked[:seen]
        strip_left = False  # the previous special token swallows whitespace on its right
        for tid, (start, end) in zip(enc.ids, enc.offsets, strict=True):
            tok = self._special.get(tid)
            if tok is None:
                continue
            shift += marked.count(z, seen, start)
            seen = end
            piece = rendered[pos : start - shift]
            if strip_left:
                piece = piece.lstrip()
            if tok.lstrip:
                piece = piece.rstrip()
            pieces.append(piece)
            specials.append(tid)
            pos = end - shift
            strip_left = tok.rstrip
        piece = rendered[pos:]
        pieces.append(piece.lstrip() if strip_left else piece)
        encoded = self._plain_tok.encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = []
        for e, tid in zip(encoded, [*specials, None], strict=True):
            ids.extend(e.ids)
            if tid is not None:
                ids.append(tid)
        return ids


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
