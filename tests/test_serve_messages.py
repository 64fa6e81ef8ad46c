"""`POST /v1/messages` (Anthropic's Messages API): driven with the `anthropic` package, whose
client, types and stream accumulator are the independent reference for the wire format; every
raw stream event is validated as its own type. A request reaches the engine as the chat
completion it means, and what cannot be honoured is a 400 naming its field, in Anthropic's
error shape."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import TURNS, named_events, serving, serving_model

from npuchat.engine.events import ChatEngine

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@contextmanager
def _client(engine: ChatEngine, **kw: Any) -> Iterator[tuple[str, anthropic.Anthropic]]:
    """(the server's URL, an `anthropic` client for it: no retries, 30 s timeout)."""
    with serving(engine, **kw) as (server, _):
        key = (kw.get("api_keys") or ("unused",))[0]
        with anthropic.Anthropic(
            base_url=server.url, api_key=key, max_retries=0, timeout=30.0
        ) as client:
            yield server.url, client


def _ask(**kw: Any) -> dict[str, Any]:
    return {"model": "scripted-1b", "max_tokens": 64, **kw}


def _hi(**kw: Any) -> dict[str, Any]:
    """A request of one user message, "hi"."""
    return _ask(messages=[{"role": "user", "content": "hi"}], **kw)


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    """The stream's events, each validated as the `anthropic` package's event type (an error
    event's data is Anthropic's error object)."""
    data = named_events(url + "/v1/messages", body)
    return [
        _other(e) if e["type"] in ("error", "ping") else EVENTS.validate_python(e) for e in data
    ]


def _other(data: dict[str, Any]) -> Any:
    """An event the SDK reads apart from the message's (a ping it skips, an error it raises)."""
    return SimpleNamespace(**data)


def test_a_text_reply_whole_and_streamed() -> None:
    engine = ScriptedEngine([ScriptedReply(["Hel", "lo"]) for _ in range(3)])
    ask = _ask(system="be brief", messages=[{"role": "user", "content": "hi"}])
    with _client(engine) as (url, client):
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            texts = list(stream.text_stream)
            final = stream.get_final_message()
        events = _events(url, ask)
    assert whole.content[0].type == "text" and whole.content[0].text == "Hello"
    assert whole.stop_reason == "end_turn" and whole.usage.output_tokens == 2
    assert whole.id.startswith("msg_") and whole.model == "scripted-1b"
    assert texts == ["Hel", "lo"] and final.content[0].text == "Hello"
    assert final.usage.output_tokens == 2 and final.stop_reason == "end_turn"
    kinds = [e.type for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    # the prompt's figures are known when message_start goes out, not only at the end
    start = events[0].message.usage
    assert start.input_tokens + (start.cache_read_input_tokens or 0) > 0
    assert start.input_tokens == final.usage.input_tokens
    request = engine.requests[0]
    assert request.system_prompt == "be brief" and request.messages[0].content == "hi"


def test_a_long_prompt_s_reading_starts_the_stream_and_pings() -> None:
    """While a long prompt is read the stream is not silent: message_start (with the whole
    prompt's count) at the first report, then a ping per report, as Anthropic's stream does."""
    replies = [ScriptedReply(["ok"], prefill=[(128, 384), (256, 384)]) for _ in range(2)]
    engine = ScriptedEngine(replies)
    with _client(engine) as (url, client):
        events = _events(url, _hi())
        with client.messages.stream(**_hi()) as stream:  # the SDK reads past the pings
            final = stream.get_final_message()
    assert final.content[0].text == "ok"
    assert [e.type for e in events[:4]] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
    ]
    assert events[0].message.usage.input_tokens == 384


def test_a_tool_call_and_its_result() -> None:
    """A call comes back as a tool_use block after the text (whole and streamed, the SDK's
    accumulator reading its input); the next turn's tool_use and tool_result blocks reach the
    engine as the assistant's call and the tool's message."""
    replies = [ScriptedReply(["Let me check. ", CALL]) for _ in range(2)]
    engine = ScriptedEngine([*replies, ScriptedReply(["Sunny."])])
    ask = _ask(messages=[{"role": "user", "content": "weather in Oslo?"}], tools=[WEATHER])
    with _client(engine) as (_, client):
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            streamed = stream.get_final_message()
        use = whole.content[1]
        assert use.type == "tool_use"
        follow = [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ]
        last = client.messages.create(**_ask(messages=follow, tools=[WEATHER]))
    assert [b.type for b in whole.content] == ["text", "tool_use"]
    assert whole.content[0].text == "Let me check." and whole.stop_reason == "tool_use"
    assert use.name == "get_weather" and use.input == {"city": "Oslo"}
    assert use.id.startswith("toolu_")
    assert [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.content[1].input == {"city": "Oslo"} and streamed.stop_reason == "tool_use"
    assert last.content[0].text == "Sunny."
    turns = engine.requests[-1].messages
    assert [m.role for m in turns] == ["user", "assistant", "tool", "user"]
    assert turns[1].content == "Let me check."
    assert turns[1].tool_calls[0].name == "get_weather"
    assert json.loads(turns[1].tool_calls[0].arguments) == {"city": "Oslo"}
    assert turns[2].content == "sunny" and turns[2].tool_call_id == use.id
    assert turns[3].content == "and tomorrow?"
    assert [t.name for t in engine.requests[-1].tools] == ["get_weather"]


def test_tool_choice_any_and_a_named_tool_force_a_call() -> None:
    engine = ScriptedEngine([ScriptedReply([CALL[len("<tool_call>\n") :]])] * 3)
    messages = [{"role": "user", "content": "weather?"}]
    with _client(engine) as (_, client):
        forced = client.messages.create(
            **_ask(messages=messages, tools=[WEATHER], tool_choice={"type": "any"})
        )
        named = client.messages.create(
            **_ask(
                messages=messages,
                tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"},
            )
        )
        client.messages.create(
            **_ask(
                messages=messages,
                tools=[WEATHER],
                tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            )
        )
    for reply in (forced, named):
        assert [b.type for b in reply.content] == ["tool_use"], reply.content
        assert reply.content[0].input == {"city": "Oslo"}
    any_, one, auto_one = engine.requests
    assert any_.reply_prefix and any_.sampling.grammar is not None
    assert one.reply_prefix and "</tool_call>" in one.sampling.stop  # one call: ends with it
    assert not auto_one.reply_prefix and "</tool_call>" in auto_one.sampling.stop


def test_a_final_assistant_message_is_continued() -> None:
    """Prefill: the reply continues the last assistant message and holds only the new text."""
    engine = ScriptedEngine([ScriptedReply(["B)"])])
    messages = [
        {"role": "user", "content": "Greek name for Sun? (A) Sol (B) Helios"},
        {"role": "assistant", "content": "The best answer is ("},
    ]
    with _client(engine) as (_, client):
        reply = client.messages.create(**_ask(messages=messages))
    assert reply.content[0].text == "B)"
    request = engine.requests[0]
    assert request.continue_reply and request.messages[-1].content == "The best answer is ("


def test_turns_are_joined_and_thinking_is_left_out() -> None:
    """Consecutive turns of one role are one turn, a turn's text blocks joined by a blank
    line; the system prompt may be blocks; thinking blocks sent back are not read."""
    engine = ScriptedEngine([ScriptedReply(["ok"])])
    messages = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": t} for t in ("two", "3")]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "yes"},
            ],
        },
        {"role": "user", "content": "go on"},
    ]
    system = [{"type": "text", "text": "be", "cache_control": {"type": "ephemeral"}}]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with _client(engine) as (_, client):
        client.messages.create(**_ask(messages=messages, system=system, thinking=thinking))
    request = engine.requests[0]
    assert [(m.role, m.content) for m in request.messages] == [
        ("user", "one\n\ntwo\n\n3"),
        ("assistant", "yes"),
        ("user", "go on"),
    ]
    assert request.system_prompt == "be" and not request.continue_reply


