"""A sequence: the tokens whose K/V fill one row of a model's cache, and their one owner.

Everything that reads or moves "which tokens are in the cache" goes through a `Sequence`: the
conversation session, the speculative decoder (its context is `tokens`; verify appends, the
rollback after acceptance truncates) and the draft model's drafter (a sequence on the draft
model). Each operation changes the row's K/V and `tokens` together, so the two cannot disagree.

Steps run through a `StepRunner`: `DirectRunner` calls the model at once (one thread, the
single-conversation session); the concurrent engine's scheduler runs them from its own thread,
batching the decode steps of several sequences into one graph run and interleaving prefill
chunks (`scheduler`). The row can change while the sequence waits (the scheduler swaps rows so a
batch's rows are contiguous); host-side edits of the cache (rollback, export, import) take the
runner's lock so they never overlap a step.

A sequence can be *parked*: its K/V rows are copied out to host memory and its row handed to
a more urgent request (an interactive reply preempting a background task). Every operation
works on the host copy while parked, and `resume` imports it into a row again, so the reply
carries on exactly where it stopped; the scheduler runs no step of a parked sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .errors import NpuchatError
from .kvcache import KVSnapshot

if TYPE_CHECKING:
    from .model import Model

__all__ = ["PARKED", "DirectRunner", "Sequence", "SlotTable", "StepRunner"]

PARKED = -1  # the row of a parked sequence


class StepRunner(Protocol):
    """Who runs a sequence's model steps (module doc)."""

    def prefill(self, seq: Sequence, ids: list[int], more: int = 0) -> np.ndarray: ...

    def decode(self, seq: Sequence, token: int) -> np.ndarray: ...

    def verify(self, seq: Sequence, ids: list[int]) -> np.ndarray: ...

    def locked(self) -> AbstractContextManager[None]: ...


class DirectRunner:
    """Runs steps on the calling thread (one sequence per model at a time)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def prefill(self, seq: Sequence, ids: list[int], more: int = 0) -> np.ndarray:
        with self._lock:
            return seq.model.prefill(ids, row=seq.row)

    def decode(self, seq: Sequence, token: int) -> np.ndarray:
        with self._lock:
            return seq.model.decode(token, row=seq.row)

    def verify(self, seq: Sequence, ids: list[int]) -> np.ndarray:
        with self._lock:
            return seq.model.verify(ids, row=seq.row)

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield


class Sequence:
    """`tokens` are exactly the tokens whose K/V are in row `row` of `model`'s cache."""

    def __init__(self, model: Model, row: int = 0, runner: StepRunner | None = None) -> None:
        self.model = model
        self.row = row
        self.runner: StepRunner = runner if runner is not None else DirectRunner()
        self.tokens: list[int] = []
        self.parked: KVSnapshot | None = None  # the K/V rows while parked (module doc)
        self.prompt: list[int] = []  # the prompt its prefill is writing, if any (`peer_prefix`)

    # the single-sequence interface the speculative decoder and the drafters use
    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def capacity(self) -> int:
        return self.model.capacity

    @property
    def max_capacity(self) -> int:
        return self.model.max_capacity

    @property
    def verify_k(self) -> int:
        return self.model.verify_k

    def prefill(self, ids: Seq[int], more: int = 0) -> np.ndarray:
        """Append `ids`; the logits after the last one. `more`: tokens of the same prompt the
        caller prefills right after this part (the scheduler keeps the turn for them, and
        makes room for the whole prompt at once)."""
        ids = [int(t) for t in ids]
        try:
            logits = self.runner.prefill(self, ids, more)
        except BaseException:
            self.resync()  # a prefill stopped between chunks (cancel, error) keeps no rows
            raise
        self.tokens.extend(ids)
        return logits

    def decode(self, token: int) -> np.ndarray:
        try:
            logits = self.runner.decode(self, int(token))
        except BaseException:
            self.resync()
            raise
        self.tokens.append(int(token))
        return logits

    def verify(self, ids: Seq[int]) -> np.ndarray:
        """Append up to k+1 tokens; logits for each (roll back what is rejected)."""
        ids = [int(t) for t in ids]
        try:
            rows = self.runner.verify(self, ids)
        except BaseException:
            self.resync()
            raise
        self.tokens.extend(ids)
        return rows

    def resync(self) -> None:
        """The row holds exactly `tokens` again: after a failed step, or after code that moved
        the model's row directly (benchmarks time raw steps on a session's model)."""
        with self.runner.locked():
            n = min(len(self.tokens), self._stored())
            self._truncate(n)
            del self.tokens[n:]

    def rollback(self, n: int) -> None:
        with self.runner.locked():
            self._truncate(n)
            del self.tokens[n:]

    def usable(self, n: int) -> int:
        """The longest prefix ≤ n of `tokens` the row can continue from: a sliding-window
        layer's ring forgets rows (`kv_ring`), so after a long reply an earlier point may only
        be reachable by prefilling again (0)."""
        with self.runner.locked():
            n = min(n, len(self.tokens))
            if self.parked is not None:
                return self.model.usable(n, ring_from=self.parked.ring_from)
            return self.model.usable(n, row=self.row)

    def kv_export(self, start: int, end: int) -> KVSnapshot:
        with self.runner.locked():
            if self.parked is None:
                return self.model.kv_export(start, end, row=self.row)
            snap = self.parked
            if not 0 <= start <= end <= snap.length:
                raise NpuchatError(f"cannot export KV rows {start}..{end}: {snap.length} are kept")
            return snap.rows(start, end)

    def adopt(self, snapshot: KVSnapshot, tokens: Seq[int]) -> None:
        """Replace the row's contents with a stored prefix: rows `[0, snapshot.length)` of
        `tokens` (a prefix-store hit)."""
        with self.runner.locked():
            if self.parked is not None:
                raise NpuchatError("a parked sequence cannot take a stored prefix; resume it first")
            self.model.rollback(0, row=self.row)
            self.model.kv_import(snapshot, 0, row=self.row)
            self.tokens = [int(t) for t in tokens[: snapshot.length]]

    def park(self) -> None:
        """Copy the row's K/V out (every row it holds, a prefill's finished chunks too) and
        give the row up (`row` becomes `PARKED`)."""
        with self.runner.locked():
            if self.parked is not None:
                return
            self.parked = self.model.kv_export(0, self.model.length(self.row), row=self.row)
            self.model.rollback(0, row=self.row)
            self.row = PARKED

    def resume(self, row: int) -> None:
        """Import the parked K/V into (empty) row `row` and run there from now on."""
        with self.runner.locked():
            snap = self.parked
            if snap is None:
                return
            self.model.rollback(0, row=row)
            if snap.length:
                self.model.kv_import(snap, 0, row=row)
            self.row, self.parked = row, None

    def _stored(self) -> int:
        return self.parked.length if self.parked is not None else self.model.length(self.row)

    def _truncate(self, n: int) -> None:
        if self.parked is None:
            self.model.rollback(n, row=self.row)
        elif n < self.parked.length:
            if self.model.usable(n, ring_from=self.parked.ring_from) != n:
                raise NpuchatError(f"cannot roll back to {n}: the parked rows do not hold it")
            self.parked = self.parked.rows(0, n)


class SlotTable:
    """Which sequence owns which cache row."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.owner: list[Sequence | None] = [None] * model.batch_max

    def swap(self, a: int, b: int) -> None:
        if a == b:
            return
        self.model.swap_rows(a, b)
        sa, sb = self.owner[a], self.owner[b]
        self.owner[a], self.owner[b] = sb, sa
        if sa is not None:
            sa.row = b
        if sb is not None:
            sb.row = a
