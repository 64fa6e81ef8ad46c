"""Stop strings in a stream of text: what may be shown now, and whether one was hit."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Holds back text that might be the start of a stop string, so none is ever shown."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buffer = ""
        self.hit: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit). Of several in the text, the one
        that begins first ends it (the longest of those beginning at the same place)."""
        self.buffer += text
        found = [(at, -len(s), s) for s in self.stops if (at := self.buffer.find(s)) >= 0]
        if found:
            at, _, self.hit = min(found)
            out, self.buffer = self.buffer[:at], ""
            return out, True
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.buffer)), 0, -1):
                if self.buffer.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out
