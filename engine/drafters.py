"""Drafters for speculative decoding: who proposes the next few tokens for the target to check.

Both drafters take the target's whole token sequence on every call and work out themselves what
they already know of it, so they stay in sync on every path the session takes (prefix reuse,
edits, regenerate, dropped turns, cancellation) without the session telling them what happened:

- `ModelDrafter`: a smaller model sharing the target's vocabulary, with its own static KV cache
  (one `Sequence` on the draft model: the owner of which tokens its cache holds). It is rolled
  back to the longest common prefix with the target's sequence and the rest is prefilled,
  exactly as the session does for the target.
- `LookupDrafter` (prompt lookup): the continuation of the most recent earlier occurrence of the
  sequence's last n-gram. Costs almost nothing, and pays when a reply quotes the prompt (code
  edits) or repeats itself.

A drafter returns the draft tokens and, for a sampled draft, the distribution `q` each token was
drawn from; a deterministic proposal has q = one-hot, which the acceptance rule handles exactly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .events import SamplingParams
from .model import Model
from .prefix_store import common_prefix_len
from .sampler import distribution, draw, is_greedy, penalised
from .sequence import Sequence as KVSequence

__all__ = ["Draft", "Drafter", "LookupDrafter", "ModelDrafter", "RecentTimes", "ema"]


@dataclass
class Draft:
    """Proposed tokens; `q[i]` is the distribution token i was drawn from (None: one-hot)."""

    tokens: list[int]
    q: list[np.ndarray] | None = None
    sync_s: float = 0.0  # time spent catching the drafter up with the sequence
    step_s: float = 0.0  # time spent producing the tokens
    forced: int = 0  # leading tokens a grammar forced (not the drafter's proposal)


@dataclass
class _Stats:
    """What a drafter knows of its own costs, measured as it runs (seconds)."""

    step_s: float | None = None  # one drafting step
    prefill_token_s: float | None = None  # one token of catch-up prefill


class Drafter:
    """Base class: a named source of draft tokens (see module doc)."""

    name: str = "drafter"
    stats: _Stats
    prior_alpha: float = 0.7  # acceptance assumed before any is measured
    free = False  # proposing costs nothing: propose first, then let the cost model cut it

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        history: Sequence[int],
        rng: np.random.Generator,
    ) -> Draft:
        raise NotImplementedError

    def catch_up(self, context: Sequence[int]) -> int:
        """Tokens the drafter must process before it can draft after `context`."""
        return 0

    def close(self) -> None:
        pass


class LookupDrafter(Drafter):
    """Prompt-lookup drafting: continue the earlier occurrence of the last n tokens whose
    preceding tokens agree longest with the sequence's end (the latest one on ties).

    The n-gram index (n-gram -> the positions after its occurrences) grows with the sequence,
    so each call costs O(new tokens) plus a bounded look at the latest `candidates`
    occurrences. A short n-gram ("    return", ") -> ") occurs all over a conversation with
    code in it; the occurrence whose earlier tokens also match (the function being copied, not
    the reply's own last line) is the one whose continuation the target repeats.
    """

    name = "lookup"
    # n-gram matches are often spurious outside quoted text: assume little until measured
    prior_alpha = 0.5
    free = True

    def __init__(
        self, max_ngram: int = 4, min_ngram: int = 2, candidates: int = 16, extend: int = 64
    ) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.candidates = candidates  # latest occurrences compared backwards
        self.extend = extend  # the longest agreement measured (tokens)
        self.stats = _Stats(step_s=0.0, prefill_token_s=0.0)
        self._seq: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self._seq)
        if len(context) < n or list(context[:n]) != self._seq:  # an edit: index again
            self._seq, self._index, n = [], {}, 0
        self._seq.extend(int(t) for t in context[n:])
        seq, index = self._seq, self._index
        # an n-gram ending at e (exclusive) maps to e, once a token at e exists to propose
        for e in range(max(1, n), len(seq)):
            for g in range(self.min_ngram, self.max_ngram + 1):
                if e - g >= 0:
                    index.setdefault(tuple(seq[e - g : e]), []).append(e)

    def _best(self, ends: list[int], g: int) -> int:
        """The position after the occurrence, among the latest `candidates`, whose preceding
        tokens agree longest with the sequence's end."""
        seq, n = self._seq, len(self._seq)
        best, best_len = ends[-1], -1
        for e in reversed(ends[-self.candidates :]):
            agree, top = g, min(self.extend, e)
            while agree < top and seq[e - agree - 1] == seq[n - agree - 1]:
                agree += 1
            if agree > best_len:
                best, best_len = e, agree
        return best

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        history: Sequence[int],
        rng: np.random.Generator,
    ) -> Draft:
        t0 = time.perf_counter()
        self._sync(context)
        seq = self._seq
        out: list[int] = []
        for g in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(seq) < g:
                continue
            ends = self._index.get(tuple(seq[-g:]))
            if ends:
                at = self._best(ends, g)
                out = seq[at : at + k]
                break
        return Draft(list(out), None, sync_s=time.perf_counter() - t0)


