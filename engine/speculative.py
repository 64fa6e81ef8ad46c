"""Speculative decoding: drafters propose, the target verifies k+1 tokens in one run.

One round, with the target's cache holding `context` and `pending` the token just chosen:
a drafter proposes d1..dk, the target runs `verify([pending, d1..dk])` (logits for every row),
the accepted prefix of the draft plus one target token come out, and the cache is rolled back to
what was accepted (a static cache: move `n`).

Which drafts are kept is the acceptance rule (`acceptance`: Leviathan et al. 2023, Chen et al.
2023), under which the output has exactly the target's distribution.

Under a JSON schema the grammar takes part: the tokens it forces next (a key's name) lead the
round's draft and a drafter continues after them, a deterministic draft is cut where the grammar
stops allowing it, and each verify row is restricted as plain constrained decoding restricts its
logits, so a constrained reply is the same with or without drafting.

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

from .acceptance import accept_greedy, accept_sampled
from .drafters import Draft, Drafter, RecentTimes, ema
from .grammar import Constraint, next_token
from .model import Model
from .sampler import Sampler, is_greedy
from .sequence import Sequence

__all__ = ["CostModel", "SpecStats", "SpeculativeDecoder"]

EXPLORE_EVERY = 16  # plain rounds before the first retry of a drafter that did not pay
EXPLORE_BACKOFF_MAX = 16  # each fruitless retry doubles the wait, up to 16 × EXPLORE_EVERY
GAIN_MARGIN = 0.03  # speculate only when expected ≥ 3% faster than plain decoding
HORIZON = 128  # tokens a catch-up prefill must pay for itself within


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
        # the logits each token of the last round's `new` was chosen from (verify rows are
        # what decode steps would have given: a drafted token's log probability is exact)
        self.last_logits: list[np.ndarray] = []

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
        self,
        target: Sequence,
        pending: int,
        sampler: Sampler,
        budget: int,
        shape: Constraint | None = None,
    ) -> tuple[list[int], list[int]]:
        """One round after `pending` (chosen, not yet in `target`, the target's sequence), held
        to `shape` when the reply is held to a JSON schema (`acceptance` says how).

        Returns (committed, new): `committed` is now in `target` after what it held
        ([pending] + accepted drafts); `new` are the next reply tokens (accepted drafts + one
        target token; -1: under a schema nothing fits, the reply ends), at most `budget`,
        already recorded in the sampler's history.
        """
        limit = min(budget - 1, target.max_capacity - target.n_past - 1)
        base = target.n_past
        seq = [*target.tokens, pending]
        draft = self._draft(seq, sampler, limit, shape) if limit >= 1 else None
        if draft is None:
            self.stats.k = 0
            t0 = self._clock()
            logits = target.decode(pending)
            token = next_token(logits, sampler, shape)
            dt = self._clock() - t0
            self.costs.record_decode(dt)
            self.stats.target_s += dt
            self.last_logits = [logits]
            return [pending], [token]
        drafter, d = draft
        t0 = self._clock()
        rows = target.verify([pending, *d.tokens])
        if is_greedy(sampler.params):
            n_acc, token, outcomes = accept_greedy(rows, d.tokens, sampler, shape)
        else:
            n_acc, token, outcomes = accept_sampled(rows, d, sampler, shape)
        accepted = d.tokens[:n_acc]
        self.last_logits = list(rows[: n_acc + 1])
        target.rollback(base + 1 + n_acc)
        dt = self._clock() - t0
        self.costs.record_verify(len(d.tokens) + 1, dt)
        if drafter is not None:  # (what the grammar forced is not the drafter's to count)
            mine = outcomes[d.forced :]
            self.costs.record_draft(drafter.name, d.sync_s, mine, drafter.prior_alpha)
        for t in accepted:
            sampler.accept(t)
        if token >= 0:
            sampler.accept(token)
        st = self.stats
        st.drafted += len(d.tokens)
        st.accepted += n_acc
        st.rounds += 1
        st.k = len(d.tokens)
        st.draft_s += d.sync_s + d.step_s
        st.target_s += dt
        return [pending, *accepted], [*accepted, token]

    def _draft(
        self, seq: list[int], sampler: Sampler, limit: int, shape: Constraint | None
    ) -> tuple[Drafter | None, Draft] | None:
        """A draft to verify and its drafter (None: the grammar's alone). Under a schema the
        tokens the grammar forces next (a key's name) come first and a drafter continues after
        them, its proposal cut where the grammar stops allowing it."""
        forced = shape.forced()[: min(limit, self.max_k)] if shape is not None else []
        room = min(limit, self.max_k) - len(forced)
        fit = partial(_fitting, shape=shape, before=forced)
        after = [*seq, *forced] if forced else seq
        found = self._proposal(after, sampler, room, fit) if room >= 1 else None
        if found is None:
            return (None, Draft(forced, forced=len(forced))) if forced else None
        drafter, d = found
        if forced:
            d.tokens = [*forced, *d.tokens]
            d.forced = len(forced)
            if d.q is not None:  # a forced token is a deterministic draft: q one-hot
                d.q = [np.eye(1, len(d.q[0]), t)[0] for t in forced] + d.q
        return drafter, d

    def _proposal(
        self, seq: list[int], sampler: Sampler, limit: int, fit: Callable[[Draft], Draft]
    ) -> tuple[Drafter, Draft] | None:
        """The first drafter's proposal after `seq` that the cost model takes, through `fit`."""
        for drafter in self.drafters:
            if drafter.free and self.fixed_k is None:
                d = self._free_draft(drafter, seq, sampler, limit, fit)
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
            d = fit(drafter.propose(seq, k, sampler.params, sampler.history, sampler.rng))
            short = len(d.tokens) < k and self.fixed_k is None and k > 1
            if d.tokens and not (short and not self.costs.pays(drafter, len(d.tokens))):
                self.costs.idle[drafter.name] = 0
                return drafter, d
            self.stats.draft_s += d.sync_s + d.step_s
        return None

    def _free_draft(
        self,
        drafter: Drafter,
        seq: list[int],
        sampler: Sampler,
        limit: int,
        fit: Callable[[Draft], Draft],
    ) -> Draft | None:
        """A free drafter proposes first and k is chosen for the proposal's own length (a retry
        is spent only where there is a draft to try), then the draft is cut to k."""
        k = min(limit, self.max_k)
        d = fit(drafter.propose(seq, k, sampler.params, sampler.history, sampler.rng))
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


def _fitting(d: Draft, shape: Constraint | None, before: list[int]) -> Draft:
    """A deterministic draft (to follow `before`) cut where the grammar stops allowing it: its
    later tokens could only be rejected. A sampled one (with q) is left whole: cutting it would
    change which tokens come out (a rejected draw's residual is not the target's distribution),
    and the acceptance rule rejects a token the grammar forbids anyway (p = 0)."""
    if shape is not None and d.q is None:
        d.tokens = d.tokens[: max(0, shape.fits([*before, *d.tokens]) - len(before))]
    return d
