"""Text helpers shared by the text engines: stop strings across token boundaries."""

from __future__ import annotations


class StopMatcher:
    """Finds stop strings in streamed text, also when one is split across tokens.

    `feed` returns the text that is safe to emit now and whether a stop string was reached;
    text that might be the start of a stop string is held back until it is decided.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        # The stop string that was reached (the earliest in the text), once one was.
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        self.pending += text
        hits = [(i, stop) for stop in self.stops if (i := self.pending.find(stop)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        hold = self._held_suffix()
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _held_suffix(self) -> int:
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
