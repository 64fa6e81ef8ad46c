"""Running `npuchat serve`'s app for a test: uvicorn on 127.0.0.1, an ephemeral port, stopped
when the test ends (the server thread is joined with a timeout, so no test can leave it behind).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai

from npuchat.app.serve.server import ServedModel, Server, create_app
from npuchat.engine.events import ChatEngine

__all__ = ["serving"]


@contextmanager
def serving(
    engine: ChatEngine, context_length: int = 1024, **kw: Any
) -> Iterator[tuple[Server, openai.OpenAI]]:
    """(server, an `openai` client for it with a 30 s timeout and no retries)."""
    card = ServedModel(engine.model_name, context_length, engine.draft_name, engine.device)
    server = Server(create_app(engine, card, **kw)).start()
    try:
        client = openai.OpenAI(
            base_url=server.url + "/v1",
            api_key=(kw.get("api_keys") or ("unused",))[0],
            timeout=30.0,
            max_retries=0,
        )
        with client:
            yield server, client
    finally:
        server.stop()
