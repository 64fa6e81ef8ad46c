"""One streamed chat completion from an OpenAI-compatible server, read as the port's events
(`OpenAIEngine.generate` starts it).

A chunk's text becomes a `TokenDelta`; what the client can measure (TTFT from sending the
request, the decode rate from the chunks' arrival) it measures, and an npuchat server's own
figures come from each chunk's `npuchat` field. Whatever shape the server sends, the reply ends
in one event: lines are read bounded, fields of another shape count as absent, and a chunk that
cannot be read ends the reply with a one-line `Failed`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx

from npuchat.engine.events import (
    Cancelled,
    Event,
    Failed,
    Finished,
    Metrics,
    MetricsUpdate,
    StopReason,
    TokenDelta,
)

__all__ = ["MAX_LINE_CHARS", "StreamedReply"]

METRICS_INTERVAL_S = 0.1
MAX_LINE_CHARS = 4 << 20  # one event's line: far more than any chunk of a reply


class _LineTooLong(ValueError):
    pass


def _lines(texts: Iterator[str], limit: int = MAX_LINE_CHARS) -> Iterator[str]:
    """The lines of a stream of text, each at most `limit` characters: a server that never
    ends a line cannot fill the memory (httpx's own `iter_lines` keeps all of it)."""
    rest = ""
    for text in texts:
        parts = (rest + text).splitlines(keepends=True)
        rest = parts.pop() if parts and not parts[-1].endswith(("\n", "\r")) else ""
        for part in parts:
            yield part.rstrip("\r\n")
        if len(rest) > limit:
            raise _LineTooLong(f"a line of its reply is over {limit:,} characters")
    if rest:
        yield rest


_STOP_REASONS: dict[str, StopReason] = {"stop": "eos", "length": "max_tokens", "tool_calls": "eos"}


class StreamedReply:
    """One streamed reply: chunks in, events out, figures measured on the way."""

    def __init__(
        self, base: Metrics, response: httpx.Response, cancel: threading.Event, t0: float
    ) -> None:
        self.response = response
        self.cancel = cancel
        self.t0 = t0
        self.t_first = 0.0
        self.chunks = 0
        self.usage: dict[str, Any] = {}
        self.server: dict[str, Any] = {}
        self.base = base

    def metrics(self) -> Metrics:
        now = time.perf_counter()
        tokens = _number(self.usage.get("completion_tokens")) or self.chunks
        decode_s = now - self.t_first
        m = replace(
            self.base,
            ttft_s=self.t_first - self.t0 if self.t_first else 0.0,
            decode_tokens=max(0, tokens - 1),
            decode_tps=(tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0,
        )
        if self.usage:
            details = _object(self.usage.get("prompt_tokens_details"))
            cached = _number(details.get("cached_tokens"))
            prompt = _number(self.usage.get("prompt_tokens"))
            m = replace(m, prefill_tokens=prompt - cached, reused_tokens=cached)
        s = self.server
        if s:  # the figures only an npuchat server knows
            m = replace(
                m,
                prefill_tps=_number(s.get("prefill_tps"), float),
                drafted=_number(s.get("drafted")),
                accepted=_number(s.get("accepted")),
                kv_used=_number(s.get("kv_used")),
                kv_capacity=_number(s.get("kv_capacity")),
                draft=str(s.get("draft") or m.draft),
            )
        return m

    def _watch_cancel(self, done: threading.Event) -> None:
        """Close the connection the moment cancel is set, even mid-prefill (no chunk to wake).

        Closing a socket does not wake a thread blocked reading it; shutting it down does, so
        the reader sees the end at once and the server sees the disconnect."""
        while not done.is_set():
            if self.cancel.wait(0.05):
                stream = self.response.extensions.get("network_stream")
                sock = stream.get_extra_info("socket") if stream is not None else None
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                self.response.close()
                return

    def events(self) -> Iterator[Event]:
        done = threading.Event()
        threading.Thread(target=self._watch_cancel, args=(done,), daemon=True).start()
        finish: str | None = None
        last_emit = 0.0
        try:
            for line in _lines(self.response.iter_text()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise TypeError("a chunk that is not an object")
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    yield Failed(str(message))
                    return
                self.usage = _object(chunk.get("usage")) or self.usage
                self.server = _object(chunk.get("npuchat")) or self.server
                for choice in chunk.get("choices") or []:
                    text = _choice_text(choice)
                    if text:
                        if not self.t_first:
                            self.t_first = time.perf_counter()
                        self.chunks += 1
                        yield TokenDelta(text)
                    finish = choice.get("finish_reason") or finish
                now = time.perf_counter()
                if self.t_first and now - last_emit >= METRICS_INTERVAL_S:
                    last_emit = now
                    yield MetricsUpdate(self.metrics())
        except _LineTooLong as exc:
            yield Failed(f"the server sent a reply npuchat cannot read: {exc}")
            return
        except (httpx.HTTPError, httpx.StreamError, ValueError) as exc:
            if not self.cancel.is_set():
                yield Failed(f"the server's reply broke off: {exc}")
                return
        except (TypeError, AttributeError, RecursionError) as exc:  # a chunk of another shape
            yield Failed(
                f"the server sent a reply npuchat cannot read ({type(exc).__name__}); is it an "
                "OpenAI-compatible server?"
            )
            return
        finally:
            done.set()
        metrics = self.metrics()
        yield MetricsUpdate(metrics)
        if self.cancel.is_set():
            yield Cancelled(metrics)
        elif finish is None:
            yield Failed("the server ended the reply without saying why")
        else:
            yield Finished(_STOP_REASONS.get(finish, "eos"), metrics)


def _object(value: object) -> dict[str, Any]:
    """A field a server may send as an object, else nothing (another server's shape)."""
    return value if isinstance(value, dict) else {}


def _number(value: object, kind: type[int] | type[float] = int) -> Any:
    """A figure a server sent, 0 where it is no number."""
    try:
        return kind(value) if isinstance(value, int | float | str) else kind(0)
    except (ValueError, OverflowError):  # "x", NaN, 1e400 as an int
        return kind(0)


def _choice_text(choice: dict[str, Any]) -> str:
    """Content of a chat delta or a completion chunk; tool calls as the text that asked for them."""
    if "text" in choice:
        return str(choice.get("text") or "")
    delta = choice.get("delta") or {}
    text = str(delta.get("content") or "")
    for call in delta.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments") or "{}"
        text += f'<tool_call>{{"name": "{fn.get("name", "")}", "arguments": {args}}}</tool_call>'
    return text
