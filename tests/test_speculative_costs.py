"""How speculation decides what to draft, without a model: the cost model's choice of k from
measured decode and verify times (off when verify is not cheaper, catch-up paying for itself,
back-off of fruitless retries, unmeasured widths estimated) and the lookup drafter's proposals.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from npuchat.engine.drafters import Drafter, LookupDrafter
from npuchat.engine.events import SamplingParams
from npuchat.engine.speculative import CostModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _costs(t_dec: float, verify: dict[int, float], alpha: float, name: str) -> CostModel:
    c = CostModel(max_k=8)
    c.record_decode(t_dec)
    for w, t in verify.items():
        c.record_verify(w, t)
    c.alpha[name] = alpha
    c.sync_s[name] = 0.0
    return c


class _Free(Drafter):
    name = "free"  # a drafter whose costs the test sets

    def __init__(self, step_s: float) -> None:
        from npuchat.engine.drafters import _Stats

        self.stats = _Stats(step_s=step_s, prefill_token_s=step_s)


def test_cost_model_turns_speculation_off_when_verify_is_not_cheaper() -> None:
    # measured verify costs of the 1.5B model on a 2-core CPU: a (k+1)-verify is far from free
    cpu = {2: 0.074, 3: 0.096, 5: 0.125, 9: 0.234}
    slow = _costs(0.063, cpu, 0.6, "free")
    slow.sync_s["free"] = 0.028  # the 0.5B draft: a step ~45% of a target step
    assert slow.choose_k(_Free(0.028), [1, 2], 8) == 0
    # an NPU: verifying k+1 tokens costs about one step; the same draft pays, and deeper
    npu = {w: 0.063 * (1 + 0.03 * w) for w in range(2, 10)}
    fast = _costs(0.063, npu, 0.6, "free")
    fast.sync_s["free"] = 0.028 / 4
    assert fast.choose_k(_Free(0.028 / 4), [1, 2], 8) >= 2
    # a free drafter (lookup) with high acceptance pays even on this CPU, a hopeless one not
    assert _costs(0.063, cpu, 0.95, "free").choose_k(_Free(0.0), [1, 2], 8) >= 2
    assert _costs(0.063, cpu, 0.1, "free").choose_k(_Free(0.0), [1, 2], 8) == 0


def test_catch_up_must_pay_for_itself() -> None:
    """A draft that would pay per token is not used if prefilling the prompt into it costs
    more than it can win back over the reply."""
    npu = {w: 0.063 * (1 + 0.03 * w) for w in range(2, 10)}
    c = _costs(0.063, npu, 0.8, "d")

    class Behind(_Free):
        name = "d"

        def catch_up(self, context: Sequence[int]) -> int:
            return len(context)

    d = Behind(0.005)
    assert c.choose_k(d, list(range(10)), 127) > 0
    assert c.choose_k(d, list(range(4000)), 127) == 0
    assert c.choose_k(d, list(range(10)), 127) > 0


def test_fruitless_retries_of_a_drafter_back_off() -> None:
    """A drafter that never pays is retried after 16 plain rounds, then 32, 64, … up to 256."""

    class Idle(Drafter):
        name = "idle"

        def catch_up(self, context: Sequence[int]) -> int:
            return 0

    costs, d, waits, n = CostModel(4), Idle(), [], 0
    for _ in range(2000):
        n += 1
        if costs.explore(d, [1, 2, 3]):
            waits.append(n)
            n = 0
    assert waits[:6] == [16, 32, 64, 128, 256, 256]
    costs.backoff["idle"], costs.idle["idle"] = 1, 0  # what the decoder does when it pays
    n = 0
    while not costs.explore(d, [1, 2, 3]):
        n += 1
    assert n + 1 == 16


def test_unmeasured_widths_are_estimated_from_measured_ones() -> None:
    c = _costs(0.06, {2: 0.08, 3: 0.1}, 0.5, "x")
    assert c.verify_cost(3) == pytest.approx(0.1)
    assert c.verify_cost(5) == pytest.approx(0.14)  # last slope, extrapolated
    assert _costs(0.06, {}, 0.5, "x").verify_cost(4) > 0.06


# --------------------------------------------------------------------------- lookup drafter


def test_lookup_drafter_proposes_the_latest_continuation() -> None:
    lk = LookupDrafter(max_ngram=3, min_ngram=2)
    rng = np.random.default_rng(0)
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lk.propose(seq, 3, GREEDY, seq, rng).tokens == [7, 8, 1]  # the latest "1 2 3"
    assert lk.propose([*seq, 7], 2, GREEDY, seq, rng).tokens == [8, 1]  # grows incrementally
    edited = [1, 2, 3, 4, 5, 9, 4, 5]
    assert lk.propose(edited, 2, GREEDY, edited, rng).tokens == [9, 4]  # re-indexed after edit
    assert lk.propose([6, 6, 0], 2, GREEDY, [], rng).tokens == []


def test_lookup_drafter_prefers_the_occurrence_that_agrees_longest() -> None:
    """A short n-gram occurs often; the occurrence whose earlier tokens match too is the copy
    the reply is making."""
    lk = LookupDrafter(max_ngram=3, min_ngram=2)
    rng = np.random.default_rng(0)
    copied = [10, 11, 12, 1, 2, 3, 20, 21]
    seq = [*copied, 5, 6, 1, 2, 3, 30, 31, 7, 10, 11, 12, 1, 2, 3]
    assert lk.propose(seq, 2, GREEDY, seq, rng).tokens == [20, 21]  # not 30 31, the latest
    # when no occurrence agrees further than the n-gram, the latest one is taken
    tail = [*seq[:-3], 9, 1, 2, 3]
    assert lk.propose(tail, 2, GREEDY, tail, rng).tokens == [30, 31]
