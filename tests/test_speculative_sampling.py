"""Speculative sampling draws from the target's own distribution above temperature 0: on a
tiny Markov model whose output distribution can be computed exactly, a chi-square test cannot
tell speculative output (draft, lookup) from plain sampling under warped parameters, and it does
tell a broken acceptance rule. No ONNX model: the decoder runs on the stand-in's logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from scipy import stats

from npuchat.engine import speculative
from npuchat.engine.drafters import Drafter, LookupDrafter, ModelDrafter
from npuchat.engine.events import SamplingParams
from npuchat.engine.sampler import Sampler, distribution, draw
from npuchat.engine.sequence import Sequence as KVSequence
from npuchat.engine.speculative import SpeculativeDecoder


class MarkovModel:
    """A stand-in target/draft over a tiny vocabulary: logits depend on the last token only.

    Implements the part of `Model` that speculation uses, so the whole decoder (drafting,
    verify, acceptance, rollback) runs on a distribution that can be computed exactly.
    """

    def __init__(self, table: np.ndarray, verify_k: int = 4) -> None:
        self.table = table
        self.verify_k = verify_k
        self.max_capacity = 10_000
        self.tokens: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def length(self, row: int = 0) -> int:
        return len(self.tokens)

    def rollback(self, n: int, row: int = 0) -> None:
        del self.tokens[n:]

    def usable(self, n: int, row: int = 0, ring_from: int | None = None) -> int:
        return min(n, len(self.tokens))  # no sliding window: every prefix can be continued

    def prefill(self, ids: Sequence[int], row: int = 0) -> np.ndarray:
        self.tokens.extend(ids)
        return self.table[self.tokens[-1]].copy()

    def decode(self, token: int, row: int = 0) -> np.ndarray:
        return self.prefill([token])

    def verify(self, ids: Sequence[int], row: int = 0) -> np.ndarray:
        self.tokens.extend(ids)
        return np.stack([self.table[t] for t in ids])

    def close(self) -> None:
        pass


VOCAB = 5
N_OUT = 3
TRIALS = 3000
WARPED = SamplingParams(temperature=0.8, top_k=4, top_p=0.97, min_p=0.0, repeat_penalty=1.3)


def _tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    p = rng.normal(0, 1.5, (VOCAB, VOCAB))
    q = p + rng.normal(0, 1.5, (VOCAB, VOCAB))  # a related but different draft
    return p, q


CONTEXT = [2, 1, 2, 0]  # lookup has something to match: "2 …" and "1 2"


def _exact_target(p_table: np.ndarray, params: SamplingParams) -> np.ndarray:
    """P(x1..x3 | CONTEXT) of plain sampling: the product of the sampler's distributions."""
    probs = np.zeros(VOCAB**N_OUT)
    for i, seq in enumerate(itertools.product(range(VOCAB), repeat=N_OUT)):
        hist, last, pr = list(CONTEXT), CONTEXT[-1], 1.0
        for x in seq:
            pr *= distribution(p_table[last], params, hist)[x]
            hist.append(x)
            last = x
        probs[i] = pr
    return probs


def _speculative_counts(params: SamplingParams, trials: int, k: int, lookup: bool) -> np.ndarray:
    p_table, q_table = _tables()
    target, draft = MarkovModel(p_table), MarkovModel(q_table)
    drafters: list[Drafter] = [LookupDrafter(max_ngram=2, min_ngram=1)] if lookup else []
    drafters.append(ModelDrafter(draft, "markov"))  # type: ignore[arg-type]
    spec = SpeculativeDecoder(target, drafters, fixed_k=k)  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    counts = np.zeros(VOCAB**N_OUT)
    context = CONTEXT
    sampler = Sampler(params, context)
    sampler.rng = rng
    seq = KVSequence(target)  # type: ignore[arg-type]
    for _ in range(trials):
        seq.rollback(0)
        seq.prefill(context)
        sampler.history = list(context)
        first = draw(sampler.probs(p_table[context[-1]]), rng)
        sampler.accept(first)
        out = [first]
        while len(out) < N_OUT:
            _, new = spec.advance(seq, out[-1], sampler, N_OUT - len(out))
            out += new
        counts[np.ravel_multi_index(out[:N_OUT], (VOCAB,) * N_OUT)] += 1
    return counts


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5  # pool the rare outcomes into one cell
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize(
    ("params", "lookup"),
    [(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), False), (WARPED, True)],
)
def test_sampled_distribution_equals_target_only(params: SamplingParams, lookup: bool) -> None:
    probs = _exact_target(_tables()[0], params)
    counts = _speculative_counts(params, trials=TRIALS, k=3, lookup=lookup)
    assert _chi2_pvalue(counts, probs) > 1e-3


def test_broken_acceptance_rule_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails when rejected drafts are resampled from p instead of p − q."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    probs = _exact_target(_tables()[0], params)
    monkeypatch.setattr(speculative, "residual", lambda p, q, x: p)
    counts = _speculative_counts(params, trials=TRIALS, k=3, lookup=False)
    assert _chi2_pvalue(counts, probs) < 1e-6
