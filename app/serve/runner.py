"""Running engine generations for the event loop: admission, a worker thread per reply, cancel.

`ChatEngine.generate` is a blocking iterator, so each reply runs in its own thread and hands
its events to the event loop through an asyncio queue. In front of the engine sits a bounded
admission queue: at most `slots` replies run at once (1 for an engine that answers a second
concurrent call with `Failed(kind="busy")`), at most `max_queue` more wait, and anything beyond
that is refused at once (HTTP 429) instead of piling up. A slot is given back when the engine's
thread has finished, not when the client goes away, so the engine is never handed two replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    Cancelled,
    ChatEngine,
    ChatRequest,
    Event,
    Failed,
    Finished,
)

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and the waiting line is full."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the server is busy; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class Load:
    running: int = 0
    waiting: int = 0


class Admission:
    """At most `slots` replies at once (None: no limit, the engine queues), `max_queue` waiting."""

    def __init__(self, slots: int | None, max_queue: int) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.load = Load()
        self._free = asyncio.Semaphore(slots) if slots else None
        self._recent: deque[float] = deque(maxlen=16)  # seconds per finished reply

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the mean recent reply time, at least 1."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, round(mean))

    async def enter(self) -> None:
        """Wait for a slot; raises QueueFull at once when the line is full."""
        if self._free is None:
            self.load.running += 1
            return
        if self._free.locked() and self.load.waiting >= self.max_queue:
            raise QueueFull(self.retry_after())
        self.load.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.load.waiting -= 1
        self.load.running += 1

    def leave(self, seconds: float) -> None:
        self.load.running -= 1
        self._recent.append(seconds)
        if self._free is not None:
            self._free.release()


_END = object()


def run_events(
    engine: ChatEngine, admission: Admission, request: ChatRequest, cancel: threading.Event
) -> AsyncIterator[Event]:
    """Start one reply now and return its events, on the event loop.

    The caller has already entered `admission`; the slot is left when the engine's thread
    returns, however the events are consumed. Leaving the iterator early (a disconnect, an
    error) sets `cancel`, so the engine stops within one step.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    started = time.monotonic()

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down): nobody to tell
            cancel.set()

    def work() -> None:
        try:
            for event in engine.generate(request, cancel):
                put(event)
                if isinstance(event, Finished | Cancelled | Failed):
                    return
            put(Failed("the engine ended the reply without saying why"))
        except NpuchatError as exc:
            put(Failed(str(exc)))
        except Exception as exc:  # a bug: the traceback goes to the log, not to the client
            log.exception("generation failed")
            put(Failed(f"internal error: {type(exc).__name__}"))
        finally:
            put(_END)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(admission.leave, time.monotonic() - started)

    threading.Thread(target=work, daemon=True, name="serve-generate").start()
    return _drain(queue, cancel)


async def _drain(queue: asyncio.Queue[object], cancel: threading.Event) -> AsyncIterator[Event]:
    finished = False
    try:
        while (item := await queue.get()) is not _END:
            event: Event = item  # type: ignore[assignment]
            if isinstance(event, Finished | Cancelled | Failed):
                finished = True
            yield event
    finally:
        if not finished:
            cancel.set()
