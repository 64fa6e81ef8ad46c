"""The conversation on screen: opening one, starting a new chat, editing one of its messages.

Kept apart from the chat screen, which lays out, sends and switches models: this layer keeps
what the message list shows equal to what the store holds (a reply streaming here gets its view
back, turns another process wrote are picked up before an action acts on "the last reply"), and
the edit of an earlier message follows the composer's reactive `editing` state, so whatever
starts or ends an edit, the highlighted message and the footer's keys follow it.
"""

from __future__ import annotations

from textual import on

from npuchat.app.store_records import ConversationSettings, StoredMessage
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.message_list import MessageList, MessageView, UserMessage
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.reply_screen import ReplyScreen
from npuchat.app.tui.sidebar import Sidebar
from npuchat.app.tui.switch_bar import ModelSwitchBar
from npuchat.engine.errors import NpuchatError


class ConversationScreen(ReplyScreen):
    def __init__(self) -> None:
        super().__init__()
        self._new_chat_settings: ConversationSettings | None = None

    @property
    def new_chat_settings(self) -> ConversationSettings | None:
        """Settings chosen before the new chat's first message (it has no row to hold them)."""
        return self._new_chat_settings

    @new_chat_settings.setter
    def new_chat_settings(self, settings: ConversationSettings | None) -> None:
        self._new_chat_settings = settings
        self.show_reply_format()

    def show_reply_format(self) -> None:
        """Say on the composer when this chat's replies are held to JSON (its settings): a
        reply that will not be prose should not come as a surprise."""
        if self.is_mounted:
            json_mode = self.current_settings.reply_format == "json"
            self.query_one(Composer).border_subtitle = "replies in JSON" if json_mode else ""

    def follow_edits(self) -> None:
        """Show the composer's `editing` state on the message views (call once mounted)."""
        self.watch(self.query_one(Composer), "editing", self._show_editing, init=False)

    @property
    def current_settings(self) -> ConversationSettings:
        if self.conversation is not None:
            return self.conversation.settings
        return self.new_chat_settings or self.npuchat.default_conversation_settings()

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

    # ---- which conversation ----------------------------------------------------------------

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

    @on(Sidebar.Selected)
    async def _sidebar_selected(self, event: Sidebar.Selected) -> None:
        await self.open_conversation(event.conversation.id)

    @on(Sidebar.SearchChanged)
    @on(Sidebar.PageChanged)
    async def _search_changed(self, event: Sidebar.SearchChanged | Sidebar.PageChanged) -> None:
        await self.refresh_sidebar()

    # ---- what the message list shows -------------------------------------------------------

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
        view = await self.query_one(MessageList).show_history(history, streaming)
        if active is not None and view is not None:
            self.replies.attach(active.conversation_id, view)

    async def _mount_views(self, views: list[MessageView]) -> None:
        messages = self.query_one(MessageList)
        await messages.mount_all(views)
        messages.update_empty_hint()
        messages.scroll_end(animate=False)

    async def _truncate_from(self, message_id: int) -> None:
        """Drop a message and everything after it, in the store and on screen."""
        assert self.conversation is not None
        self.npuchat.store.truncate_from(self.conversation.id, message_id)
        await self.query_one(MessageList).remove_from(message_id)

    # ---- editing an earlier message --------------------------------------------------------

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
        views = list(self.query(MessageView))
        later = len(views) - 1 - views.index(view)
        assert view.message_id is not None
        self.query_one(Composer).begin_edit(view.message_id, view.content, later)

    @property
    def _editing(self) -> int | None:
        return self.query_one(Composer).editing

    def _end_edit(self) -> None:
        self.query_one(Composer).editing = None

    def _show_editing(self, editing: int | None) -> None:
        for view in self.query(UserMessage):
            view.set_class(editing is not None and view.message_id == editing, "-editing")
        self.refresh_bindings()  # Esc cancels an edit
