"""OpenAI response objects built from engine events: whole replies and streamed chunks.

One `Reply` per request accumulates what the engine said (text, token count, metrics, the
terminal event); `ChatShape` and `TextShape` turn it into `/v1/chat/completions` and
`/v1/completions` objects, so the streaming and non-streaming paths share every field.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from npuchat.engine.events import (
    Cancelled,
    Event,
    Failed,
    Finished,
    Metrics,
    MetricsUpdate,
    TerminalEvent,
    TokenDelta,
    TokenLogprob,
    ToolCall,
)

from . import metrics as figures
from .call_splitter import CallReading

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_tokens": "length", "length": "length"}


@dataclass
class Reply:
    """What one generation produced so far."""

    text: str = ""
    tokens: int = 0
    metrics: Metrics = field(default_factory=Metrics)
    terminal: TerminalEvent | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for

    def add(self, event: Event) -> None:
        if isinstance(event, TokenDelta):
            self.text += event.text
            self.tokens += len(event.ids)
            self.logprobs.extend(event.logprobs)
        elif isinstance(event, MetricsUpdate):
            self.metrics = event.metrics
        elif isinstance(event, Finished | Cancelled):
            self.metrics, self.terminal = event.metrics, event
        elif isinstance(event, Failed):
            self.terminal = event

    def finish_reason(self, tool_calls: bool = False) -> str:
        if tool_calls:
            return "tool_calls"
        if isinstance(self.terminal, Finished):
            return FINISH_REASONS[self.terminal.stop_reason]
        return "stop"  # cancelled: what was generated ends there

    @property
    def completion_tokens(self) -> int:
        """Ids the text came from; an engine that sends no ids is taken at its decode count."""
        if self.tokens or not self.text:
            return self.tokens
        return self.metrics.decode_tokens + 1

    def usage(self) -> dict[str, Any]:
        return figures.usage(self.metrics, self.completion_tokens)


def usage_of(replies: list[Reply]) -> dict[str, Any]:
    """One usage object for the choices of a request: the prompt counted once, as the choice
    that prefilled most of it saw it (the others copy its rows: `peer_prefix`, so their cached
    tokens say nothing of the request), every choice's completion tokens."""
    read = [r for r in replies if figures.prompt_tokens(r.metrics)] or replies
    usage = min(read, key=lambda r: r.metrics.reused_tokens).usage()
    usage["completion_tokens"] = sum(r.completion_tokens for r in replies)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


async def recorded(first: Event, rest: AsyncIterator[Event], reply: Reply) -> AsyncIterator[Event]:
    """`first`, then `rest`, each added to `reply`, up to and including the terminal event."""
    reply.add(first)
    yield first
    if reply.terminal is not None:
        return
    async for event in rest:
        reply.add(event)
        yield event
        if reply.terminal is not None:
            return


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out["index"] = index
    return out


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`: OpenAI's `content` list (the bytes as integers)."""

    def one(e: TokenLogprob) -> dict[str, Any]:
        return {"token": e.text, "logprob": e.logprob, "bytes": list(e.piece)}

    return {
        "content": [one(e) | {"top_logprobs": [one(t) for t in e.top]} for e in entries],
        "refusal": None,
    }


def text_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs`: the legacy parallel lists; `offset`: characters of
    the reply before these tokens (where `text_offset` starts)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_by_text(e.top) for e in entries],
        "text_offset": offsets,
    }


