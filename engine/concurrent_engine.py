"""The concurrent engine: one model serving several conversations and tasks at once.

`ConcurrentEngine` implements the `ChatEngine` port for many callers: each `generate` call (from
any thread) is one request, and up to `batch_max` of them run together, each in a *KV slot* (a
row of the model's static cache, `KVCache.rows`). Their model steps go through one
`StepScheduler` (batched decode, interleaved prefill, interactive before background). The reply
loop itself, templating, prefix reuse, stop strings, metrics and speculation, is the one
`ChatSession` runs; here it runs on the request's `Sequence`.

Slots and conversations (llama.cpp server's slots, with paging):

* a conversation keeps its row after a reply, so its next turn prefills only the new message;
* a request for a conversation without a row takes a free row, or the least recently used
  idle conversation's row: that conversation's K/V is paged out to the prefix store (RAM, LRU
  under its byte budget) and, when it is long enough to be worth it, to disk, so coming back to
  it later, or after a restart, imports its rows instead of prefilling them again;
* when every row is running a request, new requests wait in a bounded queue (interactive ahead
  of background); when the queue is full a request gets `Failed(kind="busy")` at once;
* an interactive request never waits for a background one to finish: when every row is busy
  and one of them runs background work, that sequence is *parked* (its K/V copied to host
  memory, `Sequence.park`), the interactive request takes its row, and the background reply
  resumes, exactly where it stopped, as soon as a row is free and no interactive request waits.

A prompt that starts like another row's (the `n` choices of one request, one long few-shot
prompt sent with different questions) copies that row's K/V instead of prefilling it again, and
waits for it when that row is still prefilling it (`peer_prefix`).

Speculative decoding runs only while one sequence runs alone (the scheduler says so per step);
with several running, the batch is the better use of a step on this hardware (a verify of k+1
rows costs about as much as a batched decode of k+1 streams).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

from .errors import NpuchatError
from .events import Cancelled, ChatRequest, Event, Failed, Metrics, SamplingParams
from .peer_prefix import RowPeers
from .scheduler import BACKGROUND, INTERACTIVE, StepScheduler
from .sequence import PARKED, Sequence, SlotTable
from .session import ChatSession
from .token_view import TokenView
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["ConcurrentEngine"]

DEFAULT_QUEUE = 8  # requests that may wait for a slot before new ones are refused as busy
PERSIST_MIN_TOKENS = 256  # a paged-out conversation this long is also written to disk
_WAIT_POLL_S = 0.05  # a waiting request re-checks its cancel event this often


class ConcurrentEngine:
    """A `ChatEngine` that runs up to `batch_max` requests at once (module doc)."""

    def __init__(
        self,
        session: ChatSession,
        *,
        max_queue: int = DEFAULT_QUEUE,
        keep_warm_s: float = 0.0,
        share_rows: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`share_rows`: a prompt may copy the K/V another row holds (`peer_prefix`; off to
        measure what that saves, or where a test needs a prompt that is prefilled)."""
        self.session = session
        self.share_rows = share_rows
        self._tokens = TokenView(session.prompts)
        self.model = session.model
        self.slots = SlotTable(self.model)
        self.scheduler = StepScheduler(self.model, self.slots, clock=clock)
        self.max_queue = max_queue
        self._clock = clock
        self._cv = threading.Condition()  # guards everything below
        self._resident: dict[str, Sequence] = {}  # conversation id -> its sequence (in a row)
        self._conversation: dict[int, str] = {}  # id(seq) -> conversation id
        self._running: set[int] = set()  # id(seq) of sequences serving a request
        self._priority: dict[int, int] = {}  # id(seq) -> priority of the request it serves
        self._parked: list[
            Sequence
        ] = []  # running background sequences without a row, oldest first
        self._last_used: dict[int, float] = {}
        self._queue: list[tuple[int, int]] = []  # (priority, ticket) of waiting requests
        self._ticket = 0
        # The prefix store and the session's caches. Lock order: `_cv`, then `_store`, then the
        # scheduler's lock (the session takes the last two in that order too).
        self._store = threading.RLock()
        self._closed = threading.Event()
        self.warm_ticks = 0
        if keep_warm_s > 0 and session.device == "cpu":
            threading.Thread(
                target=self._keep_warm, args=(keep_warm_s,), daemon=True, name="keep-warm"
            ).start()
        # What loading left (tokenizer tables, templates, graph bindings) lives as long as the
        # engine: out of the cycle collector's way, a full collection takes ~0.3 ms instead of
        # 25-45 ms (0.5B), a pause that holds the GIL and so the next step of every stream
        # (1.5-3x a 16 ms decode step). Refcounting still frees those objects; `close` thaws
        # them so that a closed model's cycles can be collected.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ ChatEngine

    @property
    def model_name(self) -> str:
        return self.session.model_name

    @property
    def draft_name(self) -> str:
        return self.session.draft_name

    @property
    def device(self) -> str:
        return self.session.device

    @property
    def tokenizer(self) -> Tokenizer:
        return self.session.tokenizer

    # Tokenizes (serve's /tokenize and /detokenize)

    def tokenize(self, text: str, *, parse_special: bool, add_bos: bool) -> list[int]:
        return self._tokens.tokenize(text, parse_special=parse_special, add_bos=add_bos)

    def chat_tokens(self, request: ChatRequest) -> list[int]:
        return self._tokens.chat_tokens(request)

    def token_pieces(self, ids: Seq[int]) -> list[bytes]:
        return self._tokens.token_pieces(ids)

    def detokenize(self, ids: Seq[int]) -> str:
        return self._tokens.detokenize(ids)

    @property
    def batch_max(self) -> int:
        return self.model.batch_max

    def generate(self, request: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        yield from self._serve(request, cancel, None)

    def complete(
        self, ids: list[int], sampling: SamplingParams, cancel: threading.Event
    ) -> Iterator[Event]:
        """Continue raw prompt ids (no chat template), as `ChatSession.complete` does."""
        yield from self._serve(ids, cancel, sampling)

    def close(self) -> None:
        self._closed.set()
        with self._cv:
            idle = [s for s in self._resident.values() if id(s) not in self._running]
        for seq in idle:
            self._page_out(seq, persist=len(seq.tokens) >= PERSIST_MIN_TOKENS)
        self.scheduler.close()
        self.session.close()
        gc.unfreeze()

    # ------------------------------------------------------------------ requests

    def _serve(
        self,
        request: ChatRequest | list[int],
        cancel: threading.Event,
        sampling: SamplingParams | None,
    ) -> Iterator[Event]:
        if isinstance(request, ChatRequest):
            conv = request.conversation_id
            priority = BACKGROUND if request.priority == "background" else INTERACTIVE
            if request.raw_prompt is not None:  # no template: the text's own tokens
                sampling = request.sampling
                request = self.session.tokenizer.encode_prompt(request.raw_prompt)
                if not request:
                    yield Failed("the prompt is empty", kind="invalid")
                    return
        else:
            conv, priority = "", INTERACTIVE
        t_request = self._clock()  # TTFT counts the wait for a slot
        seq = self._admit(conv, priority, cancel)
        if isinstance(seq, Failed):
            yield seq
            return
        if seq is None:
            yield Cancelled(Metrics(model=self.model_name, device=self.device))
            return
        self.scheduler.register(seq, priority, cancel)
        with self._cv:
            self._priority[id(seq)] = priority
        try:
            yield from self.session.generate_on(
                seq,
                request,
                cancel,
                sampling=sampling,
                speculate=lambda: self.scheduler.alone(seq),
                store_lock=self._store,
                t_request=t_request,
                peers=self._peers(seq, priority) if self.share_rows else None,
            )
        finally:
            self.scheduler.unregister(seq)
            with self._cv:
                self._running.discard(id(seq))
                self._priority.pop(id(seq), None)
                self._last_used[id(seq)] = self._clock()
                if seq.parked is not None:  # ended without its row (cancelled while parked)
                    self._parked.remove(seq)
                    self._page_out(seq, persist=len(seq.tokens) >= PERSIST_MIN_TOKENS)
                    self._forget(seq)
                self._resume_parked()
                self._cv.notify_all()

    def _admit(self, conv: str, priority: int, cancel: threading.Event) -> Sequence | Failed | None:
        """A sequence in a row for this request, after waiting in the queue if need be."""
        with self._cv:
            if self._closed.is_set():
                return Failed("the engine is closed")
            if len(self._queue) >= self.max_queue:
                return Failed(
                    f"the engine is busy ({self.batch_max} replies running and "
                    f"{len(self._queue)} waiting); try again shortly",
                    kind="busy",
                )
            self._ticket += 1
            me = (priority, self._ticket)
            self._queue.append(me)
            try:
                while True:
                    if cancel.is_set() or self._closed.is_set():
                        return None
                    self._resume_parked()
                    # parked background replies get rows before new background requests
                    if min(self._queue) == me and (priority == INTERACTIVE or not self._parked):
                        seq = self._take_row(conv)
                        if seq is None and priority == INTERACTIVE and self._park_one():
                            seq = self._take_row(conv)
                        if seq is not None:
                            self._running.add(id(seq))
                            return seq
                    self._cv.wait(_WAIT_POLL_S)
            finally:
                self._queue.remove(me)
                self._resume_parked()
                self._cv.notify_all()

    def _take_row(self, conv: str) -> Sequence | None:
        """The conversation's resident sequence, or a new one in a free (or freed) row.

        Called with `_cv` held, as are the helpers below. The row is chosen, emptied and given
        its new owner under the scheduler's lock: a batched decode swaps rows (and their
        owners) between steps, so a row number read outside it may belong to a running one.
        """
        seq = self._resident.get(conv) if conv else None
        if seq is not None and id(seq) not in self._running:
            return seq
        with self._store, self.scheduler.lock:
            row = self._free_row()
            if row is None:
                return None
            new = Sequence(self.model, row, self.scheduler)
            self.model.rollback(0, row=row)
            self.slots.owner[row] = new
        if conv and conv not in self._resident:
            self._resident[conv] = new
            self._conversation[id(new)] = conv
        return new

    def _free_row(self) -> int | None:
        """A row without an owner, or the least recently used idle one's, paged out first."""
        with self._store, self.scheduler.lock:
            owner = self.slots.owner
            row = next((r for r, s in enumerate(owner) if s is None), None)
            if row is not None:
                return row
            idle = [s for s in owner if s is not None and id(s) not in self._running]
            if not idle:
                return None
            victim = min(idle, key=lambda s: self._last_used.get(id(s), 0.0))
            self._page_out(victim, persist=len(victim.tokens) >= PERSIST_MIN_TOKENS)
            row = victim.row
            self._forget(victim)
            return row

    def _park_one(self) -> bool:
        """Park the most recently admitted running background sequence (module doc)."""
        victims = [
            s
            for s in self.slots.owner
            if s is not None and id(s) in self._running and self._priority.get(id(s)) == BACKGROUND
        ]
        if not victims:
            return False
        with self.scheduler.lock:
            order = list(self._priority)  # admission order
            victim = max(victims, key=lambda s: order.index(id(s)))
            row = victim.row
            victim.park()
            self.slots.owner[row] = None
        self._parked.append(victim)
        log.info("parked a background reply (%d tokens) for an interactive one", len(victim.tokens))
        return True

    def _resume_parked(self) -> None:
        """Give parked sequences rows again, oldest first, while no interactive request waits."""
        while self._parked and not any(p == INTERACTIVE for p, _ in self._queue):
            with self._store, self.scheduler.lock:
                row = self._free_row()
                if row is None:
                    return
                seq = self._parked.pop(0)
                seq.resume(row)
                self.slots.owner[row] = seq
            self.scheduler.wake()

    def _peers(self, seq: Sequence, priority: int) -> RowPeers:
        """The other rows as `seq`'s prompt sees them: it waits only for prefills at least
        as urgent as its own (`peer_prefix`)."""

        def waits_for(peer: Sequence) -> bool:
            return self._priority.get(id(peer), BACKGROUND) <= priority

        return RowPeers(seq, self._sequences, self._store, waits_for)

    def _sequences(self) -> list[Sequence]:
        """Every sequence with K/V: rows' owners, and parked ones (`peer_prefix`). Read
        without `_cv` (lists copied whole under the GIL): the caller holds `_store`, which
        comes after `_cv` in the lock order; one caught between the two lists is missed."""
        return [s for s in list(self.slots.owner) if s is not None] + list(self._parked)

    def _forget(self, seq: Sequence) -> None:
        conv = self._conversation.pop(id(seq), None)
        if conv is not None and self._resident.get(conv) is seq:
            del self._resident[conv]
        self._last_used.pop(id(seq), None)
        if seq.row != PARKED and self.slots.owner[seq.row] is seq:
            self.slots.owner[seq.row] = None

    def _page_out(self, seq: Sequence, persist: bool) -> None:
        """Keep an idle sequence's K/V in the prefix store (and on disk) before its row goes."""
        if not seq.tokens:
            return
        try:
            with self._store, self.scheduler.lock:
                self.session.prefixes.put(seq.tokens, seq.kv_export)
                if persist:
                    self.session.prefixes.persist(seq.tokens, seq.kv_export)
        except (NpuchatError, OSError) as exc:  # losing a cache entry costs a prefill, no more
            log.warning("could not page out a conversation's KV: %s", exc)

    # ------------------------------------------------------------------ keep warm

    def _keep_warm(self, interval: float) -> None:
        """Touch the weights once per idle interval (`SessionOptions.keep_warm_s` says why)."""
        while not self._closed.wait(interval / 2):
            with self._cv:
                if self._running or self._queue:
                    continue
                recent = max(self._last_used.values(), default=0.0)
                seq = next((s for s in self.slots.owner if s is not None and s.tokens), None)
            if seq is None or self._clock() - recent < interval:
                continue
            try:
                with self.scheduler.lock:
                    n = self.model.length(seq.row)
                    if 0 < n < self.model.max_capacity:
                        self.model.decode(seq.tokens[-1], row=seq.row)
                        self.model.rollback(n, row=seq.row)
                        self.warm_ticks += 1
                with self._cv:
                    self._last_used[id(seq)] = self._clock()
            except Exception:  # a warm tick must never take the app down
                log.exception("keep-warm tick failed")
