"""`POST /v1/responses` (OpenAI's Responses API): every object and stream event is validated
against the `openai` package's own types (the independent reference for the wire format), a
request reaches the engine as the chat completion it means, and what cannot be honoured is a
400 naming its field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import TURNS, named_events, serving, serving_model

from npuchat.app.serve.response_store import ResponseStore

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=30)


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    """The stream's events, each validated as the `openai` package's event type."""
    out = [EVENTS.validate_python(e) for e in named_events(url + "/v1/responses", body)]
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


def test_a_text_reply_whole_and_streamed() -> None:
    engine = ScriptedEngine([ScriptedReply(["Hel", "lo"]), ScriptedReply(["Hel", "lo"])])
    body = {"model": engine.model_name, "input": "hi", "instructions": "be brief"}
    with serving(engine) as (server, _):
        whole = Response.model_validate(_post(server.url, body).json())
        events = _events(server.url, body)
    assert whole.status == "completed" and whole.output_text == "Hello"
    assert whole.usage is not None and whole.usage.output_tokens == 2
    assert whole.instructions == "be brief" and whole.model == engine.model_name
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == ["Hel", "lo"]
    final = events[-1].response
    assert final.output_text == "Hello" and final.status == "completed"
    assert [m.system_prompt for m in engine.requests] == ["be brief", "be brief"]
    assert [m.messages[-1].content for m in engine.requests] == ["hi", "hi"]


def test_tool_calls_and_their_results() -> None:
    """A call comes back as a function_call item (whole and streamed, text before it in a
    message item); the next turn's function_call and function_call_output items reach the
    engine as the assistant's call and the tool's result."""
    replies = [ScriptedReply(["Let me check. ", CALL]) for _ in range(2)]
    engine = ScriptedEngine([*replies, ScriptedReply(["Sunny."])])
    body = {"input": "weather in Oslo?", "tools": [WEATHER]}
    with serving(engine) as (server, _):
        whole = Response.model_validate(_post(server.url, body).json())
        events = _events(server.url, body)
        call = whole.output[1]
        assert call.type == "function_call"
        follow = {
            "input": [
                {"role": "user", "content": "weather in Oslo?"},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            ],
            "tools": [WEATHER],
        }
        last = Response.model_validate(_post(server.url, follow).json())
    assert [o.type for o in whole.output] == ["message", "function_call"]
    assert whole.output_text == "Let me check."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Oslo"}
    assert [o.type for o in events[-1].response.output] == ["message", "function_call"]
    assert last.output_text == "Sunny."
    turns = engine.requests[-1].messages
    assert [m.role for m in turns] == ["user", "assistant", "tool"]
    assert turns[1].tool_calls[0].name == "get_weather" and turns[2].content == "sunny"
    assert turns[2].tool_call_id == call.call_id
    assert [t.name for t in engine.requests[-1].tools] == ["get_weather"]


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    engine = ScriptedEngine([ScriptedReply(["a", "b"], stop_reason="max_tokens")] * 2)
    body = {"input": "hi", "max_output_tokens": 2}
    with serving(engine) as (server, _):
        whole = Response.model_validate(_post(server.url, body).json())
        events = _events(server.url, body)
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert events[-1].type == "response.incomplete"
    assert engine.requests[0].sampling.max_tokens == 2


def test_a_failure_mid_stream_ends_with_response_failed() -> None:
    engine = ScriptedEngine([ScriptedReply(["a"], fail="the engine broke")])
    with serving(engine) as (server, _):
        events = _events(server.url, {"input": "hi"})
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "the engine broke"


def test_text_format_holds_the_reply_to_a_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine = ScriptedEngine([ScriptedReply(['{"a": 1}'])])
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    with serving(engine) as (server, _):
        whole = Response.model_validate(
            _post(server.url, {"input": "give a", "text": {"format": fmt}}).json()
        )
    held = engine.requests[0].sampling.json_schema
    assert held is not None and json.loads(held) == schema
    assert whole.text is not None and whole.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": []}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "hi", "temperature": -1}, "temperature"),
        ({"input": 5}, "input"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    engine = ScriptedEngine()
    with serving(engine) as (server, _):
        r = _post(server.url, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert "\n" not in error["message"] and engine.requests == []


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=7)


def test_a_response_is_the_chat_completion_it_means(path: Path, tmp_path: Path) -> None:
    """On a real engine (synthetic model, greedy): the same conversation asked as a response
    and as a chat completion gives the same text, and the usage counts the same prompt."""

    with serving_model(path, tmp_path) as (_, client):
        chat = client.chat.completions.create(
            model="syn",
            messages=[{"role": "system", "content": "be brief"}, *TURNS],  # type: ignore[list-item]
            max_tokens=12,
            temperature=0,
            extra_body={"conversation_id": "chat"},
        )
        response = client.responses.create(
            model="syn",
            instructions="be brief",
            input=TURNS,  # type: ignore[arg-type]
            max_output_tokens=12,
            temperature=0,
            extra_body={"conversation_id": "response"},
        )
    assert chat.usage is not None and response.usage is not None
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens > 0


def test_log_probabilities_as_the_chat_completion_gives_them(path: Path, tmp_path: Path) -> None:
    """`top_logprobs` (or `include`): each token's log probability and alternatives on the text
    part and on the deltas, the same figures as the chat completion's for the same reply."""
    turns = [{"role": "user", "content": "hello world"}]
    ask = {"model": "syn", "input": turns, "max_output_tokens": 8, "temperature": 0}
    with serving_model(path, tmp_path) as (server, client):
        chat = client.chat.completions.create(
            model="syn",
            messages=turns,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        whole = Response.model_validate(_post(server.url, {**ask, "top_logprobs": 2}).json())
        events = _events(server.url, {**ask, "include": ["message.output_text.logprobs"]})
    expected = chat.choices[0].logprobs
    assert expected is not None and expected.content
    want = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in expected.content]
    part = whole.output[0].content[0]
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in part.logprobs] == want
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(w[0], w[1]) for w in want]
    assert all(not t.top_logprobs for t in streamed)  # `include` alone: no alternatives


