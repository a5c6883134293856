"""How much of a request's output text the front door may show, given its stop strings.

The scheduler ends a request when a stop string appears in its output; the final text is cut where the first
stop string begins. A stream must never show text that the final answer takes back, so every chunk holds back
the tail of the text that could still grow into a stop string (the longest suffix that is a prefix of one).
Then every streamed chunk is a prefix of the final text: a stop string that begins inside the shown text
would have to end inside it too, and the scheduler would have stopped there.

Stop strings are matched against the text with special tokens skipped. One that contains a special token's text
(``"<|im_end|>"``) is matched against the text with special tokens written out (as the scheduler does); its
cut and hold-back positions are mapped back onto the shown text, where special tokens take no room.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizer_proc.text import TextCodec


def first_match(text: str, stops: Sequence[str]) -> int:
    """Where the first occurrence of any of ``stops`` begins in ``text`` (``len(text)`` if none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found, default=len(text))


def hold_back_from(text: str, stops: Sequence[str]) -> int:
    """How much of ``text`` is safe to show: up to the first stop string, and short of any tail of ``text`` that
    is the beginning of a stop string (it may still become one)."""
    cut = first_match(text, stops)
    if not text:
        return cut
    last = text[-1]
    for s in stops:
        # the longest proper prefix s[:k] that ends the text; only those ending in text's last character can
        j = s.rfind(last, 0, min(len(s) - 1, len(text)))
        while j >= 0 and not text.endswith(s[: j + 1]):
            j = s.rfind(last, 0, j)
        if j >= 0:
            cut = min(cut, len(text) - (j + 1))
    return cut


class StopText:
    """A request's stop strings, split by the rendering they are matched against.

    ``plain`` stop strings are matched against the output text (special tokens skipped); ``marked`` ones contain
    a special token's text and are matched against the output with special tokens written out.
    """

    def __init__(self, stops: Sequence[str], codec: TextCodec) -> None:
        texts = set(codec.special_tokens.values())
        self.marked = [s for s in stops if any(t in s for t in texts)]
        self.plain = [s for s in stops if s not in self.marked]
        self._codec = codec

    def __bool__(self) -> bool:
        return bool(self.plain or self.marked)

    def visible(self, text: str, ids: Sequence[int]) -> str:
        """A stream chunk: ``text`` (the decoded ``ids``) without any tail that could still become a stop string."""
        cut = hold_back_from(text, self.plain)
        if self.marked:
            kept, spans = self._written_out(ids)
            cut = min(cut, _shown_position(spans, hold_back_from(kept, self.marked)))
        return text[:cut]

    def final(self, text: str, ids: Sequence[int]) -> str:
        """The final text of a request a stop string ended: ``text`` cut where the first stop string begins."""
        cut = first_match(text, self.plain)
        if self.marked:
            kept, spans = self._written_out(ids)
            at = first_match(kept, self.marked)
            if at < len(kept):
                cut = min(cut, _shown_position(spans, at))
        return text[:cut]

    def _written_out(self, ids: Sequence[int]) -> tuple[str, list[tuple[int, int, int, bool]]]:
        """The output with special tokens written out, and its spans ``(start, shown_start, length, special)``:
        runs of ordinary tokens (shown as they are) and special tokens (not shown)."""
        specials = self._codec.special_tokens
        parts: list[str] = []
        spans: list[tuple[int, int, int, bool]] = []
        pos = shown = 0
        run: list[int] = []

        def add(piece: str, special: bool) -> None:
            nonlocal pos, shown
            if piece:
                parts.append(piece)
                spans.append((pos, shown, len(piece), special))
                pos += len(piece)
                shown += 0 if special else len(piece)

        for t in ids:
            if t in specials:
                add(self._codec.decode(run), False)
                add(specials[t], True)
                run = []
            else:
                run.append(t)
        add(self._codec.decode(run), False)
        return "".join(parts), spans


def _shown_position(spans: list[tuple[int, int, int, bool]], at: int) -> int:
    """The position in the shown text of position ``at`` of the written-out text (``spans`` from
    :meth:`StopText._written_out`); a position inside a special token maps to where that token stands."""
    for start, shown, length, special in spans:
        if at < start + length:
            return shown + (0 if special else max(0, at - start))
    return spans[-1][1] + (0 if spans[-1][3] else spans[-1][2]) if spans else 0
