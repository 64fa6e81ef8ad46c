"""`npuchat serve` against a scripted engine, through the real `openai` client and raw HTTP:
the OpenAI shapes, tool calls, every bad input, auth, the bounded queue, disconnects."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import serving

from npuchat.app.cli import main
from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    ToolCall,
    ToolSpec,
)
from npuchat.engine.grammar import grammar_problem

MODEL = "scripted-1b"
USER = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _wait(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_chat_reply_carries_the_request_and_the_engine_figures() -> None:
    engine = ScriptedEngine([ScriptedReply(["Hello", ", world"])])
    with serving(engine) as (_, client):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "Be brief."}, *USER],
            temperature=0,
            top_p=0.5,
            max_tokens=50,
            seed=7,
            stop=["zz"],
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            logprobs=False,  # what clients send by default is taken
            logit_bias={"15": -2.5},
            response_format={"type": "text"},
        )
    assert r.choices[0].message.content == "Hello, world"
    assert r.choices[0].finish_reason == "stop"
    (req,) = engine.requests
    assert req.system_prompt == "Be brief."
    assert req.messages == (ChatMessage("user", "Hi"),)
    s = req.sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.seed, s.stop) == (0, 0.5, 50, 7, ("zz",))
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.25)
    assert s.logit_bias == ((15, -2.5),)
    figures = engine.metrics_at(req, 2)
    assert r.usage is not None
    assert r.usage.prompt_tokens == figures.prefill_tokens + figures.reused_tokens
    assert r.usage.completion_tokens == figures.decode_tokens + 1
    ext = (r.model_extra or {})["npuchat"]
    assert ext["ttft_s"] == figures.ttft_s and ext["decode_tps"] == figures.decode_tps
    assert ext["acceptance_rate"] == pytest.approx(figures.acceptance_rate)


def test_stream_chunks_add_up_to_the_reply_and_end_with_usage() -> None:
    engine = ScriptedEngine([ScriptedReply(["Hel", "lo", " there"], stop_reason="max_tokens")])
    with serving(engine) as (_, client):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=USER,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there"
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    assert len({c.id for c in chunks}) == 1


def test_completions_send_the_raw_prompt() -> None:
    engine = ScriptedEngine([ScriptedReply([" upon", " a time"]), ScriptedReply([" there"])])
    with serving(engine) as (_, client):
        r = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, temperature=0)
        streamed = list(client.completions.create(model=MODEL, prompt=["Then"], stream=True))
    assert r.choices[0].text == " upon a time" and r.object == "text_completion"
    assert [q.raw_prompt for q in engine.requests] == ["Once", "Then"]
    assert engine.requests[0].sampling.max_tokens == 5
    assert engine.requests[1].sampling.max_tokens == 16  # OpenAI's default for completions
    assert "".join(c.choices[0].text for c in streamed) == " there"


def test_a_completion_echoes_its_prompt_when_asked() -> None:
    """`echo`: the prompt comes back before the text, whole and as the first streamed chunk;
    the engine is asked the same either way."""
    engine = ScriptedEngine([ScriptedReply([" upon", " a time"]), ScriptedReply([" there"])])
    with serving(engine) as (_, client):
        r = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, echo=True)
        streamed = list(
            client.completions.create(model=MODEL, prompt="Then", echo=True, stream=True)
        )
    assert r.choices[0].text == "Once upon a time"
    texts = [c.choices[0].text for c in streamed if c.choices]
    assert texts[0] == "Then" and "".join(texts) == "Then there"
    assert [q.raw_prompt for q in engine.requests] == ["Once", "Then"]


def test_tool_calls_are_parsed_from_the_reply() -> None:
    engine = ScriptedEngine(lambda req: ScriptedReply(["Let me check. ", *CALL_TEXT.split("\n")]))
    with serving(engine) as (_, client):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL])
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=USER, tools=[WEATHER_TOOL], stream=True
            )
        )
        plain = client.chat.completions.create(model=MODEL, messages=USER)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    params = json.dumps(WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    assert engine.requests[0].tools == (
        ToolSpec("get_weather", "Current weather in a city", params),
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_calls = [tc for d in deltas for tc in d.tool_calls or []]
    # a call the grammar holds streams: its id and name first, then its arguments
    named = [(tc.index, tc.function.name) for tc in streamed_calls if tc.function.name]  # type: ignore[union-attr]
    assert named == [(0, "get_weather")] and (streamed_calls[0].id or "").startswith("call_")
    arguments = "".join(tc.function.arguments or "" for tc in streamed_calls)  # type: ignore[union-attr]
    assert arguments == call.function.arguments
    assert "".join(d.content or "" for d in deltas) == "Let me check. "
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # without tools in the request the same text is just text
    assert "<tool_call>" in (plain.choices[0].message.content or "")
    assert plain.choices[0].message.tool_calls is None


def test_parallel_tool_calls_false_allows_one_call() -> None:
    """`parallel_tool_calls: false`: a forced call's grammar allows one call, and every reply
    offered tools ends with its first block (a stop at its end), forced or not."""
    engine = ScriptedEngine(lambda req: ScriptedReply(['{"name": "get_weather", "arguments": {}}']))
    with serving(engine) as (_, client):
        for choice in ("required", "auto"):
            client.chat.completions.create(
                model=MODEL,
                messages=USER,
                tools=[WEATHER_TOOL],
                tool_choice=choice,  # type: ignore[arg-type]
                parallel_tool_calls=False,
            )
    required, auto = (r.sampling for r in engine.requests)
    assert required.grammar is not None and "NEXT" not in required.grammar
    assert "</tool_call>" in required.stop and "</tool_call>" in auto.stop
    assert auto.grammar is None
    assert auto.grammar_after is not None and "NEXT" not in auto.grammar_after[1]


def test_under_auto_a_call_the_model_opens_is_held_to_the_tools() -> None:
    """`auto`: free text, with the grammar of the calls after a `<tool_call>` the model writes
    (it compiles, opens with the newline after the tag, and allows several); none with
    `response_format` (the whole reply is held to that) or with `tool_choice: none`."""
    engine = ScriptedEngine(lambda req: ScriptedReply(["ok"]))
    with serving(engine) as (_, client):
        for extra in ({}, {"response_format": {"type": "json_object"}}, {"tool_choice": "none"}):
            client.chat.completions.create(
                model=MODEL,
                messages=USER,
                tools=[WEATHER_TOOL],
                **extra,  # type: ignore[arg-type]
            )
    auto, json_mode, none = (r.sampling for r in engine.requests)
    assert auto.grammar is None and auto.grammar_after is not None
    trigger, grammar = auto.grammar_after
    assert trigger == "<tool_call>" and grammar_problem(grammar) is None
    assert 'LEAD: "\\n"' in grammar and "NEXT" in grammar and '"const": "get_weather"' in grammar
    assert json_mode.grammar_after is None and none.grammar_after is None
    # and a reply that is a bare call, or calls in a json code block
    (opening, bare), (fence, fenced) = auto.grammar_if_starts
    assert opening == '{"name"' and grammar_problem(bare) is None and "SEP" in bare
    assert fence == '```json{"name"' and grammar_problem(fenced) is None and "SEP" in fenced
    assert json_mode.grammar_if_starts == () and none.grammar_if_starts == ()


def test_a_grammar_s_problem_is_remembered_as_it_is() -> None:
    """`grammar_problem` remembers answers by digest: a bad grammar stays bad when asked
    again, and one a character away is answered for itself."""
    good = 'start: foo\nfoo: "a"\n'
    bad = good.replace("foo:", "fob:")  # names a rule no one defines
    first = grammar_problem(bad)
    assert first is not None and grammar_problem(bad) == first
    assert grammar_problem(good) is None and grammar_problem(good) is None


def test_a_forced_calls_grammar_compiles_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Big tool schemas take llguidance a second or more to compile (5,000 properties: 1.2 s
    measured): while one request's call grammar compiles, the server still answers others
    (held here until /health has answered; on the event loop, /health would wait for it)."""
    from npuchat.app.serve import prepare

    answered, compiling = threading.Event(), threading.Event()
    compile_grammar = prepare.call_grammar

    def slow(tools: Any, name: str | None, several: bool, lead: str = "") -> str | None:
        if lead:  # the `auto` grammar, not the forced call's held here
            return compile_grammar(tools, name, several, lead)
        compiling.set()
        answered.wait(10)
        return compile_grammar(tools, name, several)

    monkeypatch.setattr(prepare, "call_grammar", slow)
    engine = ScriptedEngine(lambda req: ScriptedReply(['{"name": "get_weather", "arguments": {}}']))
    with serving(engine) as (server, client):
        forced = threading.Thread(
            target=lambda: client.chat.completions.create(
                model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice="required"
            )
        )
        forced.start()
        assert compiling.wait(10)
        t0 = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=10)
        waited = time.monotonic() - t0
        answered.set()
        forced.join(10)
    assert health.status_code == 200 and waited < 5, waited
    assert len(engine.requests) == 1


