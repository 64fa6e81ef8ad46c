"""`POST /tokenize` and `/detokenize`: a text or a chat in the served model's token ids.

A client counts a prompt against the context before sending it, or looks up the ids a
`logit_bias` or a stop string will meet. Both servers' shapes are read, since clients are written
for one or the other: llama-server's (`content`, `add_special` default false, `parse_special`,
`with_pieces`) and vLLM's (`prompt`, `add_special_tokens` default true, or `messages` with
`tools` for a chat, its template applied as a reply to it would start). The answer carries
both servers' fields: `tokens`, and vLLM's `count` and `max_model_len`; /detokenize's text is
both `content` (llama-server) and `prompt` (vLLM).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from npuchat.engine.errors import InvalidRequestError
from npuchat.engine.events import Tokenizes

from .prepare import prepare_chat
from .routes import Service, check_model, read_json
from .schema import ApiError, ChatCompletionIn, RequestModel, parse

MAX_TOKEN_IDS = 1 << 20  # far more than any context; the body limit bounds it too


class TokenizeIn(RequestModel):
    model: str | None = None
    content: str | None = None
    prompt: str | None = None
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    parse_special: bool = True
    with_pieces: bool = False

    def text(self) -> str:
        text = self.content if self.content is not None else self.prompt
        assert text is not None  # the validator below
        return text

    def add_bos(self) -> bool:
        """llama-server's `add_special` (default false) or vLLM's `add_special_tokens` (default
        true for its `prompt`)."""
        if self.add_special is not None:
            return self.add_special
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.content is None

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeIn:
        if (self.content is None) == (self.prompt is None):
            raise ValueError("give the text as `content` or `prompt` (or a chat as `messages`)")
        return self


class ChatTokenizeIn(ChatCompletionIn):
    """vLLM's chat form: the chat completion's fields, and llama-server's `with_pieces`."""

    with_pieces: bool = False


class DetokenizeIn(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKEN_IDS)


def tokenizing_engine(service: Service) -> Tokenizes:
    engine = service.engine
    if not isinstance(engine, Tokenizes):
        raise ApiError(501, "this server's engine does not show its tokens", type="not_supported")
    return engine


def _piece(raw: bytes) -> str | list[int]:
    """llama-server's `with_pieces`: the piece as text, or its bytes where they are not whole
    UTF-8 (part of a character split across tokens)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _tokenized(service: Service, body: dict[str, Any]) -> dict[str, Any]:
    engine = tokenizing_engine(service)
    context = service.model.context_length
    if "messages" in body:
        chat: ChatTokenizeIn = parse(ChatTokenizeIn, body)
        check_model(service, chat.model)
        ids = engine.chat_tokens(prepare_chat(chat, context).request)
        with_pieces = chat.with_pieces
    else:
        given: TokenizeIn = parse(TokenizeIn, body)
        check_model(service, given.model)
        special, bos = given.parse_special, given.add_bos()
        ids = engine.tokenize(given.text(), parse_special=special, add_bos=bos)
        with_pieces = given.with_pieces
    tokens: list[Any] = ids
    if with_pieces:
        pieces = engine.token_pieces(ids)
        tokens = [{"id": i, "piece": _piece(p)} for i, p in zip(ids, pieces, strict=True)]
    return {"tokens": tokens, "count": len(ids), "max_model_len": context}


async def tokenize(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await read_json(request, service.max_body_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    # off the event loop: 4 MiB of text takes the tokenizer a second or two
    return JSONResponse(await asyncio.to_thread(_tokenized, service, body))


async def detokenize(request: Request) -> Response:
    service: Service = request.app.state.service
    body: DetokenizeIn = parse(DetokenizeIn, await read_json(request, service.max_body_bytes))
    check_model(service, body.model)
    engine = tokenizing_engine(service)
    try:
        text = await asyncio.to_thread(engine.detokenize, body.tokens)
    except InvalidRequestError as exc:
        raise ApiError(400, f"tokens: {exc}", param="tokens") from None
    return JSONResponse({"content": text, "prompt": text})
