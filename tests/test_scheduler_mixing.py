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
ATTN_ROW_S = 0.004  # a row reading its K/V, per 1,024 of the slots it reaches (not the window)
ATTN_Q_S = 0.0002  # each query row's scores over those slots, per 1,024
FIRST_RUN_S = 0.030  # the first step after the cache moved (ONNX Runtime sizes its buffers)
FIRST_WINDOW_S = 0.005  # the first step at a window (a few more buffers)
CAPACITIES = (512, 1024, 2048, 4096)
PASTE = 1500


class CostModel:
    """The `Model` surface the scheduler uses, with step costs added to a shared clock.

    Each row's attention costs the slots it reaches, whatever the step's window (the native
    attention op reads each row's own span); a mixed step whose prompt chunk does not end its
    part skips the prompt's logits row (`Model.step_rows`'s `want`)."""

    mixes_steps = True
    batch_max = 4
    max_capacity = CAPACITIES[-1]
    prefill_chunk = 128

    def __init__(
        self,
        slow_mixed_step: int | None = None,
        slow_decodes: bool = False,
        token_s: float = TOKEN_S,
        noise: float = 0.0,
        busy_before: float = 1.0,
        load: float = 0.0,
        wall_before: float = 1.0,
    ) -> None:
        self.load = np.random.default_rng(11) if load else None  # wall: ×(1 + load·U(0, 1))
        self.load_max = load
        self.wall_before = wall_before  # and ×this before the first mixed step (a busy spell)
        self.cpu = 0.0  # the steps' own cost, which waiting for a core does not stretch
        self.busy_before = busy_before  # steps before the first mixed one cost this many times
        self.token_s = token_s  # what a prompt token adds to a mixed step's matmuls
        self.noise = np.random.default_rng(7) if noise else None  # every step ×(1 ± noise)
        self.spread = noise
        self.extra = 0.0
        self.lengths = [0] * self.batch_max
        self.mixed_steps: list[int] = []  # prompt tokens of each mixed step
        self.mixed_capacity: list[int] = []  # the capacity each mixed step ran at
        self.mixed_window: list[int] = []  # and the window it attended
        self.decode_windows: list[int] = []  # the window of each plain decode step
        self.mixed_cost: list[float] = []  # and what it cost
        self.slow_mixed_step = slow_mixed_step
        self.slow_decodes = slow_decodes  # every 6th plain decode step beside a prompt: 4x
        self.decodes_beside = 0
        self.reserved: list[int] = []  # every `reserve` call's slots
        self.held = 0
        self.ran_at: set[int] = set()  # windows a step ran at
        self.ran_capacity = 0
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

    def window(self, slots: int) -> int:
        return next((c for c in CAPACITIES if slots <= c <= self.capacity), self.capacity)

    @staticmethod
    def _attention(reach: int, queries: int) -> float:
        return attention(reach, queries)

    def _first_run(self, window: int) -> float:
        """The first step over a moved cache, or at a window, also grows ONNX Runtime's
        buffers for its shapes."""
        cost = 0.0 if window in self.ran_at else FIRST_WINDOW_S
        if self.capacity != self.ran_capacity:
            cost = FIRST_RUN_S
        self.ran_at.add(window)
        self.ran_capacity = self.capacity
        return cost

    def _noisy(self, cost: float) -> float:
        """A step's cost as a machine gives it: the same shape ±`noise` from run to run."""
        if not self.mixed_steps:
            cost *= self.busy_before  # the machine was busier before the paste came
        if self.noise is None:
            return cost
        return cost * (1 + self.spread * self.noise.uniform(-1, 1))

    def _spend(self, cost: float) -> None:
        """A step's cost on the CPU clock; on the wall clock also its wait for a core."""
        self.cpu += cost
        wait = self.load_max * self.load.uniform(0, 1) if self.load is not None else 0.0
        self.extra += cost * (1 + wait) * (1 if self.mixed_steps else self.wall_before)

    def cpu_clock(self) -> float:
        return time.perf_counter() + self.cpu

    def clock(self) -> float:
        return time.perf_counter() + self.extra

    def length(self, row: int) -> int:
        return self.lengths[row]

    def swap_rows(self, a: int, b: int) -> None:
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def decode_batch(self, tokens: list[int], first_row: int = 0) -> np.ndarray:
        rows = range(first_row, first_row + len(tokens))
        w = self.window(max(self.lengths[r] for r in rows) + 1)
        for r in rows:
            self.lengths[r] += 1
        b = len(tokens)
        reads = sum(self._attention(self.lengths[r], 1) for r in rows)
        cost = self._noisy(DECODE_S + ROW_S * b + reads) + self._first_run(w)
        if self.slow_decodes and self.mixed_steps:
            self.decodes_beside += 1
            cost *= 4 if self.decodes_beside % 6 == 0 else 1
        self._spend(cost)
        self.decode_windows.append(w)
        return np.zeros((len(tokens), 8), np.float32)

    def step_rows(
        self, ids: list[list[int]], first_row: int = 0, want: list[bool] | None = None
    ) -> np.ndarray:
        chunk = max(len(r) for r in ids)
        w = self.window(max(self.lengths[first_row + j] for j in range(len(ids))) + chunk)
        for j, r in enumerate(ids):
            self.lengths[first_row + j] += len(r)
        reads = sum(self._attention(self.lengths[first_row + j], len(r)) for j, r in enumerate(ids))
        head = HEAD_S if want is None or all(want) else 0.0  # the prompt's logits row
        cost = DECODE_S + ROW_S * (len(ids) - 1) + self.token_s * chunk + head + reads
        cost = self._noisy(cost) + self._first_run(w)
        if len(self.mixed_steps) == self.slow_mixed_step:
            cost *= 10  # a burst of other work on the machine
        self._spend(cost)
        self.mixed_steps.append(chunk)
        self.mixed_capacity.append(self.capacity)
        self.mixed_window.append(w)
        self.mixed_cost.append(cost)
        return np.zeros((len(ids) if want is None else sum(want), 8), np.float32)

    def prefill(self, ids: list[int], row: int = 0, run_options: object = None) -> np.ndarray:
        w = self.window(self.lengths[row] + len(ids))
        self.lengths[row] += len(ids)
        self._spend(DECODE_S + TOKEN_S * len(ids) + HEAD_S + w / 1024 * len(ids) * ATTN_Q_S)
        return np.zeros(8, np.float32)