def _by_text(top: tuple[TokenLogprob, ...]) -> dict[str, float]:
    """The legacy map from text to log probability: where two tokens show the same text (two
    halves of characters both read U+FFFD) the likelier one's figure stays."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t.text, t.logprob)
    return out


@dataclass
class _Shape:
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: bool = False  # the request asked for them

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass
class ChatShape(_Shape):
    """`chat.completion` and `chat.completion.chunk` objects."""

    calls: CallReading = field(default_factory=CallReading)  # `Prepared.calls`

    def __post_init__(self) -> None:
        self.id = self.id or "chatcmpl-" + secrets.token_hex(12)

    def whole(self, reply: Reply) -> dict[str, Any]:
        return self.whole_choices([reply])

    def whole_choices(self, replies: list[Reply]) -> dict[str, Any]:
        """`npuchat`: the first choice's figures (the others ran beside it)."""
        return {
            **self._head("chat.completion"),
            "choices": [self._choice(r, i) for i, r in enumerate(replies)],
            "usage": usage_of(replies),
            "npuchat": figures.extension(replies[0].metrics),
        }

    def _choice(self, reply: Reply, index: int) -> dict[str, Any]:
        content, calls = self.calls.split(reply.text)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [_tool_call_json(c) for c in calls]
        elif message["content"] is None:
            message["content"] = ""
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(reply.logprobs) if self.logprobs else None,
            "finish_reason": reply.finish_reason(bool(calls)),
        }

    def chunk(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        choice: int = 0,
    ) -> dict[str, Any]:
        """`logprobs`: those of the tokens since the last chunk (None: not asked for);
        `choice`: which of the request's choices the chunk belongs to."""
        probs = chat_logprobs(logprobs) if self.logprobs and logprobs is not None else None
        one = {"index": choice, "delta": delta, "logprobs": probs, "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [one]}

    def text_chunk(
        self, text: str, logprobs: list[TokenLogprob] | None = None, choice: int = 0
    ) -> dict[str, Any]:
        return self.chunk({"content": text}, logprobs=logprobs, choice=choice)

    def call_chunk(
        self,
        call: ToolCall,
        index: int,
        logprobs: list[TokenLogprob] | None = None,
        choice: int = 0,
    ) -> dict[str, Any]:
        delta = {"tool_calls": [_tool_call_json(call, index)]}
        return self.chunk(delta, logprobs=logprobs, choice=choice)

    def arguments_chunk(
        self,
        more: str,
        index: int,
        logprobs: list[TokenLogprob] | None = None,
        choice: int = 0,
    ) -> dict[str, Any]:
        """The next stretch of a streamed call's arguments (`call_chunk` opened it)."""
        delta = {"tool_calls": [{"index": index, "function": {"arguments": more}}]}
        return self.chunk(delta, logprobs=logprobs, choice=choice)

    def usage_chunk(self, replies: list[Reply]) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [],
            "usage": usage_of(replies),
            "npuchat": figures.extension(replies[0].metrics),
        }


@dataclass
class TextShape(_Shape):
    """`text_completion` objects, whole and streamed (OpenAI streams the same object type)."""

    echo: str = ""  # the prompt, given back before the text

    def __post_init__(self) -> None:
        self.id = self.id or "cmpl-" + secrets.token_hex(12)

    def _choice(
        self,
        text: str,
        finish: str | None,
        logprobs: list[TokenLogprob],
        offset: int = 0,
        index: int = 0,
    ) -> dict[str, Any]:
        probs = text_logprobs(logprobs, offset) if self.logprobs else None
        return {"index": index, "text": text, "logprobs": probs, "finish_reason": finish}

    def whole(self, reply: Reply) -> dict[str, Any]:
        return self.whole_choices([reply])

    def whole_choices(self, replies: list[Reply]) -> dict[str, Any]:
        choices = [
            self._choice(self.echo + r.text, r.finish_reason(), r.logprobs, index=i)
            for i, r in enumerate(replies)
        ]
        return {
            **self._head("text_completion"),
            "choices": choices,
            "usage": usage_of(replies),
            "npuchat": figures.extension(replies[0].metrics),
        }

    def chunk(
        self,
        text: str,
        finish: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        choice: int = 0,
    ) -> dict[str, Any]:
        """`logprobs`: those of the tokens since the last chunk; `offset`: the reply's
        characters before them; `choice`: which of the request's choices it belongs to."""
        one = self._choice(text, finish, logprobs or [], offset, choice)
        return {**self._head("text_completion"), "choices": [one]}

    def usage_chunk(self, replies: list[Reply]) -> dict[str, Any]:
        return {
            **self._head("text_completion"),
            "choices": [],
            "usage": usage_of(replies),
            "npuchat": figures.extension(replies[0].metrics),
        }
