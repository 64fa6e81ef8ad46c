"""Pilot tests of the chat screen against the scripted engine: streaming, stop, regenerate,
edit-and-continue, conversations, settings, export, persistence, errors, keys."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from scripted_engine import (
    NO_TITLE,
    ScriptedEngine,
    ScriptedReply,
    StepClock,
    make_app,
    reply_settled,
    send,
    wait_until,
)
from scripted_engine import run_chat as run
from textual.pilot import Pilot
from textual.widgets import Input, Label, ListView, Markdown, Sparkline, Static, TextArea
from textual.widgets.markdown import MarkdownFence

from npuchat.app.settings import Settings, load_settings
from npuchat.app.store import ConversationStore
from npuchat.app.tui import reply_controller
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.help_screen import HelpScreen
from npuchat.app.tui.loading_screen import LoadingScreen
from npuchat.app.tui.message_list import AssistantMessage, CodeFence, NoticeView, UserMessage
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.app.tui.sidebar import ConversationItem
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import ChatMessage, Notice


def metric(screen: ChatScreen, row: str) -> str:
    return str(screen.query_one(f"#m-{row}", Label).render())


def test_send_streams_reply_and_updates_metrics(
    store: ConversationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reply_controller, "SAVE_INTERVAL_S", 0.0)  # save partial text at every tick
    reply = ScriptedReply(["Hello", " **world**", "!\n\n", "Done."], hold_at=2)
    engine = ScriptedEngine([reply])

    def stored_reply() -> tuple[str, str]:
        m = store.messages(store.list_conversations()[0].id)[-1]
        return m.content, m.status

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Say hello")
        view = await _first_reply(pilot, screen)
        # Mid-stream: the first two chunks are on screen, the metrics are live, and the
        # partial text is already committed (a crash now would keep it).
        await wait_until(pilot, lambda: view.content == "Hello **world**", "partial text")
        await wait_until(pilot, lambda: metric(screen, "state") == "live", "live metrics")
        await wait_until(
            pilot, lambda: stored_reply() == ("Hello **world**", "partial"), "a partial save"
        )
        assert metric(screen, "decode") == "1 tok · 30.0 tok/s"
        assert metric(screen, "ttft") == "250 ms"
        assert screen.generating
        assert screen.query_one(Composer).text == ""
        reply.release.set()
        await wait_until(pilot, reply_settled(screen, 1), "the reply to finish")
        assert view.content == "Hello **world**!\n\nDone."
        assert view.status == "complete"
        assert metric(screen, "state") == "last reply"
        assert metric(screen, "decode") == "3 tok · 20.0 tok/s"
        assert metric(screen, "accept") == "75% (k=4)"
        assert "1,024" in metric(screen, "kv")
        assert len(screen.query_one("#rate-spark", Sparkline).data or []) >= 2

    run(make_app(engine, store), scenario)
    (request,) = engine.requests
    assert [(m.role, m.content) for m in request.messages] == [("user", "Say hello")]
    (conv,) = store.list_conversations()
    assert conv.title == "Say hello"
    msgs = store.messages(conv.id)
    assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "complete")]
    assert msgs[1].content == "Hello **world**!\n\nDone."
    assert msgs[1].metrics is not None and msgs[1].metrics.decode_tokens == 3


async def _first_reply(pilot: Pilot[None], screen: ChatScreen) -> AssistantMessage:
    await wait_until(pilot, lambda: bool(screen.query(AssistantMessage)), "a reply view")
    return screen.query(AssistantMessage).last()


def test_escape_stops_and_keeps_partial_reply(store: ConversationStore) -> None:
    reply = ScriptedReply(["Partial", " answer", " never shown"], hold_at=2)
    engine = ScriptedEngine([reply])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Long question")
        view = await _first_reply(pilot, screen)
        await wait_until(pilot, lambda: view.content == "Partial answer", "partial text")
        await pilot.press("escape")
        await wait_until(pilot, reply_settled(screen, 1), "the reply to stop")
        assert view.status == "stopped"
        assert "stopped" in str(view.query_one(".status", Label).render())
        assert metric(screen, "state") == "last reply (stopped)"

    run(make_app(engine, store), scenario)
    assert engine.cancelled == 1
    msgs = store.messages(store.list_conversations()[0].id)
    assert (msgs[1].content, msgs[1].status) == ("Partial answer", "stopped")


def test_regenerate_replaces_the_last_reply(store: ConversationStore) -> None:
    engine = ScriptedEngine([ScriptedReply(["First try."]), ScriptedReply(["Second try."])])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Question")
        await wait_until(pilot, reply_settled(screen, 1), "the first reply")
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: len(engine.requests) == 2, "a second request")
        await wait_until(pilot, reply_settled(screen, 1), "the regenerated reply")
        assert screen.query_one(AssistantMessage).content == "Second try."

    run(make_app(engine, store), scenario)
    assert engine.requests[1].messages == engine.requests[0].messages
    msgs = store.messages(store.list_conversations()[0].id)
    assert [m.content for m in msgs] == ["Question", "Second try."]


def test_edit_a_previous_message_and_continue(store: ConversationStore) -> None:
    engine = ScriptedEngine()  # replies "Reply 1.", "Reply 2.", ...

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "first question")
        await wait_until(pilot, reply_settled(screen, 1), "reply 1")
        await send(pilot, "second question")
        await wait_until(pilot, reply_settled(screen, 2), "reply 2")
        first = screen.query(UserMessage).first()
        first.focus()
        await pilot.press("e")
        composer = screen.query_one(Composer)
        assert composer.text == "first question"
        assert first.has_class("-editing")
        # The later turns are named and stay until the edit is sent; Esc keeps them.
        assert "replaces the 3 messages after it" in str(composer.border_title)
        await pilot.press("escape")
        assert not first.has_class("-editing") and len(screen.query(UserMessage)) == 2
        first.focus()
        await pilot.press("e")
        composer.text = "first question, rephrased"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(engine.requests) == 3, "the third request")
        await wait_until(pilot, reply_settled(screen, 1), "the reply after the edit")
        assert [v.content for v in screen.query(UserMessage)] == ["first question, rephrased"]

    run(make_app(engine, store), scenario)
    last = engine.requests[-1]
    assert [m.content for m in last.messages] == ["first question, rephrased"]
    msgs = store.messages(store.list_conversations()[0].id)
    assert [m.content for m in msgs] == ["first question, rephrased", "Reply 3."]


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
        values = {"temperature": "0", "top_p": "0.5", "top_k": "7", "max_tokens": "64"}
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
        await send(pilot, "Hi")
        await wait_until(pilot, reply_settled(screen, 1), "reply")

    run(make_app(engine, store), scenario)
    (request,) = engine.requests
    assert request.system_prompt == "Answer in one word."
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed) == (0.0, 0.5, 7, 64, 42)
    settings = store.list_conversations()[0].settings
    assert settings.seed == 42 and settings.system_prompt == "Answer in one word."


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


def test_engine_notices_and_failures_show_without_traceback(store: ConversationStore) -> None:
    reply = ScriptedReply(
        ["Half an"],
        notices=[Notice("Dropped 2 old turns to fit the context", "warning")],
        fail="NPU graph compile failed: op X unsupported; run with --device cpu",
    )
    engine = ScriptedEngine([reply])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Hi")
        await wait_until(pilot, reply_settled(screen, 1), "the failed reply")
        view = screen.query_one(AssistantMessage)
        assert view.status == "error" and view.content == "Half an"
        notice = screen.query_one(NoticeView)
        assert "Dropped 2 old turns" in str(notice.render())
        messages = [n.message for n in pilot.app._notifications]
        assert any("NPU graph compile failed" in m for m in messages)

    run(make_app(engine, store), scenario)
    msgs = store.messages(store.list_conversations()[0].id)
    assert msgs[1].status == "error" and "compile failed" in msgs[1].error


def test_engine_exception_becomes_an_error_reply(store: ConversationStore) -> None:
    def broken(request: object) -> ScriptedReply:
        raise NpuchatError("model file is missing; run npuchat pull")

    engine = ScriptedEngine(broken)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Hi")
        await wait_until(pilot, reply_settled(screen, 1), "the failed reply")
        assert screen.query_one(AssistantMessage).error.startswith("model file is missing")

    run(make_app(engine, store), scenario)


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


def test_copy_code_block_by_key(store: ConversationStore) -> None:
    text = "Two blocks:\n\n```python\nprint(1)\n```\n\nand\n\n```sh\nls -la\n```\n"
    engine = ScriptedEngine([ScriptedReply([text])])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Code")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        await pilot.press("f5")
        assert pilot.app.clipboard.strip() == "ls -la"
        view = screen.query_one(AssistantMessage)
        view.focus()
        await pilot.press("c")  # pressing again walks back to the previous block
        assert pilot.app.clipboard.strip() == "print(1)"
        await pilot.press("y")
        assert pilot.app.clipboard == text
        await pilot.click(MarkdownFence)  # clicking a block copies that block
        assert pilot.app.clipboard.strip() == "print(1)"

    run(make_app(engine, store), scenario)


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
    config.write_text('model = "on-disk-model"\n')
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


def test_quitting_mid_reply_keeps_the_partial_text(store: ConversationStore) -> None:
    reply = ScriptedReply(["Kept", " text", " lost"], hold_at=2)
    engine = ScriptedEngine([reply])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Hi")
        view = await _first_reply(pilot, screen)
        await wait_until(pilot, lambda: view.content == "Kept text", "partial text")
        await pilot.press("ctrl+q")

    run(make_app(engine, store), scenario)
    msgs = store.messages(store.list_conversations()[0].id)
    assert (msgs[1].content, msgs[1].status) == ("Kept text", "stopped")
    assert engine.cancelled == 1


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


def test_a_reply_cut_by_the_token_limit_is_marked_and_continues(store: ConversationStore) -> None:
    cut = ScriptedReply(["The answer", " is 12"], stop_reason="max_tokens")
    engine = ScriptedEngine([cut, ScriptedReply(["34."])])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "What is 1234?")
        await wait_until(pilot, reply_settled(screen, 1), "the cut reply")
        view = screen.query_one(AssistantMessage)
        status = str(view.query_one(".status", Label).render())
        assert "stopped at the 1,024-token limit · Ctrl+T continues" in status
        assert screen.check_action("continue_reply", ())
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: len(engine.requests) == 2, "the continue request")
        await wait_until(pilot, lambda: view.status == "complete" and view.limit == 0, "the end")
        assert view.content == "The answer is 1234."
        assert len(screen.query(AssistantMessage)) == 1  # the same reply, extended
        assert "limit" not in str(view.query_one(".status", Label).render())
        assert not screen.check_action("continue_reply", ())

    run(make_app(engine, store), scenario)
    first, again = engine.requests
    assert not first.continue_reply and again.continue_reply
    assert again.messages[-1] == ChatMessage("assistant", "The answer is 12")
    (conv,) = store.list_conversations()
    assert [(m.role, m.content) for m in store.messages(conv.id)] == [
        ("user", "What is 1234?"),
        ("assistant", "The answer is 1234."),
    ]


def test_a_long_prompt_shows_prefill_progress(store: ConversationStore) -> None:
    reply = ScriptedReply(["Read it."], prefill=[(128, 1024), (256, 1024)], hold_at=0)
    engine = ScriptedEngine([reply])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "A long paste")
        view = await _first_reply(pilot, screen)
        status = view.query_one(".status", Label)
        expected = "reading the prompt: 256 / 1,024 tokens · about 2 s left"
        await wait_until(pilot, lambda: expected in str(status.render()), "the progress")
        assert metric(screen, "prefill") == "256 / 1,024 tok · 400.0 tok/s"
        assert metric(screen, "state") == expected
        reply.release.set()
        await wait_until(pilot, reply_settled(screen, 1), "the reply")
        assert "reading" not in str(status.render()) and view.content == "Read it."

    run(make_app(engine, store), scenario)


def test_code_blocks_expand_tabs_and_scroll_wide_lines(store: ConversationStore) -> None:
    wide = "x = " + " + ".join(str(i) for i in range(60))
    text = f"```python\nif x:\n\treturn 1\n```\n\n```python\n{wide}\n```\n"
    engine = ScriptedEngine([ScriptedReply([text])])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Code")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        tabbed, long = screen.query(CodeFence)
        # Highlighted as if written with spaces: the same text and the same colours.
        got = CodeFence.highlight(tabbed.code, "python")
        want = MarkdownFence.highlight("if x:\n    return 1\n", "python")
        assert got.plain == want.plain and got.spans == want.spans
        assert "\t" in tabbed.code  # the copy keeps the tab
        # The long line is not cut silently: it scrolls, and a scrollbar shows it.
        assert long.max_scroll_x > 0 and long.scrollbars_enabled[1]
        assert long.styles.scrollbar_size_horizontal == 1

    run(make_app(engine, store), scenario, size=(100, 30))


def test_emoji_keep_the_right_border_and_the_copy_keeps_them(store: ConversationStore) -> None:
    text = "Thumbs 👍🏽 and family 👨\u200d👩\u200d👧 ❤️"
    engine = ScriptedEngine([ScriptedReply([text])])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Emoji 👍🏽")
        await wait_until(pilot, reply_settled(screen, 1), "reply")
        body = screen.query_one(UserMessage).query_one(".body", Static)
        assert str(body.render()) == "Emoji 👍"
        view = screen.query_one(AssistantMessage)
        assert "\U0001f3fd" not in view.query_one(Markdown).source
        view.focus()
        await pilot.press("y")
        assert pilot.app.clipboard == text

    run(make_app(engine, store), scenario)
