"""The paste section of `concurrency.py`: the longest gap between two tokens of a streaming reply
while another conversation prefills a ~2,000-token prompt, the same stream alone as a control,
and the per-step trace around it (the module doc of `concurrency.py` says what each figure is).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import threading
import time
from pathlib import Path

from concurrency_streams import (
    LONG_TOKENS,
    PROMPTS,
    Figures,
    Stream,
    long_text,
    open_engine,
    request,
)

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import Finished
from npuchat.engine.step_trace import StepRecord
from npuchat.engine.step_trace import log as step_log

PASTE_TOKENS = [LONG_TOKENS]  # the paste's length (`--paste-tokens`)
USUAL_TOKENS = 32  # the stream's tokens before the paste comes: its usual gap (`paste_gaps`)


def paste_figures(path: Path, cache: Path, threads: int, tokens: int, out: Figures) -> None:
    """The paste alone, then beside a stream, each on an engine of its own (a row left holding
    the first paste would keep the cache at a large capacity for the stream)."""
    caps = [512, 1024, 2048, 4096]
    engine = open_engine(path, cache, 4, threads, caps)
    try:
        list(engine.generate(request("warm", "hi", 4), threading.Event()))
        alone = Stream(engine, request("paste-alone", long_text(engine, PASTE_TOKENS[0]), 2))
        alone.run()
        assert isinstance(alone.final, Finished), alone.final
    finally:
        engine.close()
    shutil.rmtree(cache / "prefixes", ignore_errors=True)  # not read back from disk
    engine = open_engine(path, cache, 4, threads, caps)
    try:
        gaps = paste_beside_a_stream(engine, tokens, out)
    finally:
        engine.close()
    shutil.rmtree(cache / "prefixes", ignore_errors=True)
    engine = open_engine(path, cache, 4, threads, caps)
    try:
        control_gaps(engine, gaps, out)
    finally:
        engine.close()
    out["long_prefill_alone_ttft_s"] = alone.final.metrics.ttft_s
    out["long_prefill_x_alone"] = out["long_prefill_ttft_s"] / out["long_prefill_alone_ttft_s"]


class StepLog(logging.Handler):
    """Collects the scheduler's per-step records (`step_trace`) with the time they ended."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.steps: list[tuple[float, StepRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        step = getattr(record, "step", None)
        if isinstance(step, StepRecord):
            self.steps.append((time.perf_counter(), step))


def paste_beside_a_stream(engine: ConcurrentEngine, tokens: int, out: Figures) -> int:
    """The paste's figures (`paste_gaps`); returns the stream's gaps while the paste was read."""
    steps = StepLog()
    step_log.addHandler(steps)
    level = step_log.level
    step_log.setLevel(logging.DEBUG)
    try:
        return paste_gaps(engine, tokens, out, steps)
    finally:
        step_log.removeHandler(steps)
        step_log.setLevel(level)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def control_gaps(engine: ConcurrentEngine, gaps: int, out: Figures) -> None:
    """The paste's stream alone for `gaps` gaps after its first `USUAL_TOKENS` tokens: its
    longest and p99 gap against its median gap over those first tokens, as `paste_gaps` takes
    them. On this 2-core VM a stream alone has steps of 2-3x its median now and then, so the
    paste's figure is read against this one. Also the paste's longest gap against the median
    gap of this stream over the same tokens (what "normal" is at the length the stream had)."""
    list(engine.generate(request("warm", "hi", 4), threading.Event()))
    alone = Stream(engine, request("stream", PROMPTS[2], USUAL_TOKENS + gaps))
    alone.run()
    spans = [b - a for a, b in zip(alone.times, alone.times[1:], strict=False)]
    normal = statistics.median(spans[: USUAL_TOKENS - 1])
    after = spans[USUAL_TOKENS - 1 :]
    if not after:  # the paste beside the stream left no gap to compare with
        return
    out["alone_gap_normal_s"] = normal
    out["alone_gap_max_x"] = max(after) / normal
    out["alone_gap_p99_x"] = p99(after) / normal
    # the paste's longest gap against this stream's own median over the same stretch of tokens
    # (the stream's steps grow with its length, with or without a paste beside it)
    out["alone_gap_median_s"] = statistics.median(after)
    out["gap_x_alone_median"] = out["gap_max_during_prefill_s"] / out["alone_gap_median_s"]