class ModelDrafter(Drafter):
    """A draft model with its own static cache, kept equal to a prefix of the target's tokens."""

    def __init__(self, model: Model, name: str = "draft") -> None:
        self.model = model
        model.exact_decode = False  # a draft's guesses need not match its own verify rows
        self.name = name
        self.stats = _Stats()
        self.seq = KVSequence(model)  # the tokens whose K/V are in the draft cache

    def catch_up(self, context: Sequence[int]) -> int:
        keep = min(common_prefix_len(self.seq.tokens, context), len(context) - 1)
        return len(context) - self.seq.usable(keep)

    def _sync(self, context: Sequence[int]) -> np.ndarray:
        """Roll back to the common prefix, prefill the rest; logits after `context`."""
        keep = min(common_prefix_len(self.seq.tokens, context), len(context) - 1)
        keep = self.seq.usable(keep)  # a sliding-window draft may have to start over
        self.seq.rollback(keep)
        rest = [int(t) for t in context[keep:]]
        t0 = time.perf_counter()
        logits = self.seq.prefill(rest)
        dt = time.perf_counter() - t0
        if len(rest) >= 8:  # long enough to say what a token of catch-up costs
            self.stats.prefill_token_s = ema(self.stats.prefill_token_s, dt / len(rest))
        return logits

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        history: Sequence[int],
        rng: np.random.Generator,
    ) -> Draft:
        if k < 1 or len(context) + k > self.model.max_capacity:
            return Draft([])
        t0 = time.perf_counter()
        logits = self._sync(context)
        t1 = time.perf_counter()
        greedy = is_greedy(params) and not penalised(params)
        hist = list(history)
        tokens: list[int] = []
        qs: list[np.ndarray] | None = None if greedy else []
        for i in range(k):
            if greedy:
                tok = int(np.argmax(logits))
            else:
                q = distribution(logits, params, hist)
                tok = draw(q, rng)
                assert qs is not None
                qs.append(q)
            tokens.append(tok)
            hist.append(tok)
            if i < k - 1:  # the last draft token is fed next round, if the target accepts it
                logits = self.seq.decode(tok)
        t2 = time.perf_counter()
        if k > 1:
            self.stats.step_s = ema(self.stats.step_s, (t2 - t1) / (k - 1))
        return Draft(tokens, qs, sync_s=t1 - t0, step_s=t2 - t1)

    def calibrate(self, probe: Sequence[int]) -> None:
        """Time a few steps on a scratch cache, so the cost model knows the draft before use."""
        self.seq.rollback(0)
        t0 = time.perf_counter()
        self.seq.prefill(list(probe))
        self.stats.prefill_token_s = (time.perf_counter() - t0) / len(probe)
        times = []  # the fastest of a few: other processes only ever add time
        for t in probe[:4]:
            t1 = time.perf_counter()
            self.seq.decode(int(t))
            times.append(time.perf_counter() - t1)
        self.stats.step_s = min(times[1:])
        self.seq.rollback(0)

    def close(self) -> None:
        self.model.close()


def ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average (`old` None: the first sample); step costs drift slowly."""
    return new if old is None else (1 - weight) * old + weight * new


class RecentTimes:
    """A step time from its last few samples: the lower quartile.

    Other processes on the machine only ever add time to a sample, so a low quantile of recent
    samples tracks what a step costs while ignoring preempted ones; a lasting change (a longer
    context, a busier machine) moves it within a few samples.
    """

    def __init__(self, size: int = 9) -> None:
        self.samples: deque[float] = deque(maxlen=size)

    def add(self, dt: float) -> None:
        self.samples.append(dt)

    def estimate(self) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[len(ordered) // 4]
