"""What the scheduler's steps cost, measured as they run, and the chunk sizes that follows.

A step costs a fixed part (reading the weights, the same for one row or several) plus a part
per row, so a prefill chunk mixed into a decode step costs far less than a step of its own. The
scheduler asks here how many prompt tokens it may mix into a decode step so that the step costs
about `MIX_TARGET` plain ones (a stream's next token then never waits much more than usual), and,
where steps cannot mix (the NPU's static graphs), how many cost about one decode step.
"""

from __future__ import annotations

from .drafters import ema

__all__ = ["MIX_TARGET", "REFRESH_EVERY", "StepCosts"]

MIX_TARGET = 1.6  # a mixed step (decodes + a prefill chunk) should cost this many decode steps
REFRESH_EVERY = 12  # while mixing, one plain decode step in this many keeps its time current
_FIRST_MIX = 4  # prompt tokens in a mixed step before anything is measured


class StepCosts:
    """Moving averages of step times, and the chunk sizes they imply (module doc)."""

    def __init__(self, prefill_chunk: int) -> None:
        self.prefill_chunk = prefill_chunk
        self.t_decode: float | None = None  # seconds per batched decode step
        self.t_rows: dict[int, float] = {}  # the same, per number of rows decoded
        self.t_token: float | None = None  # seconds per token of a prefill chunk of its own
        self.t_mix_token: float | None = None  # seconds a prompt token adds to a mixed step
        self.mixed_run = 0  # mixed steps since the last plain decode step
        self.mix_last = _FIRST_MIX  # prompt tokens in the last mixed step

    def decoded(self, rows: int, seconds: float) -> None:
        self.t_decode = ema(self.t_decode, seconds, 0.3)
        self.t_rows[rows] = ema(self.t_rows.get(rows), seconds, 0.3)
        self.mixed_run = 0

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens >= 2:
            self.t_token = ema(self.t_token, seconds / tokens, 0.3)

    def mixed(self, decodes: int, tokens: int, seconds: float) -> None:
        """Learn what a prompt token adds to a mixed step with `decodes` decode rows. One slow
        step (the first at a new capacity, a busy machine) moves the estimate at most
        threefold, so it cannot collapse the chunk for the rest of a paste; the decode time
        itself stays current through the plain steps `needs_refresh` asks for."""
        self.mix_last = tokens
        self.mixed_run += 1
        t_decode = self.t_rows.get(decodes)
        if t_decode is None or tokens < 2:
            return
        sample = max(seconds - t_decode, 0.0) / tokens
        if self.t_mix_token is not None:
            sample = min(sample, 3 * self.t_mix_token)
        self.t_mix_token = ema(self.t_mix_token, sample, 0.3)

    @property
    def needs_refresh(self) -> bool:
        """Whether the next step should be a plain decode step (its time is getting stale)."""
        return self.mixed_run >= REFRESH_EVERY

    def mix_tokens(self, decodes: int) -> int:
        """Prompt tokens a mixed step with `decodes` decode rows can carry: `MIX_TARGET - 1`
        decode steps' worth, growing at most twofold a step (no overshoot on a first, lucky
        measurement)."""
        t_decode = self.t_rows.get(decodes)
        if t_decode is None or self.t_mix_token is None:
            return _FIRST_MIX
        fit = (MIX_TARGET - 1) * t_decode / max(self.t_mix_token, 1e-9)
        return int(max(1, min(self.prefill_chunk, fit, 2 * self.mix_last)))

    def chunk_tokens(self) -> int:
        """Prompt tokens a chunk of its own can take for about one decode step, at least one."""
        if self.t_decode is None or self.t_token is None or self.t_token <= 0:
            return min(8, self.prefill_chunk)
        return int(max(1, min(self.prefill_chunk, self.t_decode / self.t_token)))
