"""Pilot tests of the chat screen against the scripted engine: streaming, stop, regenerate,
edit-and-continue, continuing a cut reply, prefill progress, errors, quitting mid-reply, code
blocks (the app around the chat is in `test_tui_conversations`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from scripted_engine import (
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
from textual.widgets import Label, Markdown, Sparkline, Static
from textual.widgets.markdown import MarkdownFence

from npuchat.app.store import ConversationStore
from npuchat.app.tui import reply_controller
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.message_list import AssistantMessage, CodeFence, NoticeView, UserMessage
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import ChatMessage, Notice


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
        assert not screen.query_one("#kv-memory").display  # this engine reports no KV bytes
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


def test_a_cut_reply_still_says_so_and_continues_after_a_restart(tmp_path: Path) -> None:
    """The stop reason is stored with the reply: after a restart, and after the conversation's
    max_tokens changed, the reply still names the limit that cut it and Ctrl+T continues it."""
    db = tmp_path / "data" / "conversations.sqlite3"
    first_engine = ScriptedEngine(
        [ScriptedReply(["Counting: 1,", " 2,"], stop_reason="max_tokens")]
    )

    async def cut(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Count to five")
        await wait_until(pilot, reply_settled(screen, 1), "the cut reply")

    with ConversationStore.open(db, clock=StepClock()) as store:
        run(make_app(first_engine, store), cut)
        (conv,) = store.list_conversations()
        store.update_settings(conv.id, replace(conv.settings, max_tokens=4096))

    engine = ScriptedEngine([ScriptedReply([" 3, 4, 5."])])

    async def after_restart(pilot: Pilot[None], screen: ChatScreen) -> None:
        await wait_until(pilot, lambda: bool(screen.query(AssistantMessage)), "the stored reply")
        view = screen.query_one(AssistantMessage)
        status = str(view.query_one(".status", Label).render())
        assert "stopped at the 1,024-token limit · Ctrl+T continues" in status
        assert screen.check_action("continue_reply", ())
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: len(engine.requests) == 1, "the continue request")
        await wait_until(pilot, lambda: view.status == "complete" and view.limit == 0, "the end")
        assert view.content == "Counting: 1, 2, 3, 4, 5."
        assert "limit" not in str(view.query_one(".status", Label).render())

    with ConversationStore.open(db, clock=StepClock()) as store:
        run(make_app(engine, store), after_restart)
        (again,) = engine.requests
        assert again.continue_reply and again.sampling.max_tokens == 4096
        assert again.messages[-1] == ChatMessage("assistant", "Counting: 1, 2,")
        (reply,) = [m for m in store.messages(conv.id) if m.role == "assistant"]
        assert (reply.content, reply.stop_reason, reply.cut_at) == (
            "Counting: 1, 2, 3, 4, 5.",
            "eos",
            0,
        )


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


def test_metrics_panel_shows_the_kv_bytes_in_use_and_per_token(store: ConversationStore) -> None:
    """An engine that reports its cache's bytes gets two more panel rows; one that does not
    (a remote server) keeps them hidden."""
    kv = {"kv_capacity": 4096, "kv_cache": ("int8", 6528)}  # qwen2.5-coder-0.5b's int8 figures
    engine = ScriptedEngine([ScriptedReply(["a" * 400])], **kv)  # type: ignore[arg-type]

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        memory = screen.query_one("#kv-memory")
        assert not memory.display
        await send(pilot, "x" * 4000)  # ~1,000 prompt tokens
        await wait_until(pilot, reply_settled(screen, 1), "the reply")
        assert memory.display
        (conv,) = store.list_conversations()
        last = store.messages(conv.id)[-1].metrics
        assert last is not None and last.kv_used > 1000
        assert metric(screen, "kv-mem") == f"{last.kv_used * 6528 / 2**20:.1f} of 25.5 MiB"
        assert metric(screen, "kv-token") == "6.4 KiB int8"

    run(make_app(engine, store), scenario)
