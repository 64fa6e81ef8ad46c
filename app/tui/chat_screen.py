"""The chat screen: sidebar, message list, composer and metrics panel.

The screen lays out and shows; replies in flight belong to the `ReplyController` (they keep
streaming into their own conversation while another one is shown), whole-conversation dialogs
to `ConversationActions`. What the widgets show follows reactive state: the conversation on
screen, the conversations generating, and which panels are visible at this width.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Static

from npuchat.app.engine_port import EngineSpec
from npuchat.app.store import Conversation, ConversationSettings, StoredMessage
from npuchat.app.tui.commands import ChatCommands
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.conversation_actions import ConversationActions
from npuchat.app.tui.display_text import for_terminal
from npuchat.app.tui.footer import ChatFooter
from npuchat.app.tui.generation import build_request
from npuchat.app.tui.help_screen import empty_hint
from npuchat.app.tui.keys import bindings
from npuchat.app.tui.message_list import (
    AssistantMessage,
    MessageList,
    MessageView,
    UserMessage,
)
from npuchat.app.tui.messages import (
    EngineLoaded,
    EngineLoadFailed,
)
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.model_picker import ModelCommands
from npuchat.app.tui.reply_screen import ReplyScreen
from npuchat.app.tui.sidebar import ConversationList, Sidebar
from npuchat.app.tui.switch_bar import ModelSwitchBar
from npuchat.engine.errors import NpuchatError

if TYPE_CHECKING:
    pass


class ChatScreen(ReplyScreen):
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
        self.new_chat_settings: ConversationSettings | None = None
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
        self._show_engine()
        self.query_one(MetricsPanel).show(None, [], "no reply yet")
        self._apply_layout(self.app.size.width)
        last = app.store.list_conversations()
        if last:
            await self.open_conversation(last[0].id)
        else:
            self.watch_conversation(None)
            await self.refresh_sidebar()
        composer.focus()

    def watch_conversation(self, conversation: Conversation | None) -> None:
        title = conversation.title if conversation else ""
        self.query_one(MessageList).border_title = for_terminal(title) or "New chat"
        self.refresh_bindings()  # Stop, Regenerate and Continue depend on the conversation

    def _show_engine(self) -> None:
        engine = self.npuchat.engine
        if engine is not None:
            self.query_one(MetricsPanel).set_engine(
                engine.model_name, engine.draft_name, engine.device
            )

    @property
    def current_settings(self) -> ConversationSettings:
        if self.conversation is not None:
            return self.conversation.settings
        return self.new_chat_settings or self.npuchat.default_conversation_settings()

    def _spec_for(self, settings: ConversationSettings) -> EngineSpec:
        app_settings = self.npuchat.settings
        return EngineSpec(
            model=settings.model or app_settings.model,
            draft=settings.draft or app_settings.draft,
            device=app_settings.device,
        )

    def _busy_here(self, what: str) -> bool:
        """True (and tell the user) when this conversation's reply or a model load is running."""
        if self.replies.get(self.conversation_id) is not None:
            self.notify(f"A reply is being generated here; press Esc to stop it before you {what}.")
            return True
        return self._loading(what)

    def _loading(self, what: str) -> bool:
        if self.query_one(ModelSwitchBar).loading_spec is not None:
            self.notify(f"A model is loading; wait for it before you {what}.")
            return True
        return False

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

    async def _mount_views(self, views: list[MessageView]) -> None:
        messages = self.query_one(MessageList)
        await messages.mount_all(views)
        messages.update_empty_hint()
        messages.scroll_end(animate=False)

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
        if self._busy_here("edit a message"):
            return
        for other in self.query(UserMessage):
            other.set_class(other is view, "-editing")
        views = list(self.query(MessageView))
        later = len(views) - 1 - views.index(view)
        assert view.message_id is not None
        self.query_one(Composer).begin_edit(view.message_id, view.content, later)
        self.refresh_bindings()

    @property
    def _editing(self) -> int | None:
        return self.query_one(Composer).editing

    def _end_edit(self) -> None:
        for view in self.query(UserMessage):
            view.remove_class("-editing")
        self.query_one(Composer).editing = None
        self.refresh_bindings()

    async def _truncate_from(self, message_id: int) -> None:
        """Drop a message and everything after it, in the store and on screen."""
        assert self.conversation is not None
        self.npuchat.store.truncate_from(self.conversation.id, message_id)
        await self.query_one(MessageList).remove_from(message_id)

    def action_copy_code(self) -> None:
        reply = self.query_one(MessageList).focused_or_last_assistant()
        if reply is None:
            self.notify("No reply yet.")
            return
        reply.action_copy_code()

    async def action_new_chat(self) -> None:
        if self._loading("start a new chat"):
            return
        self._end_edit()
        self.conversation = None
        self.new_chat_settings = None
        await self._show_conversation([])
        self.query_one(MetricsPanel).show(None, [], "no reply yet")
        await self.refresh_sidebar()
        self.focus_composer()

    async def open_conversation(self, conversation_id: str) -> None:
        if self._loading("switch conversations"):
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
        panel = self.query_one(MetricsPanel)
        active = self.replies.get(conversation_id)
        if active is not None:
            panel.show(active.metrics, active.rates, "live")
        else:
            last = next((m for m in reversed(history) if m.metrics is not None), None)
            state = "last reply" if last else "no reply yet"
            panel.show(last.metrics if last else None, [], state)
        await self.refresh_sidebar()
        self.focus_composer()

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
        """Replace the message views; a reply still streaming here gets a view again."""
        self.replies.detach_all()
        active = self.replies.get(self.conversation_id)
        streaming = (active.message_id, active.content) if active is not None else None
        max_tokens = self.current_settings.max_tokens
        view = await self.query_one(MessageList).show_history(history, max_tokens, streaming)
        if active is not None and view is not None:
            self.replies.attach(active.conversation_id, view)

    @on(Sidebar.Selected)
    async def _sidebar_selected(self, event: Sidebar.Selected) -> None:
        await self.open_conversation(event.conversation.id)

    @on(Sidebar.SearchChanged)
    async def _search_changed(self, event: Sidebar.SearchChanged) -> None:
        await self.refresh_sidebar()

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
