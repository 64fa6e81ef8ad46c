"""Running `npuchat serve`'s app for a test: uvicorn on 127.0.0.1, an ephemeral port, stopped
when the test ends (the server thread is joined with a timeout, so no test can leave it behind).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from npuchat.app.serve.server import ServedModel, Server, create_app
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import ChatEngine
from npuchat.engine.session import ChatSession

__all__ = ["TURNS", "named_events", "serving", "serving_model"]

# a conversation for the tests that ask one model the same thing through two endpoints
TURNS = [
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the quick fox"},
    {"role": "user", "content": "a small model"},
]


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
    assert server.stopped, "the server thread outlived the test: something it runs never ends"


def named_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of each event a streamed POST to `url` sends, checked to be named (`event:`)
    by its type, as OpenAI's Responses and Anthropic's Messages streams name them."""
    out = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == kind  # the SSE event name is the data's type
                out.append(data)
    return out


@contextmanager
def serving_model(path: Path, cache_dir: Path) -> Iterator[tuple[Server, openai.OpenAI]]:
    """`serving` a real engine on the GGUF at `path` (a synthetic model: 256 tokens of
    context, 16-token prefill chunks, the concurrent engine scheduling), named "syn"."""
    session = ChatSession.open(
        path, name="syn", cache_dir=cache_dir, capacities=[256], prefill_chunk=16, accuracy_level=0
    )
    engine = ConcurrentEngine(session, max_queue=4)
    try:
        with serving(engine, context_length=256, slots=None) as running:
            yield running
    finally:
        engine.close()
