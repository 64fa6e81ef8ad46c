"""Memory over a long session: what grew with every new conversation is bounded.

The figures (RSS after 10 and 100 turns of the app) come from `benchmarks/session_memory.py`;
these tests pin the two things that grew without a bound tied to the model: the prefix store's
RAM (a fixed 512 MiB, five times a 98 MB model) and the per-system-prompt token cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from synthetic import write_synthetic_gguf

from npuchat.engine.events import ChatMessage, ChatRequest, Finished, SamplingParams
from npuchat.engine.session import ChatSession

QUARTER_OF_MODEL_MIN = 32 << 20  # the documented rule: a quarter of the GGUF, at least 32 MiB


@pytest.mark.realmodel
def test_new_conversations_keep_the_prefix_store_within_a_quarter_of_the_model(
    real_gguf: Callable[[str], Path], tmp_path: Path
) -> None:
    path = real_gguf("smollm2-135m")
    session = ChatSession.open(path, name="smollm2-135m", cache_dir=tmp_path, capacities=[512])
    budget = max(QUARTER_OF_MODEL_MIN, path.stat().st_size // 4)
    topics = ["rivers", "compilers", "bread", "chess", "volcanoes", "jazz", "tides", "ants"]
    try:
        for i in range(24):  # each conversation leaves ~1.9 MB of K/V behind when switched away
            question = f"Conversation {i}: tell me three facts about {topics[i % 8]}. " * 3
            request = ChatRequest(
                f"c{i}",
                "You are a helpful assistant.",
                (ChatMessage("user", question),),
                SamplingParams(temperature=0.0, max_tokens=2),
            )
            final = list(session.generate(request, threading.Event()))[-1]
            assert isinstance(final, Finished)
        held = session.prefixes.nbytes
        assert 0 < held <= budget, f"{held / 2**20:.1f} MiB held, budget {budget / 2**20:.1f}"
        assert len(session.prefixes) < 24  # older conversations were evicted, not kept forever
    finally:
        session.close()


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatSession]:
    path = write_synthetic_gguf(tmp_path_factory.mktemp("m") / "q.gguf", "qwen2", seed=3)
    s = ChatSession.open(path, name="q", cache_dir=tmp_path_factory.mktemp("c"), capacities=[256])
    yield s
    s.close()


def test_many_system_prompts_keep_a_bounded_token_cache(session: ChatSession) -> None:
    """A user who edits the system prompt on every turn must not grow the process per edit."""
    for i in range(200):
        prefix = session.system_prefix(f"You are assistant number {i}.")
        assert prefix  # still computed correctly
    assert len(session.prompts._system) <= 32
    again = session.system_prefix("You are assistant number 199.")
    assert again == session.system_prefix("You are assistant number 199.")
