"""Speculative sampling draws from the target's own distribution above temperature 0: on a
tiny Markov model whose output distribution can be computed exactly, a chi-square test cannot
tell speculative output (draft, lookup) from plain sampling under warped parameters, nor, under
a grammar, from plain constrained sampling, and it does tell a broken acceptance rule. No ONNX
model: the decoder runs on the stand-in's logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from scipy import stats

from npuchat.engine import acceptance, speculative
from npuchat.engine.drafters import Drafter, LookupDrafter, ModelDrafter
from npuchat.engine.events import SamplingParams
from npuchat.engine.grammar import Constraint
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
# under the grammar: a first token 0 leaves room for a draft after the forced 3
GRAMMAR_CONTEXT, GRAMMAR_OUT = [2, 1, 0, 3, 2], 4


def _setting(grammar: bool) -> tuple[list[int], int]:
    return (GRAMMAR_CONTEXT, GRAMMAR_OUT) if grammar else (CONTEXT, N_OUT)


class NoRepeats(Constraint):
    """A stand-in grammar over the Markov vocabulary: no token follows itself, and after a 0
    only a 3 or a 4 may come, the 3 offered as forced (as llguidance offers its tokenization of
    forced text, which another tokenization may also spell): the decoder drafts it, and it is
    still only accepted as often as the target picks it. A sampled draft model proposes repeats
    often (rejected: p = 0 there); lookup's drafts are cut before one."""

    def __init__(self, last: int) -> None:
        self.seq = [last]

    @staticmethod
    def allowed_after(last: int) -> np.ndarray:
        fits = np.arange(VOCAB) >= 3 if last == 0 else np.arange(VOCAB) != last
        return np.asarray(fits)

    def allowed(self) -> np.ndarray:
        return self.allowed_after(self.seq[-1])

    @property
    def done(self) -> bool:
        return False

    def restrict(self, logits: np.ndarray) -> np.ndarray | None:
        return np.where(self.allowed(), logits, -np.inf)

    def consume(self, token: int) -> bool:
        ok = bool(self.allowed()[token])
        if ok:
            self.seq.append(token)
        return ok

    def fits(self, tokens: list[int]) -> int:
        last = self.seq[-1]
        for i, t in enumerate(tokens):
            if not self.allowed_after(last)[t]:
                return i
            last = t
        return len(tokens)

    def forced(self) -> list[int]:
        return [3] if self.seq[-1] == 0 else []


def _exact_target(p_table: np.ndarray, params: SamplingParams, grammar: bool = False) -> np.ndarray:
    """P(x1..xn | context) of plain sampling: the product of the sampler's distributions (over
    the tokens `NoRepeats` allows, with `grammar`)."""
    context, n_out = _setting(grammar)
    probs = np.zeros(VOCAB**n_out)
    for i, seq in enumerate(itertools.product(range(VOCAB), repeat=n_out)):
        hist, last, pr = list(context), context[-1], 1.0
        for x in seq:
            row = p_table[last]
            if grammar:
                row = np.where(NoRepeats.allowed_after(last), row, -np.inf)
            pr *= distribution(row, params, hist)[x]
            hist.append(x)
            last = x
        probs[i] = pr
    return probs


def _speculative_counts(
    params: SamplingParams, trials: int, k: int, lookup: bool, grammar: bool = False
) -> np.ndarray:
    p_table, q_table = _tables()
    target, draft = MarkovModel(p_table), MarkovModel(q_table)
    drafters: list[Drafter] = [LookupDrafter(max_ngram=2, min_ngram=1)] if lookup else []
    drafters.append(ModelDrafter(draft, "markov"))  # type: ignore[arg-type]
    spec = SpeculativeDecoder(target, drafters, fixed_k=k)  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    context, n_out = _setting(grammar)
    counts = np.zeros(VOCAB**n_out)
    sampler = Sampler(params, context)
    sampler.rng = rng
    seq = KVSequence(target)  # type: ignore[arg-type]
    for _ in range(trials):
        seq.rollback(0)
        seq.prefill(context)
        sampler.history = list(context)
        shape = NoRepeats(context[-1]) if grammar else None
        if shape is None:
            first = draw(sampler.probs(p_table[context[-1]]), rng)
            sampler.accept(first)
        else:
            chosen = shape.choose(p_table[context[-1]], sampler)
            assert chosen is not None
            first = chosen
        out = [first]
        while len(out) < n_out:
            _, new = spec.advance(seq, out[-1], sampler, n_out - len(out), shape)
            out += new
        counts[np.ravel_multi_index(out[:n_out], (VOCAB,) * n_out)] += 1
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
    monkeypatch.setattr(acceptance, "residual", lambda p, q, x: p)
    counts = _speculative_counts(params, trials=TRIALS, k=3, lookup=False)
    assert _chi2_pvalue(counts, probs) < 1e-6


@pytest.mark.parametrize(
    ("params", "lookup"), [(SamplingParams(temperature=0.7, min_p=0.05), False), (WARPED, True)]
)
def test_sampled_distribution_under_a_grammar_equals_plain_constrained_sampling(
    params: SamplingParams, lookup: bool
) -> None:
    """Drafts from a sampled draft model (after a forced token too), lookup and the grammar's
    forced tokens, each row held to the grammar: the outcomes are distributed as plain
    constrained sampling's, and none the grammar forbids comes out."""
    probs = _exact_target(_tables()[0], params, grammar=True)
    counts = _speculative_counts(params, trials=TRIALS, k=3, lookup=lookup, grammar=True)
    assert counts[probs == 0].sum() == 0
    assert _chi2_pvalue(counts, probs) > 1e-3


def test_a_grammar_left_out_of_the_acceptance_rule_is_detected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Verify rows read without the grammar let forbidden drafts through."""
    probs = _exact_target(_tables()[0], WARPED, grammar=True)
    unheld = acceptance.accept_sampled
    monkeypatch.setattr(
        speculative, "accept_sampled", lambda rows, d, sampler, shape: unheld(rows, d, sampler)
    )
    counts = _speculative_counts(WARPED, trials=TRIALS, k=3, lookup=True, grammar=True)
    assert counts[probs == 0].sum() > 0
