"""Committed token ids -> text deltas, cut at the first stop sequence.

Text that could still turn into a stop sequence (a suffix that is a prefix of one) is held back
until the next token decides; a token that ends inside an incomplete UTF-8 sequence (the decoder
shows U+FFFD) waits for the next. Special tokens (end of text) decode to nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopText:
    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.decode = decode
        self.ids: list[int] = []
        # the decoded text so far (complete characters only), and how much of it was handed out
        self.text = ""
        self.sent = 0
        # True once a stop sequence was found; the text ends before it
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; the text that became final (possibly ""). Sets `stopped` on a stop sequence."""
        self.ids.append(int(token_id))
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._hand_out(max(cut, self.sent))
        return self._hand_out(len(text) - self._held_back())

    def flush(self) -> str:
        """At the end (not after a stop): whatever was held back."""
        return "" if self.stopped else self._hand_out(len(self.text))

    @property
    def final_text(self) -> str:
        return self.text[:self.sent]

    def _hand_out(self, end: int) -> str:
        delta = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta

    def _first_stop(self) -> int | None:
        found = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that starts some stop sequence."""
        unsent = self.text[self.sent:]
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(unsent)), best, -1):
                if unsent.endswith(s[:n]):
                    best = n
                    break
        return best
