"""`/v1/messages` answers: Anthropic's `message` object, whole or as its stream of events.

A reply becomes content blocks: its text a `text` block, each tool call a `tool_use` block
(its arguments as the `input` object), in the order the model wrote them. `stop_reason` says
why it ended: `tool_use` when it called a tool, `stop_sequence` (naming it) when one of the
request's `stop_sequences` ended it, `max_tokens`, `model_context_window_exceeded` when the
KV cache was full, else `end_turn`. Usage is Anthropic's split: `input_tokens` are the prompt
tokens read this time, `cache_read_input_tokens` those whose KV was reused.

The stream is Anthropic's events, each named by an `event:` line: `message_start`, then per
block `content_block_start`, its deltas (`text_delta`, or one `input_json_delta` holding a
call's arguments: a call comes out whole when its block closes, as chat completions split
them), `content_block_stop`; last `message_delta` (the stop reason and the final usage) and
`message_stop`, or an `error` event where the engine refused the reply. `message_start` waits
for the prompt's figures (from the first report of a long prompt's reading, else the first
token's), so its `input_tokens` are the prompt's, not a guess; while a long prompt is read,
`ping` events say the server is at work, as Anthropic's do.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from npuchat.engine.events import Failed, Finished, MetricsUpdate, TokenDelta, ToolCall

from .call_splitter import CallReading, call_events, stream_pieces
from .metrics import prompt_tokens
from .responses import Reply, recorded, sse
from .schema import ApiError
from .streaming import Start

_STOPS = {"eos": "end_turn", "max_tokens": "max_tokens", "length": "model_context_window_exceeded"}
_FAILED = {"busy": 429, "invalid": 400}


def _usage(reply: Reply) -> dict[str, Any]:
    """The reply's usage; while the prompt is being read, the whole prompt's (`prefill_total`:
    what is read this time, `reused_tokens`: what is not)."""
    m = reply.metrics
    return {
        "input_tokens": max(m.prefill_total, prompt_tokens(m) - m.reused_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": m.reused_tokens,
        "output_tokens": reply.completion_tokens,
    }


def _input(call: ToolCall) -> dict[str, Any] | None:
    """A call's arguments as the object `tool_use` carries (None: they are no object)."""
    try:
        value = json.loads(call.arguments or "{}")
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _as_text(call: ToolCall) -> str:
    """A call whose arguments are no object, given back as the model wrote its meaning."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


def _tool_use(call: ToolCall, arguments: dict[str, Any]) -> dict[str, Any]:
    tool_id = "toolu_" + call.id.removeprefix("call_")
    return {"type": "tool_use", "id": tool_id, "name": call.name, "input": arguments}


def error_event(failed: Failed) -> bytes:
    """The `error` event that ends a stream the engine refused."""
    error = ApiError(_FAILED.get(failed.kind, 500), failed.message)
    return b"event: error\n" + sse(error.anthropic_body())


@dataclass
class MessageShape:
    """The `message` object of one request."""

    model: str
    calls: CallReading = field(default_factory=CallReading)  # `Prepared.calls`
    stops: tuple[str, ...] = ()  # the request's stop_sequences
    id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))

    def head(self, reply: Reply) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(reply),
        }

    def stop(self, reply: Reply, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        end = reply.terminal
        if called:
            return "tool_use", None
        if isinstance(end, Finished) and end.stop_reason == "stop_string":
            if end.stop_string in self.stops:  # not the close of a call (`one_call`)
                return "stop_sequence", end.stop_string
            return "end_turn", None
        if isinstance(end, Finished):
            return _STOPS[end.stop_reason], None
        return "end_turn", None  # cancelled: what was written ends there

    def whole(self, reply: Reply) -> dict[str, Any]:
        content, calls = self.calls.split(reply.text)
        blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
        for call in calls:
            arguments = _input(call)
            if arguments is None:
                blocks.append({"type": "text", "text": _as_text(call)})
            else:
                blocks.append(_tool_use(call, arguments))
        reason, sequence = self.stop(reply, any(b["type"] == "tool_use" for b in blocks))
        return {
            **self.head(reply),
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
        }


class _Events:
    """The stream's events and its open block."""

    def __init__(self, shape: MessageShape, reply: Reply) -> None:
        self.shape, self.reply = shape, reply
        self.index = -1  # the latest block's
        self.text_open = False
        self.called = False

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\n".encode() + sse({"type": kind, **fields})

    def start(self) -> bytes:
        return self.event("message_start", message=self.shape.head(self.reply))

    def _open(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        return self.event("content_block_start", index=self.index, content_block=block)

    def close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        return [self.event("content_block_stop", index=self.index)]

    def text(self, text: str) -> list[bytes]:
        out = [] if self.text_open else [self._open({"type": "text", "text": ""})]
        self.text_open = True
        delta = {"type": "text_delta", "text": text}
        return [*out, self.event("content_block_delta", index=self.index, delta=delta)]

    def call(self, call: ToolCall) -> list[bytes]:
        """A whole call: a tool_use block with its input in one delta (a call whose arguments
        are no object is text)."""
        if _input(call) is None:
            return self.text(_as_text(call))
        return [*self.call_open(call), *self.call_more(call.arguments), *self.call_end(call)]

    def call_open(self, call: ToolCall) -> list[bytes]:
        self.called = True
        return [*self.close_text(), self._open(_tool_use(call, {}))]

    def call_more(self, more: str) -> list[bytes]:
        """The next stretch of the open tool_use block's input."""
        delta = {"type": "input_json_delta", "partial_json": more}
        return [self.event("content_block_delta", index=self.index, delta=delta)]

    def call_end(self, call: ToolCall) -> list[bytes]:
        return [self.event("content_block_stop", index=self.index)]

    def end(self) -> list[bytes]:
        reason, sequence = self.shape.stop(self.reply, self.called)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [
            *self.close_text(),
            self.event("message_delta", delta=delta, usage=_usage(self.reply)),
            self.event("message_stop"),
        ]


async def message_events(
    shape: MessageShape, starts: list[Start], done: Callable[[list[Reply]], None]
) -> AsyncIterator[bytes]:
    """The events of one reply (`starts` holds one: the Messages API has no `n`)."""
    (first, rest), reply = starts[0], Reply()
    ev = _Events(shape, reply)
    splitter = shape.calls.splitter()

    def pieces(text: str, final: bool = False) -> list[bytes]:
        out: list[bytes] = []
        for piece in stream_pieces(splitter, text, final):
            out += ev.text(piece.text) if piece.call is None else call_events(piece, ev)
        return out

    held: list[bytes] | None = []  # what waits for message_start (None: it went out)
    seen_token = False
    async for event in recorded(first, rest, reply):
        out = pieces(event.text) if isinstance(event, TokenDelta) and event.text else []
        figures = isinstance(event, MetricsUpdate)
        if held is not None:  # the prompt's figures: the first token's come in the event after it
            held += out
            ready = figures and (seen_token or reply.metrics.prefill_total > 0)
            out, held = ([ev.start(), *held], None) if ready or reply.terminal else ([], held)
        elif figures and not seen_token:  # a long prompt is still being read
            out = [ev.event("ping")]
        seen_token = seen_token or isinstance(event, TokenDelta)
        for chunk in out:
            yield chunk
    done([reply])
    if isinstance(reply.terminal, Failed):
        yield error_event(reply.terminal)
        return
    for chunk in [*pieces("", final=True), *ev.end()]:
        yield chunk