def test_stop_reasons() -> None:
    """`max_tokens` beyond the context (Claude Code asks for 32,000) is capped there, and a
    reply that fills the context says so."""
    engine = ScriptedEngine(
        [
            ScriptedReply(["a", "b"], stop_reason="max_tokens"),
            ScriptedReply(["a"], stop_reason="length"),
        ]
    )
    with _client(engine, context_length=512) as (_, client):
        cut = client.messages.create(**_hi(max_tokens=2))
        full = client.messages.create(**_hi(max_tokens=32_000))
    assert cut.stop_reason == "max_tokens" and engine.requests[0].sampling.max_tokens == 2
    assert full.stop_reason == "model_context_window_exceeded"
    assert engine.requests[1].sampling.max_tokens == 512


def test_output_config_holds_the_reply_to_a_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine = ScriptedEngine([ScriptedReply(['{"a": 1}'])])
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    with _client(engine) as (_, client):
        client.messages.create(
            **_ask(messages=[{"role": "user", "content": "a?"}], output_config=fmt)
        )
    held = engine.requests[0].sampling.json_schema
    assert held is not None and json.loads(held) == schema


def test_a_failure_mid_stream_ends_with_an_error_event() -> None:
    engine = ScriptedEngine([ScriptedReply(["a"], fail="the engine broke")] * 2)
    ask = _hi()
    with _client(engine) as (url, client):
        events = _events(url, ask)
        broke = pytest.raises(anthropic.APIStatusError, match="the engine broke")
        with broke, client.messages.stream(**ask) as stream:
            stream.get_final_message()
    error = ErrorResponse.model_validate(vars(events[-1]))
    assert error.error.type == "api_error" and error.error.message == "the engine broke"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (_hi(max_tokens=0), "max_tokens"),
        (_ask(messages=[]), "messages"),
        (_ask(messages="hi"), "messages"),
        (_ask(messages=[{"role": "tool", "content": "hi"}]), "messages.0.role"),
        (
            _ask(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                    }
                ]
            ),
            "messages.0.content.0.type",
        ),
        (
            _ask(
                messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                ]
            ),
            "messages.1.content.0.type",
        ),
        (
            _ask(
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f"}],
                    },
                ]
            ),
            "messages.1",  # a prefill with a call: nothing to continue
        ),
        (
            _ask(
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "web_search_20250305", "name": "web_search"}],
            ),
            "tools.0.type",
        ),
        (_hi(tools=[{"name": "f"}]), "tools.0.input_schema"),
        (
            _hi(tools=[{**WEATHER, "name": "x" * 65}]),
            "tools.0.name",
        ),
        (
            _ask(
                messages=[{"role": "user", "content": "hi"}],
                tools=[WEATHER],
                tool_choice={"type": "tool", "name": "nope"},
            ),
            "tool_choice",
        ),
        (_hi(tool_choice={"type": "x"}), "tool_choice"),
        (
            _hi(tool_choice={"type": "any"}),
            "tool_choice",
        ),
        (_hi(stop_sequences=["a"] * 5), "stop_sequences"),
        (_hi(temperature=-1), "temperature"),
        (_hi(system=[{"type": "image"}]), "system.0"),
        (
            _hi(output_config={"format": {"type": "x"}}),
            "output_config.format",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(body: dict[str, Any], field: str) -> None:
    """Anthropic's error object (no `param` in it: the message begins with the field)."""
    engine = ScriptedEngine()
    with serving(engine) as (server, _):
        r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    error = ErrorResponse.model_validate(r.json()).error
    assert r.status_code == 400 and error.type == "invalid_request_error", error
    assert error.message.startswith(field), error.message
    assert "\n" not in error.message and engine.requests == []


def test_the_model_is_listed_for_anthropic_s_client_too() -> None:
    engine = ScriptedEngine()
    with _client(engine, context_length=512) as (_, client), serving(engine) as (_, openai_):
        listed = client.models.list()
        one = client.models.retrieve("scripted-1b")
        openai_listed = openai_.models.list()
    assert [m.id for m in listed.data] == ["scripted-1b"] and not listed.has_more
    assert one.display_name == "scripted-1b" and one.max_input_tokens == 512
    assert one.created_at.tzinfo is not None
    assert [m.id for m in openai_listed.data] == ["scripted-1b"]


def test_errors_and_the_key_in_anthropics_shape() -> None:
    """The SDK's own `x-api-key` header opens the server; a wrong key, an unknown model and a
    wrong method are Anthropic's error objects, read by the SDK as its error classes."""
    engine = ScriptedEngine([ScriptedReply(["yes"])])
    messages = [{"role": "user", "content": "hi"}]
    with _client(engine, api_keys=("k-one",)) as (url, client):
        assert client.messages.create(**_ask(messages=messages)).content[0].text == "yes"
        wrong = client.with_options(api_key="k-two")
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(**_ask(messages=messages))
        with pytest.raises(anthropic.NotFoundError, match="serves 'scripted-1b'"):
            client.messages.create(**_ask(messages=messages, model="claude-sonnet-4-5"))
        got = httpx.get(url + "/v1/messages", headers={"x-api-key": "k-one"})
        bearer = httpx.post(
            url + "/v1/messages/count_tokens",
            json={"messages": messages},
            headers={"Authorization": "Bearer k-one"},
        )
        openai_path = httpx.post(url + "/v1/chat/completions", json={}, headers={"x-api-key": "x"})
    assert got.status_code == 405 and ErrorResponse.model_validate(got.json())
    assert bearer.status_code == 501  # the key is read from either header; no tokenizer here
    assert ErrorResponse.model_validate(bearer.json()).error.type == "api_error"
    assert openai_path.status_code == 401 and "error" in openai_path.json()
    assert openai_path.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=7)