def attention(reach: int, queries: int) -> float:
    """One row's attention over the `reach` slots it sees, for its `queries` new tokens."""
    return reach / 1024 * (ATTN_ROW_S + queries * ATTN_Q_S)


def mixed_cost(tokens: int, reach: int, stream: int, head: bool = False) -> float:
    """A mixed step: one stream at `stream` slots and a `tokens` chunk reaching `reach`."""
    cost = DECODE_S + ROW_S + TOKEN_S * tokens + (HEAD_S if head else 0.0)
    return cost + attention(stream, 1) + attention(reach, tokens)


class Slots:
    def __init__(self, model: CostModel, seqs: list[Any]) -> None:
        self.model, self.seqs = model, seqs

    def swap(self, a: int, b: int) -> None:
        if a == b:
            return
        self.model.swap_rows(a, b)
        for s in self.seqs:
            s.row = b if s.row == a else a if s.row == b else s.row


def run_paste(
    model: CostModel, part: int = PASTE, cpu_clock: bool = False
) -> tuple[list[float], float, float]:
    """One stream decoding, a PASTE-token prompt arriving after 20 of its tokens: the stream's
    gaps (scheduler clock) while the prompt is read, its usual gap, and when the prompt ended.
    `part`: the prompt handed in parts of this many tokens, each saying how many follow, as a
    session does (`ChatSession`: parts of the model's prefill chunk). `cpu_clock`: the
    scheduler times steps on the model's CPU clock (the engine's thread CPU clock)."""
    stream, paste = SimpleNamespace(row=0, parked=None), SimpleNamespace(row=1, parked=None)
    slots = Slots(model, [stream, paste])
    step_clock = model.cpu_clock if cpu_clock else None
    sched = StepScheduler(model, slots, clock=model.clock, step_clock=step_clock)  # type: ignore[arg-type]
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
        ids = list(range(PASTE))
        for i in range(0, PASTE, part):
            sched.prefill(paste, ids[i : i + part], more=max(0, PASTE - i - part))
        end = model.clock()
        done.set()
        t.join(timeout=10)
    finally:
        sched.close()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    usual = statistics.median([g for g, b in zip(gaps, times[1:], strict=False) if b <= start])
    during = [g for g, b in zip(gaps, times[1:], strict=False) if start < b <= end]
    return during, usual, end - start


