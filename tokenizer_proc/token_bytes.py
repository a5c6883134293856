"""The raw bytes each token id stands for, and OpenAI's way of showing a token that is not whole UTF-8.

A byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM2) spells each byte as one printable character, so one emoji
is often two or three tokens, none of them valid UTF-8 alone; decoding such a token by itself gives U+FFFD. The
OpenAI API's logprobs report each token's real ``bytes`` (so a client can join the pieces of a character) and
name a token that is not whole UTF-8 ``bytes:\\xe2\\x80``. Vocabularies with byte fallback (Llama 2, Mistral)
spell a lone byte ``<0xE2>`` and a space ``▁``.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_chars() -> dict[str, int]:
    """Character -> byte of the byte-level alphabet: the printable Latin-1 bytes stand for themselves, the other
    68 bytes, in order, for the characters from U+0100 up (the GPT-2 byte-level BPE convention)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _decoder_types(tok: Tokenizer) -> set[str]:
    """The ``type`` of the tokenizer's decoder and of every decoder in a ``Sequence``."""
    dec = json.loads(tok.to_str()).get("decoder") or {}
    found, todo = set(), [dec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            found.add(str(d.get("type")))
            todo.extend(d.get("decoders") or [])
    return found


class TokenBytes:
    """``bytes_of(id)``: the bytes token ``id`` adds to the output, read from the vocabulary (not decoded alone).

    Added tokens (the chat markup) are their text; byte-level pieces map character by character; byte-fallback
    pieces ``<0xNN>`` are that byte and ``▁`` a space; anything else is the token decoded alone. Results are
    cached per id.
    """

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        types = _decoder_types(tok)
        self._chars = byte_level_chars() if "ByteLevel" in types else None
        self._fallback = "ByteFallback" in types
        self._added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` (empty for an id past the tokenizer's vocabulary)."""
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._compute(token_id)
        return got

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._chars is not None and all(c in self._chars for c in piece):
            return bytes(self._chars[c] for c in piece)
        if self._fallback:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return self.tok.decode([token_id], skip_special_tokens=False).encode()


def token_string(raw: bytes) -> str:
    """OpenAI's ``token`` for a token's bytes: their text when they are whole UTF-8, else ``bytes:`` and each byte
    as ``\\xNN``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Completions' ``text_offset``: for each token, the characters of output text before it, counting only whole
    characters (a token inside a multi-byte character starts where that character does) and each invalid byte as
    one U+FFFD, as the detokenizer writes it. Incremental: a stream keeps one per choice and feeds it each
    chunk's new tokens, so no chunk decodes the earlier ones again."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0  # characters of the tokens fed so far
        self.tokens = 0  # tokens fed so far

    def feed(self, pieces: Iterable[bytes]) -> list[int]:
        """The offsets of the next tokens (their bytes ``pieces``), in order."""
        offsets = []
        for raw in pieces:
            offsets.append(self.chars)
            self.chars += len(self._dec.decode(raw))
            self.tokens += 1
        return offsets
