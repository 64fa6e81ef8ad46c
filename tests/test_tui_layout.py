"""Pilot tests of the layout by terminal width (panels beside the chat when they fit, over it
on demand when they do not, the footer's keys never cut off) and of the model picker."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from scripted_engine import (
    NO_TITLE,
    ScriptedEngine,
    ScriptedReply,
    make_app,
    run_chat,
    send,
    wait_until,
)
from textual.pilot import Pilot
from textual.widgets import Input, Label, ListView

from npuchat.app.engine_port import ModelChoice
from npuchat.app.settings import Settings
from npuchat.app.store import ConversationStore
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.footer import ChatFooter
from npuchat.app.tui.message_list import MessageList, UserMessage
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.app.tui.sidebar import Sidebar
from npuchat.app.tui.switch_bar import ModelSwitchBar


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


MODELS = [
    ModelChoice("default-model", "llama", 98_000_000, True, "135M"),
    ModelChoice("other-model", "qwen2", 491_000_000, False, "0.5B"),
]


def test_model_picker_in_the_palette_pulls_with_progress(store: ConversationStore) -> None:
    engines = {
        "default-model": ScriptedEngine(model_name="default-model", background=NO_TITLE),
        "other-model": ScriptedEngine(
            [ScriptedReply(["From other."])], model_name="other-model", background=NO_TITLE
        ),
    }
    go = threading.Event()

    def loader(spec: Any, progress: Callable[[str, float], None]) -> ScriptedEngine:
        if spec.model == "other-model":
            progress("Pulling other-model", 0.4)
            go.wait(10)
        return engines[spec.model]

    settings = Settings(model="default-model", draft="none", device="cpu", cursor_blink=False)
    app = make_app(None, store, settings=settings, loader=loader, models=MODELS)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await pilot.press("ctrl+p")
        await pilot.press(*"model: other")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: pilot.app.screen is screen, "the palette to close")
        assert screen.current_settings.model == "other-model"
        assert any("pulled first" in n.message for n in pilot.app._notifications)
        await send(pilot, "Hi")
        bar = screen.query_one(ModelSwitchBar)
        stage = bar.query_one("#switch-stage", Label)
        await wait_until(pilot, lambda: "Pulling other-model" in str(stage.render()), "progress")
        assert bar.display
        go.set()
        await wait_until(pilot, lambda: len(engines["other-model"].requests) == 1, "request")
        await wait_until(pilot, lambda: not screen.generating, "the reply")
        assert not bar.display

    run_chat(app, scenario)
    (conv,) = store.list_conversations()
    assert conv.settings.model == "other-model"


def test_settings_refuse_an_unknown_model(store: ConversationStore) -> None:
    settings = Settings(model="default-model", cursor_blink=False)
    app = make_app(ScriptedEngine(), store, settings=settings, models=MODELS)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen), "modal")
        modal = pilot.app.screen
        modal.query_one("#model", Input).value = "other-modl"
        await pilot.click("#save")
        assert pilot.app.screen is modal
        error = str(modal.query_one("#settings-error", Label).render())
        assert "no model named 'other-modl'" in error and "other-model" in error
        modal.query_one("#model", Input).value = "other-model"
        save = modal.query_one("#save")
        await wait_until(pilot, lambda: not save.has_class("-active"), "the button to reset")
        await pilot.click("#save")
        await wait_until(pilot, lambda: pilot.app.screen is screen, "saved")
        assert screen.current_settings.model == "other-model"

    run_chat(app, scenario)
