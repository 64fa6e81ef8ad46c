"""JSON mode in the sampler: each token is drawn from those that keep the reply a prefix of one
JSON object (`json_prefix`), the rest of the sampling settings applied as usual.

Only the tokens the sampler could pick are asked about: at temperature 0 the likeliest tokens in
order until one fits (the first almost always does); sampled, the tokens the warps keep (top-k,
top-p, min-p; at most the `_MOST_DRAWN` likeliest of them, where the warps are off and keep the
whole vocabulary) with the ones that do not fit taken out and the rest renormalised. Where none of
those fits, the likeliest token that does is taken, so the format holds whatever the settings.
A reply in JSON mode ends when its object closes.
"""

from __future__ import annotations

from collections.abc import Callable, Set

import numpy as np

from .json_prefix import JsonPrefix
from .sampler import Sampler, apply_penalties, distribution, draw, is_greedy

__all__ = ["JsonConstraint"]

_FIRST_LOOK = 64  # likeliest tokens ranked before the whole vocabulary is
_MOST_DRAWN = 256  # sampled: the likeliest tokens asked whether they fit


class JsonConstraint:
    """The reply's JSON state and the choice of each next token under it."""

    def __init__(self, piece: Callable[[int], bytes], end_ids: Set[int]) -> None:
        self._piece = piece  # a token's bytes
        self._end_ids = end_ids
        self.state = JsonPrefix()

    @property
    def done(self) -> bool:
        return self.state.done

    def _after(self, token: int) -> JsonPrefix | None:
        """The state after `token`, or None where it does not fit."""
        if token in self._end_ids:
            return None  # the reply ends when the object closes, never before
        data = self._piece(token)
        return self.state.feed(data) if data else None

    def choose(self, logits: np.ndarray, sampler: Sampler) -> int | None:
        """The next token, drawn as `sampler` would among those that fit (module doc) and
        recorded in its history; None where no token of the vocabulary fits."""
        params = sampler.params
        token: int | None = None
        if not is_greedy(params):
            probs = distribution(logits, params, sampler.history)
            support = np.flatnonzero(probs)
            if len(support) > _MOST_DRAWN:
                support = support[np.argpartition(-probs[support], _MOST_DRAWN - 1)[:_MOST_DRAWN]]
            fits = [int(t) for t in support if self._after(int(t)) is not None]
            if fits:
                kept = np.zeros_like(probs)
                kept[fits] = probs[fits]
                token = draw(kept / kept.sum(), sampler.rng)
        if token is None:
            x = apply_penalties(np.asarray(logits, dtype=np.float64), sampler.history, params)
            token = self._likeliest(x)
        if token is None:
            return None
        after = self._after(token)
        assert after is not None
        self.state = after
        sampler.accept(token)
        return token

    def _likeliest(self, x: np.ndarray) -> int | None:
        n = min(_FIRST_LOOK, x.shape[0])
        first = np.argpartition(-x, n - 1)[:n]
        for order in (first[np.argsort(-x[first], kind="stable")], np.argsort(-x, kind="stable")):
            for t in order:
                if self._after(int(t)) is not None:
                    return int(t)
        return None
