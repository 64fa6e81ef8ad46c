"""The engine steps that batch several sequences: batched decodes and mixed steps.

Split from `scheduler` (the loop and the choice of steps): how a batch's rows are made
contiguous, how a decode batch runs, and how a mixed step (the decodes plus a chunk of a
waiting prompt, `StepScheduler`'s module doc) is sized, given room in the cache and run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .model import Model
from .sequence import Sequence, SlotTable
from .step_costs import StepCosts

__all__ = ["BatchedSteps", "Choice", "Step", "StepKind"]

_ROOM_SPARE = 16  # slots reserved past what a mixed step's rows reach
StepKind = Literal["prefill", "decode", "verify"]


@dataclass(eq=False)
class Step:
    seq: Sequence
    kind: StepKind
    ids: list[int]
    priority: int
    cancel: threading.Event | None
    order: int
    done: threading.Event = field(default_factory=threading.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None
    offset: int = 0  # prefill: tokens already run


@dataclass
class Choice:
    kind: Literal["prefill", "decode", "verify", "mixed", "cancel"]
    steps: list[Step]
    finishes: bool  # the prefill (if any) is answered after this engine step; others always
    tokens: int = 0  # prefill: tokens in this chunk


class BatchedSteps:
    """The batched and mixed steps of `StepScheduler` (a mixin: it holds the state)."""

    model: Model
    slots: SlotTable
    costs: StepCosts
    _cv: threading.Condition
    _pending: list[Step]
    record_steps: bool
    clock: Callable[[], float]
    steps: list[tuple[str, object, int]]
    _room = 0  # slots reserved for the prompt being mixed in (`_make_room`)

    def _mixed_choice(self, prefill: Step, decodes: list[Step]) -> Choice:
        """The decode steps and a chunk of the prefill in one engine step, the chunk sized so
        the step costs about `MIX_TARGET` decode steps of those rows (`StepCosts`)."""
        rows = decodes[: self._mix_rows(decodes)]
        room = self.model.max_capacity - max(self.model.length(d.seq.row) for d in rows)
        left = len(prefill.ids) - prefill.offset
        n = max(1, min(left, self.costs.mix_tokens(len(rows), self._cap), room))
        return Choice("mixed", [*rows, prefill], prefill.offset + n >= len(prefill.ids), n)

    def _contiguous(self, steps: list[Step]) -> None:
        """Swap rows so the steps' sequences hold rows 0..B-1 (one view of the cache)."""
        for i, step in enumerate(sorted(steps, key=lambda s: s.seq.row)):
            self.slots.swap(step.seq.row, i)

    def _run_decode(self, steps: list[Step]) -> None:
        self._contiguous(steps)
        steps.sort(key=lambda s: s.seq.row)
        t0 = self.clock()
        logits = self.model.decode_batch([s.ids[0] for s in steps], first_row=0)
        waits = any(s.kind == "prefill" for s in list(self._pending))  # not the usual step
        self.costs.decoded(len(steps), self.clock() - t0, self._cap, waits)
        for j, step in enumerate(steps):
            step.result = logits[j]
        if self.record_steps:
            self.steps.append(("decode", len(steps), min(s.priority for s in steps)))

    def _repend(self, step: Step) -> None:
        with self._cv:
            if step not in self._pending:
                self._pending.append(step)

    @property
    def _cap(self) -> int:
        return self.model.capacity

    def _mix_rows(self, decodes: list[Step]) -> int:  # decode rows a mixed step carries
        return min(len(decodes), self.model.batch_max - 1)

    def _make_room(self, decodes: list[Step], prefill: Step, n: int) -> bool:
        """Reserve the capacity this mixed step reaches (`Model.reserve`): False while the
        pages of a larger one are still being faulted in off the step path (the streams
        decode meanwhile). The cache grows with the prompt, not to what the whole prompt will
        need at its first chunk: every row attends all of the capacity's slots, so the
        streams would pay the largest capacity's attention for the whole paste."""
        ends = [self.model.length(d.seq.row) + n for d in decodes]  # their pad slots too
        need = max(self.model.length(prefill.seq.row) + n, *ends, self._room - _ROOM_SPARE)
        need = min(need + _ROOM_SPARE, self.model.max_capacity)  # never less than before:
        ready = self.model.reserve(need)  # a smaller chunk must not move the cache back down
        self._room = need if ready else self._room
        return ready

    def _release_room(self) -> None:
        self.model.reserve(0)
        self._room = 0

    def _run_mixed(self, chosen: Choice) -> str:
        """The decode steps plus a chunk of the last step's prefill, in one graph run: "mixed".
        Only the decode steps while the room for the prompt is being made ready ("wait-room"),
        or when the cache just moved to a capacity no decode step has run at yet ("moved": the
        first run at a capacity is dearer, ONNX Runtime growing its buffers, and the chunk's
        budget needs the decode time there)."""
        steps, n = chosen.steps, chosen.tokens
        *decodes, prefill = steps
        cap = self._cap
        ready = self._make_room(decodes, prefill, n)
        if not ready or (self._cap != cap and self.costs.needs_refresh(len(decodes), self._cap)):
            self._run_decode(decodes)
            chosen.finishes = False
            self._repend(prefill)
            return "moved" if ready else "wait-room"
        if self._cap != cap:  # the cache moved: the chunk was sized for the old capacity
            n = chosen.tokens = min(n, self.costs.mix_tokens(len(decodes), self._cap))
            if chosen.finishes and prefill.offset + n < len(prefill.ids):
                chosen.finishes = False
                self._repend(prefill)
        self._contiguous(steps)
        order = sorted(steps, key=lambda s: s.seq.row)
        chunk = prefill.ids[prefill.offset : prefill.offset + n]
        t0 = self.clock()
        logits = self.model.step_rows([chunk if s is prefill else s.ids for s in order])
        self.costs.mixed(len(decodes), n, self.clock() - t0, self._cap)
        for j, step in enumerate(order):
            step.result = logits[j]
        prefill.offset += n
        if self.record_steps:
            self.steps.append(("mixed", (len(decodes), n), min(s.priority for s in steps)))
        return "mixed"
