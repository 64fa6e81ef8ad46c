"""Running an EngineLoader in a worker thread and reporting back as Textual messages."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from textual.message import Message

from npuchat.app.engine_port import EngineLoader, EngineSpec
from npuchat.app.tui.messages import EngineLoaded, EngineLoadFailed, LoadProgress
from npuchat.engine.errors import NpuchatError

log = logging.getLogger(__name__)


class LoadAborted(Exception):
    """Raised inside the loader (from its progress callback) when the app is quitting.

    A thread cannot be killed, and Python waits for executor threads at exit; so a pull that
    reports progress stops at its next report instead of holding the terminal for minutes."""


class ProgressThrottle:
    """Forward loader progress at most every `interval` s (a download may report per chunk),
    but always forward a new stage and the final 100%."""

    def __init__(
        self,
        post: Callable[[Message], object],
        interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        abort: threading.Event | None = None,
    ) -> None:
        self._post = post
        self._abort = abort
        self._interval = interval
        self._clock = clock
        self._last_stage: str | None = None
        self._last_time = float("-inf")

    def __call__(self, stage: str, fraction: float) -> None:
        if self._abort is not None and self._abort.is_set():
            raise LoadAborted("the app is quitting")
        fraction = min(1.0, max(0.0, fraction))
        now = self._clock()
        if stage == self._last_stage and fraction < 1.0 and now - self._last_time < self._interval:
            return
        self._last_stage, self._last_time = stage, now
        self._post(LoadProgress(stage, fraction))


def load_engine(
    loader: EngineLoader,
    spec: EngineSpec,
    post: Callable[[Message], object],
    abort: threading.Event | None = None,
) -> None:
    """Worker-thread body: load, then post EngineLoaded or EngineLoadFailed (never raise)."""
    try:
        engine = loader(spec, ProgressThrottle(post, abort=abort))
    except LoadAborted:
        return
    except NpuchatError as exc:
        post(EngineLoadFailed(spec, str(exc)))
    except Exception as exc:
        log.exception("engine loader failed")
        post(EngineLoadFailed(spec, f"internal error while loading: {type(exc).__name__}: {exc}"))
    else:
        post(EngineLoaded(spec, engine))
