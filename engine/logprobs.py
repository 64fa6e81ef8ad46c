"""Log probabilities of sampled tokens, for clients that ask for them (OpenAI's `logprobs`).

They come from the model's own distribution at that step, the log-softmax of its logits before
the penalties and warps the sampler applies (as vLLM returns them by default): what the model
thought of the token whatever the sampling settings, so a greedy and a sampled reply give the
same figure for the same token. Each carries the token's bytes and text, so a front end shows
them without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .events import TokenLogprob

__all__ = ["MAX_TOP_LOGPROBS", "token_logprob"]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on the alternatives per token


def token_logprob(
    logits: np.ndarray, token: int, top: int, piece: Callable[[int], bytes]
) -> TokenLogprob:
    """`token`'s log probability under `logits` and the `top` likeliest tokens' (ties: the
    lower id first); `piece` gives a token's bytes."""
    x = np.asarray(logits, dtype=np.float64)
    peak = float(np.max(x))
    logz = peak + float(np.log(np.sum(np.exp(x - peak))))

    def entry(t: int, alternatives: tuple[TokenLogprob, ...] = ()) -> TokenLogprob:
        raw = piece(t)
        text = raw.decode("utf-8", errors="replace")
        return TokenLogprob(t, text, raw, float(x[t]) - logz, alternatives)

    best: tuple[TokenLogprob, ...] = ()
    if top > 0:
        n = min(top, x.shape[0])
        idx = np.argpartition(-x, n - 1)[:n]
        idx = idx[np.lexsort((idx, -x[idx]))]
        best = tuple(entry(int(t)) for t in idx)
    return entry(int(token), best)