def paste_gaps(engine: ConcurrentEngine, tokens: int, out: Figures, steps: StepLog) -> int:
    list(engine.generate(request("warm", "hi", 4), threading.Event()))
    text = long_text(engine, PASTE_TOKENS[0])
    streaming = Stream(engine, request("stream", PROMPTS[2], 100 * tokens))
    streaming.start()
    while len(streaming.times) < USUAL_TOKENS:
        time.sleep(0.01)
    t_long = time.perf_counter()
    big = Stream(engine, request("paste", text, 2))
    big.run()
    t_first = big.times[0] if big.times else time.perf_counter()
    n_end = len(streaming.times) + 3  # and the stream's next tokens after the paste's request
    while len(streaming.times) < n_end and streaming.is_alive():  # ended (what its end costs)
        time.sleep(0.01)
    t_done = streaming.times[-1]
    streaming.cancel.set()
    streaming.join()
    pairs = list(zip(streaming.times, streaming.times[1:], strict=False))
    before = [b - a for a, b in pairs if b <= t_long]
    during = [b - a for a, b in pairs if t_long < b <= t_done]
    out["gap_normal_s"] = statistics.median(before)
    out["gap_max_during_prefill_s"] = max(during) if during else float("nan")
    out["gap_median_during_prefill_s"] = statistics.median(during) if during else float("nan")
    out["gap_x"] = out["gap_max_during_prefill_s"] / out["gap_normal_s"]
    out["gap_p99_x"] = p99(during) / out["gap_normal_s"] if during else float("nan")
    out["long_prefill_ttft_s"] = t_first - t_long
    # the same in process CPU time, which a busy machine does not stretch: the dearest step
    # while the prompt was read, against the stream's decode steps before it
    usual = [r.cpu_s for t, r in steps.steps if t <= t_long and r.kind == "decode"]
    cpu = sorted(r.cpu_s for t, r in steps.steps if t_long < t <= t_done)
    if usual and cpu:
        out["step_cpu_usual_s"] = statistics.median(usual)
        out["step_cpu_max_x"] = cpu[-1] / out["step_cpu_usual_s"]
        out["step_cpu_p99_x"] = p99(cpu) / out["step_cpu_usual_s"]
    # the stream grows by a token a step while the prompt is read (its own steps get dearer
    # with its length): each mixed step against the plain decode steps nearest it in time, by
    # CPU time and by wall time (the latter what the stream's reader waits)
    during_steps = [r for t, r in steps.steps if t_long < t <= t_done]
    for clock in ("cpu", "wall"):
        plain = [
            (i, step_seconds(r, clock)) for i, r in enumerate(during_steps) if r.kind == "decode"
        ]
        own = []
        for i, r in enumerate(during_steps):
            near = sorted(plain, key=lambda p: abs(p[0] - i))[:9]
            if r.kind == "mixed" and near:
                own.append(step_seconds(r, clock) / statistics.median(c for _, c in near))
        if own:
            own.sort()
            out[f"step_{clock}_x_own_median"] = statistics.median(own)
            out[f"step_{clock}_x_own_p99"] = p99(own)
            out[f"step_{clock}_x_own_max"] = own[-1]
    return len(during)


def step_seconds(r: StepRecord, clock: str) -> float:
    return r.cpu_s if clock == "cpu" else r.wall_s


def paste_line(name: str, figures: dict[str, float]) -> str | None:
    """The paste's figure in one plain line (issue #15), or None where it was not measured."""
    if "gap_x" not in figures:
        return None
    line = (
        f"{name}: longest gap while a {PASTE_TOKENS[0]}-token prompt is read "
        f"{1e3 * figures['gap_max_during_prefill_s']:.0f} ms, the stream's median gap "
        f"before it {1e3 * figures['gap_normal_s']:.0f} ms: {figures['gap_x']:.2f}x "
        f"(median gap meanwhile {1e3 * figures['gap_median_during_prefill_s']:.0f} ms), "
        f"p99 {figures['gap_p99_x']:.2f}x"
    )
    if "alone_gap_max_x" in figures:  # the control (`control_gaps`)
        line += (
            f"; the same stream alone over as many tokens: longest "
            f"{figures['alone_gap_max_x']:.2f}x, p99 {figures['alone_gap_p99_x']:.2f}x; the "
            f"paste's longest gap against that stream's median gap over the same tokens "
            f"({1e3 * figures['alone_gap_median_s']:.0f} ms): "
            f"{figures['gap_x_alone_median']:.2f}x"
        )
    return line
