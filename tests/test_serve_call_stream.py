"""A tool call the grammar holds streams as the model writes it, through each API's stream:
its name, then its arguments a stretch at a time, while the reply is still being written
(the engine is held mid-call to show it), adding up to the arguments the call ends with."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import serving

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
ASK = [{"role": "user", "content": "weather?"}]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": ASK, "tools": [CHAT_TOOL]},
    "/v1/responses": {
        "input": "weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
    },
    "/v1/messages": {
        "max_tokens": 64,
        "messages": ASK,
        "tools": [{"name": "get_weather", "input_schema": PARAMETERS}],
    },
}
CALL = ['{"name": "get_weather", "arguments": {"city": "', "Oslo", '", "days": 3', "}}"]
FORMS = {  # a block (Qwen2.5's template), and a json code block (qwen2.5-coder's own habit)
    "block": ["Let me look. ", "<tool_call>", "\n", *CALL, "\n</tool_call>"],
    "fenced": ["```", "json\n", *CALL, "\n```"],
}


def _arguments(path: str, data: dict[str, Any]) -> tuple[str | None, str]:
    """(the call's name where this event names it, the stretch of arguments it carries)."""
    if path == "/v1/chat/completions":
        delta = data["choices"][0]["delta"] if data.get("choices") else {}
        calls = delta.get("tool_calls") or [{"function": {}}]
        function = calls[0]["function"]
        return function.get("name"), function.get("arguments") or ""
    if path == "/v1/responses":
        item = data.get("item") or {}
        if data["type"] == "response.output_item.added" and item["type"] == "function_call":
            return item["name"], ""
        return None, data.get("delta", "") if "function_call_arguments.delta" in data[
            "type"
        ] else ""
    block = data.get("content_block") or {}
    if data["type"] == "content_block_start" and block["type"] == "tool_use":
        return block["name"], ""
    delta = data.get("delta") or {}
    return None, delta.get("partial_json", "") if delta.get("type") == "input_json_delta" else ""


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_held_call_streams_while_it_is_written(path: str, form: str) -> None:
    chunks = FORMS[form]
    reply = ScriptedReply(chunks, hold_at=chunks.index("}}"))  # held before the object's end
    engine = ScriptedEngine([reply])
    names: list[str] = []
    during = ""  # arguments seen while the engine was held mid-call
    streamed = ""
    with serving(engine) as (server, _):
        body = {**BODIES[path], "model": engine.model_name, "stream": True}
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                name, more = _arguments(path, json.loads(line.removeprefix("data: ")))
                names += [name] if name else []
                streamed += more
                if '"days": 3' in streamed and not reply.release.is_set():
                    assert reply.reached_hold.is_set()  # still writing the call
                    during = streamed
                    reply.release.set()
    assert names == ["get_weather"]
    assert during == '{"city": "Oslo", "days": 3'  # the object's close not sent yet
    assert streamed == '{"city": "Oslo", "days": 3}'
    sampling = engine.requests[0].sampling  # what holds the call
    assert sampling.grammar_after is not None and sampling.grammar_if_starts
