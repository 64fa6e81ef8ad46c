"""Speculative decoding: drafters propose, the target verifies k+1 tokens in one run.

One round, with the target's cache holding `context` and `pending` the token just chosen:
a drafter proposes d1..dk, the target runs `verify([pending, d1..dk])` (logits for every row),
the accepted prefix of the draft plus one target token come out, and the cache is rolled back to
what was accepted (a static cache: move `n`).

Acceptance (Leviathan et al. 2023, Chen et al. 2023): with p the target's distribution and q the
draft's, both after the same warps (`sampler.distribution`), draft token x is accepted with
probability min(1, p(x)/q(x)); at the first rejection the token is drawn from
normalize(max(0, p − q)); when all k are accepted a bonus token is drawn from p. The output then
has exactly the target's distribution. At temperature 0 p and q are one-hot, so this is "accept
while the target's argmax equals the draft".

Exactness rests on the target's `verify` rows being bit-identical to what `decode` would have
returned at each position (the model module says how: row-padded decode steps and K/V
scattered into the cache before attention). So greedy acceptance simply compares argmaxes, and
the K/V rows a verify leaves in the cache are the ones plain decoding would have written.

Adaptive k: `CostModel` measures, at load (`calibrate`) and while generating, the target's decode
step, its verify time at each width, each drafter's own costs and its acceptance rate, and picks
the k with the best expected tokens per second — or k = 0 (plain decoding) when no k beats
decoding by a margin, counting a draft model's catch-up prefill. Unmeasured verify widths are
interpolated from measured ones; a drafter that is not used is retried now and then, so its
acceptance estimate follows the conversation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial

import numpy as np

from .drafters import Draft, Drafter, RecentTimes, ema
from .model import Model
from .sampler import Sampler, apply_penalties, distribution, draw, is_greedy
from .sequence import Sequence

__all__ = ["CostModel", "SpecStats", "SpeculativeDecoder", "residual"]

EXPLORE_EVERY = 16  # plain rounds before the first retry of a drafter that did not pay
EXPLORE_BACKOFF_MAX = 16  # each fruitless retry doubles the wait, up to 16 × EXPLORE_EVERY
GAIN_MARGIN = 0.03  # speculate only when expected ≥ 3% faster than plain decoding
HORIZON = 128  # tokens a catch-up prefill must pay for itself within


def residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """Distribution to draw from after draft token x was rejected: normalize(max(0, p − q)).

    q None means a deterministic draft (one-hot at x): the residual is p without x.
    """
    if q is None:
        r = p.copy()
        r[x] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    total = r.sum()
    if total <= 0.0:  # p == q: rejection had probability 0; p is the answer either way
        return p
    return r / total


@dataclass
class SpecStats:
    """Per-reply speculation figures, for `Metrics`."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # verify rounds (rounds with a draft)
    draft_s: float = 0.0  # drafting, catch-up included
    target_s: float = 0.0  # target steps: verify rounds and plain decode rounds
    k: int = 0  # k of the latest round

    @property
    def mean_accepted_len(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def draft_time_share(self) -> float:
        total = self.draft_s + self.target_s
        return self.draft_s / total if total > 0 else 0.0


class CostModel:
    """Run-time measurements behind the choice of k (see module doc); times in seconds."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._dec = RecentTimes()
        self._ver: dict[int, RecentTimes] = {}
        self.alpha: dict[str, float] = {}
        self.sync_s: dict[str, float] = {}
        self.idle: dict[str, int] = {}  # plain rounds since a drafter was last tried
        self.backoff: dict[str, int] = {}  # retry wait multiplier (1 after the drafter paid)

    # measurements
    @property
    def t_dec(self) -> float | None:
        return self._dec.estimate()

    @property
    def t_ver(self) -> dict[int, float]:
        return {w: r.estimate() for w, r in self._ver.items()}  # type: ignore[misc]

    def record_decode(self, dt: float) -> None:
        self._dec.add(dt)

    def record_verify(self, width: int, dt: float) -> None:
        self._ver.setdefault(width, RecentTimes()).add(dt)

    def record_draft(
        self, name: str, sync_s: float, outcomes: Seq[bool], prior: float = 0.7
    ) -> None:
        self.sync_s[name] = ema(self.sync_s.get(name), sync_s)
        a = self.alpha.get(name, prior)
        for ok in outcomes:
            a = 0.8 * a + 0.2 * float(ok)
        self.alpha[name] = a

    # estimates
    def verify_cost(self, width: int) -> float:
        """Measured, or interpolated from measured widths (an optimistic guess when none)."""
        t_dec, t_ver = self.t_dec, self.t_ver
        assert t_dec is not None
        if width in t_ver:
            return t_ver[width]
        known = sorted({1: t_dec, **t_ver}.items())
        if len(known) == 1:
            return t_dec * (1.0 + 0.1 * (width - 1))
        ws = np.array([w for w, _ in known], dtype=float)
        ts = np.array([t for _, t in known])
        if width > ws[-1]:  # extrapolate with the last slope
            slope = (ts[-1] - ts[-2]) / (ws[-1] - ws[-2])
            return float(ts[-1] + max(slope, 0.0) * (width - ws[-1]))
        return float(np.interp(width, ws, ts))

    def rate(self, drafter: Drafter, k: int) -> float:
        """Expected tokens per second of a round drafting k tokens (k = 0: plain decoding)."""
        assert self.t_dec is not None
        if k == 0:
            return 1.0 / self.t_dec
        alpha = min(self.alpha.get(drafter.name, drafter.prior_alpha), 0.99)
        expected = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        step = drafter.stats.step_s or 0.0
        sync = self.sync_s.get(drafter.name, step)  # until measured: about one draft step
        cost = self.verify_cost(k + 1) + sync + (k - 1) * step
        return expected / cost

    def pays(self, drafter: Drafter, k: int) -> bool:
        return self.rate(drafter, k) > self.rate(drafter, 0) * (1.0 + GAIN_MARGIN)

    def choose_k(self, drafter: Drafter, context: Seq[int], limit: int) -> int:
        """The k with the best expected throughput for this drafter, or 0 (plain decoding)."""
        if self.t_dec is None or limit < 1:
            return 0
        best_k, best_rate = 0, self.rate(drafter, 0) * (1.0 + GAIN_MARGIN)
        for k in range(1, min(limit, self.max_k) + 1):
            r = self.rate(drafter, k)
            if r > best_rate:
                best_k, best_rate = k, r
        if best_k == 0:
            return 0
        behind = drafter.catch_up(context)
        if behind > 2:  # a catch-up prefill must pay for itself (twice: estimates are rough)
            per_token = drafter.stats.prefill_token_s or drafter.stats.step_s or 0.0
            gain = min(HORIZON, limit + 1) * (self.t_dec - 1.0 / best_rate)
            if 2.0 * behind * per_token > gain:
                return 0
        return best_k

    def explore(self, drafter: Drafter, context: Seq[int]) -> bool:
        """Whether to try an unprofitable drafter once more (its acceptance may have changed).

        Each retry that did not make the drafter pay doubles the wait: a draft model that never
        pays on this machine costs less and less (measured: retries every 16 rounds cost
        "both" ~5% on a chat prompt where lookup alone broke even).
        """
        name = drafter.name
        n = self.idle.get(name, 0) + 1
        self.idle[name] = n
        backoff = self.backoff.get(name, 1)
        if n >= EXPLORE_EVERY * backoff and drafter.catch_up(context) <= 2:
            self.idle[name] = 0
            self.backoff[name] = min(2 * backoff, EXPLORE_BACKOFF_MAX)
            return True
        return False


class SpeculativeDecoder:
    """Produces the next tokens of a reply with drafts + one verify, or one decode (k = 0)."""

    def __init__(
        self,
        target: Model,
        drafters: Seq[Drafter],
        *,
        max_k: int | None = None,
        fixed_k: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`fixed_k` drafts that many tokens every round, bypassing the cost model (tests)."""
        self.target = target
        self.drafters = list(drafters)
        self.max_k = min(max_k if max_k is not None else target.verify_k, target.verify_k)
        self.fixed_k = fixed_k
        self.costs = CostModel(self.max_k)
        self.stats = SpecStats()
        self._clock = clock

    @property
    def name(self) -> str:
        return "+".join(d.name for d in self.drafters)

    def calibrate(
        self, seq: Sequence, probe: Seq[int] = (16, 17, 18, 19, 20, 21, 22, 23, 24)
    ) -> None:
        """Time a decode step and a few verify widths now, so the first reply starts with
        measured costs (widths in between are interpolated, the rest measured as used).

        Runs at the end of `seq` (a sequence on the target) and rolls back, so the cached
        conversation is untouched.
        """
        target, n = seq, seq.n_past
        if n + self.max_k + 2 > target.max_capacity:
            return
        ids = [int(t) for t in probe]
        clock = self._clock

        def fastest(run: Callable[[], object], timed: int) -> float:
            """Best of `timed` runs after a warm-up: other processes only ever add time."""
            times = []
            for i in range(timed + 1):
                t0 = clock()
                run()
                target.rollback(n)
                if i:
                    times.append(clock() - t0)
            return min(times)

        # Few runs: this is part of start-up. Widths in between are interpolated, and every
        # verify a reply runs refines the figures.
        self.costs.record_decode(fastest(lambda: target.decode(ids[0]), 2))
        for w in sorted({min(5, self.max_k + 1), self.max_k + 1}):
            if w >= 2:
                self.costs.record_verify(w, fastest(partial(target.verify, ids[:w]), 1))

    def new_reply(self) -> None:
        self.stats = SpecStats()

    def close(self) -> None:
        for d in self.drafters:
            d.close()

    def advance(
        self, target: Sequence, pending: int, sampler: Sampler, budget: int
    ) -> tuple[list[int], list[int]]:
        """One round after `pending` (chosen, not yet in `target`, the target's sequence).

        Returns (committed, new): `committed` is now in `target` after what it held
        ([pending] + accepted drafts); `new` are the next reply tokens (accepted drafts + one
        target token), at most `budget`, already recorded in the sampler's history.
        """
        limit = min(budget - 1, target.max_capacity - target.n_past - 1)
        base = target.n_past
        seq = [*target.tokens, pending]
        draft = self._draft(seq, sampler, limit) if self.drafters and limit >= 1 else None
        if draft is None:
            self.stats.k = 0
            t0 = self._clock()
            logits = target.decode(pending)
            token = sampler.sample(logits)
            dt = self._clock() - t0
            self.costs.record_decode(dt)
            self.stats.target_s += dt
            return [pending], [token]
        drafter, d = draft
        t0 = self._clock()
        rows = target.verify([pending, *d.tokens])
        if is_greedy(sampler.params):
            n_acc, token, outcomes = self._accept_greedy(rows, d.tokens, sampler)
        else:
            n_acc, token, outcomes = self._accept_sampled(rows, d, sampler)
        accepted = d.tokens[:n_acc]
        target.rollback(base + 1 + n_acc)
        dt = self._clock() - t0
        self.costs.record_verify(len(d.tokens) + 1, dt)
        self.costs.record_draft(drafter.name, d.sync_s, outcomes, drafter.prior_alpha)
        for t in accepted:
            sampler.accept(t)
        sampler.accept(token)
        st = self.stats
        st.drafted += len(d.tokens)
        st.accepted += n_acc
        st.rounds += 1
        st.k = len(d.tokens)
        st.draft_s += d.sync_s + d.step_s
        st.target_s += dt
        return [pending, *accepted], [*accepted, token]

    def _draft(self, seq: list[int], sampler: Sampler, limit: int) -> tuple[Drafter, Draft] | None:
        for drafter in self.drafters:
            if drafter.free and self.fixed_k is None:
                d = self._free_draft(drafter, seq, sampler, limit)
                if d is not None:
                    return drafter, d
                continue
            if self.fixed_k is not None:
                k = min(self.fixed_k, limit, self.max_k)
            else:
                k = self.costs.choose_k(drafter, seq, limit)
                if k > 0:
                    self.costs.backoff[drafter.name] = 1
                elif self.costs.t_dec is not None and self.costs.explore(drafter, seq):
                    k = 1
            if k == 0:
                continue
            d = drafter.propose(seq, k, sampler.params, sampler.history, sampler.rng)
            short = len(d.tokens) < k and self.fixed_k is None and k > 1
            if d.tokens and not (short and not self.costs.pays(drafter, len(d.tokens))):
                self.costs.idle[drafter.name] = 0
                return drafter, d
            self.stats.draft_s += d.sync_s + d.step_s
        return None

    def _free_draft(
        self, drafter: Drafter, seq: list[int], sampler: Sampler, limit: int
    ) -> Draft | None:
        """A free drafter proposes first and k is chosen for the proposal's own length (a retry
        is spent only where there is a draft to try), then the draft is cut to k."""
        d = drafter.propose(
            seq, min(limit, self.max_k), sampler.params, sampler.history, sampler.rng
        )
        k = self.costs.choose_k(drafter, seq, len(d.tokens)) if d.tokens else 0
        if k > 0:
            self.costs.backoff[drafter.name] = 1
        elif d.tokens and self.costs.t_dec is not None and self.costs.explore(drafter, seq):
            k = 1
        if k == 0:
            self.stats.draft_s += d.sync_s
            return None
        self.costs.idle[drafter.name] = 0
        d.tokens = d.tokens[:k]
        return d

    def _accept_greedy(
        self, rows: np.ndarray, drafts: list[int], sampler: Sampler
    ) -> tuple[int, int, list[bool]]:
        """(accepted count, next token, per-draft outcomes): the target's argmax, row by row."""
        hist = list(sampler.history)
        outcomes: list[bool] = []
        for i in range(len(drafts) + 1):
            row = apply_penalties(rows[i], hist, sampler.params)
            top = int(np.argmax(row))
            if i < len(drafts) and top == drafts[i]:
                outcomes.append(True)
                hist.append(top)
                continue
            if i < len(drafts):
                outcomes.append(False)
            return i, top, outcomes
        raise AssertionError("unreachable")

    def _accept_sampled(
        self, rows: np.ndarray, d: Draft, sampler: Sampler
    ) -> tuple[int, int, list[bool]]:
        """Leviathan/Chen acceptance (module doc); (accepted count, next token, outcomes)."""
        params, rng = sampler.params, sampler.rng
        hist = list(sampler.history)
        outcomes: list[bool] = []
        for i, x in enumerate(d.tokens):
            p = distribution(rows[i], params, hist)
            q = d.q[i] if d.q is not None else None
            qx = q[x] if q is not None else 1.0
            if rng.random() * qx < p[x]:  # probability min(1, p(x)/q(x))
                outcomes.append(True)
                hist.append(x)
                continue
            outcomes.append(False)
            return i, draw(residual(p, q, x), rng), outcomes
        p = distribution(rows[len(d.tokens)], params, hist)
        return len(d.tokens), draw(p, rng), outcomes
