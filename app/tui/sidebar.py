"""The conversation sidebar: a search box over a list of conversations.

It only displays what it is given and reports what the user did (messages); the chat screen
owns the store and decides what to list. The list shows one page of the most recent matches
(`Sidebar.limit`) and an "older chats" row that shows the next page: every row is a few
widgets, rebuilt on each refresh, so a store with thousands of conversations must not put
thousands of rows on screen (search reaches every conversation).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Input, Label, ListItem, ListView

from npuchat.app.store_records import Conversation
from npuchat.app.tui.display_text import for_terminal
from npuchat.app.tui.formatting import when
from npuchat.app.tui.keys import bindings


class ConversationItem(ListItem):
    """Two lines: the title across the whole width, then when it was last used, or that a
    reply is being generated in it."""

    generating: reactive[bool] = reactive(False, init=False)

    def __init__(self, conversation: Conversation, now: datetime) -> None:
        self._when = when(conversation.updated_at, now)
        super().__init__(
            Label(for_terminal(conversation.title or "New chat"), classes="title", markup=False),
            Label(self._when, classes="when", markup=False),
        )
        self.conversation = conversation

    def watch_generating(self, generating: bool) -> None:
        self.set_class(generating, "-generating")
        text = "● generating…" if generating else self._when
        self.query_one(".when", Label).update(text)


class OlderItem(ListItem):
    """The last row when more conversations match than the page shows."""

    def __init__(self) -> None:
        super().__init__(Label("Older chats…", classes="title", markup=False), classes="-older")


class ConversationList(ListView):
    BINDINGS = bindings("list_delete")

    class DeleteRequested(Message):
        def __init__(self, conversation: Conversation) -> None:
            super().__init__()
            self.conversation = conversation

    def on_focus(self) -> None:
        # Entering the list highlights something, so Enter always opens a conversation.
        if self.index is None and self.children:
            self.index = 0

    def action_delete(self) -> None:
        item = self.highlighted_child
        if isinstance(item, ConversationItem):
            self.post_message(self.DeleteRequested(item.conversation))


class Sidebar(Vertical):
    PAGE = 50
    """Conversations per page of the list."""

    generating: reactive[frozenset[str]] = reactive(frozenset(), init=False)
    """Ids of the conversations that have a reply in flight (marked in the list)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.limit = self.PAGE
        """How many conversations the list shows now (grows a page per "older chats")."""

    class Selected(Message):
        def __init__(self, conversation: Conversation) -> None:
            super().__init__()
            self.conversation = conversation

    class PageChanged(Message):
        """The user asked for the next page of conversations."""

    class SearchChanged(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def compose(self) -> ComposeResult:
        yield Input(placeholder="Search chats", id="search")
        yield ConversationList(id="conversations")

    @property
    def search_text(self) -> str:
        return self.query_one("#search", Input).value

    async def show(
        self,
        conversations: Sequence[Conversation],
        selected_id: str | None,
        now: datetime,
        more: bool = False,
    ) -> None:
        """Replace the list; keep the current conversation highlighted without re-selecting.
        `more`: further conversations match (the list ends with a row that shows them)."""
        view = self.query_one(ConversationList)
        paging = isinstance(view.highlighted_child, OlderItem)
        with self.prevent(ListView.Highlighted, ListView.Selected):
            await view.clear()
            rows: list[ListItem] = [ConversationItem(c, now) for c in conversations]
            if more:
                rows.append(OlderItem())
            await view.extend(rows)
            if paging:  # keep reading down: the first row of the new page
                index: int | None = min(len(rows) - 1, self.limit - self.PAGE)
            else:
                index = next((i for i, c in enumerate(conversations) if c.id == selected_id), None)
            view.index = index
        self.watch_generating(self.generating)

    def watch_generating(self, generating: frozenset[str]) -> None:
        for item in self.query(ConversationItem):
            item.generating = item.conversation.id in generating

    @on(Input.Changed, "#search")
    def _search_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.limit = self.PAGE
        self.post_message(self.SearchChanged(event.value))

    @on(Input.Submitted, "#search")
    def _search_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(ConversationList).focus()

    @on(ListView.Selected, "#conversations")
    def _selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Selected(event.item.conversation))
        elif isinstance(event.item, OlderItem):
            self.limit += self.PAGE
            self.post_message(self.PageChanged())
