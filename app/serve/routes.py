"""The HTTP endpoints: read and check a request, run it on the engine, answer in OpenAI's shape.

Every way a request can go wrong before the engine runs (too big, not JSON, unknown model,
bad parameters, a full queue) ends here as an OpenAI error object with a 4xx status; a reply
the engine refuses (`Failed`, kind busy or invalid) becomes 429 or 400 the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from npuchat.engine.events import ChatEngine, ChatRequest, Event, Failed

from .metrics import ServerMetrics
from .prepare import Prepared, prepare_chat, prepare_completion
from .response_store import ResponseStore
from .responses import ChatShape, Reply, TextShape, recorded
from .runner import Admission, QueueFull, run_events
from .schema import ApiError, ChatCompletionIn, CompletionIn, parse
from .streaming import EventStream, Start, chat_chunks, text_chunks

T = TypeVar("T")
B = TypeVar("B", ChatCompletionIn, CompletionIn)
MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServedModel:
    """What `/v1/models` says about the model (the engine port does not carry the context)."""

    id: str
    context_length: int
    draft: str
    device: str


@dataclass
class Service:
    engine: ChatEngine
    model: ServedModel
    admission: Admission
    metrics: ServerMetrics
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    started: float = 0.0
    responses: ResponseStore = field(default_factory=ResponseStore)
    browsers: tuple[tuple[str, ...], bool] = ((), True)  # allowed origins, loopback only


def error_response(exc: ApiError, anthropic: bool = False) -> JSONResponse:
    """The error as OpenAI's object, or Anthropic's on its API's paths."""
    headers = {}
    if exc.status == 429 and exc.code is not None and exc.code.isdigit():
        headers["Retry-After"] = exc.code
    body = exc.anthropic_body() if anthropic else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=headers)


def busy_error(retry_after_s: int, message: str) -> ApiError:
    # code carries Retry-After to error_response; OpenAI's own 429s have a null code anyway
    return ApiError(429, message, type="rate_limit_error", code=str(retry_after_s))


def too_long_error(prompt_tokens: int, context: int, raw: bool = False) -> ApiError:
    """A prompt that does not fit, in OpenAI's words and code (vLLM's too) and Anthropic's:
    clients trim or compact the history on these, so they are kept as the APIs say them.
    `raw`: a completion's prompt rather than a chat's messages."""
    what = "prompt" if raw else "messages"
    return ApiError(
        400,
        f"This model's maximum context length is {context} tokens. However, your {what} "
        f"resulted in {prompt_tokens} tokens. Please reduce the length of the {what}.",
        param=what,
        code="context_length_exceeded",
        anthropic_message=f"prompt is too long: {prompt_tokens} tokens > {context} maximum",
    )


