"""The chat screen: sidebar, message list, composer and metrics panel, and the reply lifecycle.

A reply's lifecycle: the user message is committed, an empty assistant row is committed with
status "partial", the engine runs in a thread worker feeding a ReplyBuffer, a 10 Hz timer drains
the buffer into the streaming Markdown and the metrics panel (saving the partial text every few
seconds), and the terminal event writes the final text, status and metrics in one commit.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Input, Label, ProgressBar, Static

from npuchat.app.engine_port import EngineSpec
from npuchat.app.store import (
    Conversation,
    ConversationSettings,
    MessageStatus,
    StoredMessage,
)
from npuchat.app.store_schema import DatabaseBusyError
from npuchat.app.tui.commands import ChatCommands
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.dialogs import ConfirmScreen, PromptScreen
from npuchat.app.tui.generation import ReplyBuffer, build_request, run_generation, thin
from npuchat.app.tui.help_screen import key_label
from npuchat.app.tui.keys import bindings, effective_keys
from npuchat.app.tui.loader_worker import load_engine
from npuchat.app.tui.message_list import (
    AssistantMessage,
    MessageList,
    MessageView,
    NoticeView,
    UserMessage,
)
from npuchat.app.tui.messages import EngineLoaded, EngineLoadFailed, GenerationEnded, LoadProgress
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.app.tui.sidebar import ConversationList, Sidebar
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    Cancelled,
    ChatEngine,
    ChatRequest,
    Finished,
    Metrics,
    Notice,
    TerminalEvent,
)

if TYPE_CHECKING:
    from npuchat.app.tui.app import NpuchatApp

DRAIN_INTERVAL_S = 0.1
"""UI refresh period while streaming: at most 10 updates a second."""
SAVE_INTERVAL_S = 0.5
"""How often a streaming reply's text is committed: a kill -9 loses at most this much."""


def empty_hint(keymap: Mapping[str, str]) -> str:
    """The first-screen hint, naming the keys as the user's keymap has them."""
    keys = {row[3]: key_label(row[1]) for row in effective_keys(keymap)}
    return (
        "Ask anything.\n\n"
        f"{keys['send']} sends · {keys['newline']} new line\n"
        f"{keys['stop']} stops a reply · {keys['regenerate']} regenerates\n"
        f"{keys['command_palette']} commands · {keys['help']} keys · {keys['settings']} settings"
    )


@dataclass
class ActiveReply:
    conversation_id: str
    view: AssistantMessage
    buffer: ReplyBuffer = field(default_factory=ReplyBuffer)
    cancel: threading.Event = field(default_factory=threading.Event)
    metrics: Metrics | None = None
    rates: list[float] = field(default_factory=list)
    saved_at: float = field(default_factory=time.monotonic)
    saved_len: int = 0


