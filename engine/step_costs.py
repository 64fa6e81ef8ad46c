"""What the scheduler's steps cost, measured as they run, and the chunk sizes that follows.

A step costs a fixed part (reading the weights, the same for one row or several) plus a part
per row, so a prefill chunk mixed into a decode step costs far less than a step of its own. The
scheduler asks here how many prompt tokens it may mix into a decode step so that the step costs
about `MIX_TARGET` of the streams' *usual* steps (their decode steps while no prompt is read
beside them), and, where steps cannot mix (the NPU's static graphs), how many cost about one
decode step.

Costs are kept per attention window (`kv_layout.attention_window`): a step attends the cache
slots its rows reach, so the streams' own decode steps cost what their lengths need while a
long prompt grows beside them, and a mixed step, whose rows all attend as far as the prompt has
reached, costs more as the prompt grows. A mixed step's time is fitted as a line, `fixed + n *
per_token` over its n prompt tokens, per window, and the chunk is what keeps it within
`MIX_TARGET` of the streams' usual step: the fixed part is the decode rows' own step plus what
the prompt's row costs whatever its length (its logits row through the vocabulary matmul, its
attention, the decode rows' attention over the prompt's window), and a chunk sized as if that
part were paid per token would stay at one token for the rest of a paste.
"""

from __future__ import annotations

from collections import deque
from itertools import combinations
from statistics import median

from .drafters import ema

__all__ = ["MIX_TARGET", "REFRESH_EVERY", "StepCosts"]

MIX_TARGET = 1.6  # a mixed step (decodes + a prefill chunk) should cost this many usual steps
REFRESH_EVERY = 12  # while mixing, one plain decode step in this many keeps its time current
_FIRST_MIX = 1  # prompt tokens in a mixed step before anything is measured (2 can cost 1.7x)
_LONG_CHUNK = 32  # a prefill chunk this long says what a prompt token itself costs
_SAMPLES = 8  # mixed steps the line is fitted to, per (decode rows, window)

Key = tuple[int, int]  # (decode rows, attention window)
MixKey = tuple[int, int, bool]  # and whether the prompt's logits row is computed


