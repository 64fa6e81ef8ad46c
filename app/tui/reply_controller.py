"""Replies in flight, one per conversation, whatever conversation is on screen.

A reply's lifecycle: its assistant row is committed with status "partial", the engine runs in a
thread worker feeding a ReplyBuffer, a 10 Hz timer drains every buffer (the reply's own text
grows whether or not its conversation is shown; an attached view streams it as Markdown), the
partial text is saved every few seconds, and the terminal event writes the final text, status
and metrics in one commit. Switching conversations only attaches or detaches views, so a reply
keeps streaming into its own conversation while the user reads or writes another one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from textual.timer import Timer

from npuchat.app.store import ConversationStore
from npuchat.app.store_records import MessageStatus
from npuchat.app.store_schema import DatabaseBusyError
from npuchat.app.tui.formatting import prefill_progress, prefilling
from npuchat.app.tui.generation import ReplyBuffer, thin
from npuchat.app.tui.message_list import AssistantMessage
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    Cancelled,
    ChatEngine,
    ChatRequest,
    Finished,
    Metrics,
    Notice,
    StopReason,
    TerminalEvent,
)

DRAIN_INTERVAL_S = 0.1
"""UI refresh period while streaming: at most 10 updates a second."""
SAVE_INTERVAL_S = 0.5
"""How often a streaming reply's text is committed: a kill -9 loses at most this much."""
BUSY_MESSAGE = "the engine is busy with another reply; press Ctrl+R here when that one ends"


@dataclass
class ActiveReply:
    """One reply being generated. `prefix` is text the reply already had (a continued reply);
    `content` is everything so far, `view` the widget showing it while its conversation is open."""

    conversation_id: str
    message_id: int
    request: ChatRequest
    prefix: str = ""
    content: str = ""
    view: AssistantMessage | None = None
    buffer: ReplyBuffer = field(default_factory=ReplyBuffer)
    cancel: threading.Event = field(default_factory=threading.Event)
    metrics: Metrics | None = None
    rates: list[float] = field(default_factory=list)
    saved_at: float = field(default_factory=time.monotonic)
    saved_len: int = 0
    status: MessageStatus = "partial"
    stop_reason: StopReason | None = None
    error: str = ""

    def __post_init__(self) -> None:
        self.content = self.content or self.prefix
        self.saved_len = len(self.content)


class ReplyHost(Protocol):
    """What the controller needs from the screen that owns it."""

    def spawn_generation(self, engine: ChatEngine, reply: ActiveReply) -> None:
        """Run `engine.generate` for `reply` in a thread worker feeding `reply.buffer`."""
        ...

    def set_interval(self, interval: float, callback: Callable[[], Awaitable[None]]) -> Timer: ...

    def reply_progressed(self, reply: ActiveReply) -> None:
        """New metrics or rates for `reply` (the panel shows them if it is on screen)."""
        ...

    async def reply_notice(self, reply: ActiveReply, notice: Notice) -> None: ...

    async def reply_finished(self, reply: ActiveReply) -> None:
        """`reply` ended and is saved; `reply.status` says how."""
        ...

    def reply_not_saved(self, reply: ActiveReply, message: str) -> None:
        """The store refused a save (a damaged or locked-for-good database)."""
        ...


