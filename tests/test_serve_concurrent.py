"""`npuchat serve` on the concurrent engine (KV slots, batched decode) over a synthetic model:
requests from several clients run together, each reply equals the same request run alone, and
a client that disconnects frees its slot at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import serving

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.session import ChatSession

NAME = "synthetic-concurrent"
PROMPTS = ["hello world", "the quick fox", "def add(a, b):", "a small model"]


def _engine(path: Path, cache: Path, batch_max: int) -> ConcurrentEngine:
    session = ChatSession.open(
        path,
        name=NAME,
        cache_dir=cache,
        capacities=[256],
        prefill_chunk=16,
        accuracy_level=0,
        batch_max=batch_max,
    )
    return ConcurrentEngine(session, max_queue=8)


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=11)


def _ask(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> str:
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"conversation_id": prompt},
    )
    return r.choices[0].message.content or ""


def test_concurrent_clients_get_their_own_replies(path: Path, tmp_path: Path) -> None:
    alone_engine = _engine(path, tmp_path / "alone", batch_max=1)
    with serving(alone_engine, context_length=256, slots=None) as (_, client):
        alone = {p: _ask(client, p) for p in PROMPTS}
    alone_engine.close()

    engine = _engine(path, tmp_path / "together", batch_max=4)
    together: dict[str, str] = {}
    with serving(engine, context_length=256, slots=None) as (_, client):
        threads = [
            threading.Thread(target=lambda p=p: together.__setitem__(p, _ask(client, p)))
            for p in PROMPTS
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    engine.close()
    assert together == alone
    assert len(set(alone.values())) > 1, "the prompts should give different replies"


def test_disconnect_frees_the_slot(path: Path, tmp_path: Path) -> None:
    engine = _engine(path, tmp_path / "c", batch_max=2)
    try:
        with serving(engine, context_length=256, slots=None) as (server, client):
            body = {
                "model": NAME,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 200,
                "stream": True,
            }
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                while '"content": ""' in (line := next(lines)) or not line:
                    pass  # up to the first token
            deadline = time.monotonic() + 5
            while httpx.get(server.url + "/health").json()["running"]:
                assert time.monotonic() < deadline, "the reply kept running after the client left"
                time.sleep(0.01)
            assert _ask(client, "the quick fox", max_tokens=4)  # the engine takes new work
    finally:
        engine.close()
