"""Pilot tests: the app is never blocked by a streaming reply, and typing always reaches the
composer. Against the scripted engine, which can stream several replies at once or answer
"busy" like a one-sequence engine."""

from __future__ import annotations

from scripted_engine import (
    ScriptedEngine,
    ScriptedReply,
    make_app,
    run_chat,
    send,
    wait_until,
)
from textual.pilot import Pilot
from textual.widgets import ListView

from npuchat.app.store import ConversationStore
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.message_list import AssistantMessage, UserMessage
from npuchat.app.tui.sidebar import ConversationItem
from npuchat.engine.events import ChatMessage


def items(screen: ChatScreen) -> dict[str, ConversationItem]:
    return {item.conversation.title: item for item in screen.query(ConversationItem)}


def generating(screen: ChatScreen) -> set[str]:
    return {title for title, item in items(screen).items() if item.generating}


async def choose(pilot: Pilot[None], screen: ChatScreen, title: str) -> None:
    """Pick a conversation in the sidebar with the keyboard, as a user would."""
    listing = screen.query_one("#conversations", ListView)
    listing.focus()
    listing.index = list(items(screen)).index(title)
    await pilot.press("enter")
    await wait_until(
        pilot,
        lambda: screen.conversation is not None and screen.conversation.title == title,
        f"conversation {title!r} on screen",
    )


def test_a_reply_keeps_streaming_while_the_user_works_in_another_chat(
    store: ConversationStore,
) -> None:
    slow = ScriptedReply(["Long ", "answer ", "about ", "Rust."], hold_at=2)
    engine = ScriptedEngine([slow, ScriptedReply(["Quick answer."])])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Explain Rust")
        await wait_until(pilot, slow.reached_hold.is_set, "the first reply mid-stream")
        await pilot.press("ctrl+n")  # not refused while the reply streams
        await wait_until(pilot, lambda: screen.conversation is None, "a new chat")
        assert not screen.query(UserMessage)
        assert screen.query_one(Composer).has_focus
        await send(pilot, "Quick question")
        await wait_until(
            pilot,
            lambda: (
                screen.query(AssistantMessage).last().content == "Quick answer."
                and screen.replying == {store.list_conversations()[1].id}
            ),
            "the second reply, while the first still streams",
        )
        rust = items(screen)["Explain Rust"]
        assert rust.generating and rust.has_class("-generating")
        assert "generating" in str(rust.query_one(".when").render())
        assert not items(screen)["Quick question"].generating

        await choose(pilot, screen, "Explain Rust")
        assert screen.query_one(Composer).has_focus  # focus back in the composer
        view = screen.query_one(AssistantMessage)
        assert view.content == "Long answer "  # what streamed while it was hidden
        slow.release.set()
        await wait_until(pilot, lambda: view.status == "complete", "the first reply to end")
        assert view.content == "Long answer about Rust."
        await wait_until(pilot, lambda: "Explain Rust" not in generating(screen), "mark off")

    run_chat(make_app(engine, store), scenario)
    assert engine.max_in_flight == 2
    by_title = {c.title: c.id for c in store.list_conversations()}
    rust = store.messages(by_title["Explain Rust"])
    assert (rust[1].content, rust[1].status) == ("Long answer about Rust.", "complete")
    quick = store.messages(by_title["Quick question"])
    assert quick[1].content == "Quick answer."


def test_a_busy_engine_is_said_out_loud(store: ConversationStore) -> None:
    slow = ScriptedReply(["One ", "two."], hold_at=1)
    engine = ScriptedEngine([slow], concurrent=False)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "First")
        await wait_until(pilot, slow.reached_hold.is_set, "the first reply mid-stream")
        await pilot.press("ctrl+n")
        await send(pilot, "Second")
        await wait_until(
            pilot,
            lambda: screen.query(AssistantMessage).last().status == "error",
            "the busy answer",
        )
        view = screen.query(AssistantMessage).last()
        assert "busy with another reply" in str(view.query_one(".status").render())
        assert any("busy" in n.message for n in pilot.app._notifications)
        slow.release.set()
        await wait_until(pilot, lambda: not screen.generating, "the first reply to end")

    run_chat(make_app(engine, store), scenario)
    assert engine.busy_answers == 1
    second = store.messages(store.search("Second")[0].id)
    assert second[1].status == "error" and "busy" in second[1].error


def test_typing_with_a_message_focused_goes_to_the_composer(store: ConversationStore) -> None:
    engine = ScriptedEngine([ScriptedReply(["Sure."])])

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "Hi")
        await wait_until(pilot, lambda: not screen.generating, "the reply")
        screen.query_one(UserMessage).focus()
        await pilot.press("h")  # a message has no "h" binding: the key goes to the composer
        await pilot.press(*"ello")
        composer = screen.query_one(Composer)
        assert composer.text == "hello" and composer.has_focus
        assert not screen.query_one(UserMessage).has_class("-editing")
        # From the sidebar as well.
        screen.query_one("#conversations", ListView).focus()
        await pilot.press("!")
        assert composer.text == "hello!" and composer.has_focus

    run_chat(make_app(engine, store), scenario)


def test_a_new_conversation_gets_a_title_from_the_model(store: ConversationStore) -> None:
    title = ScriptedReply(['"Rust ', "lifetimes", ' explained."\n'])
    engine = ScriptedEngine(background=lambda request: title)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "can you tell me how lifetimes work in rust, with examples")
        await wait_until(pilot, lambda: "Rust lifetimes explained" in items(screen), "the title")
        assert screen.conversation is not None
        assert screen.conversation.title == "Rust lifetimes explained"
        await send(pilot, "and for structs?")
        await wait_until(pilot, lambda: not screen.generating, "the second reply")

    run_chat(make_app(engine, store), scenario)
    first, second = engine.requests
    (asked,) = engine.background_requests
    # The conversation so far (its KV is reused) and the instruction; greedy and short.
    assert asked.messages[:2] == (*first.messages, ChatMessage("assistant", "Reply 1."))
    assert "title" in asked.messages[-1].content and asked.sampling.max_tokens <= 16
    assert asked.conversation_id == first.conversation_id
    assert len(second.messages) == 3  # the title exchange is not part of the conversation
    assert [c.title for c in store.list_conversations()] == ["Rust lifetimes explained"]


def test_sending_cancels_a_running_title(store: ConversationStore) -> None:
    held = ScriptedReply(["Never ", "used"], hold_at=1)
    engine = ScriptedEngine(background=lambda request: held, concurrent=False)

    async def scenario(pilot: Pilot[None], screen: ChatScreen) -> None:
        await send(pilot, "first message")
        await wait_until(pilot, held.reached_hold.is_set, "the title request mid-stream")
        await send(pilot, "second message")  # cancels the title, then runs (not "busy")
        await wait_until(pilot, lambda: len(screen.query(AssistantMessage)) == 2, "reply 2")
        await wait_until(pilot, lambda: not screen.generating, "reply 2 to end")
        assert screen.query(AssistantMessage).last().status == "complete"

    run_chat(make_app(engine, store), scenario)
    assert engine.cancelled == 1 and engine.busy_answers == 0
    assert [c.title for c in store.list_conversations()] == ["first message"]
