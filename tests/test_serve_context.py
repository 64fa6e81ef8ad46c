"""A conversation longer than the served model's context, on a real engine (synthetic qwen2,
256 tokens of context): each API refuses it in its own words with the prompt's count, as
clients act on those errors (trim, compact), unless the Responses API's `truncation: "auto"`
asks the server to drop turns; and the app over `npuchat --server` drops the oldest turns and
asks again, as it does with a local model."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from serve_helpers import serving_model

from npuchat.app.openai_engine import OpenAIEngine
from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Failed,
    Finished,
    MetricsUpdate,
    Notice,
    SamplingParams,
)

CONTEXT = 256  # serving_model's
LONG: list[dict[str, Any]] = []
for i in range(16):
    LONG += [
        {"role": "user", "content": f"tell me about the quick fox number {i} and the world"},
        {"role": "assistant", "content": f"the small model {i} says the fox is quick"},
    ]
LONG.append({"role": "user", "content": "and the world now?"})


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=7)


def _openai_refusals(client: openai.OpenAI) -> list[openai.BadRequestError]:
    out = []
    asks: list[Callable[[], object]] = [
        lambda: client.chat.completions.create(model="syn", messages=LONG, max_tokens=4),  # type: ignore[arg-type]
        lambda: client.chat.completions.create(
            model="syn",
            messages=LONG,  # type: ignore[arg-type]
            max_tokens=4,
            stream=True,
        ),
        lambda: client.responses.create(model="syn", input=LONG, max_output_tokens=4),  # type: ignore[arg-type]
    ]
    for ask in asks:
        with pytest.raises(openai.BadRequestError) as refused:
            ask()
        out.append(refused.value)
    return out


def test_each_api_refuses_a_conversation_past_the_context_in_its_own_words(
    path: Path, tmp_path: Path
) -> None:
    with serving_model(path, tmp_path) as (server, client):
        counted = httpx.post(
            f"{server.url}/tokenize", json={"model": "syn", "messages": LONG}, timeout=30
        ).json()["count"]
        refusals = _openai_refusals(client)
        a = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        with a, pytest.raises(anthropic.BadRequestError) as message:
            a.messages.create(model="syn", max_tokens=4, messages=LONG)  # type: ignore[arg-type]
        truncated = client.responses.create(
            model="syn",
            input=LONG,  # type: ignore[arg-type]
            max_output_tokens=4,
            truncation="auto",
            temperature=0,
        )
        fits = client.chat.completions.create(model="syn", messages=LONG[-3:], max_tokens=4)  # type: ignore[arg-type]
    assert counted > CONTEXT
    for refused in refusals:  # chat, streamed chat, responses: OpenAI's error and code
        assert refused.code == "context_length_exceeded" and refused.param == "messages"
        assert f"maximum context length is {CONTEXT} tokens" in refused.message
        assert f"resulted in {counted} tokens" in refused.message
    error = message.value.body["error"]  # type: ignore[index]
    assert error == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {counted} tokens > {CONTEXT} maximum",
    }
    assert truncated.error is None and truncated.truncation == "auto"
    assert truncated.usage is not None and truncated.usage.output_tokens > 0
    assert truncated.usage is not None and truncated.usage.input_tokens < CONTEXT
    assert fits.choices[0].finish_reason in ("stop", "length")


def test_the_app_over_a_server_drops_the_oldest_turns_as_it_does_at_home(
    path: Path, tmp_path: Path
) -> None:
    messages = tuple(ChatMessage(m["role"], m["content"]) for m in LONG)
    request = ChatRequest("c", "", messages, SamplingParams(temperature=0, max_tokens=8))
    with serving_model(path, tmp_path) as (server, _):
        engine = OpenAIEngine(server.url)
        try:
            events = list(engine.generate(request, threading.Event()))
            strict = list(engine.generate(replace(request, drop_turns=False), threading.Event()))
        finally:
            engine.close()
    (notice,) = [e for e in events if isinstance(e, Notice)]
    dropped = re.fullmatch(r"dropped (\d+) oldest turns to fit the server's context", notice.text)
    assert dropped is not None and 1 <= int(dropped.group(1)) < 16
    assert isinstance(events[-1], Finished)
    read = [e.metrics for e in events if isinstance(e, MetricsUpdate)][-1]
    assert 0 < read.prefill_tokens + read.reused_tokens <= CONTEXT - 8  # room for the reply
    assert isinstance(strict[-1], Failed) and strict[-1].kind == "invalid"
    assert "maximum context length is 256 tokens" in strict[-1].message