def test_tool_choice_forces_a_call() -> None:
    """`tool_choice` naming a function: the reply is made to start inside that call (the
    engine gets the block's opening as `reply_prefix`, a stop at its end and the grammar of a
    call to that function with its parameters), and the client gets the call, whole or
    streamed. "required" offers every tool, one call or more. A tool whose parameters
    llguidance cannot compile still has its name held, its arguments any value; a forced call
    leaves `response_format` out (it speaks of the message, not the call)."""

    def reply(req: ChatRequest) -> ScriptedReply:
        if '"const": "odd"' in (req.sampling.grammar or "") and "NEXT" not in req.sampling.grammar:
            return ScriptedReply(['{"name": "odd", "arguments": [1, 2]}'])
        city = "Oslo" if "</tool_call>" in req.sampling.stop else "Rome"
        return ScriptedReply(['{"name": "get_weather", "arguments": ', f'{{"city": "{city}"}}}}'])

    engine = ScriptedEngine(reply)
    named = {"type": "function", "function": {"name": "get_weather"}}
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "wizard"}}}
    with serving(engine) as (_, client):
        r = client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice=named
        )
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice=named, stream=True
            )
        )
        req = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER_TOOL, odd],  # type: ignore[list-item]
            tool_choice="required",
        )
        oddly = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER_TOOL, odd],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "odd"}},
            response_format={"type": "json_object"},
        )
    (call,) = r.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    first = engine.requests[0].sampling
    assert engine.requests[0].reply_prefix == "<tool_call>\n" and "</tool_call>" in first.stop
    grammar = first.grammar or ""
    assert '"const": "get_weather"' in grammar and '"city"' in grammar and "NEXT" not in grammar
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.function.name for tc in streamed if tc.function.name] == ["get_weather"]  # type: ignore[union-attr]
    arguments = "".join(tc.function.arguments or "" for tc in streamed)  # type: ignore[union-attr]
    assert json.loads(arguments) == {"city": "Oslo"}
    assert "".join(d.content or "" for d in deltas) == ""
    (call,) = req.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    third = engine.requests[2].sampling
    assert "</tool_call>" not in third.stop and "NEXT" in (third.grammar or "")  # more may follow
    assert '"const": "odd"' in (third.grammar or "")
    (call,) = oddly.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("odd", [1, 2])
    fourth = engine.requests[3].sampling
    assert fourth.json_schema is None and '"arguments": {}' in (fourth.grammar or "")


