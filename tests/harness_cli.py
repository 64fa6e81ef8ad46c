"""`npuchat` run as a script, with its engine changed for a test: each reply token delayed by
NPUCHAT_TEST_TOKEN_DELAY_S seconds (default 0.05, so a test can signal or kill the process while a
reply streams), and NPUCHAT_TEST_REPLY_PREFIX, if set, streamed before the model's own text (so a
test can see what becomes of text a model could write)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from npuchat.app import run_command
from npuchat.app.cli import main
from npuchat.engine.events import ChatRequest, Event, TokenDelta

_open_engine = run_command.open_concurrent_engine


def _slow_open_engine(*args: Any, **kwargs: Any) -> Any:
    engine = _open_engine(*args, **kwargs)
    generate = engine.generate
    delay = float(os.environ.get("NPUCHAT_TEST_TOKEN_DELAY_S", "0.05"))

    prefix = os.environ.get("NPUCHAT_TEST_REPLY_PREFIX", "")

    def slow_generate(request: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        if prefix:
            yield TokenDelta(prefix)
        for event in generate(request, cancel):
            if isinstance(event, TokenDelta):
                time.sleep(delay)
            yield event

    engine.generate = slow_generate  # type: ignore[method-assign]
    return engine


run_command.open_concurrent_engine = _slow_open_engine  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
