"""Continuing a reply cut by max_tokens through `npuchat serve` (`continue_final_message`,
vLLM's spelling) and through `npuchat --server`'s client engine, on a real session over a tiny
synthetic model: the continuation is what one longer reply says, from the cached KV."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest
from serve_helpers import serving
from synthetic import write_synthetic_gguf

from npuchat.app.openai_engine import OpenAIEngine
from npuchat.engine.events import ChatMessage, ChatRequest, Finished, SamplingParams, TokenDelta
from npuchat.engine.session import ChatSession

NAME = "synthetic"
SYSTEM = "Be brief."
QUESTION = "model small"
"""A question whose greedy reply re-tokenizes to the ids it was sampled as (random weights
also sample half characters, which cannot come back the same way)."""
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    path = write_synthetic_gguf(tmp_path_factory.mktemp("m") / "chat.gguf", "qwen2", seed=3)
    session = ChatSession.open(
        path, name=NAME, cache_dir=tmp_path_factory.mktemp("cache"),
        capacities=[256], prefill_chunk=16, accuracy_level=0,
    )  # fmt: skip
    try:
        with serving(session, context_length=256) as (_, c):
            yield c
    finally:
        session.close()


def _ask(client: openai.OpenAI, messages: list[dict[str, str]], n: int, **extra: object) -> str:
    r = client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, max_tokens=n, extra_body=extra or None
    )
    assert r.choices[0].finish_reason == "length"  # every reply here runs to its limit
    return r.choices[0].message.content or ""


def test_a_cut_reply_continues_through_the_server(client: openai.OpenAI) -> None:
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    cut = _ask(client, question, 4)
    longer = _ask(client, question, 8)
    cut_turn = {"role": "assistant", "content": cut}
    more = client.chat.completions.create(
        model=NAME,
        messages=[*question, cut_turn],
        temperature=0,
        max_tokens=4,
        extra_body=CONTINUE,
    )
    continuation = more.choices[0].message.content or ""
    assert cut and cut + continuation == longer
    # the prompt and the cut reply come from the cache: only its last token is prefilled
    usage = more.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    # without the extension the final assistant message is a finished turn: a new reply
    assert _ask(client, [*question, cut_turn], 4) != continuation


def test_the_client_engine_continues_a_cut_reply_through_the_server(
    client: openai.OpenAI,
) -> None:
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    cut, longer = _ask(client, question, 4), _ask(client, question, 8)
    turns = (ChatMessage("user", QUESTION), ChatMessage("assistant", cut))
    request = ChatRequest(
        "c", SYSTEM, turns, SamplingParams(temperature=0.0, max_tokens=4), continue_reply=True
    )
    remote = OpenAIEngine(str(client.base_url))
    try:
        events = list(remote.generate(request, threading.Event()))
    finally:
        remote.close()
    final = events[-1]
    assert isinstance(final, Finished) and final.stop_reason == "max_tokens"
    assert cut + "".join(e.text for e in events if isinstance(e, TokenDelta)) == longer