STREAM_AT = 24  # the stream's length when the paste comes (its prompt and 20 tokens)
USUAL_S = DECODE_S + ROW_S + attention(STREAM_AT, 1)  # the stream's own step


def budget_seconds() -> float:
    """The paste read in mixed steps beside one stream, each chunk filling what `MIX_TARGET`
    usual steps leave (at least one token), at the windows the paste passes through: what
    the chunk sizing should achieve, from the cost model's own figures."""
    done, total, stream = 0, 0.0, STREAM_AT
    while done < PASTE:
        per_token = mixed_cost(1, done + 1, stream) - mixed_cost(0, done, stream)
        fit = int((MIX_TARGET * USUAL_S - mixed_cost(0, done, stream)) / per_token)
        n = max(1, min(PASTE - done, fit))
        done += n
        total += mixed_cost(n, done, stream, head=done == PASTE)
        stream += 1
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


def test_the_cache_moves_once_for_a_paste_and_the_steps_attend_what_their_rows_reach() -> None:
    """The cache moves to what the whole prompt needs before its first chunk, while its rows
    hold little to copy (each move copies the rows, at a step), and stays there; the steps pay
    for the slots their rows reach, not for that capacity: the mixed steps' windows grow with
    the prompt, the stream's own decode steps stay at the window of its length."""
    model = CostModel()
    run_paste(model)
    assert set(model.mixed_capacity) == {2048}, sorted(set(model.mixed_capacity))
    assert model.mixed_window[0] == 512 and model.mixed_window[-1] == 2048
    assert model.mixed_window == sorted(model.mixed_window)
    assert max(model.decode_windows) < 2048, sorted(set(model.decode_windows))


def test_a_prompt_sent_in_parts_moves_the_cache_once_too() -> None:
    """A session hands a long prompt to the scheduler in parts of the prefill chunk, each
    saying how many tokens follow: the room is made for the whole prompt before its first
    chunk and kept between its parts. (Made for each part, the cache moved at every capacity
    the prompt passed, 512 -> 1024 -> 2048, each move a step copying more rows, and a gap.)"""
    model = CostModel()
    during, usual, _ = run_paste(model, part=CostModel.prefill_chunk)
    assert set(model.mixed_capacity) == {2048}, sorted(set(model.mixed_capacity))
    assert len({r for r in model.reserved if r}) == 1, sorted(set(model.reserved))
    assert model.reserved[-1] == 0  # given back once the last part was read
    assert max(during) <= 2.0 * usual, max(during) / usual


def test_chunks_keep_to_the_streams_usual_step_time_at_a_larger_window() -> None:
    """The budget is the streams' usual step (before the paste), not a step at the window the
    paste has reached: those cost more, and a budget taken from them would let the stream
    slow down by more than `MIX_TARGET`. Only a one-token chunk may go past it."""
    model = CostModel()
    run_paste(model)
    over = [
        (n, w, round(t / USUAL_S, 2))
        for n, w, t in zip(model.mixed_steps, model.mixed_window, model.mixed_cost, strict=True)
        if n > 1 and t > 1.05 * MIX_TARGET * USUAL_S
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


def test_slow_decode_steps_beside_the_prompt_do_not_make_its_tokens_look_free() -> None:
    """A busy machine slows some of the streams' plain decode steps (here one in six, 4x):
    the chunks are still sized from what the mixed steps themselves cost. (Sized from what a
    chunk adds to the latest decode time, a slow decode step made the prompt's tokens look
    free and the chunks doubled step after step, each step stretching the stream's gap.)"""
    model = CostModel(slow_decodes=True)
    run_paste(model)
    assert model.decodes_beside >= 12  # the slow steps happened while the prompt was read
    over = [
        (n, w, round(t / USUAL_S, 2))
        for n, w, t in zip(model.mixed_steps, model.mixed_window, model.mixed_cost, strict=True)
        if n > 1 and t > 1.05 * MIX_TARGET * USUAL_S
    ]
    assert not over, over[:10]


def test_before_anything_is_measured_a_mixed_step_carries_one_prompt_token() -> None:
    """A fresh engine knows nothing of what a prompt token costs; on this CPU one costs about a
    third of a decode step, so a first chunk of four made the stream's first gap beside a paste
    2.2x its usual. One token first, then what the measured steps allow."""
    model = CostModel()
    run_paste(model)
    assert model.mixed_steps[0] == 1, model.mixed_steps[:8]
    assert max(model.mixed_steps[:20]) > 1  # and the chunks grow from there
