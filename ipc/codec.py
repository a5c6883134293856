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
