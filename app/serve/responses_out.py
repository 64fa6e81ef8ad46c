"""`/v1/responses` answers: the `response` object, whole or as its stream of typed events.

A reply becomes output items: its text a `message` item (one `output_text` part), each tool
call a `function_call` item, in the order the model wrote them. The stream says the same
through OpenAI's events, each with a `sequence_number`: `response.created`, then per item
`output_item.added`, its deltas and `done` events, `output_item.done`, and last
`response.completed` (or `response.incomplete` when `max_output_tokens` cut it, `response.failed`
when the engine refused it), with no `[DONE]` after it. The tool-call blocks are split out of
the text as chat completions split them (`ToolCallSplitter`), so text streams at once and a
call comes out whole when its block closes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from npuchat.engine.events import Failed, Finished, TokenDelta, TokenLogprob, ToolCall

from .call_splitter import CallReading, call_events, stream_pieces
from .responses import Reply, chat_logprobs, recorded, sse
from .responses_in import ResponseIn
from .schema import ChatCompletionIn
from .streaming import Start

_FAILED_CODES = {"busy": "rate_limit_exceeded", "invalid": "invalid_prompt"}


def echo(given: ResponseIn, chat: ChatCompletionIn) -> dict[str, Any]:
    """The request's settings a response repeats, as OpenAI's do."""
    fmt = (given.text or {}).get("format") or {"type": "text"}
    return {
        "instructions": given.instructions,
        "tools": given.tools or [],
        "tool_choice": given.tool_choice or "auto",
        "parallel_tool_calls": given.parallel_tool_calls,
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "max_output_tokens": given.max_output_tokens,
        "top_logprobs": given.top_logprobs,
        "text": {"format": fmt},
        "truncation": given.truncation or "disabled",
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _usage(reply: Reply) -> dict[str, Any]:
    u = reply.usage()
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _token_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Tokens' log probabilities as a text part and a delta carry them (chat's entries)."""
    return list(chat_logprobs(entries)["content"])


