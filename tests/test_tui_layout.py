"""Pilot tests of the layout by terminal width: panels beside the chat when they fit, over it
on demand when they do not, and the footer's keys never cut off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine, StepClock, make_app, run_chat, send, wait_until
from textual.pilot import Pilot
from textual.widgets import ListView

from npuchat.app.store import ConversationStore
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.footer import ChatFooter
from npuchat.app.tui.message_list import MessageList, UserMessage
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.sidebar import Sidebar


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ConversationStore]:
    s = ConversationStore.open(tmp_path / "data" / "conversations.sqlite3", clock=StepClock())
    yield s
    s.close()


def footer_text(screen: ChatScreen) -> str:
    return " ".join(str(key.render()) for key in screen.query_one(ChatFooter).children)


def test_small_terminal_opens_panels_over_the_chat(store: ConversationStore) -> None:
    for title in ("Older chat", "Newer chat"):
        conv = store.create_conversation()
        store.add_message(conv.id, "user", title)
        store.add_message(conv.id, "assistant", "Answer.")

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        sidebar, panel = screen.query_one(Sidebar), screen.query_one(MetricsPanel)
        chat = screen.query_one(MessageList)
        assert not sidebar.display and not panel.display
        assert chat.size.width >= 56  # the chat keeps (nearly) the whole width
        assert screen.query_one(Composer).has_focus
        assert screen.conversation is not None and screen.conversation.title == "Newer chat"
        assert "Chats" in footer_text(screen) and "Settings" not in footer_text(screen)
        await pilot.press("ctrl+b")
        assert sidebar.display and screen.query_one("#conversations", ListView).has_focus
        assert chat.size.width >= 56  # over the chat, not beside it
        await pilot.press("down", "enter")
        await wait_until(
            pilot,
            lambda: [v.content for v in screen.query(UserMessage)] == ["Older chat"],
            "the chosen conversation",
        )
        assert not sidebar.display and screen.query_one(Composer).has_focus
        await pilot.press("f3")
        assert panel.display
        await pilot.press("escape")  # closes what opened over the chat
        assert not panel.display
        await send(pilot, "Still usable at 60x20")
        await wait_until(pilot, lambda: not screen.generating, "the reply")
        assert len(screen.query(UserMessage)) == 2

    run_chat(make_app(ScriptedEngine(), store), scenario, size=(60, 20))


def test_wide_terminal_shows_everything(store: ConversationStore) -> None:
    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        assert screen.query_one(Sidebar).display and screen.query_one(MetricsPanel).display
        assert "Settings" in footer_text(screen)
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: not screen.query_one(MetricsPanel).display, "collapse")
        assert screen.query_one(Sidebar).display

    run_chat(make_app(ScriptedEngine(), store), scenario, size=(140, 40))
