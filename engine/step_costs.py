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

The gap that matters is a stream's *longest* one, so chunks are sized for the dearest step, not
the typical one: steps of one shape vary by ~15% from run to run, so the fitted time aims at
`MIX_TARGET` (1.35) for the dearest to stay within `MIX_LIMIT` (1.6). While one chunk size has
been seen, the next size is predicted as the decode rows' own step plus what the chunk added to
it, per token (more than the true slope, as the prompt row's fixed part is counted per token:
errs small); a blind "one token more" probe made a two-token step of the 0.5B, 1.6-1.7x.
"""

from __future__ import annotations

from collections import deque
from itertools import combinations
from statistics import median

from .drafters import ema

__all__ = ["MIX_LIMIT", "MIX_TARGET", "REFRESH_EVERY", "StepCosts"]

MIX_TARGET = 1.35  # a mixed step (decodes + a prefill chunk) is sized to cost this many usual steps
MIX_LIMIT = 1.6  # and the dearest of them should stay within this many (module doc)
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
        if runs == 2 and old:
            self.t_rows[key] = min(old, seconds)
        else:  # quick to come down: mixed steps are budgeted from it too (`mix_tokens`)
            self.t_rows[key] = ema(old, seconds, 0.7 if old and seconds < old else 0.3)
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
        keeps within `MIX_TARGET` of their usual step, or of their latest plain step where
        that is less (the machine got quieter since the usual one: a budget from a busier
        moment's wall times let 3-4 token chunks cost 1.6-1.85 of the steps beside them),
        growing at most 1.5x a step (no overshoot on a first, lucky measurement), at least
        one. At a window not mixed at yet
        it starts again from one token. `head`: a chunk that computes the prompt's logits row
        (one that ends a part of the prompt)."""
        decode = self._decode_time(decodes, own)
        usual = self.usual.get(decodes, decode)
        floor = min(usual, decode) if usual is not None and decode is not None else None
        line = self._line(decodes, window, head, floor)
        if usual is None or line is None:
            return _FIRST_MIX if not self.samples else 1
        fixed, per_token = line
        if self.t_long:  # a prompt token costs at least about half what it does in a chunk
            per_token = max(per_token, 0.5 * self.t_long)
        fit = (MIX_TARGET * (floor or usual) - fixed) / per_token
        grown = max(self.mix_last + 1, 3 * self.mix_last // 2)
        return int(max(1, min(self.prefill_chunk, fit, grown)))

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

    def _line(
        self, decodes: int, window: int, head: bool, decode: float | None
    ) -> tuple[float, float] | None:
        """(fixed, per token) seconds of the recent mixed steps at this shape, `fixed + n *
        per_token`: the median of the slopes between pairs of steps of different sizes
        (Theil-Sen: one slow step among them, a busy moment, barely moves it); while a single
        size has been seen (or the slopes say nothing), the line from the decode rows' own
        step (`decode`: the lesser of it and their usual one) through that size's median
        (module doc), or, not knowing that step, the line
        through zero (dearer for larger chunks than the true one, so chunks err small). The
        whole step's time is fitted, not what it adds to a decode step: a difference of two
        noisy times let a loaded machine's slow decode step make the prompt look free."""
        samples = self.samples.get((decodes, window, head))
        if not samples:
            return None
        slopes = [
            (t2 - t1) / (n2 - n1) for (n1, t1), (n2, t2) in combinations(samples, 2) if n2 != n1
        ]
        slope = median(slopes) if slopes else 0.0
        if slope > 0:
            fixed = sorted(t - slope * n for n, t in samples)  # through the dearest but one
            return max(0.0, fixed[-2] if len(fixed) > 2 else fixed[-1]), slope
        n, t = min(samples)[0], median(t for n0, t in samples if n0 == min(samples)[0])
        if decode is not None and t > decode:
            return decode, (t - decode) / n
        return 0.0, max(median(t / n for n, t in samples), 1e-9)
