"""`/v1/responses`: create a response, and get or delete a kept one.

A request is read as the chat completion it means (`responses_in`), run as one (`run_reply`)
and answered as a response (`responses_out`); with `store` (OpenAI's default) the answer is
kept (`response_store`) for a later `previous_response_id` or GET.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .prepare import prepare_chat
from .response_store import MAX_KEPT
from .responses import Reply
from .responses_in import ResponseIn, as_chat, history, renamed, wants_logprobs
from .responses_out import ResponseShape, echo, response_events
from .routes import Service, check_model, conversation_key, read_json, run_reply
from .schema import ApiError, ChatCompletionIn, parse
from .streaming import Start


def _not_kept(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"no response {response_id!r} is kept here (the newest {MAX_KEPT:,} are, in memory, "
        "while the server runs); send the whole conversation as `input`",
        param=param,
        code="response_not_found",
    )


def _before(service: Service, given: ResponseIn) -> list[dict[str, Any]]:
    """The conversation of the kept response this request continues ([] for none)."""
    if given.previous_response_id is None:
        return []
    kept = service.responses.get(given.previous_response_id)
    if kept is None:
        raise _not_kept(given.previous_response_id, "previous_response_id")
    return kept.conversation


async def create(request: Request) -> Response:
    service: Service = request.app.state.service
    given: ResponseIn = parse(ResponseIn, await read_json(request, service.max_body_bytes))
    check_model(service, given.model)
    turns = history(given, _before(service, given))
    try:
        body: ChatCompletionIn = parse(ChatCompletionIn, as_chat(given, turns))
        context = service.model.context_length
        drop = given.truncation == "auto"
        prepared = await asyncio.to_thread(prepare_chat, body, context, drop)
    except ApiError as exc:
        raise renamed(exc) from None
    prepared = prepared.named(conversation_key(body.conversation_id, prepared))

    def keep(obj: dict[str, Any]) -> None:
        service.responses.put(obj, turns)

    shape = ResponseShape(
        service.model.id,
        echo(given, body),
        prepared.calls,
        logprobs=wants_logprobs(given),
        keep=keep if given.store else None,
        previous=given.previous_response_id,
    )

    def stream(starts: list[Start], done: Callable[[list[Reply]], None]) -> AsyncIterator[bytes]:
        return response_events(shape, starts, done)

    return await run_reply(request, service, prepared, shape.whole, stream)


async def kept(request: Request) -> Response:
    """GET a kept response, or DELETE it."""
    service: Service = request.app.state.service
    response_id = request.path_params["response_id"]
    if request.method == "DELETE":
        if not service.responses.delete(response_id):
            raise _not_kept(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    entry = service.responses.get(response_id)
    if entry is None:
        raise _not_kept(response_id)
    return JSONResponse(entry.response)