class ReplyController:
    """Starts, streams, saves and ends replies; the screen only shows what it is told."""

    def __init__(self, host: ReplyHost, store: ConversationStore) -> None:
        self._host = host
        self._store = store
        self._replies: dict[str, ActiveReply] = {}
        self._drain_lock = asyncio.Lock()
        self._timer: Timer | None = None

    # ---- queries ---------------------------------------------------------------------------

    def get(self, conversation_id: str | None) -> ActiveReply | None:
        return self._replies.get(conversation_id) if conversation_id else None

    @property
    def conversation_ids(self) -> frozenset[str]:
        return frozenset(self._replies)

    def __bool__(self) -> bool:
        return bool(self._replies)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(
        self,
        engine: ChatEngine,
        request: ChatRequest,
        message_id: int,
        view: AssistantMessage | None,
        prefix: str = "",
    ) -> ActiveReply:
        """Begin streaming `request` into the stored assistant row `message_id`."""
        reply = ActiveReply(request.conversation_id, message_id, request, prefix=prefix)
        self._replies[reply.conversation_id] = reply
        self.attach(reply.conversation_id, view)
        if self._timer is None:
            self._timer = self._host.set_interval(DRAIN_INTERVAL_S, self.drain)
        self._host.spawn_generation(engine, reply)
        return reply

    def attach(self, conversation_id: str, view: AssistantMessage | None) -> None:
        """Show the reply of `conversation_id` in `view` (None: its conversation is hidden)."""
        reply = self._replies.get(conversation_id)
        if reply is None:
            return
        reply.view = view
        if view is not None:
            view.set_generating()

    def detach_all(self) -> None:
        for reply in self._replies.values():
            reply.view = None

    def stop(self, conversation_id: str) -> bool:
        """Ask the engine to stop the reply of `conversation_id`; False if there is none."""
        reply = self._replies.get(conversation_id)
        if reply is None:
            return False
        reply.cancel.set()
        return True

    async def drain(self) -> None:
        """Move what the workers produced into the replies and their views (≤ 10 Hz)."""
        async with self._drain_lock:
            for reply in list(self._replies.values()):
                await self._drain_one(reply)
            if not self._replies and self._timer is not None:
                self._timer.stop()
                self._timer = None

    async def _drain_one(self, reply: ActiveReply) -> None:
        drained = reply.buffer.drain()
        for notice in drained.notices:
            await self._host.reply_notice(reply, notice)
        if drained.text:
            reply.content += drained.text
            if reply.view is not None:
                await reply.view.append(drained.text)
        if drained.metrics is not None:
            reply.metrics = drained.metrics
            if reply.view is not None and (prefilling(reply.metrics) or reply.view.progress):
                progress = prefill_progress(reply.metrics) if prefilling(reply.metrics) else ""
                reply.view.set_generating(progress)
        if drained.rates:
            reply.rates = thin(reply.rates + drained.rates)
        if drained.metrics is not None or drained.rates:
            self._host.reply_progressed(reply)
        if drained.terminal is not None:
            await self._finish(reply, drained.terminal)
        elif (
            time.monotonic() - reply.saved_at >= SAVE_INTERVAL_S
            and len(reply.content) != reply.saved_len
        ):
            self._save(reply, "partial")

    def _save(
        self, reply: ActiveReply, status: MessageStatus, deadline_s: float | None = 0.0
    ) -> None:
        """Commit the reply's text; a periodic save (deadline 0) that finds the file locked
        gives up and the next tick catches up. The final save waits (deadline None)."""
        reply.saved_at = time.monotonic()
        try:
            self._store.update_message(
                reply.message_id,
                content=reply.content,
                status=status,
                metrics=reply.metrics,
                error=reply.error,
                stop_reason=reply.stop_reason,
                token_limit=reply.request.sampling.max_tokens,
                deadline_s=deadline_s,
            )
        except NpuchatError as exc:
            if deadline_s is None or not isinstance(exc, DatabaseBusyError):
                self._host.reply_not_saved(reply, str(exc))
            return
        reply.saved_len = len(reply.content)

    async def _finish(self, reply: ActiveReply, terminal: TerminalEvent) -> None:
        if isinstance(terminal, Finished):
            reply.status, reply.stop_reason = "complete", terminal.stop_reason
            reply.metrics = terminal.metrics
        elif isinstance(terminal, Cancelled):
            reply.status, reply.metrics = "stopped", terminal.metrics
        else:
            reply.status = "error"
            reply.error = BUSY_MESSAGE if terminal.kind == "busy" else terminal.message
        self._save(reply, reply.status, deadline_s=None)
        if reply.view is not None:
            limit = reply.request.sampling.max_tokens if reply.stop_reason == "max_tokens" else 0
            await reply.view.finish(reply.status, reply.metrics, reply.error, limit)
        del self._replies[reply.conversation_id]
        await self._host.reply_finished(reply)

    def shutdown(self) -> None:
        """Quitting: stop every reply and keep what was generated, marked stopped."""
        for reply in list(self._replies.values()):
            reply.cancel.set()
            reply.content += reply.buffer.drain().text
            self._save(reply, "stopped", deadline_s=None)
        self._replies.clear()
