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
TOKEN_S = 0.002  # what each prompt token adds to a mixed step's matmuls
HEAD_S = 0.012  # a prompt row's one logits row (the vocabulary matmul), whatever its length
ATTN_ROW_S = 0.004  # a row reading the cache's K/V, per 1,024 slots of capacity
ATTN_Q_S = 0.0002  # each query row's scores over the cache, per 1,024 slots
FIRST_RUN_S = 0.030  # what the first step at a capacity adds (ONNX Runtime grows its buffers)
CAPACITIES = (512, 1024, 2048, 4096)
PASTE = 1500


class CostModel:
    """The `Model` surface the scheduler uses, with step costs added to a shared clock.

    Every row attends all of the capacity's slots (the cost grows with the capacity, as the
    real graph's attention does), and in a mixed step the decode rows are padded to the chunk's
    length for attention."""

    mixes_steps = True
    batch_max = 4
    max_capacity = CAPACITIES[-1]
    prefill_chunk = 128

    def __init__(self, slow_mixed_step: int | None = None) -> None:
        self.extra = 0.0
        self.lengths = [0] * self.batch_max
        self.mixed_steps: list[int] = []  # prompt tokens of each mixed step
        self.mixed_capacity: list[int] = []  # the capacity each mixed step ran at
        self.mixed_cost: list[float] = []  # and what it cost
        self.slow_mixed_step = slow_mixed_step
        self.reserved: list[int] = []  # every `reserve` call's slots
        self.held = 0
        self.ran_at: set[int] = set()  # capacities a step ran at
        self.unready = 3

    @property
    def capacity(self) -> int:
        need = max(self.held, *self.lengths)
        return next(c for c in CAPACITIES if c >= need)

    def reserve(self, slots: int) -> bool:
        """Room for a prompt read in mixed steps: not ready for the first few asks (its pages
        are being faulted in), as a cache growing into fresh memory is."""
        self.reserved.append(slots)
        if slots and len([r for r in self.reserved if r]) <= self.unready:
            return False
        self.held = slots
        return True

    def _attention(self, rows: int, queries: int, capacity: int) -> float:
        return capacity / 1024 * (rows * ATTN_ROW_S + rows * queries * ATTN_Q_S)

    def _first_run(self) -> float:
        """The first step at a capacity also grows ONNX Runtime's buffers for its shapes."""
        if self.capacity in self.ran_at:
            return 0.0
        self.ran_at.add(self.capacity)
        return FIRST_RUN_S

    def clock(self) -> float:
        return time.perf_counter() + self.extra

    def length(self, row: int) -> int:
        return self.lengths[row]

    def swap_rows(self, a: int, b: int) -> None:
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def decode_batch(self, tokens: list[int], first_row: int = 0) -> np.ndarray:
        for r in range(first_row, first_row + len(tokens)):
            self.lengths[r] += 1
        b = len(tokens)
        self.extra += DECODE_S + ROW_S * b + self._attention(b, 1, self.capacity)
        self.extra += self._first_run()
        return np.zeros((len(tokens), 8), np.float32)

    def step_rows(self, ids: list[list[int]], first_row: int = 0) -> np.ndarray:
        for j, r in enumerate(ids):
            self.lengths[first_row + j] += len(r)
        decodes = [r for r in ids if len(r) == 1]
        chunk = max(len(r) for r in ids)
        cost = DECODE_S + ROW_S * len(decodes) + TOKEN_S * chunk + HEAD_S
        cost += self._attention(len(ids), chunk, self.capacity)
        cost += self._first_run()
        if len(self.mixed_steps) == self.slow_mixed_step:
            cost *= 10  # a burst of other work on the machine
        self.extra += cost
        self.mixed_steps.append(chunk)
        self.mixed_capacity.append(self.capacity)
        self.mixed_cost.append(cost)
        return np.zeros((len(ids), 8), np.float32)

    def prefill(self, ids: list[int], row: int = 0, run_options: object = None) -> np.ndarray:
        self.lengths[row] += len(ids)
        self.extra += self.prefill_cost(len(ids), self.capacity)
        return np.zeros(8, np.float32)

    @staticmethod
    def prefill_cost(tokens: int, capacity: int) -> float:
        return DECODE_S + TOKEN_S * tokens + HEAD_S + capacity / 1024 * tokens * ATTN_Q_S


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