def test_tool_results_reach_the_engine_as_turns() -> None:
    engine = ScriptedEngine([ScriptedReply(["It is 18 C in Paris."])])
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    with serving(engine) as (_, client):
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    turns = engine.requests[0].messages
    assert turns[1] == ChatMessage(
        "assistant", "", (ToolCall("get_weather", '{"city": "Paris"}', "call_1"),)
    )
    assert turns[2] == ChatMessage("tool", "18 C", tool_call_id="call_1")


def test_turns_of_one_chat_share_a_conversation_id() -> None:
    engine = ScriptedEngine()
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    later = [*first, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}]
    other = [{"role": "system", "content": "S"}, {"role": "user", "content": "Bye"}]
    with serving(engine) as (_, client):
        for messages in (first, later, other):
            client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
        client.chat.completions.create(
            model=MODEL, messages=USER, extra_body={"conversation_id": "mine"}
        )
    ids = [r.conversation_id for r in engine.requests]
    assert ids[0] == ids[1] != ids[2] and ids[3] == "mine"


def test_background_priority_is_passed_to_the_engine() -> None:
    engine = ScriptedEngine()
    with serving(engine) as (_, client):
        client.chat.completions.create(model=MODEL, messages=USER)
        client.chat.completions.create(
            model=MODEL, messages=USER, extra_body={"priority": "background"}
        )
    assert [r.priority for r in engine.requests] == ["interactive", "background"]


def test_models_health_and_metrics() -> None:
    engine = ScriptedEngine([ScriptedReply(["one", " two"])])
    with serving(engine, context_length=2048) as (server, client):
        client.chat.completions.create(model=MODEL, messages=USER)
        (listed,) = client.models.list().data
        one = client.models.retrieve(MODEL)
        health = httpx.get(server.url + "/health").json()
        text = httpx.get(server.url + "/metrics").text
    assert listed.id == one.id == MODEL
    extra = listed.model_extra or {}
    assert extra["context_length"] == 2048 and extra["npuchat"]["draft"] == "scripted-draft"
    assert health["status"] == "ok" and health["running"] == 0
    lines = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert lines['npuchat_requests_total{endpoint="/v1/chat/completions",status="200"}'] == "1"
    assert lines["npuchat_completion_tokens_total"] == "2"
    assert lines["npuchat_ttft_seconds_count"] == "1"
    assert lines['npuchat_ttft_seconds_bucket{le="0.25"}'] == "1"
    assert lines['npuchat_ttft_seconds_bucket{le="0.1"}'] == "0"
    assert float(lines["npuchat_decode_tokens_per_second"]) > 0


