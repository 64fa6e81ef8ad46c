"""Stop strings in a stream of text: what may be shown now, and whether one was hit."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Holds back text that might be the start of a stop string, so none is ever shown."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.buffer += text
        for stop in self.stops:
            at = self.buffer.find(stop)
            if at >= 0:
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
