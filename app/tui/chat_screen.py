"""The chat screen: sidebar, message list, composer and metrics panel.

The screen lays out, sends, regenerates and switches models; replies in flight belong to the
`ReplyController` (they keep streaming into their own conversation while another one is shown),
which conversation is shown and the edit of an earlier message to `ConversationScreen`, and
whole-conversation dialogs to `ConversationActions`. What the widgets show follows reactive
state: the conversation on screen, the conversations generating, the message being edited, and
which panels are visible at this width.
"""

from __future__ import annotations

from dataclasses import replace

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Static

from npuchat.app.engine_port import EngineSpec
from npuchat.app.store_records import Conversation, ConversationSettings
from npuchat.app.tui.commands import ChatCommands
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.conversation_actions import ConversationActions
from npuchat.app.tui.conversation_screen import ConversationScreen
from npuchat.app.tui.display_text import for_terminal
from npuchat.app.tui.footer import ChatFooter
from npuchat.app.tui.generation import build_request
from npuchat.app.tui.help_screen import empty_hint
from npuchat.app.tui.keys import bindings
from npuchat.app.tui.message_list import (
    AssistantMessage,
    MessageList,
    UserMessage,
)
from npuchat.app.tui.messages import (
    EngineLoaded,
    EngineLoadFailed,
)
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.model_picker import ModelCommands
from npuchat.app.tui.sidebar import ConversationList, Sidebar
from npuchat.app.tui.switch_bar import ModelSwitchBar
from npuchat.engine.errors import NpuchatError


