"""End to end: the app over the real engine (SmolLM2-135M, Gemma 3 270M; CPU), by the pilot."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from scripted_engine import StepClock, make_app, reply_settled, wait_for_chat, wait_until
from textual.widgets import Input, Label

from npuchat.app.engine_port import EngineSpec
from npuchat.app.settings import Settings
from npuchat.app.store import ConversationStore
from npuchat.app.store_records import ConversationSettings
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.message_list import AssistantMessage
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.engine.events import ChatEngine


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])  # gemma: a base model
def test_real_engine_reply_and_metrics(
    real_gguf: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    from npuchat.engine.session import ChatSession

    model_path = real_gguf(name)
    specs: list[EngineSpec] = []
    # Gemma's 262k-piece tokenizer takes longer to build than the chat screen is awaited here:
    # open it before the app starts (SmolLM2 loads inside the app, behind its progress screen).
    ready = None
    if name == "gemma3-270m":
        ready = ChatSession.open(model_path, name=name, cache_dir=tmp_path / "cache", device="cpu")

    def loader(spec: EngineSpec, progress: Callable[[str, float], None]) -> ChatEngine:
        specs.append(spec)
        if ready is not None:
            return ready
        return ChatSession.open(
            model_path, name=spec.model, cache_dir=tmp_path / "cache", device="cpu",
            progress=progress,
        )  # fmt: skip

    settings = Settings(model=name, draft="none", device="cpu", cursor_blink=False)
    store = ConversationStore.open(tmp_path / "db.sqlite3", clock=StepClock())
    app = make_app(None, store, settings=settings, loader=loader)

    def panel(row: str) -> str:
        return str(app.screen.query_one(f"#m-{row}", Label).render())

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "settings")
            app.screen.query_one("#max_tokens", Input).value = "24"
            app.screen.query_one("#temperature", Input).value = "0"
            await pilot.click("#save")
            await wait_until(pilot, lambda: app.screen is screen, "settings closed")
            composer = screen.query_one(Composer)
            composer.text = "What is the capital of France?"
            await pilot.press("enter")
            await wait_until(pilot, reply_settled(screen, 1), "the real reply", timeout=300)
            reply = screen.query_one(AssistantMessage)
            assert reply.status == "complete", reply.error
            assert reply.content.strip()
            assert panel("ttft") not in ("–", "")
            assert "tok/s" in panel("decode") and not panel("decode").startswith("0 tok")
            assert reply.metrics is not None
            assert reply.metrics.ttft_s > 0 and reply.metrics.decode_tps > 0
            assert panel("device") == "cpu"

    try:
        asyncio.run(main())
    finally:
        store.close()
    assert specs == [EngineSpec(name, "none", "cpu")]


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_engine_titles_and_continues(real_gguf: Callable[[str], Path], tmp_path: Path) -> None:
    """SmolLM2-135M: a background title lands in the sidebar, and Continue extends a reply cut
    at a 6-token limit from the cached KV (only the reply's last token is prefilled)."""
    from npuchat.engine.session import ChatSession

    model_path = real_gguf("smollm2-135m")

    def loader(spec: EngineSpec, progress: Callable[[str, float], None]) -> ChatEngine:
        return ChatSession.open(
            model_path, name=spec.model, cache_dir=tmp_path / "cache", device="cpu",
            progress=progress,
        )  # fmt: skip

    settings = Settings(model="smollm2-135m", draft="none", device="cpu", cursor_blink=False)
    store = ConversationStore.open(tmp_path / "db.sqlite3", clock=StepClock())
    store.create_conversation(settings=ConversationSettings(temperature=0.0, max_tokens=6))
    app = make_app(None, store, settings=settings, loader=loader)
    question = "Name three colours of the rainbow."

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            composer = screen.query_one(Composer)
            composer.text = question
            await pilot.press("enter")
            await wait_until(pilot, reply_settled(screen, 1), "the cut reply", timeout=300)
            reply = screen.query_one(AssistantMessage)
            assert reply.limit == 6, (reply.status, reply.content)
            cut_text = reply.content
            await wait_until(
                pilot,
                lambda: (
                    screen.conversation is not None
                    and screen.conversation.title not in ("", question)
                ),
                "a generated title",
                timeout=120,
            )
            await pilot.press("ctrl+t")
            await wait_until(
                pilot,
                lambda: len(reply.content) > len(cut_text) and not screen.generating,
                "the continuation",
                timeout=300,
            )
            assert reply.content.startswith(cut_text) and len(reply.content) > len(cut_text)
            assert reply.metrics is not None and reply.metrics.prefill_tokens <= 2

    try:
        asyncio.run(main())
    finally:
        store.close()
