"""Sampling warps on hand-made logits, greedy, seeds and the draw itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from npuchat.engine.events import SamplingParams
from npuchat.engine.sampler import Sampler, apply_penalties, distribution, draw

# softmax of these at T=1: [0.6439, 0.2369, 0.0871, 0.0321] (checked by hand with exp())
LOGITS = np.array([2.0, 1.0, 0.0, -1.0, -30.0], dtype=np.float32)


def _p(**kw: float) -> SamplingParams:
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    return SamplingParams(**(base | kw))  # type: ignore[arg-type]


def test_plain_softmax_at_temperature_one() -> None:
    e = np.exp(LOGITS.astype(np.float64) - 2.0)
    np.testing.assert_allclose(distribution(LOGITS, _p()), e / e.sum(), rtol=1e-12)


def test_greedy_is_argmax() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=1000).astype(np.float32)
        s = Sampler(SamplingParams(temperature=0.0))
        assert s.sample(logits) == int(np.argmax(logits))
        assert distribution(logits, SamplingParams(temperature=0.0))[np.argmax(logits)] == 1.0


def test_top_k_keeps_k_best() -> None:
    p = distribution(LOGITS, _p(top_k=2))
    assert np.count_nonzero(p) == 2 and p[0] > p[1] > 0
    assert math.isclose(p[0], 1 / (1 + math.exp(-1.0)), rel_tol=1e-12)


def test_top_p_smallest_set_reaching_p() -> None:
    # cumulative: 0.644, 0.881, 0.968 → p=0.85 keeps 2 tokens, p=0.9 keeps 3
    assert np.count_nonzero(distribution(LOGITS, _p(top_p=0.85))) == 2
    assert np.count_nonzero(distribution(LOGITS, _p(top_p=0.9))) == 3


def test_min_p_relative_to_best() -> None:
    # ratios to the best: 1, e^-1=0.37, e^-2=0.135, e^-3=0.05
    assert np.count_nonzero(distribution(LOGITS, _p(min_p=0.3))) == 2
    assert np.count_nonzero(distribution(LOGITS, _p(min_p=0.1))) == 3


def test_temperature_sharpens_and_flattens() -> None:
    cold = distribution(LOGITS, _p(temperature=0.5))
    hot = distribution(LOGITS, _p(temperature=2.0))
    assert math.isclose(cold[0] / cold[1], math.exp(2.0), rel_tol=1e-9)
    assert math.isclose(hot[0] / hot[1], math.exp(0.5), rel_tol=1e-9)


def test_repeat_penalty_rule() -> None:
    out = apply_penalties(np.array([2.0, -2.0, 1.0]), [0, 1], _p(repeat_penalty=2.0))
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    """logit - count * frequency - (count > 0) * presence, written out by hand, after the
    repetition penalty; only the last `REPEAT_WINDOW` tokens count (llama.cpp's window)."""
    logits = np.array([2.0, -2.0, 1.0, 0.5])
    history = [3] * 100 + [0, 1, 1, 0, 1]  # the 3s fall out of the window but for 59 of them
    params = _p(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, history, params)
    want = [2.0 / 2 - 0.5 - 2 * 0.25, -2.0 * 2 - 0.5 - 3 * 0.25, 1.0, 0.5 / 2 - 0.5 - 59 * 0.25]
    np.testing.assert_allclose(out, want)
    favoured = apply_penalties(logits, [2], _p(presence_penalty=-1.0, frequency_penalty=-0.5))
    np.testing.assert_allclose(favoured, [2.0, -2.0, 2.5, 0.5])


def test_logit_bias_is_added_before_the_penalties() -> None:
    """llama.cpp's order, by hand: 2 + 1 = 3 then divided by the repetition penalty 2; an
    unseen token only biased; -100 takes a token out of greedy decoding."""
    logits = np.array([2.0, 1.0, 0.5])
    params = _p(repeat_penalty=2.0, logit_bias=((0, 1.0), (2, -100.0)))
    np.testing.assert_allclose(apply_penalties(logits, [0], params), [1.5, 1.0, -99.5])
    np.testing.assert_allclose(apply_penalties(logits, [], params), [3.0, 1.0, -99.5])
    sampler = Sampler(_p(temperature=0.0, logit_bias=((0, -100.0),)))
    assert sampler.sample(logits) == 1


def test_greedy_sampler_with_a_frequency_penalty_moves_off_a_repeated_token() -> None:
    """The argmax fast path is not taken when a penalty is set: the leading token, once
    sampled twice, loses to the runner-up."""
    logits = np.array([3.0, 2.6, 0.0])
    sampler = Sampler(_p(temperature=0.0, frequency_penalty=0.3))
    assert [sampler.sample(logits) for _ in range(3)] == [0, 0, 1]


def test_seed_reproducible_and_different_seeds_differ() -> None:
    logits = np.random.default_rng(1).normal(size=500).astype(np.float32)
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42)

    def run(seed: int) -> list[int]:
        s = Sampler(SamplingParams(**(params.__dict__ | {"seed": seed})))
        return [s.sample(logits) for _ in range(50)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_draw_matches_distribution() -> None:
    probs = np.array([0.5, 0.3, 0.0, 0.2])
    rng = np.random.default_rng(7)
    n = 20000
    counts = np.bincount([draw(probs, rng) for _ in range(n)], minlength=4)
    assert counts[2] == 0
    expected = probs * n
    mask = probs > 0
    chi2 = float(np.sum((counts[mask] - expected[mask]) ** 2 / expected[mask]))
    assert chi2 < 13.8  # chi-square, 2 dof, p = 0.001


@pytest.mark.parametrize("vocab", [10, 151936])
def test_distribution_sums_to_one(vocab: int) -> None:
    logits = np.random.default_rng(3).normal(size=vocab).astype(np.float32) * 5
    p = distribution(logits, SamplingParams())
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-9)
    assert np.count_nonzero(p) <= 40
