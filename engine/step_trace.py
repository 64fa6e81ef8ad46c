"""A per-step trace of the scheduler: what each engine step ran and what it cost.

Enabled by the `npuchat.engine.steps` logger at DEBUG (off, it costs one level check a step):
each step logs its kind, decode rows, prompt tokens, the cache capacity before and after, and
its wall and process CPU time. CPU time is what to read on a loaded machine (wall time then
includes waiting for a core); a step much dearer than its neighbours of the same shape points at
one-off work on the step path (a capacity move, fresh memory, a new shape's first run). Each
record carries the figures as `record.step` (a `StepRecord`) for tools that collect them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["StepRecord", "StepTrace", "log"]

log = logging.getLogger("npuchat.engine.steps")
Began = tuple[float, float, int]  # wall clock, CPU clock, capacity


@dataclass(frozen=True)
class StepRecord:
    kind: str  # decode, mixed, prefill, verify, cancel; wait-room, moved: decodes, a prompt waits
    rows: int  # decode rows
    tokens: int  # prompt tokens (a prefill chunk, or the chunk mixed in; verify: its tokens)
    capacity_before: int
    capacity_after: int
    wall_s: float
    cpu_s: float


class StepTrace:
    """`begin` before a step, `end` after it; both do nothing while the logger is off."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self._capacity = capacity

    def begin(self) -> Began | None:
        if not log.isEnabledFor(logging.DEBUG):
            return None
        return time.perf_counter(), time.process_time(), self._capacity()

    def end(self, began: Began | None, kind: str, rows: int, tokens: int) -> None:
        if began is None:
            return
        wall, cpu, cap = time.perf_counter() - began[0], time.process_time() - began[1], began[2]
        rec = StepRecord(kind, rows, tokens, cap, self._capacity(), wall, cpu)
        log.debug(
            "step %-9s rows=%d tokens=%-4d capacity=%d->%d wall=%.1fms cpu=%.1fms",
            kind,
            rows,
            tokens,
            cap,
            rec.capacity_after,
            1e3 * wall,
            1e3 * cpu,
            extra={"step": rec},
        )
