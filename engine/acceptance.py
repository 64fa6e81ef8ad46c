"""Which drafted tokens the target keeps: the acceptance rule of speculative decoding.

Given the target's verify rows for `[pending, d1..dk]` (row i: the logits after d_i), the rule
returns how many drafts are accepted and the token that follows them, so that the reply has
exactly the distribution plain decoding gives (Leviathan et al. 2023, Chen et al. 2023): draft
token x is kept with probability min(1, p(x)/q(x)), the first rejected one is replaced by a draw
from normalize(max(0, p − q)), and after k kept drafts a bonus token is drawn from p. At
temperature 0 that is "keep while the target's argmax equals the draft".

Under a JSON schema (`shape`) each row is restricted the way plain decoding restricts its logits
(the tokens the grammar does not allow next set to -inf, before the penalties, as
`Constraint.choose` does), the grammar consuming each kept token before the next row is read, so
p is the distribution the constrained sampler would have drawn from at that point. A draft that
completes the value ends the round there: it becomes the round's own token (the reply stops
after it, as it would after a decoded one). A row where nothing fits ends the reply (-1).
"""

from __future__ import annotations

import numpy as np

from .drafters import Draft
from .grammar import Constraint
from .sampler import Sampler, apply_penalties, distribution, draw

__all__ = ["accept_greedy", "accept_sampled", "residual"]

Outcome = tuple[int, int, list[bool]]  # (drafts kept, the token after them, per-draft outcomes)


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


def _restricted(row: np.ndarray, shape: Constraint | None) -> np.ndarray | None:
    return row if shape is None else shape.restrict(row)


def _last(token: int, shape: Constraint | None) -> int:
    """The round's own token, consumed by the grammar (-1: it does not fit; the reply ends)."""
    return token if shape is None or shape.consume(token) else -1


def _completes(token: int, shape: Constraint | None) -> bool:
    """Consume a kept draft; whether it completed the value (the round ends with it)."""
    return shape is not None and (not shape.consume(token) or shape.done)


def accept_greedy(
    rows: np.ndarray, drafts: list[int], sampler: Sampler, shape: Constraint | None = None
) -> Outcome:
    """The target's argmax, row by row, against the drafts."""
    hist = list(sampler.history)
    outcomes: list[bool] = []
    for i in range(len(drafts) + 1):
        allowed = _restricted(rows[i], shape)
        if allowed is None:
            return i, -1, outcomes
        top = int(np.argmax(apply_penalties(allowed, hist, sampler.params)))
        if i < len(drafts) and top == drafts[i]:
            outcomes.append(True)
            if _completes(top, shape):
                return i, top, outcomes
            hist.append(top)
            continue
        if i < len(drafts):
            outcomes.append(False)
        return i, _last(top, shape), outcomes
    raise AssertionError("unreachable")


def accept_sampled(
    rows: np.ndarray, d: Draft, sampler: Sampler, shape: Constraint | None = None
) -> Outcome:
    """Leviathan/Chen acceptance (module doc)."""
    params, rng = sampler.params, sampler.rng
    hist = list(sampler.history)
    outcomes: list[bool] = []
    for i, x in enumerate(d.tokens):
        allowed = _restricted(rows[i], shape)
        if allowed is None:
            return i, -1, outcomes
        p = distribution(allowed, params, hist)
        q = d.q[i] if d.q is not None else None
        qx = q[x] if q is not None else 1.0
        if rng.random() * qx < p[x]:  # probability min(1, p(x)/q(x))
            outcomes.append(True)
            if _completes(x, shape):
                return i, x, outcomes
            hist.append(x)
            continue
        outcomes.append(False)
        return i, _last(draw(residual(p, q, x), rng), shape), outcomes
    allowed = _restricted(rows[len(d.tokens)], shape)
    if allowed is None:
        return len(d.tokens), -1, outcomes
    return len(d.tokens), _last(draw(distribution(allowed, params, hist), rng), shape), outcomes