class StepCosts:
    """Moving averages of step times, and the chunk sizes they imply (module doc)."""

    def __init__(self, prefill_chunk: int) -> None:
        self.prefill_chunk = prefill_chunk
        self.t_rows: dict[Key, float] = {}  # seconds per decode step of b rows at window A
        self.usual: dict[int, float] = {}  # the same while no prompt waits, per rows
        self.last: Key | None = None  # the latest decode step's key
        self.decodes_at: dict[Key, int] = {}  # decode steps measured per key
        self.t_token: float | None = None  # seconds per token of a prefill chunk of its own
        self.t_long: float | None = None  # the same, of chunks of `_LONG_CHUNK` tokens or more
        self.samples: dict[MixKey, deque[tuple[int, float]]] = {}  # mixed: (tokens, seconds)
        self.mixed_run = 0  # mixed steps since the last plain decode step
        self.mix_last = _FIRST_MIX  # prompt tokens in the last mixed step

    @property
    def t_decode(self) -> float | None:
        """Seconds of the latest kind of decode step (the NPU's chunks are sized from it)."""
        return self.t_rows[self.last] if self.last is not None else None

    def decoded(self, rows: int, seconds: float, window: int, prompt_waits: bool) -> None:
        """A plain decode step of `rows` rows attending `window` slots; `prompt_waits`: a
        prompt is being read beside them (the step does not say what the streams usually
        cost)."""
        key = (rows, window)
        runs = self.decodes_at[key] = self.decodes_at.get(key, 0) + 1
        old = self.t_rows.get(key)  # the first step at a window also grows ORT's buffers
        self.t_rows[key] = min(old, seconds) if runs == 2 and old else ema(old, seconds, 0.3)
        if not prompt_waits:
            self.usual[rows] = ema(self.usual.get(rows), seconds, 0.3)
        self.last, self.mixed_run = key, 0

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens >= 2:
            self.t_token = ema(self.t_token, seconds / tokens, 0.3)
        if tokens >= _LONG_CHUNK:  # mostly the tokens' own cost, the weights' read spread thin
            self.t_long = ema(self.t_long, seconds / tokens, 0.3)

    def mixed(
        self, decodes: int, tokens: int, seconds: float, window: int, head: bool = True
    ) -> None:
        """Learn what a mixed step of `decodes` decode rows and `tokens` prompt tokens,
        attending `window` slots, costs (`_line`); `head`: with the prompt's logits row (the
        chunk that ends a part of the prompt), fitted apart."""
        self.mix_last = tokens
        self.mixed_run += 1
        key = (decodes, window, head)
        self.samples.setdefault(key, deque(maxlen=_SAMPLES)).append((tokens, seconds))

    def needs_refresh(self, decodes: int, own: int) -> bool:
        """Whether the next step should be a plain decode step of these rows (at their `own`
        window): its time is getting stale, or not known there from two steps (the first at a
        window is dearer)."""
        known = self.decodes_at.get((decodes, own), 0) >= 2
        if not known and any(c == own and n >= 2 for (_, c), n in self.decodes_at.items()):
            known = True  # another row count is known here (`_decode_time`)
        return self.mixed_run >= REFRESH_EVERY or not known

    def mix_tokens(self, decodes: int, own: int, window: int, head: bool = True) -> int:
        """Prompt tokens a mixed step attending `window` slots, with `decodes` decode rows
        (whose own decode steps attend `own`), can carry: as many as the step's fitted time
        keeps within `MIX_TARGET` of their usual step, growing at most twofold a step (no
        overshoot on a first, lucky measurement), at least one. At a window not mixed at yet
        it starts again from one token. `head`: a chunk that computes the prompt's logits row
        (one that ends a part of the prompt)."""
        usual = self.usual.get(decodes, self._decode_time(decodes, own))
        line = self._line(decodes, window, head)
        if usual is None or line is None:
            return _FIRST_MIX if not self.samples else 1
        fixed, per_token = line
        if self.t_long:  # a prompt token costs at least about half what it does in a chunk
            per_token = max(per_token, 0.5 * self.t_long)
        budget = MIX_TARGET * usual
        fit = (budget - fixed) / per_token
        samples = self.samples[(decodes, window, head)]
        seen = {n for n, _ in samples}
        if len(seen) == 1 and max(t for _, t in samples) < budget:
            fit = max(fit, next(iter(seen)) + 1)  # one size seen, under budget: try one more
        return int(max(1, min(self.prefill_chunk, fit, 2 * self.mix_last)))

    def chunk_tokens(self) -> int:
        """Prompt tokens a chunk of its own can take for about one decode step, at least one."""
        t_decode = self.t_decode
        if t_decode is None or self.t_token is None or self.t_token <= 0:
            return min(8, self.prefill_chunk)
        return int(max(1, min(self.prefill_chunk, t_decode / self.t_token)))

    def _decode_time(self, decodes: int, window: int) -> float | None:
        """A decode step of `decodes` rows at `window`: measured, or the nearest row count
        measured at that window (a step of 3 rows is never run alone when 4 stream)."""
        known = [(abs(b - decodes), t) for (b, c), t in self.t_rows.items() if c == window]
        return self.t_rows.get((decodes, window), min(known)[1] if known else None)

    def _line(self, decodes: int, window: int, head: bool) -> tuple[float, float] | None:
        """(fixed, per token) seconds of the recent mixed steps at this shape, `fixed + n *
        per_token`: the median of the slopes between pairs of steps of different sizes
        (Theil-Sen: one slow step among them, a busy moment, barely moves it), or, while a
        single size has been seen (or the slopes say nothing), the median time per token (its
        line through zero: dearer for larger chunks than the true one, so chunks err small).
        The whole step's time is fitted, not what it adds to a decode step: a difference of
        two noisy times let a loaded machine's slow decode step make the prompt look free."""
        samples = self.samples.get((decodes, window, head))
        if not samples:
            return None
        slopes = [
            (t2 - t1) / (n2 - n1) for (n1, t1), (n2, t2) in combinations(samples, 2) if n2 != n1
        ]
        slope = median(slopes) if slopes else 0.0
        if slope <= 0:
            return 0.0, max(median(t / n for n, t in samples), 1e-9)
        return max(0.0, median(t - slope * n for n, t in samples)), slope
