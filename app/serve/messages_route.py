"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API.

A request is read as the chat completion it means (`messages_in`), run as one (`run_reply`)
and answered as a message (`messages_out`). Errors on these paths are Anthropic's error
objects (`ApiError.anthropic_body`), so its clients read them as they read Anthropic's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .messages_in import MessagesBase, MessagesIn, as_chat, history, renamed
from .messages_out import MessageShape, message_events
from .prepare import Prepared, prepare_chat
from .responses import Reply
from .routes import Service, check_model, conversation_key, read_json, run_reply
from .schema import ApiError, ChatCompletionIn, parse
from .streaming import Start
from .tokens import tokenizing_engine

_OWN = ("/messages", "/messages/count_tokens")
PATHS = frozenset(root + path for root in ("/v1", "") for path in _OWN)  # Anthropic's errors


def _prepared(service: Service, given: MessagesBase) -> Prepared:
    """The request as the chat completion it means, checked and prepared (off the event loop:
    a forced call's grammar over big schemas compiles for a while)."""
    check_model(service, given.model)
    turns, origin = history(given)
    chat = as_chat(given, turns, service.model.context_length)
    try:
        body: ChatCompletionIn = parse(ChatCompletionIn, chat)
        prepared = prepare_chat(body, service.model.context_length)
    except ApiError as exc:
        raise renamed(exc, origin, chat["messages"][0]["role"] == "system") from None
    return prepared.named(conversation_key(body.conversation_id, prepared))


async def create(request: Request) -> Response:
    service: Service = request.app.state.service
    given: MessagesIn = parse(MessagesIn, await read_json(request, service.max_body_bytes))
    prepared = await asyncio.to_thread(_prepared, service, given)
    shape = MessageShape(
        service.model.id,
        prepared.calls,
        stops=tuple(given.stop_sequences or ()),
    )

    def stream(starts: list[Start], done: Callable[[list[Reply]], None]) -> AsyncIterator[bytes]:
        return message_events(shape, starts, done)

    return await run_reply(request, service, prepared, shape.whole, stream)


def _counted(service: Service, given: MessagesBase) -> dict[str, Any]:
    engine = tokenizing_engine(service)
    return {"input_tokens": len(engine.chat_tokens(_prepared(service, given).request))}


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model will read them: the chat template applied, tools too."""
    service: Service = request.app.state.service
    given: MessagesBase = parse(MessagesBase, await read_json(request, service.max_body_bytes))
    return JSONResponse(await asyncio.to_thread(_counted, service, given))
