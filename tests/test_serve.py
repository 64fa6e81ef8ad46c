"""`npuchat serve` on a real `ChatSession` over a tiny synthetic model with Qwen2.5's tool-using
chat template: what the `openai` client gets equals what the engine gives when asked directly."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from serve_helpers import serving
from synthetic_vocab import QWEN25_TOOL_TEMPLATE

from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Event,
    Failed,
    Finished,
    SamplingParams,
    TokenDelta,
    ToolSpec,
)
from npuchat.engine.session import ChatSession

NAME = "synthetic-tools"
SYSTEM = "You are a test."
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def session(
    synthetic_gguf: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChatSession]:
    path = synthetic_gguf("qwen2", chat_template=QWEN25_TOOL_TEMPLATE, seed=5, context_length=1024)
    s = ChatSession.open(
        path,
        name=NAME,
        cache_dir=tmp_path_factory.mktemp("cache"),
        capacities=[1024],
        prefill_chunk=16,
        # float activations: a reply after a reused prefix must equal the reply after a fresh
        # prefill (int8 activations may round one value differently between kernel paths)
        accuracy_level=0,
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(session: ChatSession) -> Iterator[openai.OpenAI]:
    with serving(session, context_length=session.model.max_capacity) as (_, c):
        yield c


def _engine_events(run: Callable[[], Iterator[Event]]) -> list[Event]:
    """Events of a direct call, once the served reply before it has let go of the session (the
    server answers as soon as the engine's last event is out, a moment before it is free)."""
    deadline = time.monotonic() + 10
    while True:
        events = list(run())
        busy = isinstance(events[-1], Failed) and events[-1].kind == "busy"
        if not busy or time.monotonic() > deadline:
            return events
        time.sleep(0.01)


def _direct(session: ChatSession, request: ChatRequest) -> tuple[str, Finished]:
    """The reply the engine gives without the server: the reference for every test here."""
    events = _engine_events(lambda: session.generate(request, threading.Event()))
    final = events[-1]
    assert isinstance(final, Finished), final
    return "".join(e.text for e in events if isinstance(e, TokenDelta)), final


def _request(user: str, max_tokens: int, stop: tuple[str, ...] = ()) -> ChatRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop)
    return ChatRequest("ref", SYSTEM, (ChatMessage("user", user),), sampling)


def _messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_chat_equals_the_engine_and_reports_its_figures(
    session: ChatSession, client: openai.OpenAI
) -> None:
    expected, final = _direct(session, _request("hello world", 12))
    r = client.chat.completions.create(
        model=NAME, messages=_messages("hello world"), temperature=0, max_tokens=12
    )
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == ("length" if final.stop_reason == "max_tokens" else "stop")
    prompt = session.prompt_ids(SYSTEM, [ChatMessage("user", "hello world")])
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    # asked twice: the second time the whole prompt but its last token comes from the cache
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    ext = (r.model_extra or {})["npuchat"]
    assert ext["reused_tokens"] + ext["prefill_tokens"] == len(prompt)
    assert ext["ttft_s"] > 0 and ext["model"] == NAME and ext["device"] == "cpu"


def test_stream_equals_the_engine(session: ChatSession, client: openai.OpenAI) -> None:
    expected, _ = _direct(session, _request("the fox", 10))
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=_messages("the fox"),
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0


def test_stop_string_cuts_the_reply(session: ChatSession, client: openai.OpenAI) -> None:
    full, _ = _direct(session, _request("a small model", 16))
    assert len(full) >= 4, f"the synthetic reply is too short to cut: {full!r}"
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    r = client.chat.completions.create(
        model=NAME, messages=_messages("a small model"), temperature=0, max_tokens=16, stop=stop
    )
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"


def test_completion_continues_the_raw_prompt(session: ChatSession, client: openai.OpenAI) -> None:
    prompt = "def add(a, b):\n"
    ids = session.tokenizer.encode_prompt(prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    events = _engine_events(lambda: session.complete(ids, greedy, threading.Event()))
    expected = "".join(e.text for e in events if isinstance(e, TokenDelta))
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == expected
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_tools_are_rendered_into_the_prompt(session: ChatSession, client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=NAME, messages=_messages("look up fox"), temperature=0, max_tokens=2
    )
    tooled = client.chat.completions.create(
        model=NAME, messages=_messages("look up fox"), temperature=0, max_tokens=2, tools=[TOOL]
    )
    spec = ToolSpec("lookup", "Look a word up", json.dumps(TOOL["function"]["parameters"]))  # type: ignore[index]
    with_tools = session.prompt_ids(SYSTEM, [ChatMessage("user", "look up fox")], [spec])
    assert plain.usage is not None and tooled.usage is not None
    assert tooled.usage.prompt_tokens == len(with_tools) > plain.usage.prompt_tokens
    text = session.template.render(
        [{"role": "user", "content": "x"}],
        tools=[TOOL],
    )
    assert '"name": "lookup"' in text and "<tools>" in text


def test_prompt_longer_than_the_context_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="your messages resulted in") as chat:
        client.chat.completions.create(
            model=NAME, messages=_messages("hello world " * 1000), max_tokens=4
        )
    with pytest.raises(openai.BadRequestError, match="your prompt resulted in") as completion:
        client.completions.create(model=NAME, prompt="hello world " * 1000, max_tokens=4)
    assert chat.value.code == completion.value.code == "context_length_exceeded"
    assert (chat.value.param, completion.value.param) == ("messages", "prompt")
