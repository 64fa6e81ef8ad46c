"""The hand-off between the engine (in a worker thread) and the UI (on the event loop).

The engine may yield an event per token, far faster than a terminal should repaint. The worker
only appends events to a `ReplyBuffer`; the UI drains it on a 10 Hz timer, so text and metrics
updates are coalesced to at most ten repaints a second however fast the engine runs, and a slow
engine never leaves text waiting in the worker. Nothing here imports Textual.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from npuchat.app.store_records import ConversationSettings, StoredMessage
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    Cancelled,
    ChatEngine,
    ChatMessage,
    ChatRequest,
    Event,
    Failed,
    Finished,
    Metrics,
    MetricsUpdate,
    Notice,
    TerminalEvent,
    TokenDelta,
)

log = logging.getLogger(__name__)

MAX_RATE_POINTS = 512
"""Sparkline points kept per reply; older points are thinned out, never the newest."""


@dataclass
class Drained:
    """Everything that arrived since the previous drain."""

    text: str = ""
    metrics: Metrics | None = None
    rates: list[float] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    terminal: TerminalEvent | None = None


class ReplyBuffer:
    """Thread-safe accumulator: `push` from the worker, `drain` from the UI."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = Drained()
        self._last_point: tuple[int, float] | None = None

    def push(self, event: Event) -> None:
        with self._lock:
            pending = self._pending
            if isinstance(event, TokenDelta):
                pending.text += event.text
            elif isinstance(event, MetricsUpdate):
                pending.metrics = event.metrics
                rate = self._instant_rate(event.metrics)
                if rate is not None:
                    pending.rates.append(rate)
            elif isinstance(event, Notice):
                pending.notices.append(event)
            elif pending.terminal is None:
                pending.terminal = event
                if isinstance(event, Finished | Cancelled):
                    pending.metrics = event.metrics

    def drain(self) -> Drained:
        with self._lock:
            drained, self._pending = self._pending, Drained()
            return drained

    def _instant_rate(self, metrics: Metrics) -> float | None:
        """Decode tok/s since the previous update, from the engine's own figures: the decode
        time so far is decode_tokens / decode_tps, so the rate over an interval needs no clock
        here (and is the same in every run of a scripted test)."""
        if metrics.decode_tps <= 0 or metrics.decode_tokens <= 0:
            return None
        point = (metrics.decode_tokens, metrics.decode_tokens / metrics.decode_tps)
        previous, self._last_point = self._last_point, point
        if previous is None:
            return metrics.decode_tps
        d_tokens, d_time = point[0] - previous[0], point[1] - previous[1]
        if d_tokens <= 0 or d_time <= 0:
            return None
        return d_tokens / d_time


def thin(points: list[float], limit: int = MAX_RATE_POINTS) -> list[float]:
    """Halve the resolution of the older half when over `limit`, keeping the shape."""
    if len(points) <= limit:
        return points
    half = len(points) // 2
    older = [(points[i] + points[i + 1]) / 2 for i in range(0, half - 1, 2)]
    return older + points[half:]


def run_generation(
    engine: ChatEngine, request: ChatRequest, cancel: threading.Event, buffer: ReplyBuffer
) -> None:
    """Worker-thread body: feed every event into `buffer`, always ending with a terminal event.

    Engine exceptions become `Failed` so the UI shows a message, never a traceback; anything
    that is not an NpuchatError is a bug and is logged with its traceback.
    """
    try:
        for event in engine.generate(request, cancel):
            buffer.push(event)
            if isinstance(event, Finished | Cancelled | Failed):
                return
        buffer.push(Failed("the engine ended the reply without saying why"))
    except NpuchatError as exc:
        buffer.push(Failed(str(exc)))
    except Exception as exc:
        log.exception("engine failed")
        buffer.push(Failed(f"internal error in the engine: {type(exc).__name__}: {exc}"))


def build_request(
    conversation_id: str, settings: ConversationSettings, history: Sequence[StoredMessage]
) -> ChatRequest:
    """The engine request for a conversation: every user turn and every assistant reply that
    has text (a stopped reply stays part of the conversation, as the user saw it)."""
    messages = tuple(
        ChatMessage(m.role, m.content)
        for m in history
        if m.role == "user" or (m.role == "assistant" and m.content.strip())
    )
    return ChatRequest(
        conversation_id=conversation_id,
        system_prompt=settings.system_prompt,
        messages=messages,
        sampling=settings.sampling(),
    )