def failed_error(event: Failed, service: Service, raw: bool = False) -> ApiError:
    """The engine's refusal as the API's error (`raw`: of a completion's prompt)."""
    if event.too_long is not None:
        return too_long_error(*event.too_long, raw=raw)
    if event.kind == "busy":
        return busy_error(service.admission.retry_after(), event.message)
    if event.kind == "invalid":
        return ApiError(400, event.message)
    return ApiError(500, event.message, type="server_error")


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(
                    413, f"the request body is over {limit} bytes", code="body_too_large"
                )
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body") from None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # Python's parser stops at ~1,000 levels
        raise ApiError(400, "the request body is nested too deeply") from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` unless the client disconnects first: (finished, result)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


def check_model(service: Service, name: str | None) -> None:
    if name is not None and name != service.model.id:
        raise ApiError(
            404,
            f"the model '{name}' does not exist here; this server serves '{service.model.id}'",
            param="model",
            code="model_not_found",
        )


async def _collect(first: Event, rest: AsyncIterator[Event]) -> Reply:
    reply = Reply()
    async for _ in recorded(first, rest, reply):
        pass
    return reply


async def _start(service: Service, request: ChatRequest, cancel: threading.Event) -> Start:
    """One of several choices begun: a slot, its first event; a refusal as an `ApiError`."""
    try:
        await service.admission.enter()
    except QueueFull as exc:
        raise busy_error(exc.retry_after_s, str(exc)) from None
    events = run_events(service.engine, service.admission, request, cancel)
    first = await anext(events)
    if isinstance(first, Failed):
        await events.aclose()  # type: ignore[attr-defined]
        raise failed_error(first, service, request.raw_prompt is not None)
    return first, events


async def _whole(service: Service, start: Start) -> Reply:
    reply = await _collect(*start)
    if isinstance(reply.terminal, Failed):
        raise failed_error(reply.terminal, service)
    return reply


async def _run_choices(
    request: Request,
    service: Service,
    prepared: Prepared,
    whole: Callable[[list[Reply]], dict[str, Any]],
    stream: Callable[[list[Start], Callable[[list[Reply]], None]], AsyncIterator[bytes]],
) -> Response:
    """`n` choices of one request, run together (each in a KV slot of its own, their decode
    steps batched), streamed side by side or answered whole; a refusal before the stream
    answers the request and cancels the rest, as does the client going away."""
    cancel = threading.Event()  # one for every choice: they end together

    async def begun() -> list[Start]:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(_start(service, prepared.choice(i), cancel))
                for i in range(prepared.choices)
            ]
        return [t.result() for t in tasks]

    async def every(starts: list[Start]) -> list[Reply]:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_whole(service, s)) for s in starts]
        return [t.result() for t in tasks]

    def done(replies: list[Reply]) -> None:
        for reply in replies:
            service.metrics.record_reply(reply.metrics, reply.completion_tokens)

    try:
        got, starts = await until_disconnect(request, begun())
        if got and starts is not None and prepared.stream:
            return EventStream(stream(starts, done), cancel)
        replies = None
        if got and starts is not None:
            got, replies = await until_disconnect(request, every(starts))
    except BaseExceptionGroup as group:
        cancel.set()
        raise group.exceptions[0] from None
    if not got or replies is None:
        cancel.set()
        return Response(status_code=499)
    done(replies)
    return JSONResponse(whole(replies))


async def run_reply(
    request: Request,
    service: Service,
    prepared: Prepared,
    whole: Callable[[Reply], dict[str, Any]],
    stream: Callable[[list[Start], Callable[[list[Reply]], None]], AsyncIterator[bytes]],
) -> Response:
    admission = service.admission
    try:
        entered, _ = await until_disconnect(request, admission.enter())
    except QueueFull as exc:
        raise busy_error(exc.retry_after_s, str(exc)) from None
    if not entered:
        return Response(status_code=499)
    cancel = threading.Event()
    events = run_events(service.engine, admission, prepared.request, cancel)
    try:
        got, first = await until_disconnect(request, anext(events))
        if not got or first is None:
            return Response(status_code=499)
        if isinstance(first, Failed):
            raise failed_error(first, service, prepared.request.raw_prompt is not None)

        def done(reply: Reply) -> None:
            service.metrics.record_reply(reply.metrics, reply.completion_tokens)

        if prepared.stream:
            return EventStream(stream([(first, events)], lambda rs: done(rs[0])), cancel)
        got, reply = await until_disconnect(request, _collect(first, events))
        if not got or reply is None:
            return Response(status_code=499)
        if isinstance(reply.terminal, Failed):
            raise failed_error(reply.terminal, service)
        done(reply)
        return JSONResponse(whole(reply))
    except BaseException:
        cancel.set()
        raise


def conversation_key(given: str | None, prepared: Prepared) -> str:
    """Which conversation a request continues, so the engine can keep its KV together.

    HTTP is stateless: a client may name it (`conversation_id`, an npuchat extension);
    otherwise a chat is known by its system prompt and first user message, which every later
    turn repeats, and a completion by the start of its prompt."""
    if given:
        return given
    r = prepared.request
    first = r.raw_prompt[:256] if r.raw_prompt is not None else r.messages[0].content
    key = json.dumps([r.system_prompt, first, r.raw_prompt is not None])
    return "http-" + hashlib.sha256(key.encode()).hexdigest()[:16]


async def _body(request: Request, schema: type[B]) -> tuple[Service, B]:
    """The service and the request's body read as `schema`, for a model this server serves."""
    service: Service = request.app.state.service
    body: B = parse(schema, await read_json(request, service.max_body_bytes))
    check_model(service, body.model)
    return service, body


async def chat_completions(request: Request) -> Response:
    service, body = await _body(request, ChatCompletionIn)
    # off the event loop: a forced call's grammar over big tool schemas compiles for ~1 s
    prepared = await asyncio.to_thread(prepare_chat, body, service.model.context_length)
    prepared = prepared.named(conversation_key(body.conversation_id, prepared))
    logprobs = prepared.request.sampling.logprobs is not None
    shape = ChatShape(
        service.model.id,
        logprobs=logprobs,
        calls=prepared.calls,
    )

    def stream(starts: list[Start], done: Callable[[list[Reply]], None]) -> AsyncIterator[bytes]:
        return chat_chunks(shape, starts, include_usage=prepared.include_usage, done=done)

    if prepared.choices > 1:
        return await _run_choices(request, service, prepared, shape.whole_choices, stream)
    return await run_reply(request, service, prepared, shape.whole, stream)


async def completions(request: Request) -> Response:
    service, body = await _body(request, CompletionIn)
    prepared = prepare_completion(body, service.model.context_length)
    prepared = prepared.named(conversation_key(body.conversation_id, prepared))
    logprobs = prepared.request.sampling.logprobs is not None
    shape = TextShape(service.model.id, logprobs=logprobs, echo=prepared.echo)

    def stream(starts: list[Start], done: Callable[[list[Reply]], None]) -> AsyncIterator[bytes]:
        return text_chunks(shape, starts, include_usage=prepared.include_usage, done=done)

    if prepared.choices > 1:
        return await _run_choices(request, service, prepared, shape.whole_choices, stream)
    return await run_reply(request, service, prepared, shape.whole, stream)


def _model_object(service: Service) -> dict[str, Any]:
    """The model as OpenAI's model object and Anthropic's `ModelInfo` at once (their fields
    do not clash), so both APIs' clients can list it."""
    m = service.model
    started = datetime.fromtimestamp(int(service.started), tz=UTC).isoformat()
    return {
        "id": m.id,
        "object": "model",
        "created": int(service.started),
        "owned_by": "npuchat",
        "type": "model",
        "display_name": m.id,
        "created_at": started.replace("+00:00", "Z"),
        "lifecycle": "active",
        "max_input_tokens": m.context_length,
        "max_tokens": m.context_length,
        "context_length": m.context_length,
        "meta": {"n_ctx": m.context_length, "draft": m.draft or None, "device": m.device},
        "npuchat": {"draft": m.draft or None, "speculative": bool(m.draft), "device": m.device},
    }


async def models(request: Request) -> Response:
    service: Service = request.app.state.service
    one = _model_object(service)
    page = {"has_more": False, "first_id": one["id"], "last_id": one["id"]}  # Anthropic's
    return JSONResponse({"object": "list", "data": [one], **page})


async def model(request: Request) -> Response:
    service: Service = request.app.state.service
    check_model(service, request.path_params["name"])
    return JSONResponse(_model_object(service))


async def health(request: Request) -> Response:
    service: Service = request.app.state.service
    load = service.admission.load
    return JSONResponse(
        {
            "status": "ok",
            "model": service.model.id,
            "running": load.running,
            "waiting": load.waiting,
            "uptime_s": round(time.time() - service.started, 1),
        }
    )


async def prometheus(request: Request) -> Response:
    service: Service = request.app.state.service
    return PlainTextResponse(
        service.metrics.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )
