"""A per-step trace of the scheduler: what each engine step ran and what it cost.

Enabled by the `npuchat.engine.steps` logger at DEBUG (off, it costs one level check a step):
each step logs its kind, decode rows, prompt tokens, the cache capacity before and after, and
its wall and process CPU time, and the page faults and involuntary context switches the
process took meanwhile. CPU time is what to read on a loaded machine (wall time then includes
waiting for a core); a step much dearer than its neighbours of the same shape points at one-off
work on the step path (a capacity move, fresh memory: its faults, a new shape's first run), or,
with as many faults and switches as they had, at the machine. Each
record carries the figures as `record.step` (a `StepRecord`) for tools that collect them.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["StepRecord", "StepTrace", "log"]

log = logging.getLogger("npuchat.engine.steps")
Began = tuple[float, float, int, int, int, float]  # wall, CPU, capacity, faults, switches, steal
_TICK = 1.0 / os.sysconf("SC_CLK_TCK")  # /proc/stat's unit


@dataclass(frozen=True)
class StepRecord:
    kind: str  # decode, mixed, prefill, verify, cancel; wait-room, moved: decodes, a prompt waits
    rows: int  # decode rows
    tokens: int  # prompt tokens (a prefill chunk, or the chunk mixed in; verify: its tokens)
    capacity_before: int
    capacity_after: int
    wall_s: float
    cpu_s: float
    faults: int = 0  # minor page faults of the process (fresh memory, pages handed back)
    switches: int = 0  # involuntary context switches (a thread preempted for another)
    steal_s: float = 0.0  # CPU time the hypervisor gave other guests, all CPUs (10 ms ticks)


class StepTrace:
    """`begin` before a step, `end` after it; both do nothing while the logger is off."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self._capacity = capacity

    def begin(self) -> Began | None:
        if not log.isEnabledFor(logging.DEBUG):
            return None
        use = resource.getrusage(resource.RUSAGE_SELF)
        wall, cpu = time.perf_counter(), time.process_time()
        return wall, cpu, self._capacity(), *_counts(use), _steal_s()

    def end(self, began: Began | None, kind: str, rows: int, tokens: int) -> None:
        if began is None:
            return
        wall, cpu, cap = time.perf_counter() - began[0], time.process_time() - began[1], began[2]
        faults, switches = _counts(resource.getrusage(resource.RUSAGE_SELF))
        faults, switches, steal = faults - began[3], switches - began[4], _steal_s() - began[5]
        rec = StepRecord(
            kind, rows, tokens, cap, self._capacity(), wall, cpu, faults, switches, steal
        )
        log.debug(
            "step %-9s rows=%d tokens=%-4d capacity=%d->%d wall=%.1fms cpu=%.1fms "
            "faults=%d switches=%d steal=%.0fms",
            kind,
            rows,
            tokens,
            cap,
            rec.capacity_after,
            1e3 * wall,
            1e3 * cpu,
            faults,
            switches,
            1e3 * steal,
            extra={"step": rec},
        )


def _counts(use: resource.struct_rusage) -> tuple[int, int]:
    return use.ru_minflt + use.ru_majflt, use.ru_nivcsw


def _steal_s() -> float:
    """Seconds of steal time all CPUs have had (0 where /proc/stat does not say)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        return int(fields[8]) * _TICK if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0
