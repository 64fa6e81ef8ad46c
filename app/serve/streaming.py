"""Server-sent events: engine events out as `data: {...}` chunks, and cancel on disconnect.

`EventStream` listens for the client going away for as long as it streams (not only when a
write fails, which could be a whole prefill later) and sets the reply's cancel event at once.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from npuchat.engine.events import Event, Failed, TokenDelta, TokenLogprob

from .responses import ChatShape, Reply, TextShape, recorded, sse
from .schema import ApiError
from .tools import ToolCallSplitter

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


async def chat_chunks(
    shape: ChatShape,
    first: Event,
    rest: AsyncIterator[Event],
    *,
    include_usage: bool,
    done: Callable[[Reply], None],
) -> AsyncIterator[bytes]:
    reply = Reply()
    splitter = ToolCallSplitter(shape.tools) if shape.tools else None
    if splitter is not None:
        splitter.feed(shape.prefix)  # an open block: nothing comes out before its end
    calls = 0
    pending: list[TokenLogprob] = []  # the tokens' since the last chunk, which carries them

    def taken() -> list[TokenLogprob]:
        out = pending.copy()
        pending.clear()
        return out

    def pieces(text: str, final: bool = False) -> list[bytes]:
        nonlocal calls
        if splitter is None:
            return [sse(shape.text_chunk(text, taken()))] if text else []
        out = []
        for piece in splitter.flush() if final else splitter.feed(text):
            if piece.call is not None:
                out.append(sse(shape.call_chunk(piece.call, calls, taken())))
                calls += 1
            elif piece.text:
                out.append(sse(shape.text_chunk(piece.text, taken())))
        return out

    yield sse(shape.chunk({"role": "assistant", "content": ""}))
    async for event in recorded(first, rest, reply):
        if isinstance(event, TokenDelta):
            pending.extend(event.logprobs)
            for chunk in pieces(event.text):
                yield chunk
    if isinstance(reply.terminal, Failed):
        yield _error_chunk(reply.terminal)
    else:
        for chunk in pieces("", final=True):
            yield chunk
        yield sse(shape.chunk({}, reply.finish_reason(calls > 0), taken() or None))
        if include_usage:
            yield sse(shape.usage_chunk(reply))
    yield sse("[DONE]")
    done(reply)


async def text_chunks(
    shape: TextShape,
    first: Event,
    rest: AsyncIterator[Event],
    *,
    include_usage: bool,
    done: Callable[[Reply], None],
) -> AsyncIterator[bytes]:
    reply = Reply()
    pending: list[TokenLogprob] = []  # the tokens' since the last chunk, which carries them
    offset = 0  # the reply's characters before them
    if shape.echo:
        yield sse(shape.chunk(shape.echo))
    async for event in recorded(first, rest, reply):
        if isinstance(event, TokenDelta):
            pending.extend(event.logprobs)
            if event.text:
                yield sse(shape.chunk(event.text, logprobs=pending, offset=offset))
                offset += sum(len(e.text) for e in pending)
                pending = []
    if isinstance(reply.terminal, Failed):
        yield _error_chunk(reply.terminal)
    else:
        yield sse(shape.chunk("", reply.finish_reason(), logprobs=pending, offset=offset))
        if include_usage:
            yield sse(shape.usage_chunk(reply))
    yield sse("[DONE]")
    done(reply)
