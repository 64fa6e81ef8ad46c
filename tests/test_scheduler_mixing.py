"""How the scheduler sizes the prefill chunks it mixes into decode steps: a stream's tokens keep
coming at most about twice as far apart while another conversation's long prompt is read.

The model here is a cost model (a decode step of b rows costs a fixed part plus a little a row;
a mixed step adds a cost per prompt token), advancing the scheduler's clock instead of running
a graph, so the figures are exact and the test is fast; tests/test_concurrent.py runs the same
scheduler on real graphs.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from npuchat.engine.scheduler import INTERACTIVE, StepScheduler
from npuchat.engine.step_costs import MIX_TARGET

DECODE_S = 0.040  # a decode step's fixed part (reading the weights)
ROW_S = 0.002  # what each decode row adds
TOKEN_S = 0.004  # what each prompt token adds to a mixed step
PASTE = 600


class CostModel:
    """The `Model` surface the scheduler uses, with step costs added to a shared clock."""

    mixes_steps = True
    batch_max = 4
    max_capacity = 4096
    prefill_chunk = 128

    def __init__(self, slow_mixed_step: int | None = None) -> None:
        self.extra = 0.0
        self.lengths = [0] * self.batch_max
        self.mixed_steps: list[int] = []  # prompt tokens of each mixed step
        self.slow_mixed_step = slow_mixed_step
        self.reserved: list[int] = []  # every `reserve` call's slots
        self.unready = 3

    def reserve(self, slots: int) -> bool:
        """Room for a prompt read in mixed steps: not ready for the first few asks (its pages
        are being faulted in), as a cache growing into fresh memory is."""
        self.reserved.append(slots)
        return slots == 0 or len([r for r in self.reserved if r]) > self.unready

    def clock(self) -> float:
        return time.perf_counter() + self.extra

    def length(self, row: int) -> int:
        return self.lengths[row]

    def swap_rows(self, a: int, b: int) -> None:
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def decode_batch(self, tokens: list[int], first_row: int = 0) -> np.ndarray:
        self.extra += DECODE_S + ROW_S * len(tokens)
        for r in range(first_row, first_row + len(tokens)):
            self.lengths[r] += 1
        return np.zeros((len(tokens), 8), np.float32)

    def step_rows(self, ids: list[list[int]], first_row: int = 0) -> np.ndarray:
        decodes = [r for r in ids if len(r) == 1]
        chunk = max(len(r) for r in ids)
        cost = DECODE_S + ROW_S * len(decodes) + TOKEN_S * chunk
        if len(self.mixed_steps) == self.slow_mixed_step:
            cost *= 10  # one step at a new capacity, or a burst of other work on the machine
        self.extra += cost
        self.mixed_steps.append(chunk)
        for j, r in enumerate(ids):
            self.lengths[first_row + j] += len(r)
        return np.zeros((len(ids), 8), np.float32)

    def prefill(self, ids: list[int], row: int = 0, run_options: object = None) -> np.ndarray:
        self.extra += DECODE_S + TOKEN_S * len(ids)
        self.lengths[row] += len(ids)
        return np.zeros(8, np.float32)


class Slots:
    def __init__(self, model: CostModel, seqs: list[Any]) -> None:
        self.model, self.seqs = model, seqs

    def swap(self, a: int, b: int) -> None:
        if a == b:
            return
        self.model.swap_rows(a, b)
        for s in self.seqs:
            s.row = b if s.row == a else a if s.row == b else s.row


def run_paste(model: CostModel) -> tuple[list[float], float, float]:
    """One stream decoding, a PASTE-token prompt arriving after 20 of its tokens: the stream's
    gaps (scheduler clock) while the prompt is read, its usual gap, and when the prompt ended."""
    stream, paste = SimpleNamespace(row=0, parked=None), SimpleNamespace(row=1, parked=None)
    sched = StepScheduler(model, Slots(model, [stream, paste]), clock=model.clock)  # type: ignore[arg-type]
    times: list[float] = []
    done = threading.Event()
    try:
        sched.register(stream, INTERACTIVE, None)

        def decode() -> None:
            sched.prefill(stream, [1, 2, 3])
            while not done.is_set():
                sched.decode(stream, 5)
                times.append(model.clock())

        t = threading.Thread(target=decode, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while len(times) < 20:
            assert t.is_alive() and time.monotonic() < deadline, "the stream stopped decoding"
            time.sleep(0.001)
        start = model.clock()
        sched.register(paste, INTERACTIVE, None)
        sched.prefill(paste, list(range(PASTE)))
        end = model.clock()
        done.set()
        t.join(timeout=10)
    finally:
        sched.close()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    usual = statistics.median([g for g, b in zip(gaps, times[1:], strict=False) if b <= start])
    during = [g for g, b in zip(gaps, times[1:], strict=False) if start < b <= end]
    return during, usual, end - start


def test_a_paste_keeps_a_streams_gaps_within_twice_the_usual() -> None:
    model = CostModel()
    during, usual, took = run_paste(model)
    assert max(during) <= 2.0 * usual, (max(during) / usual, model.mixed_steps[:20])
    # the chunk grows to what the budget allows: the prompt is read at near its full speed
    fit = (MIX_TARGET - 1) * (DECODE_S + ROW_S) / TOKEN_S
    assert statistics.median(model.mixed_steps) >= 0.8 * fit, model.mixed_steps[:40]
    alone = PASTE * TOKEN_S  # the prompt's own work, were nothing else running
    assert took <= alone * (1 + 1 / (MIX_TARGET - 1)) * 1.25, (took, alone)
    # room for the whole prompt was asked for before its first chunk, and given back after
    asks = [r for r in model.reserved if r]
    assert asks[0] >= PASTE and model.reserved[-1] == 0
    assert len(asks) > model.unready  # the stream decoded while the room was not ready


def test_one_slow_step_does_not_shrink_the_chunks_for_the_rest_of_the_paste() -> None:
    model = CostModel(slow_mixed_step=3)
    during, usual, _ = run_paste(model)
    later = model.mixed_steps[10:]
    fit = (MIX_TARGET - 1) * (DECODE_S + ROW_S) / TOKEN_S
    assert statistics.median(later) >= 0.8 * fit, model.mixed_steps[:40]
    # apart from the one slow step itself, gaps stay within twice the usual
    assert sorted(during)[-2] <= 2.0 * usual
