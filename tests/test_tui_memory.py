"""Memory over a long session, on the app's side: what a new conversation leaves behind.

A user who starts a new chat every few minutes keeps the app open for days. Each new chat may
add its sidebar row, and nothing else may stay alive: the widgets of earlier conversations,
footers and dialogs are released once they leave the screen, and the sidebar shows one page of
rows however many conversations the store holds. The RSS figures are in
`benchmarks/session_memory.py`; these tests count the objects that grew.
"""

from __future__ import annotations

import gc

import pytest
from scripted_engine import ScriptedEngine, ScriptedReply, make_app, run_chat, send, wait_until
from textual.dom import DOMNode
from textual.pilot import Pilot
from textual.widgets import Input, ListView

from npuchat.app.store import ConversationStore
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.message_list import AssistantMessage
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.app.tui.sidebar import ConversationItem, OlderItem, Sidebar

REPLY = "A reply with **bold**, `code` and a list:\n\n- one\n- two\n\n```python\nx = 1\n```\n"


def live_nodes() -> int:
    """Widgets (and other DOM nodes) that Python still holds, mounted or not."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, DOMNode))


async def settled_nodes(pilot: Pilot[None]) -> int:
    """`live_nodes()` once the app has settled: its workers done (a background title may still
    be streaming after its chat's reply), then the fewest of the last eight counts, a pause
    apart, once the last three agree (the last messages of a reply mount and drop widgets for a
    moment; a node that stays alive stays in every count, so the fewest still has it). Under a
    loaded suite the old two-count rule once counted 15 such nodes, and the three-count rule
    counted 15 in one run of 13 on an idle machine."""
    await pilot.app.workers.wait_for_complete()
    seen: list[int] = []
    for _ in range(60):
        await pilot.pause(0.1)
        seen.append(live_nodes())
        if len(seen) >= 8 and len(set(seen[-3:])) == 1:
            break
    return min(seen[-8:])


async def new_conversation(pilot: Pilot[None], screen: ChatScreen, text: str) -> None:
    await pilot.press("ctrl+n")
    await wait_until(pilot, lambda: screen.conversation is None, "a new chat")
    await send(pilot, text)
    await wait_until(
        pilot,
        lambda: not screen.generating and len(screen.query(AssistantMessage)) == 1,
        f"the reply to {text!r}",
    )
    await pilot.pause()


def test_new_conversations_leave_only_their_sidebar_row_alive(store: ConversationStore) -> None:
    engine = ScriptedEngine(lambda request: ScriptedReply([REPLY]))
    counts: list[int] = []

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        for turn in range(6):
            await new_conversation(pilot, screen, f"Question {turn}")
            if turn in (1, 5):
                counts.append(await settled_nodes(pilot))
                rows = len(screen.query(ConversationItem))
                counts.append(rows)

    run_chat(make_app(engine, store), scenario)
    nodes_2, rows_2, nodes_6, rows_6 = counts
    assert (rows_2, rows_6) == (2, 6)
    row_widgets = 3  # a ConversationItem and its two labels
    grown = nodes_6 - nodes_2
    # Each chat used to keep ~55 nodes alive (the footer's keys from every focus change).
    assert grown <= (rows_6 - rows_2) * row_widgets + 6, f"{grown} nodes kept by 4 new chats"


def test_the_sidebar_shows_a_page_of_a_large_store_and_pages_on(
    store: ConversationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Sidebar, "PAGE", 10)  # the rule, at a size that keeps the test fast
    total = 2 * Sidebar.PAGE + 7
    for i in range(total):  # the store's clock ticks, so the last one is the most recent
        store.create_conversation(f"Chat {i}")

    def titles(screen: ChatScreen) -> list[str]:
        return [item.conversation.title for item in screen.query(ConversationItem)]

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await pilot.pause()
        newest = [f"Chat {i}" for i in range(total - 1, -1, -1)]
        assert titles(screen) == newest[: Sidebar.PAGE]
        assert len(screen.query(OlderItem)) == 1
        listing = screen.query_one("#conversations", ListView)
        listing.focus()
        await pilot.pause()
        listing.index = len(listing.children) - 1  # the "older chats" row, by keyboard
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(titles(screen)) > Sidebar.PAGE, "the next page")
        assert titles(screen) == newest[: 2 * Sidebar.PAGE]
        # The highlight moved to the first row of the new page, so reading goes on downwards.
        assert listing.index == Sidebar.PAGE
        listing.index = len(listing.children) - 1
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(titles(screen)) == total, "the last page")
        assert not screen.query(OlderItem)  # nothing older left
        # Search reaches every conversation, the oldest (beyond the first page) too.
        screen.query_one("#search", Input).value = "Chat 0"
        await wait_until(pilot, lambda: titles(screen) == ["Chat 0"], "the search result")

    run_chat(make_app(ScriptedEngine(), store), scenario)


def test_closed_dialogs_are_released(store: ConversationStore) -> None:
    """The settings dialog's system-prompt editor watches the app's theme; each dialog used to
    stay alive through that watcher after it closed."""
    counts: list[int] = []

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        for turn in range(6):
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen), "dialog")
            await pilot.press("escape")
            await wait_until(pilot, lambda: pilot.app.screen is screen, "the chat again")
            await pilot.pause()
            if turn in (1, 5):
                counts.append(await settled_nodes(pilot))

    run_chat(make_app(ScriptedEngine(), store), scenario)
    assert counts[1] <= counts[0], f"{counts[1] - counts[0]} nodes kept by 4 closed dialogs"
