"""Encode and decode one socket edge's messages with msgspec msgpack (no pickle anywhere)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class WireError(ValueError):
    """A frame could not be decoded as this edge's messages; the message says why (garbled, truncated...)."""


class Codec(Generic[T]):
    """Encoder/decoder for one tagged union ``union`` (e.g. ``ClientMsg``).

    ``decode`` raises :class:`WireError` for anything that is not a well-formed message of the union:
    garbled or truncated msgpack, an unknown tag, a missing or unknown field, a wrong type.
    """

    def __init__(self, union: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)

    def encode(self, msg: Any) -> bytes:
        """Serialize ``msg`` (a Struct of this edge) to bytes."""
        return self._enc.encode(msg)

    def decode(self, frame: bytes | memoryview) -> T:
        """Parse one frame. Raises WireError naming the problem."""
        try:
            return self._dec.decode(frame)
        except msgspec.ValidationError as e:
            raise WireError(f"invalid message: {e}") from None
        except msgspec.DecodeError as e:
            raise WireError(f"malformed frame ({len(frame)} bytes): {e}") from None


# ----------------------------------------------------------------------------- a cheap look inside a request frame


class _SamplingPeek(msgspec.Struct):
    stop_token_ids: msgspec.Raw = msgspec.Raw()


class _RequestPeek(msgspec.Struct):
    """The fields of a request whose size matters, left undecoded (unknown fields, the tag too, are skipped)."""

    rid: Any = None
    text: msgspec.Raw = msgspec.Raw()
    input_ids: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    sampling_params: _SamplingPeek | None = None


class _RidPeek(msgspec.Struct):
    rid: Any = None


_PEEK = msgspec.msgpack.Decoder(_RequestPeek)
_RID_PEEK = msgspec.msgpack.Decoder(_RidPeek)
MAX_PEEK_RID = 256


class FramePeek(msgspec.Struct, frozen=True):
    """What :func:`peek_request` read from a frame without building its lists: ``rid`` ("" if none could be
    read), and the byte length of ``text`` and the element counts of ``input_ids``, ``messages`` and
    ``sampling_params.stop_token_ids`` (None where absent or not of that shape)."""

    rid: str = ""
    text_bytes: int | None = None
    input_ids: int | None = None
    messages: int | None = None
    stop_token_ids: int | None = None


def _length(raw: msgspec.Raw, kind: str) -> int | None:
    """The element count (``kind="array"``) or byte length (``"str"``) in a msgpack value's header."""
    b = memoryview(raw)
    if not len(b):
        return None
    t = b[0]
    if kind == "array":
        if 0x90 <= t <= 0x9F:
            return t & 0x0F
        sizes = {0xDC: 2, 0xDD: 4}
    else:
        if 0xA0 <= t <= 0xBF:
            return t & 0x1F
        sizes = {0xD9: 1, 0xDA: 2, 0xDB: 4}
    n = sizes.get(t)
    if n is None or len(b) < 1 + n:
        return None
    return int.from_bytes(b[1 : 1 + n], "big")


def peek_request(frame: bytes | memoryview) -> FramePeek:
    """Read a request frame's rid and the sizes of its long fields without decoding them.

    Skipping a list of 2.7 million ids costs about a tenth of decoding it, so a frame that can only be refused
    for its size is refused without building millions of Python ints. A frame this cannot read gives an empty
    :class:`FramePeek` (the full decode then names what is wrong).
    """
    try:
        p = _PEEK.decode(frame)
    except msgspec.MsgspecError:
        try:  # a long field of the wrong type: the rid may still be readable
            p = _RID_PEEK.decode(frame)
        except msgspec.MsgspecError:
            return FramePeek()
        return FramePeek(p.rid if isinstance(p.rid, str) and len(p.rid) <= MAX_PEEK_RID else "")
    stop_ids = None if p.sampling_params is None else _length(p.sampling_params.stop_token_ids, "array")
    rid = p.rid if isinstance(p.rid, str) and len(p.rid) <= MAX_PEEK_RID else ""
    return FramePeek(rid, _length(p.text, "str"), _length(p.input_ids, "array"), _length(p.messages, "array"), stop_ids)
