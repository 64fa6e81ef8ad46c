"""Logits → next token, on the host.

The warps run in llama.cpp's order: the logit bias, the penalties (repetition, then presence and
frequency over the same window of recent tokens), top-k, top-p, min-p, temperature. They are
split from the draw (`distribution` then `draw`) because speculative decoding needs the exact
distribution the plain sampler would draw from, for the target and the draft alike: the
acceptance rule compares p(x) and q(x) after the same warps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .events import SamplingParams

REPEAT_WINDOW = 64  # tokens of history the repetition penalty looks at (llama.cpp's default)


def penalised(params: SamplingParams) -> bool:
    """Whether any penalty or bias changes the logits (else the argmax needs no copy)."""
    return (
        params.repeat_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or bool(params.logit_bias)
    )


def apply_penalties(
    logits: np.ndarray, history: Sequence[int], params: SamplingParams, window: int = REPEAT_WINDOW
) -> np.ndarray:
    """llama.cpp's order: each `logit_bias` added to its token's logit (-100 bans a token), then
    the penalties over the last `window` tokens: a seen token's positive logit divided by the
    repetition penalty, a negative one multiplied; then OpenAI's presence penalty subtracted
    once and the frequency penalty once per occurrence (negative values favour the seen
    tokens instead)."""
    if not penalised(params):
        return logits
    out = logits.copy()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        np.add.at(out, np.asarray(ids, dtype=np.int64), np.asarray(bias, dtype=out.dtype))
    if history and (
        params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    ):
        seen, counts = np.unique(np.asarray(history[-window:], dtype=np.int64), return_counts=True)
        vals = out[seen]
        if params.repeat_penalty != 1.0:
            penalty = params.repeat_penalty
            vals = np.where(vals > 0, vals / penalty, vals * penalty)
        out[seen] = vals - params.presence_penalty - params.frequency_penalty * counts
    return out


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= 0.0 or params.top_k == 1


def distribution(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()
) -> np.ndarray:
    """The probability vector (float64, sums to 1) the sampler draws the next token from.

    Greedy settings give a one-hot vector at the argmax, so "sampling" from it is exact greedy.
    """
    x = apply_penalties(np.asarray(logits, dtype=np.float64), history, params)
    vocab = x.shape[0]
    out = np.zeros(vocab, dtype=np.float64)
    if is_greedy(params):
        out[int(np.argmax(x))] = 1.0
        return out
    k = params.top_k if 0 < params.top_k < vocab else vocab
    idx = np.argpartition(-x, k - 1)[:k] if k < vocab else np.arange(vocab)
    vals = x[idx]
    order = np.argsort(-vals, kind="stable")
    idx, vals = idx[order], vals[order]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    keep = len(idx)
    if 0.0 < params.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(probs >= params.min_p * probs[0]))))
    idx, vals = idx[:keep], vals[:keep]
    scaled = (vals - vals[0]) / params.temperature
    p = np.exp(scaled)
    out[idx] = p / p.sum()
    return out


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector (inverse CDF, so one uniform number per token)."""
    nz = np.flatnonzero(probs)
    if len(nz) == 1:
        return int(nz[0])
    cdf = np.cumsum(probs[nz])
    u = rng.random() * cdf[-1]
    return int(nz[min(int(np.searchsorted(cdf, u, side="right")), len(nz) - 1)])


class Sampler:
    """Sampling state for one reply: parameters, a seeded generator, the token history."""

    def __init__(self, params: SamplingParams, history: Sequence[int] = ()) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.history: list[int] = list(history[-REPEAT_WINDOW:])

    def probs(self, logits: np.ndarray) -> np.ndarray:
        return distribution(logits, self.params, self.history)

    def sample(self, logits: np.ndarray) -> int:
        if is_greedy(self.params) and not penalised(self.params):
            token = int(np.argmax(logits))  # skip building a dense vector on the hot path
        else:
            token = draw(self.probs(logits), self.rng)
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        self.history.append(token)
        if len(self.history) > 2 * REPEAT_WINDOW:
            del self.history[:-REPEAT_WINDOW]