def test_api_key_is_required_when_set() -> None:
    engine = ScriptedEngine()
    with serving(engine, api_keys=("s3cret",)) as (server, client):
        assert client.chat.completions.create(model=MODEL, messages=USER).choices  # type: ignore[arg-type]
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cre", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/metrics").status_code == 401
        basic = httpx.get(server.url + "/v1/models", headers={"Authorization": "Basic s3cret"})
        assert basic.status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
    assert len(engine.requests) == 1


def test_no_key_needed_on_loopback_without_one() -> None:
    with serving(ScriptedEngine()) as (server, _):
        assert httpx.get(server.url + "/v1/models").status_code == 200


def test_serving_beyond_loopback_needs_a_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main(["serve", "--max-queue", "-1"]) == 2


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def test_a_request_without_a_model_is_answered_by_the_served_one() -> None:
    """llama-server's and vLLM's examples send no `model`; a one-model server answers them."""
    engine = ScriptedEngine([ScriptedReply(["Hello"]), ScriptedReply(["text"])])
    with serving(engine) as (server, _):
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER})
        text = httpx.post(server.url + "/v1/completions", json={"prompt": "a"})
    assert chat.status_code == 200 and text.status_code == 200
    assert chat.json()["model"] == MODEL == text.json()["model"]
    assert chat.json()["choices"][0]["message"]["content"] == "Hello"
    assert text.json()["choices"][0]["text"] == "text"


def test_the_api_at_the_root_as_llama_server_serves_it() -> None:
    """A client given the address without /v1 works, and the key guards those paths too."""
    engine = ScriptedEngine([ScriptedReply(["Hello"])])
    with serving(engine, api_keys=("k",)) as (server, _):
        bare = openai.OpenAI(base_url=server.url, api_key="k", max_retries=0)
        assert (
            bare.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content
            == "Hello"
        )
        assert [m.id for m in bare.models.list()] == [MODEL]
        assert httpx.post(server.url + "/chat/completions", json=_chat()).status_code == 401
        assert httpx.post(server.url + "/completions", json=_chat()).status_code == 401
        assert httpx.get(server.url + "/models").status_code == 401


def test_full_queue_answers_429_with_retry_after() -> None:
    held = ScriptedReply(["first"], hold_at=0)
    engine = ScriptedEngine([held, ScriptedReply(["second"])])
    with serving(engine, max_queue=1) as (server, client):
        results: list[str] = []

        def ask() -> None:
            r = client.chat.completions.create(model=MODEL, messages=USER)
            results.append(r.choices[0].message.content or "")

        first = threading.Thread(target=ask)
        first.start()
        assert held.reached_hold.wait(5)
        second = threading.Thread(target=ask)
        second.start()
        _wait(lambda: httpx.get(server.url + "/health").json()["waiting"] == 1, "a waiting one")
        r = httpx.post(server.url + "/v1/chat/completions", json=_chat())
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        held.release.set()
        first.join(10)
        second.join(10)
    assert sorted(results) == ["first", "second"]
    assert len(engine.requests) == 2


def test_disconnect_during_a_stream_cancels_the_reply() -> None:
    reply = ScriptedReply(["a", "b", "c"], hold_at=1)
    engine = ScriptedEngine([reply])
    with serving(engine) as (server, _):
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=_chat(stream=True)
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert reply.reached_hold.wait(5)
        _wait(lambda: engine.cancelled == 1, "the engine to see the cancel")
        _wait(lambda: httpx.get(server.url + "/health").json()["running"] == 0, "a free slot")


def test_disconnect_while_waiting_for_a_whole_reply_cancels_it() -> None:
    reply = ScriptedReply(["a", "b"], hold_at=1)  # the first token is out, then it waits
    engine = ScriptedEngine([reply])
    with serving(engine) as (server, _):
        body = json.dumps(_chat()).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert reply.reached_hold.wait(5)
        _wait(lambda: engine.cancelled == 1, "the engine to see the cancel")
        _wait(lambda: httpx.get(server.url + "/health").json()["running"] == 0, "a free slot")
