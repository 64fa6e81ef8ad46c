"""The app as a client: `OpenAIEngine` (the ChatEngine behind `npuchat --server URL`) against
`npuchat serve` over a scripted engine, and the chat app driven by a pilot against it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from scripted_engine import (
    NO_TITLE,
    ScriptedEngine,
    ScriptedReply,
    make_app,
    reply_settled,
    wait_for_chat,
    wait_until,
)
from serve_helpers import serving
from textual.widgets import Label

from npuchat.app.openai_engine import OpenAIEngine, base_url, remote_loader
from npuchat.app.store import ConversationStore
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.message_list import AssistantMessage
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Failed,
    Finished,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.grammar import ANY_OBJECT

REQUEST = ChatRequest(
    "c1",
    "Be brief.",
    (ChatMessage("user", "Hi"),),
    SamplingParams(
        temperature=0.0,
        max_tokens=20,
        stop=("zz",),
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        json_schema=ANY_OBJECT,  # the app's JSON mode
    ),
    priority="background",
)


def _events(engine: OpenAIEngine, request: ChatRequest = REQUEST) -> list[Event]:
    return list(engine.generate(request, threading.Event()))


def test_base_url_accepts_what_users_paste() -> None:
    assert base_url("http://h:8080") == base_url("http://h:8080/v1/") == "http://h:8080/v1"
    with pytest.raises(NpuchatError, match="http"):
        base_url("h:8080")


def test_reply_request_and_figures_round_trip() -> None:
    scripted = ScriptedEngine([ScriptedReply(["Hello", ", you"])])
    with serving(scripted) as (server, _):
        engine = OpenAIEngine(server.url)
        try:
            events = _events(engine)
        finally:
            engine.close()
    assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == "Hello, you"
    final = events[-1]
    assert isinstance(final, Finished) and final.stop_reason == "eos"
    (sent,) = scripted.requests
    assert sent.system_prompt == "Be brief." and sent.messages == REQUEST.messages
    assert sent.sampling == REQUEST.sampling and sent.priority == "background"
    # the server's own figures (only npuchat sends them) come through, the rest is measured
    server_side = scripted.metrics_at(sent, 2)
    m = final.metrics
    assert (m.prefill_tps, m.drafted, m.accepted) == (400.0, 4, 3)
    assert m.reused_tokens == server_side.reused_tokens
    assert m.decode_tokens == 1 and m.ttft_s > 0
    assert m.model == "scripted-1b" and m.kv_max_capacity == 1024
    assert engine.model_name == "scripted-1b" and engine.draft_name == "scripted-draft"
    assert engine.device.endswith(f"127.0.0.1:{server.port}")


def test_a_schema_goes_as_the_response_format() -> None:
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}}'
    scripted = ScriptedEngine([ScriptedReply(['{"n": 1}'])])
    request = ChatRequest("c", "", (ChatMessage("user", "n?"),), SamplingParams(json_schema=schema))
    with serving(scripted) as (server, _):
        engine = OpenAIEngine(server.url)
        _events(engine, request)
        engine.close()
    sent = scripted.requests[0].sampling.json_schema
    assert sent is not None and json.loads(sent) == json.loads(schema)


def test_raw_prompt_goes_to_completions() -> None:
    scripted = ScriptedEngine([ScriptedReply([" upon a time"])])
    with serving(scripted) as (server, _):
        engine = OpenAIEngine(server.url)
        events = _events(engine, ChatRequest("c", "", (), raw_prompt="Once"))
        engine.close()
    assert [e.text for e in events if isinstance(e, TokenDelta)] == [" upon a time"]
    assert scripted.requests[0].raw_prompt == "Once"


def test_cancel_closes_the_request_and_the_server_stops_the_reply() -> None:
    reply = ScriptedReply(["a", "b"], hold_at=1)
    scripted = ScriptedEngine([reply])
    with serving(scripted) as (server, _):
        engine = OpenAIEngine(server.url)
        cancel = threading.Event()
        events: list[Event] = []
        worker = threading.Thread(target=lambda: events.extend(engine.generate(REQUEST, cancel)))
        worker.start()
        assert reply.reached_hold.wait(5)
        cancel.set()
        worker.join(5)
        deadline = time.monotonic() + 5
        while scripted.cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.close()
    assert not worker.is_alive()
    assert isinstance(events[-1], Cancelled)
    assert scripted.cancelled == 1


def test_server_refusals_become_failed_events() -> None:
    held = ScriptedReply(["a"], hold_at=0)
    scripted = ScriptedEngine([held])
    with serving(scripted, max_queue=0) as (server, _):
        engine = OpenAIEngine(server.url)
        first = threading.Thread(target=lambda: _events(engine))
        first.start()
        assert held.reached_hold.wait(5)
        (busy,) = _events(engine)
        held.release.set()
        first.join(5)
        bad = ChatRequest("c", "", (ChatMessage("user", "x"),), SamplingParams(max_tokens=5000))
        (invalid,) = _events(engine, bad)
        engine.close()
    assert isinstance(busy, Failed) and busy.kind == "busy"
    assert isinstance(invalid, Failed) and invalid.kind == "invalid"
    assert "max_tokens" in invalid.message


def test_unreachable_server_and_wrong_key_are_one_line_errors() -> None:
    with pytest.raises(NpuchatError, match="cannot reach"):
        OpenAIEngine("http://127.0.0.1:9")
    with serving(ScriptedEngine(), api_keys=("k",)) as (server, _):
        with pytest.raises(NpuchatError, match="--api-key"):
            OpenAIEngine(server.url)
        with pytest.raises(NpuchatError, match="does not serve"):
            OpenAIEngine(server.url, api_key="k", model="other")
        OpenAIEngine(server.url, api_key="k").close()


def test_the_app_chats_with_a_served_engine(store: ConversationStore) -> None:
    # the app's background title request reaches the server too; it gets an empty title
    scripted = ScriptedEngine([ScriptedReply(["Served", " hello"])], background=NO_TITLE)

    async def main(url: str) -> None:
        app = make_app(None, store, loader=remote_loader(url, None, None))
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            composer = screen.query_one(Composer)
            composer.focus()
            composer.text = "Hello server"
            await pilot.press("enter")
            await wait_until(pilot, reply_settled(screen, 1), "the served reply", timeout=20)
            view = screen.query_one(AssistantMessage)
            assert view.content == "Served hello" and view.status == "complete"
            accept = str(screen.query_one("#m-accept", Label).render())
            assert accept.startswith("75%")  # the server's draft figures reached the panel

    with serving(scripted) as (server, _):
        asyncio.run(main(server.url))
    (sent,) = scripted.requests
    assert sent.messages == (ChatMessage("user", "Hello server"),)
    msgs = store.messages(store.list_conversations()[0].id)
    assert [(m.role, m.content) for m in msgs] == [
        ("user", "Hello server"),
        ("assistant", "Served hello"),
    ]
    assert msgs[1].metrics is not None and msgs[1].metrics.model == "scripted-1b"


def test_server_flag_checks_the_url_before_the_app_opens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from npuchat.app.cli import main

    assert main(["--server", "localhost:8080"]) == 2
    assert "http://" in capsys.readouterr().err
