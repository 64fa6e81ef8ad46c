"""The step scheduler: one thread runs every model step of every running sequence.

Each request runs its reply loop in its own thread (the caller's `generate`), and every model
step it needs (a prefill, a decode, a verify) is handed to the scheduler, which runs one *engine
step* at a time:

* one batched decode over every sequence waiting for a decode step (one graph run over their
  cache rows: the weights are read once for all of them), or
* on the CPU, a *mixed* step: that batched decode plus a chunk of one waiting prompt in the same
  graph run (vLLM's chunked prefill), so a long paste never freezes the other streams, or
* one prefill chunk of one waiting sequence (nothing streams, or the NPU's static graphs), or
* one verify (speculative decoding runs only while a sequence runs alone).

Before choosing, the scheduler waits a moment (`GATHER_S`) for every registered sequence to
hand in its next step, so a batch holds all the streams that are running (a reply thread does a
little host work, sampling and detokenizing, between steps). A sequence that is streaming (its
last step was a decode), or whose prompt comes in parts (`Sequence.prefill(more=N)`: the
session reports progress between parts), is waited for longer (`LATE_S`) than one that has not
handed in its first step, and chunks stay small while anything streams: on a loaded machine a
reply thread can miss a short window, and the step would then run without it (a smaller batch,
or a prefill chunk that freezes its stream).

Choice (vLLM's and llama.cpp server's policies, shaped for one CPU):

* interactive before background: while an interactive sequence waits to prefill, background
  sequences are paused (their K/V stays in their rows); background decode rows ride along in an
  interactive decode batch (a batch row costs far less than a step of its own); a background
  prefill chunk gets one step in `BACKGROUND_EVERY` while interactive streams decode;
* when decodes and a prompt both wait, they share mixed steps, the chunk sized from measured
  times so a mixed step costs about `MIX_TARGET` of the streams' usual steps (`step_costs`): a
  stream's next token then never waits much more than its usual time. (A step costs a fixed
  part, reading the weights, plus a part per row: a prefill chunk of its own between decode
  steps could never keep that bound.) One step in `REFRESH_EVERY` is a plain decode, so the
  decode time stays current. The cache moves once, to what the prompt needs (`_make_room`).
  On the NPU they alternate, the chunk costing about one decode step; with nothing decoding,
  chunks are the model's full prefill chunk;
* cancel: a prefill checks its request's cancel event between chunks, and a chunk run alone
  is ended by it while it runs (`run_abort`);
* a parked sequence (`Sequence.park`: its row given to an interactive request) has its steps
  held until it resumes; cancelling it answers them at once.

Batched rows must be contiguous in the cache (one `[B, Hkv, C, dh]` view); the scheduler swaps
rows (`SlotTable.swap`) when the batch's sequences are not, which costs one copy of their rows
and happens only when the set of running sequences changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from .errors import NpuchatError, RequestCancelled
from .model import Model
from .run_abort import abortable
from .scheduler_steps import BatchedSteps, Choice, Step, StepKind
from .sequence import Sequence, SlotTable
from .step_costs import StepCosts
from .step_trace import StepTrace

log = logging.getLogger(__name__)

__all__ = ["StepScheduler"]

GATHER_S = 0.003  # how long to wait for every running sequence to hand in its step
LATE_S = 0.03  # how long a step waits for a streaming sequence's next decode step
BACKGROUND_EVERY = 4  # a background prefill chunk gets 1 engine step in this many
_PARKED_POLL_S = 0.05  # how often a parked sequence's cancel is looked at
INTERACTIVE, BACKGROUND = 0, 1


class StepScheduler(BatchedSteps):
    """Runs the steps of many sequences on one model from one thread (module doc)."""

    def __init__(
        self,
        model: Model,
        slots: SlotTable,
        *,
        clock: Callable[[], float] = time.perf_counter,
        step_clock: Callable[[], float] | None = None,
    ) -> None:
        """`clock`: waits and deadlines; `step_clock`: what a step costs (`step_costs`), by
        default on the CPU the scheduler thread's CPU clock: the thread runs every step's
        graph (ONNX Runtime's calling thread works or spins through the whole run), so on a
        quiet machine it reads the step's wall time, and on a busy one not the time spent
        waiting for a core, which changes from step to step and made a budget from a busier
        moment let chunks cost 1.6-1.85x the steps beside them. (The NPU's steps wait for the
        device: wall time.)"""
        self.model = model
        self.slots = slots
        self.clock = clock
        if step_clock is None:
            cpu = clock is time.perf_counter and model.mixes_steps
            step_clock = time.thread_time if cpu else clock
        self.step_clock = step_clock
        self.lock = threading.RLock()  # held while a step runs or the cache is edited
        self._cv = threading.Condition()
        self._pending: list[Step] = []
        self._registered: dict[int, tuple[Sequence, int, threading.Event | None]] = {}
        self._streaming: dict[int, int] = {}  # id(seq) -> priority, last step a decode/verify
        self._prompting: dict[int, int] = {}  # id(seq): tokens of its prompt still to come
        self._order = 0
        self._turn = 0  # engine steps run, for turn-taking
        self._last: StepKind | None = None
        self.costs = StepCosts(model.prefill_chunk)  # step times, and the chunks they allow
        self._closed = False
        self.steps: list[tuple[str, object, int]] = []  # (kind, rows or tokens, priority): tests
        self.record_steps = False
        self.trace = StepTrace(lambda: model.capacity)  # `npuchat.engine.steps` at DEBUG
        self._thread = threading.Thread(target=self._loop, name="npuchat-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ sequences

    def register(self, seq: Sequence, priority: int, cancel: threading.Event | None) -> None:
        with self._cv:
            self._registered[id(seq)] = (seq, priority, cancel)

    def unregister(self, seq: Sequence) -> None:
        with self._cv:
            self._registered.pop(id(seq), None)
            self._streaming.pop(id(seq), None)
            self._prompting.pop(id(seq), None)
            self._cv.notify_all()

    def running(self) -> int:
        with self._cv:
            return len(self._registered)

    def alone(self, seq: Sequence) -> bool:
        """Whether `seq` is the only sequence running (speculation pays only then)."""
        with self._cv:
            return len(self._registered) == 1 and id(seq) in self._registered

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ StepRunner

    def prefill(self, seq: Sequence, ids: list[int], more: int = 0) -> np.ndarray:
        """`more`: tokens of the same prompt that follow in later parts (`Sequence.prefill`)."""
        with self._cv:
            if more:  # the rest of its prompt follows: wait for it as for a stream
                self._prompting[id(seq)] = more
            else:
                self._prompting.pop(id(seq), None)
        return self._submit(seq, "prefill", ids, more)

    def decode(self, seq: Sequence, token: int) -> np.ndarray:
        return self._submit(seq, "decode", [token])

    def verify(self, seq: Sequence, ids: list[int]) -> np.ndarray:
        return self._submit(seq, "verify", ids)

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self.lock:
            yield

    def _submit(self, seq: Sequence, kind: StepKind, ids: list[int], more: int = 0) -> np.ndarray:
        with self._cv:
            if self._closed:
                raise NpuchatError("the engine is closed")
            _, priority, cancel = self._registered.get(id(seq), (seq, INTERACTIVE, None))
            self._order += 1
            step = Step(seq, kind, list(ids), priority, cancel, self._order, follows=more)
            self._pending.append(step)
            if kind == "prefill":
                self._streaming.pop(id(seq), None)
            else:
                self._streaming[id(seq)] = priority
            if self.record_steps:
                self.steps.append(("submit", kind, priority))
            self._cv.notify_all()
        step.done.wait()
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._runnable() and not self._closed:
                    # a parked sequence's cancel sets no condition: look again now and then
                    self._cv.wait(_PARKED_POLL_S if self._pending else None)
                if self._closed:
                    for step in self._pending:
                        step.error = NpuchatError("the engine is closed")
                        step.done.set()
                    return
                self._gather(LATE_S, set(self._streaming) | set(self._prompting))
                self._gather(GATHER_S, set(self._registered))
                chosen = self._choose()
                if chosen is None:  # what was runnable was parked meanwhile
                    continue
                for step in chosen.steps:
                    if step.kind != "prefill" or chosen.finishes:
                        self._pending.remove(step)
            self._run(chosen)

    def _runnable(self) -> list[Step]:
        """Pending steps that may run now: a parked sequence's wait until it resumes, unless
        its request was cancelled (answered at once)."""
        return [
            s
            for s in self._pending
            if s.seq.parked is None or (s.cancel is not None and s.cancel.is_set())
        ]

    def wake(self) -> None:
        """Look at the pending steps again (a parked sequence resumed)."""
        with self._cv:
            self._cv.notify_all()

    def _gather(self, wait_s: float, expected: set[int]) -> None:
        """Wait up to `wait_s` until every sequence in `expected` has a step pending."""
        deadline = self.clock() + wait_s
        expected -= {i for i, (seq, _, _) in self._registered.items() if seq.parked is not None}
        while not expected <= {id(s.seq) for s in self._pending}:
            left = deadline - self.clock()
            if left <= 0 or self._closed:
                return
            self._cv.wait(left)
            expected &= set(self._registered)

    def _choose(self) -> Choice | None:
        pending = sorted(self._runnable(), key=lambda s: (s.priority, s.order))
        if not pending:
            return None
        for step in pending:  # a cancelled prefill (or any step of a parked one) is answered
            cancelled = step.cancel is not None and step.cancel.is_set()
            if cancelled and (step.kind == "prefill" or step.seq.parked is not None):
                return Choice("cancel", [step], True)
        verifies = [s for s in pending if s.kind == "verify"]
        decodes = [s for s in pending if s.kind == "decode"]
        prefills = [s for s in pending if s.kind == "prefill"]
        top = pending[0].priority
        if verifies and verifies[0].priority == top:
            return Choice("verify", [verifies[0]], True)
        if prefills:
            p = prefills[0]
            streams = {k: v for k, v in self._streaming.items() if k != id(p.seq)}
            streams.update({id(d.seq): d.priority for d in decodes})
            interactive_streams = INTERACTIVE in streams.values()
            if not streams:
                return self._prefill_choice(p, full=True)
            if p.priority == INTERACTIVE and not interactive_streams:
                return self._prefill_choice(p, full=True)  # background waits (paused)
            if p.priority == INTERACTIVE or not interactive_streams:
                mixing = decodes and self.model.mixes_steps
                rows = decodes[: self._mix_rows(decodes)]
                if mixing and not self.costs.needs_refresh(len(rows), self._own_window(rows)):
                    return self._mixed_choice(p, decodes)
                if decodes and self.model.mixes_steps:  # a plain step: a current decode time
                    return Choice("decode", decodes[: self.model.batch_max], True)
                if self._last != "prefill" or not decodes:
                    return self._prefill_choice(p, full=False)
            elif not decodes or (self._turn % BACKGROUND_EVERY == 0 and self._last == "decode"):
                if decodes and self.model.mixes_steps:
                    return self._mixed_choice(p, decodes)
                return self._prefill_choice(p, full=False)
        if decodes and (any(d.priority == INTERACTIVE for d in decodes) or top == BACKGROUND):
            return Choice("decode", decodes[: self.model.batch_max], True)
        if verifies:
            return Choice("verify", [verifies[0]], True)
        return self._prefill_choice(prefills[0], full=True)

    def _prompt_ended(self) -> bool:
        """No prompt is being read in parts, nor waits: the room kept for one can go."""
        with self._cv:
            waiting = any(s.kind == "prefill" for s in self._pending)
            return not waiting and not self._prompting

    def _prefill_choice(self, step: Step, full: bool) -> Choice:
        left = len(step.ids) - step.offset
        n = left if full else min(left, self.costs.chunk_tokens())
        n = min(n, self.model.prefill_chunk) if full else n
        return Choice("prefill", [step], step.offset + n >= len(step.ids), n)

    def _run(self, chosen: Choice) -> None:
        self._turn += 1
        began, kind = self.trace.begin(), str(chosen.kind)
        try:
            with self.lock:
                if chosen.kind == "cancel":
                    raise RequestCancelled("cancelled")
                if chosen.kind == "decode":
                    self._run_decode(chosen.steps)
                elif chosen.kind == "verify":
                    step = chosen.steps[0]
                    step.result = self.model.verify(step.ids, row=step.seq.row)
                elif chosen.kind == "mixed":
                    kind = self._run_mixed(chosen)  # or decodes alone, the prompt waiting
                else:
                    self._run_prefill(chosen.steps[0], chosen.tokens)
                last = chosen.steps[-1]
                if chosen.finishes and last.kind == "prefill" and not last.follows:
                    self._release_room()
                elif self._room and self._prompt_ended():
                    self._release_room()  # its next part never came (cancelled between)
            self._last = "prefill" if chosen.kind == "prefill" else "decode"
        except BaseException as exc:  # handed to the waiting request thread
            for step in chosen.steps:
                step.error = exc
            last = chosen.steps[-1]
            if last.kind == "prefill" and not chosen.finishes:
                with self._cv:
                    if last in self._pending:
                        self._pending.remove(last)
                chosen.finishes = True
            if last.kind == "prefill":
                with self.lock:
                    self._release_room()
        rows = sum(s.kind == "decode" for s in chosen.steps)
        tokens = len(chosen.steps[0].ids) if kind == "verify" else chosen.tokens
        self.trace.end(began, kind, rows, tokens if kind not in ("wait-room", "moved") else 0)
        for step in chosen.steps:  # an unfinished prefill waits for its next chunk
            if step.kind != "prefill" or chosen.finishes:
                step.done.set()

    def _run_prefill(self, step: Step, n: int) -> None:
        chunk = step.ids[step.offset : step.offset + n]
        t0 = self.step_clock()
        with abortable(step.cancel) as run_options:  # a chunk of this sequence alone
            logits = self.model.prefill(chunk, row=step.seq.row, run_options=run_options)
        self.costs.prefilled(len(chunk), self.step_clock() - t0)
        step.offset += n
        step.result = logits
        if self.record_steps:
            self.steps.append(("prefill", n, step.priority))