def test_a_kept_response_is_continued_fetched_and_deleted() -> None:
    """`store` (the default): the next request names the response instead of sending the
    conversation again, and the engine sees the whole conversation; the instructions are the
    new request's own. A response asked not to be kept cannot be named."""
    replies = [ScriptedReply(["Let me check. ", CALL]), ScriptedReply(["Sunny."])]
    engine = ScriptedEngine([*replies, ScriptedReply(["streamed"]), ScriptedReply(["x"])])
    with serving(engine) as (server, _):
        first = Response.model_validate(
            _post(
                server.url,
                {"input": "weather in Oslo?", "tools": [WEATHER], "instructions": "first"},
            ).json()
        )
        call = first.output[-1]
        assert first.store and call.type == "function_call"
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        second = _post(
            server.url,
            {"previous_response_id": first.id, "input": [result], "tools": [WEATHER]},
        ).json()
        streamed = _events(server.url, {"previous_response_id": second["id"], "input": "and?"})
        fetched = httpx.get(f"{server.url}/v1/responses/{second['id']}").json()
        unkept = _post(server.url, {"input": "hi", "store": False}).json()
        gone = httpx.delete(f"{server.url}/v1/responses/{first.id}")
        after = httpx.get(f"{server.url}/v1/responses/{first.id}")
        named_unkept = _post(server.url, {"previous_response_id": unkept["id"], "input": "hi"})
    assert second["previous_response_id"] == first.id and fetched == second
    continued = engine.requests[1]
    assert [m.role for m in continued.messages] == ["user", "assistant", "tool"]
    assert continued.messages[1].tool_calls[0].id == call.call_id
    assert continued.system_prompt == ""  # the first request's instructions stay with it
    assert [m.content for m in engine.requests[2].messages] == [
        "weather in Oslo?",
        "Let me check.",
        "sunny",
        "Sunny.",
        "and?",
    ]
    assert streamed[-1].response.output_text == "streamed"
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert after.status_code == 404 and not unkept["store"]
    assert named_unkept.status_code == 404
    assert named_unkept.json()["error"]["param"] == "previous_response_id"
    assert len(engine.requests) == 4


def test_the_store_keeps_the_newest_within_its_bounds() -> None:
    def response(i: int, text: str = "x") -> dict[str, Any]:
        item = {"type": "message", "content": [{"type": "output_text", "text": text}]}
        return {"id": f"resp_{i}", "output": [item]}

    store = ResponseStore(max_kept=3, max_bytes=2_000)
    for i in range(5):
        store.put(response(i), [{"role": "user", "content": "q"}])
    assert [i for i in range(5) if store.get(f"resp_{i}")] == [2, 3, 4]
    big = ResponseStore()
    big.put(response(0, "y" * 900), [])
    one = big.get("resp_0")
    assert one is not None
    store = ResponseStore(max_kept=100, max_bytes=3 * one.size + 10)
    for i in range(4):
        store.put(response(i, "y" * 900), [])
    assert [i for i in range(4) if store.get(f"resp_{i}")] == [1, 2, 3]  # the oldest made room
    store.put(response(9, "z" * 4_000), [])  # alone over the bound: not kept, nothing dropped
    assert store.get("resp_9") is None and store.get("resp_1") is not None
    kept = store.get("resp_3")
    assert kept is not None and kept.conversation[-1] == {"role": "assistant", "content": "y" * 900}