class ChatScreen(Screen[None]):
    BINDINGS = bindings(
        "stop",
        "regenerate",
        "edit_last",
        "copy_code",
        "new_chat",
        "rename_chat",
        "delete_chat",
        "search",
        "toggle_sidebar",
        "toggle_metrics",
        "settings",
        "export",
    )
    COMMANDS = {ChatCommands}  # noqa: RUF012 (Textual's class-level declaration)

    def __init__(self) -> None:
        super().__init__()
        self.conversation: Conversation | None = None
        self._new_chat_settings: ConversationSettings | None = None
        self._reply: ActiveReply | None = None
        self._editing_id: int | None = None
        self._loading_spec: EngineSpec | None = None
        self._load_abort = threading.Event()
        self._drain_lock = asyncio.Lock()
        self._drain_timer: Timer | None = None

    @property
    def generating(self) -> bool:
        return self._reply is not None

    @property
    def npuchat(self) -> NpuchatApp:
        return cast("NpuchatApp", self.app)

    # ---- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                with MessageList(id="messages"):
                    hint = empty_hint(self.npuchat.settings.keymap)
                    yield Static(hint, id="empty", markup=False)
                with Horizontal(id="switching"):
                    yield Label("", id="switch-stage", markup=False)
                    yield ProgressBar(total=1.0, show_eta=False, id="switch-bar")
                yield Composer(id="composer")
            yield MetricsPanel(id="metrics")
        yield Footer()

    async def on_mount(self) -> None:
        app = self.npuchat
        self.query_one("#switching").display = False
        self.query_one("#metrics").display = app.settings.show_metrics
        composer = self.query_one(Composer)
        composer.cursor_blink = app.settings.cursor_blink
        composer.border_title = "Message"
        self._show_engine()
        self.query_one(MetricsPanel).show(None, [], "no reply yet")
        await self._refresh_sidebar()
        composer.focus()

    def _show_engine(self) -> None:
        engine = self.npuchat.engine
        if engine is not None:
            self.query_one(MetricsPanel).set_engine(
                engine.model_name, engine.draft_name, engine.device
            )

    @property
    def _settings(self) -> ConversationSettings:
        if self.conversation is not None:
            return self.conversation.settings
        return self._new_chat_settings or self.npuchat.default_conversation_settings()

    def _spec_for(self, settings: ConversationSettings) -> EngineSpec:
        app_settings = self.npuchat.settings
        return EngineSpec(
            model=settings.model or app_settings.model,
            draft=settings.draft or app_settings.draft,
            device=app_settings.device,
        )

    async def _refresh_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        conversations = self.npuchat.store.search(sidebar.search_text)
        current = self.conversation.id if self.conversation else None
        await sidebar.show(conversations, current, self.npuchat.now())
        title = self.conversation.title if self.conversation else ""
        self.query_one(MessageList).border_title = title or "New chat"

    def _update_empty_hint(self) -> None:
        has_messages = bool(self.query_one(MessageList).query(MessageView))
        self.query_one("#empty").display = not has_messages

    def _busy(self, what: str) -> bool:
        """True (and tell the user) when a reply or a model load is in progress."""
        if self._reply is not None:
            self.notify(f"A reply is being generated; press Esc to stop it before you {what}.")
            return True
        if self._loading_spec is not None:
            self.notify(f"A model is loading; wait for it before you {what}.")
            return True
        return False

    # ---- sending and replies ---------------------------------------------------------------

    @on(Composer.Submitted)
    async def _submitted(self, event: Composer.Submitted) -> None:
        if self._busy("send another message"):
            return
        store = self.npuchat.store
        try:
            if self.conversation is None:
                self.conversation = store.create_conversation(settings=self._settings)
                self._new_chat_settings = None
            conv_id = self.conversation.id
            if await self._pick_up_other_writes() and self._editing_id is not None:
                self._end_edit()
                self.notify("Another process added turns here; your text is kept, send again.")
                return
            if self._editing_id is not None:
                await self._truncate_from(self._editing_id)
                self._end_edit()
            message = store.add_message(conv_id, "user", event.text)
            self.conversation = store.get_conversation(conv_id)
        except NpuchatError as exc:  # a locked or damaged database: the text stays typed
            self.notify(str(exc), title="Not sent", severity="error", timeout=12)
            return
        composer = self.query_one(Composer)
        composer.clear()
        await self._mount_views([UserMessage(message.id, message.content)])
        await self._refresh_sidebar()
        await self._start_reply()

    async def _start_reply(self) -> None:
        assert self.conversation is not None
        spec = self._spec_for(self.conversation.settings)
        engine = self.npuchat.engine
        if engine is None or spec != self.npuchat.engine_spec:
            self._switch_engine(spec)
            return
        store = self.npuchat.store
        conv = self.conversation
        try:
            request = build_request(conv.id, conv.settings, store.messages(conv.id))
            row = store.add_message(conv.id, "assistant", "", status="partial")
        except NpuchatError as exc:
            self.notify(str(exc), title="Cannot reply", severity="error", timeout=12)
            return
        view = AssistantMessage(row.id, status="partial")
        await self._mount_views([view])
        view.set_generating()
        reply = ActiveReply(conv.id, view)
        self._reply = reply
        self.query_one(MetricsPanel).show(None, [], "waiting for the first token…")
        self._drain_timer = self.set_interval(DRAIN_INTERVAL_S, self._drain)
        self._generate(engine, request, reply.cancel, reply.buffer)

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate(
        self,
        engine: ChatEngine,
        request: ChatRequest,
        cancel: threading.Event,
        buffer: ReplyBuffer,
    ) -> None:
        run_generation(engine, request, cancel, buffer)
        self.post_message(GenerationEnded())

    async def on_generation_ended(self, message: GenerationEnded) -> None:
        message.stop()
        await self._drain()

    async def _drain(self) -> None:
        """Move what the worker produced into the UI (called at ≤ 10 Hz and at the end)."""
        async with self._drain_lock:
            reply = self._reply
            if reply is None:
                return
            drained = reply.buffer.drain()
            for notice in drained.notices:
                await self._show_notice(notice, before=reply.view)
            if drained.text:
                await reply.view.append(drained.text)
            if drained.metrics is not None:
                reply.metrics = drained.metrics
            if drained.rates:
                reply.rates = thin(reply.rates + drained.rates)
            if drained.metrics is not None or drained.rates:
                state = "stopping…" if reply.cancel.is_set() else "live"
                self.query_one(MetricsPanel).show(reply.metrics, reply.rates, state)
            if drained.terminal is not None:
                await self._finish(reply, drained.terminal)
            elif (
                time.monotonic() - reply.saved_at >= SAVE_INTERVAL_S
                and len(reply.view.content) != reply.saved_len
            ):
                self._save_partial(reply, "partial")

    def _save_partial(
        self, reply: ActiveReply, status: MessageStatus, deadline_s: float | None = 0.0
    ) -> None:
        """Commit the text on screen; a locked file is retried at the next tick."""
        assert reply.view.message_id is not None
        reply.saved_at = time.monotonic()
        try:
            self.npuchat.store.update_message(
                reply.view.message_id,
                content=reply.view.content,
                status=status,
                metrics=reply.metrics,
                deadline_s=deadline_s,
            )
        except NpuchatError as exc:
            if not isinstance(exc, DatabaseBusyError):
                self.notify(str(exc), title="Reply not saved", severity="error", timeout=12)
            return
        reply.saved_len = len(reply.view.content)

    async def _finish(self, reply: ActiveReply, terminal: TerminalEvent) -> None:
        if self._drain_timer is not None:
            self._drain_timer.stop()
            self._drain_timer = None
        status: MessageStatus
        error = ""
        if isinstance(terminal, Finished):
            status, reply.metrics = "complete", terminal.metrics
        elif isinstance(terminal, Cancelled):
            status, reply.metrics = "stopped", terminal.metrics
        else:
            status, error = "error", terminal.message
            self.notify(terminal.message, title="Engine error", severity="error", timeout=8)
        await reply.view.finish(status, reply.metrics, error)
        assert reply.view.message_id is not None
        try:
            self.npuchat.store.update_message(
                reply.view.message_id,
                content=reply.view.content,
                status=status,
                metrics=reply.metrics,
                error=error,
            )
        except NpuchatError as exc:
            self.notify(str(exc), title="Reply not saved", severity="error", timeout=12)
        self._reply = None
        state = {"complete": "last reply", "stopped": "last reply (stopped)"}.get(
            status, "last reply (failed)"
        )
        self.query_one(MetricsPanel).show(reply.metrics, reply.rates, state)
        if self.conversation is not None and self.conversation.id == reply.conversation_id:
            self.conversation = self.npuchat.store.get_conversation(reply.conversation_id)
        await self._refresh_sidebar()

    async def _show_notice(self, notice: Notice, before: MessageView | None = None) -> None:
        view = NoticeView(notice.text, notice.level)
        await self.query_one(MessageList).mount(view, before=before)
        if notice.level != "info":
            severity: Literal["error", "warning"] = (
                "error" if notice.level == "error" else "warning"
            )
            self.notify(notice.text, severity=severity)

    async def _mount_views(self, views: list[MessageView]) -> None:
        messages = self.query_one(MessageList)
        await messages.mount_all(views)
        self._update_empty_hint()
        messages.scroll_end(animate=False)

    # ---- model switching -------------------------------------------------------------------

    def _switch_engine(self, spec: EngineSpec) -> None:
        """Load another model for this conversation, with progress above the composer."""
        self._loading_spec = spec
        self.query_one("#switching").display = True
        self.query_one("#switch-stage", Label).update(f"Loading {spec.model}…")
        self._load(spec)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, spec: EngineSpec) -> None:
        load_engine(self.npuchat.loader, spec, self.post_message, self._load_abort)

    def on_load_progress(self, message: LoadProgress) -> None:
        message.stop()
        self.query_one("#switch-stage", Label).update(message.stage)
        self.query_one("#switch-bar", ProgressBar).update(progress=message.fraction)

    async def on_engine_loaded(self, message: EngineLoaded) -> None:
        message.stop()
        self._loading_spec = None
        self.query_one("#switching").display = False
        self.npuchat.set_engine(message.spec, message.engine)
        self._show_engine()
        if self.conversation is not None and self._reply is None:
            await self._start_reply()

    def on_engine_load_failed(self, message: EngineLoadFailed) -> None:
        message.stop()
        self._loading_spec = None
        self.query_one("#switching").display = False
        self.notify(
            f"{message.message} (fix it in settings, then regenerate)",
            title=f"Could not load {message.spec.model}",
            severity="error",
            timeout=10,
        )

    # ---- actions ---------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self._reply is not None:
            self._reply.cancel.set()
            self.query_one(MetricsPanel).query_one("#m-state", Label).update("stopping…")
        elif self._editing_id is not None:
            self._end_edit()
            self.query_one(Composer).clear()

    async def action_regenerate(self) -> None:
        if self.conversation is None or self._busy("regenerate"):
            return
        if await self._pick_up_other_writes():
            self.notify(
                "Another process changed this conversation; it is shown as saved now."
                " Regenerate again to replace its last reply."
            )
            return
        history = self.npuchat.store.messages(self.conversation.id)
        last_user = max((m.id for m in history if m.role == "user"), default=None)
        if last_user is None:
            self.notify("Nothing to regenerate yet.")
            return
        later = [m.id for m in history if m.id > last_user]
        if later:
            await self._truncate_from(later[0])
        await self._start_reply()

    def action_edit_last(self) -> None:
        views = list(self.query(UserMessage))
        if views:
            self._begin_edit(views[-1])
        else:
            self.notify("No message to edit yet.")

    @on(UserMessage.EditRequested)
    def _edit_requested(self, event: UserMessage.EditRequested) -> None:
        self._begin_edit(event.view)

    def _begin_edit(self, view: UserMessage) -> None:
        if self._busy("edit a message"):
            return
        for other in self.query(UserMessage):
            other.set_class(other is view, "-editing")
        self._editing_id = view.message_id
        composer = self.query_one(Composer)
        composer.text = view.content
        composer.move_cursor(composer.document.end)
        composer.border_title = "Editing · Enter sends and continues from here · Esc cancels"
        composer.add_class("-editing")
        composer.focus()

    def _end_edit(self) -> None:
        self._editing_id = None
        for view in self.query(UserMessage):
            view.remove_class("-editing")
        composer = self.query_one(Composer)
        composer.border_title = "Message"
        composer.remove_class("-editing")

    async def _truncate_from(self, message_id: int) -> None:
        """Drop a message and everything after it, in the store and on screen."""
        assert self.conversation is not None
        self.npuchat.store.truncate_from(self.conversation.id, message_id)
        messages = self.query_one(MessageList)
        doomed = []
        seen_doomed = False
        for child in messages.children:
            if isinstance(child, MessageView) and child.message_id is not None:
                seen_doomed = seen_doomed or child.message_id >= message_id
            if seen_doomed and child.id != "empty":
                doomed.append(child)
        if doomed:
            await messages.remove_children(doomed)
        self._update_empty_hint()

    def action_copy_code(self) -> None:
        reply = self.query_one(MessageList).focused_or_last_assistant()
        if reply is None:
            self.notify("No reply yet.")
            return
        reply.action_copy_code()

    async def action_new_chat(self) -> None:
        if self._busy("start a new chat"):
            return
        self._end_edit()
        self.conversation = None
        self._new_chat_settings = None
        await self._show_conversation([])
        self.query_one(MetricsPanel).show(None, [], "no reply yet")
        await self._refresh_sidebar()
        self.query_one(Composer).focus()

    async def open_conversation(self, conversation_id: str) -> None:
        if self._busy("switch conversations"):
            return
        self._end_edit()
        store = self.npuchat.store
        try:
            conversation = store.get_conversation(conversation_id)
            history = store.messages(conversation_id)
        except NpuchatError as exc:  # damaged, locked or deleted by another process
            self.notify(str(exc), title="Cannot open the chat", severity="error", timeout=12)
            return
        self.conversation = conversation
        await self._show_conversation(history)
        last = next((m for m in reversed(history) if m.metrics is not None), None)
        panel = self.query_one(MetricsPanel)
        panel.show(last.metrics if last else None, [], "last reply" if last else "no reply yet")
        await self._refresh_sidebar()
        self.query_one(Composer).focus()

    async def _pick_up_other_writes(self) -> bool:
        """Show the conversation as stored if another process (`npuchat run --conversation`)
        changed it since it was shown; True if it had. Actions that delete or continue from
        "the last reply" must act on what the user sees, never on turns they have not seen."""
        if self.conversation is None:
            return False
        history = self.npuchat.store.messages(self.conversation.id)
        stored = [m.id for m in history if m.role in ("user", "assistant")]
        shown = [v.message_id for v in self.query_one(MessageList).query(MessageView)]
        if stored == shown:
            return False
        await self._show_conversation(history)
        return True

    async def _show_conversation(self, history: list[StoredMessage]) -> None:
        messages = self.query_one(MessageList)
        await messages.remove_children([c for c in messages.children if c.id != "empty"])
        views: list[MessageView] = []
        for m in history:
            if m.role == "user":
                views.append(UserMessage(m.id, m.content))
            elif m.role == "assistant":
                views.append(AssistantMessage(m.id, m.content, m.status, m.metrics, m.error))
        await self._mount_views(views)

    @on(Sidebar.Selected)
    async def _sidebar_selected(self, event: Sidebar.Selected) -> None:
        await self.open_conversation(event.conversation.id)

    @on(Sidebar.SearchChanged)
    async def _search_changed(self, event: Sidebar.SearchChanged) -> None:
        await self._refresh_sidebar()

    def action_search(self) -> None:
        self.query_one(Sidebar).display = True
        self.query_one("#search", Input).focus()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        sidebar.display = not sidebar.display

    def action_toggle_metrics(self) -> None:
        panel = self.query_one(MetricsPanel)
        panel.display = not panel.display
        self.npuchat.persist_setting("show_metrics", bool(panel.display))

    def action_rename_chat(self) -> None:
        conv = self.conversation
        if conv is None:
            self.notify("Send a message first; a new chat has nothing to rename.")
            return

        async def done(title: str | None) -> None:
            if title:
                self.npuchat.store.rename(conv.id, title)
                self.conversation = self.npuchat.store.get_conversation(conv.id)
                await self._refresh_sidebar()

        self.app.push_screen(PromptScreen("Rename chat", conv.title), done)

    @on(ConversationList.DeleteRequested)
    def _delete_requested(self, event: ConversationList.DeleteRequested) -> None:
        self._confirm_delete(event.conversation)

    def action_delete_chat(self) -> None:
        if self.conversation is None:
            self.notify("This chat is not saved yet; nothing to delete.")
            return
        self._confirm_delete(self.conversation)

    def _confirm_delete(self, conv: Conversation) -> None:
        if self._reply is not None and self._reply.conversation_id == conv.id:
            self.notify("Stop the reply (Esc) before deleting this chat.")
            return

        async def done(confirmed: bool | None) -> None:
            if not confirmed:
                return
            self.npuchat.store.delete_conversation(conv.id)
            if self.conversation is not None and self.conversation.id == conv.id:
                await self.action_new_chat()
            else:
                await self._refresh_sidebar()
            self.notify(f"Deleted “{conv.title or 'New chat'}”", timeout=3)

        question = f"Delete “{conv.title or 'New chat'}” and all its messages?"
        self.app.push_screen(ConfirmScreen(question), done)

    def action_settings(self) -> None:
        conv = self.conversation
        title = conv.title if conv and conv.title else "new chat"

        def done(settings: ConversationSettings | None) -> None:
            if settings is None:
                return
            if self.conversation is not None:
                self.npuchat.store.update_settings(self.conversation.id, settings)
                self.conversation = self.npuchat.store.get_conversation(self.conversation.id)
            else:
                self._new_chat_settings = settings
            self.notify("Settings saved; they apply from the next reply.", timeout=3)

        app_settings = self.npuchat.settings
        defaults = {
            "model": f"empty: {app_settings.model}",
            "draft": f"empty: {app_settings.draft or 'none'} · none · lookup · default · a name",
        }
        self.app.push_screen(SettingsScreen(self._settings, title, defaults), done)

    def action_export(self, fmt: str = "markdown") -> None:
        conv = self.conversation
        if conv is None:
            self.notify("Nothing to export yet.")
            return
        suffix = ".json" if fmt == "json" else ".md"
        default = Path.cwd() / (_slug(conv.title or "chat") + suffix)

        def done(path_text: str | None) -> None:
            if not path_text:
                return
            try:
                path = self.npuchat.store.export(conv.id, Path(path_text))
            except NpuchatError as exc:
                self.notify(str(exc), title="Export failed", severity="error")
                return
            self.notify(f"Exported to {path}", title="Export", timeout=6)

        hint = "A .json path writes JSON; any other path writes Markdown."
        self.app.push_screen(PromptScreen("Export conversation to", str(default), hint), done)

    def on_unmount(self) -> None:
        """Quitting mid-reply: stop the engine and keep what was generated."""
        self._load_abort.set()
        reply = self._reply
        if reply is not None:
            reply.cancel.set()
            reply.view.content += reply.buffer.drain().text
            self._save_partial(reply, "stopped", deadline_s=None)


def _slug(title: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
    return slug[:48] or "chat"
