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
    follows: int = 0  # prefill: tokens of the same prompt in parts still to come


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
    step_clock: Callable[[], float]  # what a step costs (`StepScheduler`)
    steps: list[tuple[str, object, int]]
    _room = 0  # slots reserved for the prompt being mixed in (`_make_room`)

    def _mixed_choice(self, prefill: Step, decodes: list[Step]) -> Choice:
        """The decode steps and a chunk of the prefill in one engine step, the chunk sized so
        the step costs about `MIX_TARGET` decode steps of those rows (`StepCosts`)."""
        rows = decodes[: self._mix_rows(decodes)]
        room = self.model.max_capacity - max(self.model.length(d.seq.row) for d in rows)
        left = len(prefill.ids) - prefill.offset
        window = self._mixed_window(rows, prefill, self.costs.mix_last)
        own = self._own_window(rows)
        fits = self.costs.mix_tokens(len(rows), own, window, head=False)
        if left <= fits:  # the chunk would end the part: it computes the prompt's logits too
            with_head = self.costs.mix_tokens(len(rows), own, window, head=True)
            fits = left if with_head >= left else left - with_head  # that chunk comes next
        n = max(1, min(left, fits, room))
        return Choice("mixed", [*rows, prefill], prefill.offset + n >= len(prefill.ids), n)

    def _contiguous(self, steps: list[Step]) -> None:
        """Swap rows so the steps' sequences hold rows 0..B-1 (one view of the cache)."""
        for i, step in enumerate(sorted(steps, key=lambda s: s.seq.row)):
            self.slots.swap(step.seq.row, i)

    def _own_window(self, decodes: list[Step]) -> int:
        """The cache slots a decode step of these rows attends (`Model.window`)."""
        return self.model.window(max(self.model.length(d.seq.row) for d in decodes) + 1)

    def _mixed_window(self, decodes: list[Step], prefill: Step, n: int) -> int:
        """The slots a mixed step with an `n`-token chunk attends: the decode rows are padded
        to the chunk's length, so each row reaches its length + n."""
        rows = [*decodes, prefill]
        return self.model.window(max(self.model.length(s.seq.row) for s in rows) + n)

    def _run_decode(self, steps: list[Step], timed: bool = True) -> None:
        """A batched decode step; `timed`: its time says what such a step costs (the first
        step after the cache moved does not: ONNX Runtime sizes its buffers anew)."""
        self._contiguous(steps)
        steps.sort(key=lambda s: s.seq.row)
        own = self._own_window(steps)
        t0 = self.step_clock()
        logits = self.model.decode_batch([s.ids[0] for s in steps], first_row=0)
        waits = any(s.kind == "prefill" for s in list(self._pending))  # not the usual step
        if timed:
            self.costs.decoded(len(steps), self.step_clock() - t0, own, waits)
        for j, step in enumerate(steps):
            step.result = logits[j]
        if self.record_steps:
            self.steps.append(("decode", len(steps), min(s.priority for s in steps)))

    def _repend(self, step: Step) -> None:
        with self._cv:
            if step not in self._pending:
                self._pending.append(step)

    def _mix_rows(self, decodes: list[Step]) -> int:  # decode rows a mixed step carries
        return min(len(decodes), self.model.batch_max - 1)

    def _make_room(self, decodes: list[Step], prefill: Step, n: int) -> bool:
        """Reserve the capacity the whole prompt needs, the parts still to come too
        (`Step.follows`; a session sends a long prompt in parts): False while its
        pages are still being faulted in off the step path (the streams decode meanwhile).
        The cache moves once, before the prompt's first chunk, while its rows hold little to
        copy; that costs the streams nothing after, since a step attends only the slots its
        rows reach (`Model.window`), not the capacity. (Growing with the prompt instead moved
        the cache at every variant it passed, each move copying more rows, at a step.)"""
        ends = [self.model.length(d.seq.row) + n for d in decodes]  # their pad slots too
        left = len(prefill.ids) - prefill.offset + prefill.follows  # the parts to come too
        end = self.model.length(prefill.seq.row) + left
        need = max(end, *ends, self._room - _ROOM_SPARE)  # never less than before: the
        need = min(need + _ROOM_SPARE, self.model.max_capacity)  # cache must not move down
        ready = self.model.reserve(need)
        self._room = need if ready else self._room
        return ready

    def _release_room(self) -> None:
        self.model.reserve(0)
        self._room = 0

    def _run_mixed(self, chosen: Choice) -> str:
        """The decode steps plus a chunk of the last step's prefill, in one graph run: "mixed".
        Only the decode steps while the room for the prompt is being made ready ("wait-room"),
        and in the step after the cache moved there ("moved": the first run over the moved
        cache is dearer, ONNX Runtime sizing its buffers for it, and a chunk on top of that
        would stretch the streams' gap)."""
        steps, n = chosen.steps, chosen.tokens
        *decodes, prefill = steps
        cap = self.model.capacity
        ready = self._make_room(decodes, prefill, n)
        if not ready or self.model.capacity != cap:
            self._run_decode(decodes, timed=False)  # neither says what a decode step costs
            chosen.finishes = False
            self._repend(prefill)
            return "moved" if ready else "wait-room"
        self._contiguous(steps)
        order = sorted(steps, key=lambda s: s.seq.row)
        chunk = prefill.ids[prefill.offset : prefill.offset + n]
        window = self._mixed_window(decodes, prefill, n)
        # the prompt's logits only after the last chunk of its part (the vocabulary matmul is
        # a good part of what a prompt token costs)
        want = [s is not prefill or chosen.finishes for s in order]
        t0 = self.step_clock()
        logits = self.model.step_rows([chunk if s is prefill else s.ids for s in order], 0, want)
        self.costs.mixed(len(decodes), n, self.step_clock() - t0, window, chosen.finishes)
        rows = iter(logits)
        for step, wanted in zip(order, want, strict=True):
            if wanted:
                step.result = next(rows)
        prefill.offset += n
        if self.record_steps:
            self.steps.append(("mixed", (len(decodes), n), min(s.priority for s in steps)))
        return "mixed"
