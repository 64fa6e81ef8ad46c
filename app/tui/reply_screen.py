"""The chat screen's replies: in flight in any conversation, with their background titles.

`ReplyScreen` is the `ReplyHost` of the `ReplyController`: it runs each reply's engine call in a
thread worker, shows a reply's progress where its conversation is on screen, and marks the
conversations generating in the sidebar. The chat screen builds on it.
"""

from __future__ import annotations

from typing import Literal

from textual import work
from textual.reactive import var

from npuchat.app.store_records import Conversation
from npuchat.app.tui.formatting import prefill_progress, prefilling
from npuchat.app.tui.generation import run_generation
from npuchat.app.tui.message_list import AssistantMessage, MessageList, NoticeView
from npuchat.app.tui.messages import GenerationEnded, TitleGenerated
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.panel_screen import PanelScreen
from npuchat.app.tui.reply_controller import ActiveReply, ReplyController
from npuchat.app.tui.sidebar import Sidebar
from npuchat.app.tui.titles import TitleJob, TitleJobs, generate_title
from npuchat.engine.events import ChatEngine, ChatRequest, Notice


class ReplyScreen(PanelScreen):
    conversation: var[Conversation | None] = var(None, init=False)
    """The conversation on screen (None: a new chat not saved yet)."""
    replying: var[frozenset[str]] = var(frozenset(), init=False)
    """Conversations with a reply in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.replies = ReplyController(self, self.npuchat.store)
        self.titles = TitleJobs(self._title_worker)

    @property
    def generating(self) -> bool:
        """True while any reply is in flight, in any conversation."""
        return bool(self.replies)

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if self.conversation is not None else None

    def watch_replying(self, replying: frozenset[str]) -> None:
        self.query_one(Sidebar).generating = replying
        self.refresh_bindings()

    def begin_reply(
        self,
        engine: ChatEngine,
        request: ChatRequest,
        message_id: int,
        view: AssistantMessage,
        prefix: str = "",
    ) -> None:
        """Stream `request` into the stored row `message_id`, shown in `view`."""
        self.replies.start(engine, request, message_id, view, prefix)
        self.replying = self.replies.conversation_ids
        self.query_one(MetricsPanel).show(None, [], "waiting for the first token…")

    async def refresh_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        found = self.npuchat.store.search(sidebar.search_text, limit=sidebar.limit + 1)
        more = len(found) > sidebar.limit
        await sidebar.show(found[: sidebar.limit], self.conversation_id, self.npuchat.now(), more)

    async def conversation_changed(self, conversation_id: str) -> None:
        """The store changed a conversation (title, settings): show the new state."""
        if self.conversation_id == conversation_id:
            self.conversation = self.npuchat.store.get_conversation(conversation_id)
        await self.refresh_sidebar()

    def spawn_generation(self, engine: ChatEngine, reply: ActiveReply) -> None:
        self._generate(engine, reply)

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate(self, engine: ChatEngine, reply: ActiveReply) -> None:
        run_generation(engine, reply.request, reply.cancel, reply.buffer)
        self.post_message(GenerationEnded())

    async def on_generation_ended(self, message: GenerationEnded) -> None:
        message.stop()
        await self.replies.drain()

    @work(thread=True, group="titles", exit_on_error=False)
    def _title_worker(self, engine: ChatEngine, request: ChatRequest, job: TitleJob) -> None:
        title = generate_title(engine, request, job.cancel)
        self.post_message(TitleGenerated(job.conversation_id, title))

    async def on_title_generated(self, message: TitleGenerated) -> None:
        if self.titles.landed(self.npuchat.store, message.conversation_id, message.title):
            await self.conversation_changed(message.conversation_id)

    def reply_progressed(self, reply: ActiveReply) -> None:
        if reply.conversation_id == self.conversation_id:
            state = "stopping…" if reply.cancel.is_set() else "live"
            if reply.metrics is not None and prefilling(reply.metrics):
                state = prefill_progress(reply.metrics)
            self.query_one(MetricsPanel).show(reply.metrics, reply.rates, state)

    async def reply_notice(self, reply: ActiveReply, notice: Notice) -> None:
        if reply.view is not None:
            await self.query_one(MessageList).mount(
                NoticeView(notice.text, notice.level), before=reply.view
            )
        if notice.level != "info":
            severity: Literal["error", "warning"] = (
                "error" if notice.level == "error" else "warning"
            )
            self.notify(notice.text, severity=severity)

    def reply_not_saved(self, reply: ActiveReply, message: str) -> None:
        self.notify(message, title="Reply not saved", severity="error", timeout=12)

    async def reply_finished(self, reply: ActiveReply) -> None:
        self.replying = self.replies.conversation_ids
        engine = self.npuchat.engine
        if reply.status == "complete" and engine is not None:
            self.titles.after_reply(engine, self.npuchat.store, reply.conversation_id)
        if reply.status == "error":
            self.notify(reply.error, title="Engine error", severity="error", timeout=8)
        if reply.conversation_id == self.conversation_id:
            state = {"complete": "last reply", "stopped": "last reply (stopped)"}.get(
                reply.status, "last reply (failed)"
            )
            self.query_one(MetricsPanel).show(reply.metrics, reply.rates, state)
            self.conversation = self.npuchat.store.get_conversation(reply.conversation_id)
        await self.refresh_sidebar()

    def on_unmount(self) -> None:
        """Quitting mid-reply: stop the engine and keep what was generated."""
        self.replies.shutdown()