class ChatScreen(ConversationScreen):
    BINDINGS = bindings(
        "stop",
        "regenerate",
        "continue_reply",
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
    COMMANDS = {ChatCommands, ModelCommands}  # noqa: RUF012 (Textual's class-level declaration)

    def __init__(self) -> None:
        super().__init__()
        self.actions = ConversationActions(self)

    # ---- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                with MessageList(id="messages"):
                    hint = empty_hint(self.npuchat.settings.keymap)
                    yield Static(hint, id="empty", markup=False)
                yield ModelSwitchBar(id="switching")
                yield Composer(id="composer")
            yield MetricsPanel(id="metrics")
        yield ChatFooter()

    async def on_mount(self) -> None:
        app = self.npuchat
        composer = self.query_one(Composer)
        composer.cursor_blink = app.settings.cursor_blink
        composer.border_title = "Message"
        self.follow_edits()
        self._show_engine()
        self.query_one(MetricsPanel).show(None, [], "no reply yet")
        self._apply_layout(self.app.size.width)
        last = app.store.list_conversations(limit=1)
        if last:
            await self.open_conversation(last[0].id)
        else:
            self.watch_conversation(None)
            await self.refresh_sidebar()
        composer.focus()

    def watch_conversation(self, conversation: Conversation | None) -> None:
        title = conversation.title if conversation else ""
        self.query_one(MessageList).border_title = for_terminal(title) or "New chat"
        self.show_reply_format()
        self.refresh_bindings()  # Stop, Regenerate and Continue depend on the conversation

    def _show_engine(self) -> None:
        engine = self.npuchat.engine
        if engine is not None:
            self.query_one(MetricsPanel).set_engine(
                engine.model_name, engine.draft_name, engine.device
            )

    def _spec_for(self, settings: ConversationSettings) -> EngineSpec:
        app_settings = self.npuchat.settings
        return EngineSpec(
            model=settings.model or app_settings.model,
            draft=settings.draft or app_settings.draft,
            device=app_settings.device,
        )

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Hide the keys that do nothing right now, so the footer stays short."""
        here = self.replies.get(self.conversation_id) is not None
        if action == "stop":
            searching = self.query_one("#search", Input).has_focus
            return here or searching or self._editing is not None or self.overlay_open()
        if action == "regenerate":
            return self.conversation is not None and not here
        if action == "continue_reply":
            last = self.query_one(MessageList).last_assistant()
            return not here and last is not None and last.limit > 0
        return True

    # ---- sending and replies ---------------------------------------------------------------

    @on(Composer.Submitted)
    async def _submitted(self, event: Composer.Submitted) -> None:
        if self._busy_here("send another message"):
            return
        store = self.npuchat.store
        try:
            if self.conversation is None:
                self.conversation = store.create_conversation(settings=self.current_settings)
                self.new_chat_settings = None
            conv_id = self.conversation.id
            if await self._pick_up_other_writes() and self._editing is not None:
                self._end_edit()
                self.notify("Another process added turns here; your text is kept, send again.")
                return
            if self._editing is not None:
                await self._truncate_from(self._editing)
                self._end_edit()
            message = store.add_message(conv_id, "user", event.text)
            self.conversation = store.get_conversation(conv_id)
        except NpuchatError as exc:  # a locked or damaged database: the text stays typed
            self.notify(str(exc), title="Not sent", severity="error", timeout=12)
            return
        self.query_one(Composer).clear()
        await self._mount_views([UserMessage(message.id, message.content)])
        await self.refresh_sidebar()
        await self._start_reply()

    async def _start_reply(self) -> None:
        conv = self.conversation
        assert conv is not None
        spec = self._spec_for(conv.settings)
        engine = self.npuchat.engine
        if engine is None or spec != self.npuchat.engine_spec:
            self._switch_engine(spec)
            return
        await self.titles.cancel_all()
        store = self.npuchat.store
        try:
            request = build_request(conv.id, conv.settings, store.messages(conv.id))
            row = store.add_message(conv.id, "assistant", "", status="partial")
        except NpuchatError as exc:
            self.notify(str(exc), title="Cannot reply", severity="error", timeout=12)
            return
        view = AssistantMessage(row.id, status="partial")
        await self._mount_views([view])
        self.begin_reply(engine, request, row.id, view)

    # ---- model switching -------------------------------------------------------------------

    def _switch_engine(self, spec: EngineSpec) -> None:
        """Load another model for this conversation, with progress above the composer."""
        if self.replies:
            self.notify(
                f"This chat uses {spec.model}; switching models waits until the replies"
                " being generated end. Press Ctrl+R here then.",
                severity="warning",
            )
            return
        self.query_one(ModelSwitchBar).load(self.npuchat.loader, spec)

    async def on_engine_loaded(self, message: EngineLoaded) -> None:
        message.stop()
        self.npuchat.set_engine(message.spec, message.engine)
        self._show_engine()
        if self.conversation is not None and self.replies.get(self.conversation.id) is None:
            await self._start_reply()

    def on_engine_load_failed(self, message: EngineLoadFailed) -> None:
        message.stop()
        self.notify(
            f"{message.message} (fix it in settings, then regenerate)",
            title=f"Could not load {message.spec.model}",
            severity="error",
            timeout=10,
        )

    # ---- actions on the conversation on screen ---------------------------------------------

    def action_stop(self) -> None:
        """Esc: leave the search (cleared, so the list shows every chat again), else stop this
        chat's reply, else cancel an edit, else close a panel open over the chat."""
        search = self.query_one("#search", Input)
        if search.has_focus:
            search.value = ""
            self.close_overlays()
            self.focus_composer()
        elif self.replies.stop(self.conversation_id or ""):
            self.query_one(MetricsPanel).state = "stopping…"
        elif self._editing is not None:
            self._end_edit()
            self.query_one(Composer).clear()
        elif self.overlay_open():
            self.close_overlays()

    async def action_regenerate(self) -> None:
        if self.conversation is None or self._busy_here("regenerate"):
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

    async def action_continue_reply(self) -> None:
        """Extend the last reply where the token limit cut it: the same row, the same view,
        the engine reusing the cached KV of the conversation and of the reply so far."""
        conv, view = self.conversation, self.query_one(MessageList).last_assistant()
        if conv is None or view is None or view.limit == 0 or self._busy_here("continue"):
            return
        engine = self.npuchat.engine
        if engine is None or self._spec_for(conv.settings) != self.npuchat.engine_spec:
            self.notify("Load this chat's model first (Ctrl+R regenerates with it).")
            return
        await self.titles.cancel_all()
        store = self.npuchat.store
        request = build_request(conv.id, conv.settings, store.messages(conv.id))
        assert view.message_id is not None
        view.limit = 0
        self.begin_reply(
            engine, replace(request, continue_reply=True), view.message_id, view, view.content
        )

    def action_copy_code(self) -> None:
        reply = self.query_one(MessageList).focused_or_last_assistant()
        if reply is None:
            self.notify("No reply yet.")
            return
        reply.action_copy_code()

    def action_rename_chat(self) -> None:
        self.actions.rename()

    @on(ConversationList.DeleteRequested)
    def _delete_requested(self, event: ConversationList.DeleteRequested) -> None:
        self.actions.delete(event.conversation)

    def action_delete_chat(self) -> None:
        self.actions.delete()

    def action_settings(self) -> None:
        self.actions.settings()

    async def use_model(self, name: str) -> None:
        await self.actions.use_model(name)

    def action_export(self, fmt: str = "markdown") -> None:
        self.actions.export(fmt)
