"""Replies held to a JSON schema (structured outputs) or to any JSON object (JSON mode): every
synthetic architecture's reply is the schema's JSON, sampled or greedy, drafted or not,
bad schemas are one-line errors, and the service takes OpenAI's `response_format`."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_helpers import serving

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.drafters import LookupDrafter
from npuchat.engine.errors import InvalidRequestError
from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Failed,
    Finished,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.grammar import ANY_OBJECT, constraint_for
from npuchat.engine.session import ChatSession

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def _reply(session: ChatSession, params: SamplingParams, text: str = "hello") -> tuple[str, Any]:
    request = ChatRequest("c", "", (ChatMessage("user", text),), params)
    events = list(session.generate(request, threading.Event()))
    return "".join(e.text for e in events if isinstance(e, TokenDelta)), events[-1]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_a_random_models_reply_is_the_schemas_json(
    synthetic_gguf: Callable[..., Path], tmp_path: Path, arch: str
) -> None:
    """Models of random weights (a byte-level BPE and a SentencePiece vocabulary), greedy and
    sampled, with the lookup drafter on: each reply parses as the object the schema describes
    and ends there (stop reason eos), with no run of whitespace over 16 (these models write
    little else where they may); the keys the schema forces were drafted."""
    session = ChatSession.open(
        synthetic_gguf(arch, seed=11), name="syn", cache_dir=tmp_path, capacities=[256]
    )
    session.use_drafters([LookupDrafter()])
    try:
        for temperature, seed in ((0.0, 0), (0.9, 1), (0.9, 2)):
            params = SamplingParams(
                temperature=temperature, seed=seed, max_tokens=200, json_schema=json.dumps(SCHEMA)
            )
            text, final = _reply(session, params)
            assert isinstance(final, Finished) and final.stop_reason == "eos", text
            value = json.loads(text)
            assert set(value) == {"ok", "color"}, text
            assert isinstance(value["ok"], bool) and value["color"] in ("red", "green")
            assert not re.search(r"\s{17,}", text), text  # whitespace runs are bounded
            assert final.metrics.drafted > 0
    finally:
        session.close()


def test_json_mode_starts_an_object_and_a_free_reply_does_not(
    synthetic_gguf: Callable[..., Path], tmp_path: Path
) -> None:
    session = ChatSession.open(
        synthetic_gguf("qwen2", seed=11), name="syn", cache_dir=tmp_path, capacities=[256]
    )
    try:
        free, _ = _reply(session, SamplingParams(temperature=0.0, max_tokens=8))
        shaped, final = _reply(
            session, SamplingParams(temperature=0.0, max_tokens=8, json_schema=ANY_OBJECT)
        )
    finally:
        session.close()
    assert shaped.startswith("{") and not free.startswith("{")
    assert isinstance(final, Finished) and final.stop_reason == "max_tokens"


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ("{not json", "is not valid"),
        (json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "cannot be"),
        (json.dumps({"type": "wizard"}), "cannot be"),
        ('{"a":' * 3000 + "1" + "}" * 3000, "nested too deeply"),
    ],
)
def test_a_bad_schema_is_a_one_line_invalid_request(
    synthetic_gguf: Callable[..., Path], tmp_path: Path, schema: str, needle: str
) -> None:
    session = ChatSession.open(
        synthetic_gguf("qwen2", seed=11), name="syn", cache_dir=tmp_path, capacities=[256]
    )
    try:
        with pytest.raises(InvalidRequestError, match=needle):
            constraint_for(session.tokenizer, schema)
        _, final = _reply(session, SamplingParams(json_schema=schema))
    finally:
        session.close()
    assert isinstance(final, Failed) and final.kind == "invalid"
    assert needle in final.message and "\n" not in final.message


def test_served_response_formats(synthetic_gguf: Callable[..., Path], tmp_path: Path) -> None:
    """OpenAI's `response_format` through the `openai` client on the concurrent engine: a
    schema's reply parses to it, JSON mode starts an object, text is free; malformed formats
    and schemas are 400s."""
    session = ChatSession.open(
        synthetic_gguf("qwen2", seed=11),
        name="syn",
        cache_dir=tmp_path,
        capacities=[256],
        batch_max=2,
    )
    engine = ConcurrentEngine(session, max_queue=4)
    ask: dict[str, Any] = {
        "model": "syn",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0,
        "max_tokens": 200,
    }
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    with serving(engine, context_length=256, slots=None) as (_, client):
        shaped = client.chat.completions.create(**ask, response_format=schema)
        anything = client.chat.completions.create(
            **ask | {"max_tokens": 4}, response_format={"type": "json_object"}
        )
        bad = [
            {"type": "yaml"},
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/x"}}},
        ]
        for response_format in bad:
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(**ask, response_format=response_format)
    engine.close()
    assert shaped.choices[0].finish_reason == "stop"
    value = json.loads(shaped.choices[0].message.content or "")
    assert set(value) == {"ok", "color"}
    assert (anything.choices[0].message.content or "").startswith("{")
