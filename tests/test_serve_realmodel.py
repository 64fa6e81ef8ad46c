"""`npuchat serve` on real models, a few tokens each, through the `openai` client: replies equal
the engine's own (asked directly, on a second session that sees the same requests in the same
order), and qwen2.5-coder-0.5b's answer to a tool request comes back as a tool call."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import serving
from tool_asks import ASKS, SCHEMAS, TOOLS, fits

from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.session import ChatSession

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}


CAT = {
    "name": "cat",
    "schema": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "colors": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        },
        "required": ["name", "age", "colors"],
        "additionalProperties": False,
    },
}


def _open(path: Path, cache: Path, name: str) -> ChatSession:
    return ChatSession.open(path, name=name, cache_dir=cache, capacities=[512], threads=2)


def _text(session: ChatSession, request: ChatRequest) -> str:
    events = session.generate(request, threading.Event())
    return "".join(e.text for e in events if isinstance(e, TokenDelta))


def test_smollm2_chat_stream_and_completion_equal_the_engine(
    real_gguf: Callable[[str], Path], tmp_path: Path
) -> None:
    path = real_gguf("smollm2-135m")
    served = _open(path, tmp_path / "cache", "smollm2-135m")
    reference = _open(path, tmp_path / "cache", "smollm2-135m")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    try:
        with serving(served, context_length=512) as (_, client):
            ask = ChatRequest("r", "Be brief.", (ChatMessage("user", "What is 2+2?"),), greedy)
            r = client.chat.completions.create(
                model="smollm2-135m",
                messages=[
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 2+2?"},
                ],
                temperature=0,
                max_tokens=8,
            )
            assert r.choices[0].message.content == _text(reference, ask)
            assert r.usage is not None and r.usage.completion_tokens <= 8

            ask = ChatRequest("r", "", (ChatMessage("user", "Name a colour."),), greedy)
            stream = client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": "Name a colour."}],
                temperature=0,
                max_tokens=8,
                stream=True,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == _text(reference, ask)

            ask = ChatRequest("r", "", (), greedy, raw_prompt="The capital of France is")
            c = client.completions.create(
                model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0
            )
            assert c.choices[0].text == _text(reference, ask)
            assert "Paris" in c.choices[0].text
    finally:
        served.close()
        reference.close()


def test_qwen_tool_request_comes_back_as_a_tool_call(
    real_gguf: Callable[[str], Path], tmp_path: Path
) -> None:
    session = _open(real_gguf("qwen2.5-coder-0.5b"), tmp_path / "cache", "qwen2.5-coder-0.5b")
    try:
        with serving(session, context_length=512) as (_, client):
            r = client.chat.completions.create(
                model="qwen2.5-coder-0.5b",
                messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
                tools=[WEATHER],  # type: ignore[list-item]
                temperature=0,
                max_tokens=40,
            )
            # a question the model would answer in prose, with the call forced
            forced = client.chat.completions.create(
                model="qwen2.5-coder-0.5b",
                messages=[{"role": "user", "content": "I am flying to Oslo tomorrow."}],
                tools=[WEATHER],  # type: ignore[list-item]
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                temperature=0,
                max_tokens=24,
            )
    finally:
        session.close()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]


def test_qwen_json_mode_answers_with_one_json_object(
    real_gguf: Callable[[str], Path], tmp_path: Path
) -> None:
    """`response_format`: where the model left alone opens a code block, JSON mode's reply is
    one JSON object that parses, ending (finish reason stop) when it closes, and a schema's
    reply has the schema's fields and types."""
    session = _open(real_gguf("qwen2.5-coder-0.5b"), tmp_path / "cache", "qwen2.5-coder-0.5b")
    ask: dict[str, Any] = {
        "model": "qwen2.5-coder-0.5b",
        "messages": [{"role": "user", "content": "Describe a cat in JSON: name, age, colors."}],
        "temperature": 0,
        "max_tokens": 80,
    }
    try:
        with serving(session, context_length=512) as (_, client):
            plain = client.chat.completions.create(**ask)
            shaped = client.chat.completions.create(**ask, response_format={"type": "json_object"})
            typed = client.chat.completions.create(
                **ask, response_format={"type": "json_schema", "json_schema": CAT}
            )
    finally:
        session.close()
    assert (plain.choices[0].message.content or "").lstrip().startswith("```")
    choice = shaped.choices[0]
    assert choice.finish_reason == "stop"
    cat = json.loads(choice.message.content or "")
    assert isinstance(cat, dict) and {"name", "age"} <= set(cat)
    choice = typed.choices[0]
    assert choice.finish_reason == "stop"
    cat = json.loads(choice.message.content or "")
    assert set(cat) == {"name", "age", "colors"}
    assert isinstance(cat["name"], str) and isinstance(cat["age"], int)
    assert cat["colors"] and all(isinstance(c, str) for c in cat["colors"])


def test_qwen_forced_calls_follow_the_tools_schemas(
    real_gguf: Callable[[str], Path], tmp_path: Path
) -> None:
    """`tool_choice: "required"` with three tools: every reply is a call to one of them whose
    arguments have exactly the parameters' keys, types and ranges (held to a grammar, as
    llama.cpp's server holds it). Left to itself on these asks (`benchmarks/tool_calls.py`),
    the 0.5B model called a tool nobody offered or ran out of tokens in a block."""
    session = _open(real_gguf("qwen2.5-coder-0.5b"), tmp_path / "cache", "qwen2.5-coder-0.5b")
    try:
        with serving(session, context_length=512) as (_, client):
            for ask in ASKS:
                r = client.chat.completions.create(
                    model="qwen2.5-coder-0.5b",
                    messages=[{"role": "user", "content": ask}],
                    tools=TOOLS,  # type: ignore[arg-type]
                    tool_choice="required",
                    temperature=0,
                    max_tokens=80,
                )
                choice = r.choices[0]
                assert choice.finish_reason == "tool_calls", (ask, choice.message.content)
                for call in choice.message.tool_calls or []:
                    name, args = call.function.name, json.loads(call.function.arguments)  # type: ignore[union-attr]
                    assert name in SCHEMAS and fits(args, SCHEMAS[name]), (ask, name, args)
    finally:
        session.close()
