"""The chunks a paste's mixed steps carry are sized for a stream's *longest* gap, not its
typical one: the dearest mixed step stays within `MIX_LIMIT` of the stream's usual step while
a step's cost varies from run to run, and where a prompt token is dear (a third of a decode
step, the 0.5B on this CPU) no step tries a second token that the first one's cost already
says would go past the limit. Cost model and paste from tests/test_scheduler_mixing.py."""

from __future__ import annotations

import time

from test_scheduler_mixing import DECODE_S, USUAL_S, CostModel, Slots, run_paste

from npuchat.engine.scheduler import StepScheduler
from npuchat.engine.step_costs import MIX_LIMIT, REFRESH_EVERY


def dearest(model: CostModel, tokens: int = 2) -> float:
    """The dearest mixed step with at least `tokens` prompt tokens, × the usual step."""
    costs = [c for n, c in zip(model.mixed_steps, model.mixed_cost, strict=True) if n >= tokens]
    return max(costs, default=0.0) / USUAL_S


def test_with_steps_varying_8_percent_no_chunk_takes_a_step_past_the_limit() -> None:
    model = CostModel(noise=0.08)
    during, usual, _ = run_paste(model)
    assert max(model.mixed_steps) > 2  # chunks grew: the bound is not kept by never mixing
    # How many steps the stream runs before the paste, and their order beside it, vary with
    # thread timing, and with them which noise draws land on the largest chunks: 1.40-1.62 over
    # 30 runs, so the bound is the limit plus 5% (the fitted line's error under noise).
    assert dearest(model) <= 1.05 * MIX_LIMIT, (dearest(model), model.mixed_steps[:30])
    assert max(during) <= 2.0 * usual, max(during) / usual


def test_where_a_prompt_token_costs_a_third_of_a_decode_step_chunks_stay_at_one() -> None:
    """One token costs ~1.35 usual steps, so two would cost ~1.7: the line from the stream's
    own step through the one-token steps says so, and no two-token step is tried. (A blind
    probe of one more token, while one size had been seen under budget, ran such steps.)"""
    model = CostModel(token_s=DECODE_S / 3)
    run_paste(model)
    assert set(model.mixed_steps) == {1}, sorted(set(model.mixed_steps))


def test_a_quieter_machine_after_the_usual_step_was_measured_does_not_widen_the_budget() -> None:
    """The stream's usual step was timed while the machine was busy (1.5x); beside the paste it
    is quiet again: once its plain steps beside the paste were timed (one in `REFRESH_EVERY`),
    the chunks keep within the limit of the steps as they now cost."""
    model = CostModel(busy_before=1.5)
    run_paste(model)
    steps = list(zip(model.mixed_steps, model.mixed_cost, strict=True))[2 * REFRESH_EVERY :]
    later = [c / USUAL_S for n, c in steps if n > 1]
    assert later and max(later) <= MIX_LIMIT, (max(later), model.mixed_steps[:40])


def test_on_a_busy_machine_chunks_are_sized_from_the_steps_cpu_time() -> None:
    """Each step waits for a core a different while (wall ×1 to ×2), and the stream's usual
    step was timed in a busier spell (×2.5): timed by wall, the budget is that spell's and the
    first chunks cost ~2x; timed on the CPU clock, as the engine's steps are, the chunks keep
    the steps' own cost within the limit."""
    model = CostModel(load=1.0, wall_before=2.5)
    run_paste(model, cpu_clock=True)
    assert max(model.mixed_steps) > 2
    assert dearest(model) <= MIX_LIMIT, (dearest(model), model.mixed_steps[:30])
    by_wall = CostModel(load=1.0, wall_before=2.5)
    run_paste(by_wall)
    assert dearest(by_wall) > MIX_LIMIT  # what the CPU clock saves


def test_the_engine_times_cpu_steps_on_the_scheduler_threads_cpu_clock() -> None:
    model = CostModel()
    sched = StepScheduler(model, Slots(model, []))  # type: ignore[arg-type]
    try:
        assert sched.step_clock is time.thread_time  # the thread that runs every step
    finally:
        sched.close()
    model.mixes_steps = False  # the NPU's steps wait for the device: wall time
    sched = StepScheduler(model, Slots(model, []))  # type: ignore[arg-type]
    try:
        assert sched.step_clock is time.perf_counter
    finally:
        sched.close()
