"""Server-sent events: engine events out as `data: {...}` chunks, and cancel on disconnect.

`EventStream` listens for the client going away for as long as it streams (not only when a
write fails, which could be a whole prefill later) and sets the reply's cancel event at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from npuchat.engine.events import Event, Failed, TokenDelta, TokenLogprob

from .call_splitter import stream_pieces
from .responses import ChatShape, Reply, TextShape, recorded, sse
from .schema import ApiError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """A streaming response that sets `cancel` as soon as the client disconnects."""

    def __init__(self, content: AsyncIterator[bytes], cancel: threading.Event) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.cancel = cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:  # the connection broke mid-write
                    self.cancel.set()
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            self.cancel.set()
            group.cancel_scope.cancel()


def _error_chunk(event: Failed) -> bytes:
    status = 429 if event.kind == "busy" else 400 if event.kind == "invalid" else 500
    kind = "server_error" if status == 500 else "invalid_request_error"
    return sse(ApiError(status, event.message, type=kind).body())


Start = tuple[Event, AsyncIterator[Event]]  # a choice's first event and the rest


async def _merged(starts: list[Start], replies: list[Reply]) -> AsyncIterator[tuple[int, Event]]:
    """Every choice's events as they come, with the choice's index, each choice's up to its
    terminal event, recorded in its `Reply`. Leaving early stops the readers (and so, through
    `run_events`, the engine's replies)."""
    if len(starts) == 1:
        first, rest = starts[0]
        async for event in recorded(first, rest, replies[0]):
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def read(i: int, first: Event, rest: AsyncIterator[Event]) -> None:
        try:
            async for event in recorded(first, rest, replies[i]):
                await queue.put((i, event))
        finally:
            await queue.put((i, None))

    readers = [asyncio.ensure_future(read(i, f, r)) for i, (f, r) in enumerate(starts)]
    try:
        left = len(readers)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for reader in readers:
            reader.cancel()


def _ending(
    replies: list[Reply],
    failed: Failed | None,
    usage: Callable[[list[Reply]], dict[str, Any]] | None,
    done: Callable[[list[Reply]], None],
) -> list[bytes]:
    """A stream's last chunks: the refusal that ended it, or the usage where asked for; then
    `[DONE]`. The replies are handed to `done` (the server's figures) either way."""
    done(replies)
    last = [_error_chunk(failed)] if failed is not None else []
    if failed is None and usage is not None:
        last.append(sse(usage(replies)))
    return [*last, sse("[DONE]")]


class _ChatChoice:
    """One choice's stream state: its tool-call splitter, calls so far, and the log
    probabilities of tokens not yet sent (the next chunk of the choice carries them)."""

    def __init__(self, shape: ChatShape, index: int) -> None:
        self.shape, self.index = shape, index
        self.splitter = shape.calls.splitter()
        self.calls = 0
        self.pending: list[TokenLogprob] = []

    def taken(self) -> list[TokenLogprob]:
        out = self.pending.copy()
        self.pending.clear()
        return out

    def pieces(self, text: str, final: bool = False) -> list[bytes]:
        shape, i = self.shape, self.index
        out = []
        for piece in stream_pieces(self.splitter, text, final):
            if piece.call is None:
                out.append(sse(shape.text_chunk(piece.text, self.taken(), i)))
            elif piece.stage == "more":
                out.append(sse(shape.arguments_chunk(piece.text, self.calls, self.taken(), i)))
            elif piece.stage != "end":  # whole, or opened: its id and name
                out.append(sse(shape.call_chunk(piece.call, self.calls, self.taken(), i)))
            if piece.complete:
                self.calls += 1
        return out


async def chat_chunks(
    shape: ChatShape,
    starts: list[Start],
    *,
    include_usage: bool,
    done: Callable[[list[Reply]], None],
) -> AsyncIterator[bytes]:
    """The chunks of every choice (`index` telling them apart), each choice's finish chunk
    when it ends; a refusal in any ends the stream with its error."""
    replies = [Reply() for _ in starts]
    choices = [_ChatChoice(shape, i) for i in range(len(starts))]
    for c in choices:
        yield sse(shape.chunk({"role": "assistant", "content": ""}, choice=c.index))
    async for i, event in _merged(starts, replies):
        c, reply = choices[i], replies[i]
        if isinstance(event, TokenDelta):
            c.pending.extend(event.logprobs)
            for chunk in c.pieces(event.text):
                yield chunk
        elif isinstance(reply.terminal, Failed):
            for chunk in _ending(replies, reply.terminal, None, done):
                yield chunk
            return
        elif reply.terminal is not None:
            for chunk in c.pieces("", final=True):
                yield chunk
            finish = reply.finish_reason(c.calls > 0)
            yield sse(shape.chunk({}, finish, c.taken() or None, choice=i))
    for chunk in _ending(replies, None, shape.usage_chunk if include_usage else None, done):
        yield chunk


async def text_chunks(
    shape: TextShape,
    starts: list[Start],
    *,
    include_usage: bool,
    done: Callable[[list[Reply]], None],
) -> AsyncIterator[bytes]:
    """As `chat_chunks`, for completions (the prompt first where it is echoed)."""
    replies = [Reply() for _ in starts]
    pending: list[list[TokenLogprob]] = [[] for _ in starts]  # per choice, as in `_ChatChoice`
    offsets = [0] * len(starts)  # each reply's characters before its pending tokens
    if shape.echo:
        for i in range(len(starts)):
            yield sse(shape.chunk(shape.echo, choice=i))
    async for i, event in _merged(starts, replies):
        reply = replies[i]
        if isinstance(event, TokenDelta):
            pending[i].extend(event.logprobs)
            if event.text:
                yield sse(shape.chunk(event.text, None, pending[i], offsets[i], i))
                offsets[i] += sum(len(e.text) for e in pending[i])
                pending[i] = []
        elif isinstance(reply.terminal, Failed):
            for chunk in _ending(replies, reply.terminal, None, done):
                yield chunk
            return
        elif reply.terminal is not None:
            yield sse(shape.chunk("", reply.finish_reason(), pending[i], offsets[i], i))
    for chunk in _ending(replies, None, shape.usage_chunk if include_usage else None, done):
        yield chunk