def _message(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [_text_part(text, logprobs)] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _call(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


@dataclass
class ResponseShape:
    """The `response` object of one request; `echo` holds the request's settings it repeats
    (tools, tool_choice, temperature, ...)."""

    model: str
    echo: dict[str, Any]
    calls: CallReading = field(default_factory=CallReading)  # `Prepared.calls`
    logprobs: bool = False  # the request asked for them (`top_logprobs` or `include`)
    keep: Callable[[dict[str, Any]], None] | None = None  # `store`: where the answer is kept
    previous: str | None = None  # the kept response this one continues
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def head(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "usage": None,
            "metadata": {},
            "store": self.keep is not None,
            "previous_response_id": self.previous,
            **self.echo,
        }

    def ended(self, reply: Reply, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished object: completed, or incomplete where the token budget ran out;
        kept where the request asked for that."""
        cut = isinstance(reply.terminal, Finished) and reply.terminal.stop_reason in (
            "max_tokens",
            "length",
        )
        obj = self.head("incomplete" if cut else "completed", output)
        if cut:
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        obj["usage"] = _usage(reply)
        if self.keep is not None:
            self.keep(obj)
        return obj

    def whole(self, reply: Reply) -> dict[str, Any]:
        content, calls = self.calls.split(reply.text)
        probs = _token_logprobs(reply.logprobs) if self.logprobs and not calls else None
        output = [_message(_id("msg"), content, "completed", probs)] if content else []
        output += [_call(_id("fc"), c) for c in calls]
        return self.ended(reply, output)


class _Events:
    """The stream's events, numbered, and the output items they have built."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item
        self.call_id = ""  # the latest function_call item's
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n".encode() + sse(data)

    def response(self, kind: str, obj: dict[str, Any]) -> bytes:
        return self.event(kind, response=obj)

    def text_delta(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        out = []
        if self.message is None:
            self.message = _message(_id("msg"), "", "in_progress")
            self.text = ""
            self.logprobs: list[dict[str, Any]] = []
            out.append(self._added(self.message))
            out.append(self._part("response.content_part.added", _text_part("")))
        self.text += text
        self.logprobs += logprobs or []
        out.append(
            self._text_event("response.output_text.delta", delta=text, logprobs=logprobs or [])
        )
        return out

    def close_message(self) -> list[bytes]:
        if self.message is None:
            return []
        done = _message(self.message["id"], self.text, "completed", self.logprobs)
        out = [
            self._text_event("response.output_text.done", text=self.text, logprobs=self.logprobs),
            self._part("response.content_part.done", _text_part(self.text, self.logprobs)),
            self.event("response.output_item.done", output_index=len(self.output), item=done),
        ]
        self.output.append(done)
        self.message = None
        return out

    def call(self, call: ToolCall) -> list[bytes]:
        """A whole call: opened, its arguments in one delta, ended."""
        return [*self.call_open(call), *self.call_more(call.arguments), *self.call_end(call)]

    def call_open(self, call: ToolCall) -> list[bytes]:
        out = self.close_message()
        self.call_id = _id("fc")
        return [*out, self._added(_call(self.call_id, call, "in_progress"))]

    def call_more(self, more: str) -> list[bytes]:
        """The next stretch of the open call's arguments."""
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=self.call_id,
                output_index=len(self.output),
                delta=more,
            )
        ]

    def call_end(self, call: ToolCall) -> list[bytes]:
        index = len(self.output)
        done = _call(self.call_id, call)
        self.output.append(done)
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=self.call_id,
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def _added(self, item: dict[str, Any]) -> bytes:
        return self.event("response.output_item.added", output_index=len(self.output), item=item)

    def _part(self, kind: str, part: dict[str, Any]) -> bytes:
        assert self.message is not None
        index = len(self.output)
        return self.event(
            kind, item_id=self.message["id"], output_index=index, content_index=0, part=part
        )

    def _text_event(self, kind: str, **fields: Any) -> bytes:
        assert self.message is not None
        index = len(self.output)
        return self.event(
            kind,
            item_id=self.message["id"],
            output_index=index,
            content_index=0,
            **fields,
        )


async def response_events(
    shape: ResponseShape, starts: list[Start], done: Callable[[list[Reply]], None]
) -> AsyncIterator[bytes]:
    """The events of one reply (`starts` holds one: the Responses API has no `n`)."""
    (first, rest), reply = starts[0], Reply()
    ev = _Events(shape)
    splitter = shape.calls.splitter()
    yield ev.response("response.created", shape.head("in_progress", []))
    yield ev.response("response.in_progress", shape.head("in_progress", []))

    def pieces(
        text: str, final: bool = False, logprobs: list[dict[str, Any]] | None = None
    ) -> list[bytes]:
        if splitter is not None:  # with tools, text and calls split apart: no log probabilities
            logprobs = None
        out: list[bytes] = []
        for piece in stream_pieces(splitter, text, final):
            if piece.call is None:
                out += ev.text_delta(piece.text, logprobs)
            else:
                out += call_events(piece, ev)
        return out

    pending: list[dict[str, Any]] = []  # log probabilities of tokens not yet sent
    async for event in recorded(first, rest, reply):
        if isinstance(event, TokenDelta):
            if shape.logprobs:  # a token that ends inside a character waits for the next delta
                pending += _token_logprobs(list(event.logprobs))
            probs, pending = (pending, []) if event.text else (None, pending)
            for chunk in pieces(event.text, logprobs=probs):
                yield chunk
    done([reply])
    if isinstance(reply.terminal, Failed):
        failed = shape.head("failed", ev.output)
        code = _FAILED_CODES.get(reply.terminal.kind, "server_error")
        failed["error"] = {"code": code, "message": reply.terminal.message}
        yield ev.response("response.failed", failed)
        return
    for chunk in [*pieces("", final=True), *ev.close_message()]:
        yield chunk
    obj = shape.ended(reply, ev.output)
    yield ev.response(f"response.{obj['status']}", obj)