def budget_seconds() -> float:
    """The paste read in mixed steps beside one stream, each chunk filling what `MIX_TARGET`
    usual steps leave (at least one token), at the capacities the paste passes through: what
    the chunk sizing should achieve, from the cost model's own figures."""
    usual = DECODE_S + ROW_S + 512 / 1024 * (ATTN_ROW_S + ATTN_Q_S)
    done, total = 0, 0.0
    while done < PASTE:
        c = next(c for c in CAPACITIES if c >= done + 24)
        base = DECODE_S + ROW_S + c / 1024 * (ATTN_ROW_S + ATTN_Q_S)
        fixed = HEAD_S + c / 1024 * ATTN_ROW_S
        per_token = TOKEN_S + 2 * c / 1024 * ATTN_Q_S  # the chunk and the decode row padded
        n = max(1, min(PASTE - done, int((MIX_TARGET * usual - base - fixed) / per_token)))
        done += n
        total += base + fixed + n * per_token
    return total


def test_a_paste_keeps_a_streams_gaps_within_twice_the_usual() -> None:
    model = CostModel()
    during, usual, took = run_paste(model)
    assert max(during) <= 2.0 * usual, (max(during) / usual, model.mixed_steps[:20])
    # the chunks fill the budget: the prompt is read about as fast as the budget allows
    assert took <= 1.25 * budget_seconds(), (took, budget_seconds(), model.mixed_steps[:40])
    # the room was asked for before the first chunk, and given back after
    asks = [r for r in model.reserved if r]
    assert model.reserved[-1] == 0
    assert len(asks) > model.unready  # the stream decoded while the room was not ready


def test_the_cache_grows_with_the_prompt_not_to_its_end_at_once() -> None:
    """Every row attends the whole capacity: while the prompt is short the streams' steps stay
    at the small capacity (and cheap), instead of paying the final one from the first chunk."""
    model = CostModel()
    run_paste(model)
    assert max(model.mixed_capacity[:60]) == 512, model.mixed_capacity[:60]
    assert model.mixed_capacity[-1] == 2048
    # and only grows: a smaller chunk after a move does not take the cache back down
    assert model.mixed_capacity == sorted(model.mixed_capacity)


def test_chunks_keep_to_the_streams_usual_step_time_at_a_larger_capacity() -> None:
    """The budget is the streams' usual step (before the paste), not a step at the capacity the
    paste moved the cache to: those cost more, and a budget taken from them would let the
    stream slow down by more than `MIX_TARGET`. Only a one-token chunk may go past it."""
    model = CostModel()
    run_paste(model)
    usual = DECODE_S + ROW_S + 512 / 1024 * (ATTN_ROW_S + ATTN_Q_S)
    over = [
        (n, c, round(t / usual, 2))
        for n, c, t in zip(model.mixed_steps, model.mixed_capacity, model.mixed_cost, strict=True)
        if n > 1 and t > 1.05 * MIX_TARGET * usual
    ]
    assert not over, over[:10]


def test_one_slow_step_does_not_shrink_the_chunks_for_the_rest_of_the_paste() -> None:
    model = CostModel(slow_mixed_step=3)
    during, usual, _ = run_paste(model)
    steady = CostModel()
    run_paste(steady)
    later = model.mixed_steps[10:40]
    assert statistics.median(later) >= 0.8 * statistics.median(steady.mixed_steps[10:40])
    # apart from the one slow step itself, gaps stay within twice the usual
    assert sorted(during)[-2] <= 2.0 * usual
