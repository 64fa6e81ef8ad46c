"""Every bad input to `npuchat serve` gets an OpenAI error object with a 4xx status (never a
500 or a traceback) and never reaches the engine; engine refusals map to 429 / 400 / 500."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from scripted_engine import ScriptedEngine
from serve_helpers import serving

from npuchat.engine.events import ChatRequest, Event, Failed, FailureKind

MODEL = "scripted-1b"
USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
REPLY = {"role": "assistant", "content": "Hel"}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


BAD_INPUTS: list[tuple[str, str, bytes | dict[str, Any] | list[Any], int, str | None]] = [
    ("not JSON", "/v1/chat/completions", b'{"model": ', 400, None),
    ("not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("nested too deeply", "/v1/chat/completions", b"[" * 2_000 + b"]" * 2_000, 400, None),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-4o"), 404, "model"),
    ("negative temperature", "/v1/chat/completions", _chat(temperature=-0.5), 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", _chat(top_p=0), 400, "top_p"),
    ("top_p over 1", "/v1/chat/completions", _chat(top_p=1.5), 400, "top_p"),
    (
        "NaN temperature",
        "/v1/chat/completions",
        b'{"model": "scripted-1b", "messages": [{"role": "user", "content": "x"}], '
        b'"temperature": NaN}',
        400,
        "temperature",
    ),
    ("zero repeat penalty", "/v1/chat/completions", _chat(repeat_penalty=0), 400, "repeat_penalty"),
    (
        "presence penalty 3",
        "/v1/chat/completions",
        _chat(presence_penalty=3),
        400,
        "presence_penalty",
    ),
    (
        "frequency penalty -2.5",
        "/v1/chat/completions",
        _chat(frequency_penalty=-2.5),
        400,
        "frequency_penalty",
    ),
    ("top_logprobs alone", "/v1/chat/completions", _chat(top_logprobs=3), 400, "top_logprobs"),
    (
        "top_logprobs 21",
        "/v1/chat/completions",
        _chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
    ),
    ("completion logprobs 21", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("a bias key", "/v1/chat/completions", _chat(logit_bias={"a": 5}), 400, "logit_bias"),
    ("a bias of 150", "/v1/chat/completions", _chat(logit_bias={"15": 150}), 400, "logit_bias"),
    (
        "a JSON schema",
        "/v1/chat/completions",
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format",
    ),
    ("empty stop string", "/v1/chat/completions", _chat(stop=[""]), 400, "stop"),
    ("negative seed", "/v1/chat/completions", _chat(seed=-5), 400, "seed"),
    ("max_tokens over context", "/v1/chat/completions", _chat(max_tokens=5000), 400, "max_tokens"),
    (
        "max_completion_tokens over context",
        "/v1/chat/completions",
        _chat(max_completion_tokens=1025),
        400,
        "max_tokens",
    ),
    ("max_tokens 0", "/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("five choices", "/v1/chat/completions", _chat(n=5), 400, "n"),
    ("no messages", "/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    (
        "only a system message",
        "/v1/chat/completions",
        _chat(messages=[{"role": "system", "content": "x"}]),
        400,
        "messages",
    ),
    (
        "unknown role",
        "/v1/chat/completions",
        _chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages.0.role",
    ),
    (
        "content is a number",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": 5}]),
        400,
        None,
    ),
    (
        "image content",
        "/v1/chat/completions",
        _chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        400,
        None,
    ),
    ("five stop strings", "/v1/chat/completions", _chat(stop=list("abcde")), 400, "stop"),
    (
        "tool choice without tools",
        "/v1/chat/completions",
        _chat(tool_choice="required"),
        400,
        "tool_choice",
    ),
    (
        "tool choice naming a tool not offered",
        "/v1/chat/completions",
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "rm"}}),
        400,
        "tool_choice.function.name",
    ),
    (
        "continue a user message",
        "/v1/chat/completions",
        _chat(continue_final_message=True, add_generation_prompt=False),
        400,
        "messages.0",
    ),
    (
        "continue and a generation prompt",
        "/v1/chat/completions",
        _chat(messages=[*USER, REPLY], continue_final_message=True, add_generation_prompt=True),
        400,
        "add_generation_prompt",
    ),
    (
        "no generation prompt without continuing",
        "/v1/chat/completions",
        _chat(messages=[*USER, REPLY], add_generation_prompt=False),
        400,
        "add_generation_prompt",
    ),
    (
        "continue with a forced tool call",
        "/v1/chat/completions",
        _chat(
            messages=[*USER, REPLY],
            continue_final_message=True,
            tools=[TOOL],
            tool_choice="required",
        ),
        400,
        "tool_choice",
    ),
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("no prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    (
        "echo with logprobs",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "echo": True, "logprobs": 1},
        400,
        "echo",
    ),
]


@pytest.fixture(scope="module")
def scripted_server() -> Iterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine()
    with serving(engine, max_body_bytes=4096) as (server, _):
        yield server.url, engine


@pytest.mark.parametrize(("what", "path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_an_openai_error(
    scripted_server: tuple[str, ScriptedEngine],
    what: str,
    path: str,
    body: bytes | dict[str, Any] | list[Any],
    status: int,
    param: str | None,
) -> None:
    url, engine = scripted_server
    before = len(engine.requests)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, what
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in r.text
    assert error["type"] in ("invalid_request_error", "not_found_error")
    if param is not None:
        assert error["param"] == param or (error["param"] or "").startswith(param), error
    assert len(engine.requests) == before, "a bad request must not reach the engine"


def test_more_tools_than_openai_allows_is_a_400() -> None:
    """129 tools (OpenAI's limit is 128; a forced call compiles each one's schema): refused
    before the engine, naming the field."""
    engine = ScriptedEngine()
    with serving(engine) as (server, _):
        r = httpx.post(server.url + "/v1/chat/completions", json=_chat(tools=[TOOL] * 129))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert not engine.requests
    assert "at most 128" in r.json()["error"]["message"]


def test_oversized_body_and_unknown_routes(scripted_server: tuple[str, ScriptedEngine]) -> None:
    url, _ = scripted_server
    big = json.dumps(_chat(messages=[{"role": "user", "content": "x" * 5000}]))
    r = httpx.post(url + "/v1/chat/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield big.encode()

    r = httpx.post(url + "/v1/chat/completions", content=chunks())
    assert r.status_code == 413
    assert httpx.get(url + "/v1/nothing").status_code == 404
    r = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_openai_client_raises_the_matching_errors(
    scripted_server: tuple[str, ScriptedEngine],
) -> None:
    url, _ = scripted_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=-1)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="serves 'scripted-1b'"):
        client.chat.completions.create(model="other", messages=USER)  # type: ignore[arg-type]


class RefusingEngine:
    """Answers every request with one Failed event of the given kind."""

    model_name, draft_name, device = MODEL, "", "cpu"

    def __init__(self, kind: FailureKind) -> None:
        self.kind = kind

    def generate(self, request: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        yield Failed(f"refused ({self.kind})", kind=self.kind)


@pytest.mark.parametrize(("kind", "status"), [("busy", 429), ("invalid", 400), ("error", 500)])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusals_map_to_http_statuses(kind: FailureKind, status: int, stream: bool) -> None:
    with serving(RefusingEngine(kind)) as (server, _):
        r = httpx.post(server.url + "/v1/chat/completions", json=_chat(stream=stream))
    assert r.status_code == status
    assert r.json()["error"]["message"] == f"refused ({kind})"
    if status == 429:
        assert "Retry-After" in r.headers