def test_a_message_is_the_chat_completion_it_means(path: Path, tmp_path: Path) -> None:
    """On a real engine (synthetic model, greedy): the same conversation asked as a message
    and as a chat completion gives the same text and counts; count_tokens counts the prompt
    the engine read; a stop sequence from the reply cuts it there and is named."""

    # temperature is not among the SDK's arguments any more; servers still take it
    ask = {"model": "syn", "max_tokens": 12, "system": "be brief"}
    with serving_model(path, tmp_path) as (server, openai_client):
        chat = openai_client.chat.completions.create(
            model="syn",
            messages=[{"role": "system", "content": "be brief"}, *TURNS],  # type: ignore[list-item]
            max_tokens=12,
            temperature=0,
            extra_body={"conversation_id": "chat"},
        )
        with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
            message = client.messages.create(
                **ask,
                messages=TURNS,
                extra_body={"conversation_id": "message", "temperature": 0},
            )
            counted = client.messages.count_tokens(model="syn", system="be brief", messages=TURNS)
            text = message.content[0].text
            stop = text[3:5]
            cut = client.messages.create(
                **ask,
                messages=TURNS,
                stop_sequences=["never written", stop],
                extra_body={"conversation_id": "message", "temperature": 0},
            )
    assert chat.usage is not None and len(text) >= 5
    assert text == chat.choices[0].message.content
    read = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert read == chat.usage.prompt_tokens == counted.input_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]
    assert cut.usage.cache_read_input_tokens  # the same prompt again: its KV reused
