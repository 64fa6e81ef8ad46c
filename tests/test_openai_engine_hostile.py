"""`npuchat --server URL` against a server that answers in other shapes (broken, or hostile):
every reply ends in one event the app shows as a line, never an exception in its worker."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from npuchat.app.openai_engine import OpenAIEngine
from npuchat.app.serve.server import Server
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import ChatMessage, ChatRequest, Failed, Finished, TokenDelta

REQUEST = ChatRequest("c", "", (ChatMessage("user", "hi"),))
DEEP = "[" * 100_000
GOOD = '{"choices": [{"delta": {"content": "ok"}, "finish_reason": null}]}'
END = '{"choices": [{"delta": {}, "finish_reason": "stop"}]}'

STREAMS = {
    "not an object": ["5"],
    "choices not a list of objects": ['{"choices": [5]}'],
    "delta not an object": ['{"choices": [{"delta": "x"}]}'],
    "tool_calls of strings": ['{"choices": [{"delta": {"tool_calls": ["x"]}}]}'],
    "nested past the parser": [DEEP],
    "figures that are no numbers": [
        GOOD,
        '{"choices": [], "usage": {"completion_tokens": "many", "prompt_tokens": 1e400,'
        ' "prompt_tokens_details": [1]}, "npuchat": {"prefill_tps": "fast", "drafted": null}}',
        END,
    ],
    "usage a list": [GOOD, '{"choices": [], "usage": [1, 2]}', END],
}


def _app(models: object, stream: list[str]) -> Starlette:
    async def list_models(request: Request) -> Response:
        if isinstance(models, str):
            return PlainTextResponse(models)
        return JSONResponse(models)

    async def chat(request: Request) -> Response:
        body = "".join(f"data: {line}\n\n" for line in stream) + "data: [DONE]\n\n"
        return PlainTextResponse(body, media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", list_models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@pytest.fixture
def serve() -> Iterator[object]:
    running: list[Server] = []

    def start(models: object, stream: list[str]) -> str:
        server = Server(_app(models, stream)).start()  # type: ignore[arg-type]
        running.append(server)
        return server.url

    yield start
    for server in running:
        server.stop()
        assert server.stopped


@pytest.mark.parametrize("kind", sorted(STREAMS))
def test_a_reply_of_another_shape_ends_in_one_event(kind: str, serve: object) -> None:
    url = serve({"data": [{"id": "m"}]}, STREAMS[kind])  # type: ignore[operator]
    engine = OpenAIEngine(url)
    try:
        events = list(engine.generate(REQUEST, threading.Event()))
    finally:
        engine.close()
    last = events[-1]
    if kind in ("figures that are no numbers", "usage a list"):  # the text still comes through
        assert isinstance(last, Finished) and "ok" in "".join(
            e.text for e in events if isinstance(e, TokenDelta)
        )
    else:
        assert isinstance(last, Failed) and "\n" not in last.message
        assert "cannot read" in last.message or "broke off" in last.message


@pytest.mark.parametrize(
    "models",
    ["not json", [1, 2], {"data": [5]}, {"data": [{"name": "no id"}]}, {"data": "x"}, DEEP],
    ids=["text", "a list", "items no objects", "no id", "data a string", "nested"],
)
def test_a_model_list_of_another_shape_is_a_one_line_error(models: object, serve: object) -> None:
    url = serve(models, [])  # type: ignore[operator]
    with pytest.raises(NpuchatError, match="OpenAI-compatible") as info:
        OpenAIEngine(url)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("status", [200, 400])
def test_a_line_that_never_ends_is_a_one_line_error(status: int) -> None:
    """A server that streams one line forever, as a reply or as a refusal's body: the reply
    fails once the client has read its bound, instead of growing in memory until the user
    gives up; the server sees the client go long before its 64 MiB are sent."""
    sent: list[int] = []
    endless = Server(_endless_app(status, sent)).start()
    engine = OpenAIEngine(endless.url)
    cancel = threading.Event()
    events: list[object] = []
    reader = threading.Thread(target=lambda: events.extend(engine.generate(REQUEST, cancel)))
    try:
        reader.start()
        reader.join(60)
        finished = not reader.is_alive()
    finally:
        cancel.set()  # ends it either way
        reader.join(10)
        engine.close()
        endless.stop()
    assert endless.stopped, "the server is still streaming to a client that went away"
    assert finished, "the reply was still being read after 60 s"
    last = events[-1]
    assert isinstance(last, Failed) and "\n" not in last.message
    assert ("over" in last.message) if status == 200 else len(last.message) <= 200
    assert sum(sent) < 32 << 20  # a client reading the whole body takes all 64 MiB


def _endless_app(status: int, sent: list[int]) -> Starlette:
    async def list_models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m"}]})

    async def chat(request: Request) -> Response:
        async def endless() -> AsyncIterator[bytes]:
            # 64 MiB with no line end: "forever" to a client that keeps a line whole; the
            # server stops there and when the client goes (a generator writing to a closed
            # connection would spin for the rest of the test session)
            yield b"data: " if status == 200 else b'{"error": {"message": "'
            for _ in range(1024):
                if await request.is_disconnected():
                    return
                sent.append(65536)
                yield b"x" * 65536

        kind = "text/event-stream" if status == 200 else "application/json"
        return StreamingResponse(endless(), status_code=status, media_type=kind)

    return Starlette(
        routes=[
            Route("/v1/models", list_models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )
