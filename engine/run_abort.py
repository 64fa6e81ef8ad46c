"""Ending a graph run that is under way when its request is cancelled.

A prefill chunk is one `session.run`, and on a large model it takes seconds (128 tokens of the
1.5B model on two cores: about 3.5 s), so a cancel checked between chunks leaves Esc waiting for
the rest of the chunk. ONNX Runtime checks `RunOptions.terminate` between the graph's nodes: set
from another thread, it ends the run after the node in progress (milliseconds) with an error.

What an ended run leaves behind is safe: the graph writes the chunk's K/V rows into the cache
in place, but a row's fill level (`KVCache.lengths`) moves only after a run returns, so those
rows lie past it, are never attended, and the next step overwrites them; the `Sequence` keeps
the tokens of the chunks that finished (`Sequence.resync`).

Only a run that serves one sequence alone may be ended this way: a batched or mixed step also
carries other streams, whose tokens must not be lost (their chunks are small anyway).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import onnxruntime as ort  # type: ignore[import-untyped]

from .errors import RequestCancelled

__all__ = ["abortable"]

POLL_S = 0.01
"""How often the watcher looks at the cancel event while a run is under way."""


class _Watch:
    """A thread that terminates `options` once `cancel` is set, until `stop` is called."""

    def __init__(self, cancel: threading.Event) -> None:
        self.options = ort.RunOptions()
        self._cancel = cancel
        self._lock = threading.Lock()
        self._stopped = False
        self._terminated = False
        threading.Thread(target=self._run, name="npuchat-run-abort", daemon=True).start()

    def _run(self) -> None:
        while not self._stopped:
            if self._cancel.wait(POLL_S):
                with self._lock:
                    if not self._stopped:
                        self.options.terminate = True
                        self._terminated = True
                return

    def stop(self) -> bool:
        """End the watch; whether it terminated the run."""
        with self._lock:
            self._stopped = True
            return self._terminated


@contextmanager
def abortable(cancel: threading.Event | None) -> Iterator[ort.RunOptions | None]:
    """Run options for one graph run that `cancel` ends early (module doc); the run's error
    then becomes `RequestCancelled`. Without a cancel event: no options, nothing watched."""
    if cancel is None:
        yield None
        return
    watch = _Watch(cancel)
    try:
        yield watch.options
    except Exception as exc:
        if watch.stop():
            raise RequestCancelled("cancelled") from exc
        raise
    finally:
        watch.stop()
