"""Pilot tests of the app around the chat, against the scripted engine: conversations (new, rename,
search, delete), the settings dialog, export, history across restarts, loading a conversation's
model, keys, themes and the command palette."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripted_engine import (
    NO_TITLE,
    ScriptedEngine,
    ScriptedReply,
    StepClock,
    make_app,
    metric,
    reply_settled,
    send,
    wait_until,
)
from scripted_engine import run_chat as run
from textual.pilot import Pilot
from textual.widgets import Input, Label, ListView, TextArea

from npuchat.app.settings import Settings, load_settings
from npuchat.app.store import ConversationStore
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.help_screen import HelpScreen
from npuchat.app.tui.loading_screen import LoadingScreen
from npuchat.app.tui.message_list import AssistantMessage, UserMessage
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.app.tui.sidebar import ConversationItem
from npuchat.engine.errors import NpuchatError


def test_conversations_new_rename_search_delete(store: ConversationStore) -> None:
    engine = ScriptedEngine()

    def titles(screen: ChatScreen) -> list[str]:
        return [item.conversation.title for item in screen.query(ConversationItem)]

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "About Rust lifetimes")
        await wait_until(pilot, reply_settled(screen, 1), "reply 1")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not screen.query(UserMessage), "an empty chat")
        assert screen.conversation is None
        await send(pilot, "About Python decorators")
        await wait_until(pilot, reply_settled(screen, 1), "reply 2")
        assert titles(screen) == ["About Python decorators", "About Rust lifetimes"]

        # Rename the current chat.
        await pilot.press("f2")
        await wait_until(pilot, lambda: bool(pilot.app.screen.query("#prompt-input")), "prompt")
        pilot.app.screen.query_one("#prompt-input", Input).value = "Decorators"
        await pilot.press("enter")
        await wait_until(pilot, lambda: "Decorators" in titles(screen), "the new title")

        # Search by message content (the assistant text is the same, so search a user word).
        await pilot.press("ctrl+f")
        await pilot.press(*"rust")
        await wait_until(pilot, lambda: titles(screen) == ["About Rust lifetimes"], "a match")
        # Open the found conversation from the list.
        await pilot.press("enter")  # search box -> list
        await pilot.press("enter")  # select the item
        await wait_until(
            pilot,
            lambda: [v.content for v in screen.query(UserMessage)] == ["About Rust lifetimes"],
            "the opened conversation",
        )
        # Esc in the search box clears the filter (visibly: every chat is listed again).
        await pilot.press("ctrl+f")
        assert screen.query_one("#search", Input).value == "rust"
        await pilot.press("escape")
        assert screen.query_one("#search", Input).value == ""
        assert screen.query_one(Composer).has_focus
        await wait_until(pilot, lambda: len(titles(screen)) == 2, "both chats listed")

        # Delete the current (Rust) chat, with confirmation; cancel first, then confirm.
        await pilot.press("f8")
        await wait_until(pilot, lambda: bool(pilot.app.screen.query("#confirm")), "confirm")
        await pilot.press("escape")
        assert len(titles(screen)) == 2
        await pilot.press("f8")
        await wait_until(pilot, lambda: bool(pilot.app.screen.query("#confirm")), "confirm")
        await pilot.click("#confirm")
        await wait_until(pilot, lambda: titles(screen) == ["Decorators"], "one chat left")
        assert screen.conversation is None and not screen.query(UserMessage)

    run(make_app(engine, store), scenario)
    assert [c.title for c in store.list_conversations()] == ["Decorators"]


def test_settings_modal_values_reach_the_engine_request(store: ConversationStore) -> None:
    engine = ScriptedEngine()

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen), "modal")
        modal = pilot.app.screen
        modal.query_one("#system_prompt", TextArea).text = "Answer in one word."
        values = {
            "temperature": "0",
            "top_p": "0.5",
            "top_k": "7",
            "min_p": "0.1",
            "repeat_penalty": "1.1",
            "presence_penalty": "0.5",
            "frequency_penalty": "-0.25",
            "max_tokens": "64",
            "reply_format": "JSON",
        }
        for name, value in values.items():
            modal.query_one(f"#{name}", Input).value = value
        # An invalid seed keeps the modal open with a message.
        modal.query_one("#seed", Input).value = "abc"
        await pilot.click("#save")
        assert pilot.app.screen is modal
        assert "Seed" in str(modal.query_one("#settings-error", Label).render())
        modal.query_one("#seed", Input).value = "42"
        save = modal.query_one("#save")
        await wait_until(pilot, lambda: not save.has_class("-active"), "the button to reset")
        await pilot.click("#save")
        await wait_until(pilot, lambda: pilot.app.screen is screen, "modal closed")
        composer = screen.query_one(Composer)
        assert composer.border_subtitle == "replies in JSON"  # said before the first message
        await send(pilot, "Hi")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        assert composer.border_subtitle == "replies in JSON"  # and kept by the stored chat
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: screen.conversation is None, "a new chat")
        assert composer.border_subtitle == ""
        await screen.open_conversation(store.list_conversations()[0].id)
        assert composer.border_subtitle == "replies in JSON"

    run(make_app(engine, store), scenario)
    (request,) = engine.requests
    assert request.system_prompt == "Answer in one word."
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed) == (0.0, 0.5, 7, 64, 42)
    assert (s.min_p, s.repeat_penalty, s.presence_penalty, s.frequency_penalty) == (
        0.1,
        1.1,
        0.5,
        -0.25,
    )
    assert s.json_schema is not None and json.loads(s.json_schema) == {"type": "object"}
    settings = store.list_conversations()[0].settings
    assert settings.seed == 42 and settings.system_prompt == "Answer in one word."
    assert settings.reply_format == "json"


def test_export_writes_the_file_and_says_where(store: ConversationStore, tmp_path: Path) -> None:
    engine = ScriptedEngine([ScriptedReply(["```python\nprint(1)\n```\n"])])
    target = tmp_path / "exports" / "chat.json"

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Code please")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: bool(pilot.app.screen.query("#prompt-input")), "prompt")
        prompt = pilot.app.screen.query_one("#prompt-input", Input)
        assert prompt.value.endswith("code-please.md")
        prompt.value = str(target)
        await pilot.press("enter")
        await wait_until(pilot, target.exists, "the export file")
        messages = [n.message for n in pilot.app._notifications]
        assert any(str(target) in m for m in messages)

    run(make_app(engine, store), scenario)
    doc = json.loads(target.read_text())
    assert [m["content"] for m in doc["messages"]] == ["Code please", "```python\nprint(1)\n```\n"]


def test_history_survives_an_app_restart(tmp_path: Path) -> None:
    db = tmp_path / "data" / "conversations.sqlite3"
    engine = ScriptedEngine([ScriptedReply(["Stored **reply**."])])

    async def first(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Remember this")
        await wait_until(pilot, reply_settled(screen, 1), "reply")

    with ConversationStore.open(db, clock=StepClock()) as store:
        run(make_app(engine, store), first)

    async def second(pilot: Pilot[None], screen: ChatScreen) -> None:
        items = list(screen.query(ConversationItem))
        assert [i.conversation.title for i in items] == ["Remember this"]
        screen.query_one("#conversations", ListView).focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: bool(screen.query(AssistantMessage)), "the reply")
        view = screen.query_one(AssistantMessage)
        assert view.content == "Stored **reply**." and view.status == "complete"
        assert metric(screen, "state") == "last reply"
        assert metric(screen, "ttft") == "250 ms"

    with ConversationStore.open(db) as store:
        run(make_app(ScriptedEngine(), store), second)


def test_loader_failure_is_shown_on_the_loading_screen(store: ConversationStore) -> None:
    def loader(spec: object, progress: Callable[[str, float], None]) -> ScriptedEngine:
        progress("Pulling model", 0.3)
        raise NpuchatError("no network; copy the GGUF and run npuchat import FILE")

    app = make_app(ScriptedEngine(), store, loader=loader)

    async def main() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, LoadingScreen), "loading")
            error = app.screen.query_one("#loading-error", Label)
            await wait_until(pilot, lambda: error.display, "the error")
            assert "npuchat import FILE" in str(error.render())

    asyncio.run(main())


def test_a_conversation_model_is_loaded_through_the_loader(store: ConversationStore) -> None:
    specs: list[Any] = []
    engines = {
        "default-model": ScriptedEngine(model_name="default-model", background=NO_TITLE),
        "other-model": ScriptedEngine(
            [ScriptedReply(["From other."])], model_name="other-model", background=NO_TITLE
        ),
    }

    def loader(spec: Any, progress: Callable[[str, float], None]) -> ScriptedEngine:
        specs.append(spec)
        return engines[spec.model]

    settings = Settings(model="default-model", draft="none", device="cpu", cursor_blink=False)
    app = make_app(engines["default-model"], store, settings=settings, loader=loader)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen), "modal")
        pilot.app.screen.query_one("#model", Input).value = "other-model"
        await pilot.click("#save")
        await send(pilot, "Hi")
        await wait_until(pilot, lambda: len(engines["other-model"].requests) == 1, "request")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        assert screen.query_one(AssistantMessage).content == "From other."
        assert metric(screen, "model") == "other-model"

    run(app, scenario)
    assert engines["default-model"].closed and not engines["other-model"].closed
    assert [(s.model, s.draft, s.device) for s in specs] == [
        ("default-model", "none", "cpu"),
        ("other-model", "none", "cpu"),
    ]


def test_keymap_remaps_and_help_lists_the_new_key(store: ConversationStore) -> None:
    engine = ScriptedEngine([ScriptedReply(["One."]), ScriptedReply(["Two."])])
    settings = Settings(cursor_blink=False, keymap={"regenerate": "ctrl+g", "bogus": "x"})

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Hi")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        await pilot.press("ctrl+r")  # no longer bound
        await pilot.pause(0.2)
        assert len(engine.requests) == 1
        await pilot.press("ctrl+g")
        await wait_until(pilot, lambda: len(engine.requests) == 2, "regenerate by ctrl+g")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        messages = [n.message for n in pilot.app._notifications]
        assert any("bogus" in m for m in messages)
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen), "help")
        table = pilot.app.screen.query_one("#keys")
        rows = [table.get_row_at(i) for i in range(table.row_count)]
        assert ["Chat", "Ctrl+G", "Regenerate", "regenerate"] in rows
        await pilot.press("escape")
        assert pilot.app.screen is screen

    run(make_app(engine, store, settings=settings), scenario)


def test_theme_choice_is_saved_and_user_themes_load(
    store: ConversationStore, tmp_path: Path
) -> None:
    config = tmp_path / "config" / "config.toml"
    (config.parent / "themes").mkdir(parents=True)
    config.write_text('# my settings\nmodel = "on-disk-model"  # the one I use\n')
    (config.parent / "themes" / "mine.toml").write_text('name = "mine"\nprimary = "#ff0000"\n')
    (config.parent / "themes" / "broken.toml").write_text('name = "broken"\n')
    settings = Settings(model="cli-override", cursor_blink=False)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        app = pilot.app
        assert {"npuchat-dark", "npuchat-light", "mine"} <= set(app.available_themes)
        assert "broken" not in app.available_themes
        assert any("broken.toml" in n.message for n in app._notifications)
        assert app.theme == "npuchat-dark"
        # A Textual theme without npuchat variables gets defaults that follow that theme.
        app.theme = "gruvbox"
        await pilot.pause()
        variables = app.get_css_variables()
        assert variables["npuchat-kv-bar"] == variables["primary"]
        assert variables["npuchat-sparkline-max"] == variables["accent"]
        app.theme = "npuchat-light"
        await pilot.pause()
        await pilot.press("f3")  # hide the metrics panel: saved too
        assert not screen.query_one(MetricsPanel).display

    run(make_app(ScriptedEngine(), store, settings=settings, config_path=config), scenario)
    saved = load_settings(config)
    assert saved.theme == "npuchat-light"
    assert saved.show_metrics is False
    assert saved.model == "on-disk-model"  # the CLI override was not written back
    # only the changed keys were written; the user's comments and lines stay as they were
    assert config.read_text().startswith(
        '# my settings\nmodel = "on-disk-model"  # the one I use\n'
    )


def test_command_palette_runs_chat_actions(store: ConversationStore) -> None:
    engine = ScriptedEngine()

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Hi")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        await pilot.press("ctrl+p")
        await pilot.press(*"new chat")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: screen.conversation is None, "a new chat")
        assert not screen.query(UserMessage)

    run(make_app(engine, store), scenario)


def test_quitting_while_loading_aborts_the_loader(store: ConversationStore) -> None:
    reports: list[float] = []
    aborted = threading.Event()

    def slow_loader(spec: object, progress: Callable[[str, float], None]) -> ScriptedEngine:
        try:
            for i in range(2000):  # a long pull that reports progress
                progress("Downloading", i / 2000)
                reports.append(i)
                time.sleep(0.005)
        except BaseException:
            aborted.set()
            raise
        raise AssertionError("the loader should have been aborted")

    app = make_app(ScriptedEngine(), store, loader=slow_loader)

    async def main() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_until(pilot, lambda: len(reports) > 5, "progress")
            bar = app.screen.query_one("#loading-bar")
            await wait_until(pilot, lambda: (bar.progress or 0) > 0, "the bar to move")
            await pilot.press("q")

    started = time.monotonic()
    asyncio.run(main())
    assert aborted.wait(5) and time.monotonic() - started < 8
    assert len(reports) < 2000
