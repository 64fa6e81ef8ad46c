"""Snapshot tests of the main screens (pytest-textual-snapshot).

Deterministic by construction: a fixed clock for the app and the store, a scripted engine with
deterministic metrics, no cursor blink, a fixed terminal size. Regenerate after an intended UI
change with `pytest tests/test_tui_snapshots.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from scripted_engine import (
    ScriptedEngine,
    ScriptedReply,
    make_app,
    wait_for_chat,
    wait_until,
)
from textual.pilot import Pilot

from npuchat.app.settings import Settings
from npuchat.app.store import ConversationStore
from npuchat.app.store_records import ConversationSettings
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.help_screen import HelpScreen
from npuchat.app.tui.message_list import AssistantMessage
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.engine.events import Metrics

SIZE = (120, 36)

CODE_REPLY = """Here is a **binary search** in Python:

```python
def bsearch(xs: list[int], x: int) -> int:
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo
```

- runs in *O(log n)*
- returns the insertion point
"""

STORED_METRICS = Metrics(
    ttft_s=0.182,
    prefill_tokens=96,
    prefill_tps=527.5,
    reused_tokens=32,
    decode_tokens=87,
    decode_tps=41.3,
    kv_used=215,
    kv_capacity=1024,
    kv_max_capacity=4096,
    drafted=120,
    accepted=84,
    draft_k=4,
    model="qwen2.5-coder-1.5b",
    draft="qwen2.5-coder-0.5b",
    device="npu",
)


def seed_conversation(store: ConversationStore) -> str:
    older = store.create_conversation()
    store.add_message(older.id, "user", "What is a KV cache?")
    store.add_message(older.id, "assistant", "It stores keys and values.", metrics=STORED_METRICS)
    conv = store.create_conversation(settings=ConversationSettings(temperature=0.2))
    store.add_message(conv.id, "user", "Write a binary search in Python")
    store.add_message(conv.id, "assistant", CODE_REPLY, metrics=STORED_METRICS)
    return conv.id


def open_conversation(conversation_id: str) -> Callable[[Pilot[None]], object]:
    async def run_before(pilot: Pilot[None]) -> None:
        screen = await wait_for_chat(pilot)
        await screen.open_conversation(conversation_id)
        await pilot.pause()

    return run_before


async def chat_ready(pilot: Pilot[None]) -> None:
    await wait_for_chat(pilot)


def test_empty_first_screen(snap_compare, store: ConversationStore) -> None:
    app = make_app(ScriptedEngine(), store)
    assert snap_compare(app, terminal_size=SIZE, run_before=chat_ready)


def test_conversation_with_markdown_and_code(snap_compare, store: ConversationStore) -> None:
    conv_id = seed_conversation(store)
    app = make_app(ScriptedEngine(), store)
    assert snap_compare(app, terminal_size=SIZE, run_before=open_conversation(conv_id))


def test_conversation_in_light_theme(snap_compare, store: ConversationStore) -> None:
    conv_id = seed_conversation(store)
    settings = Settings(theme="npuchat-light", cursor_blink=False)
    app = make_app(ScriptedEngine(), store, settings=settings)
    assert snap_compare(app, terminal_size=SIZE, run_before=open_conversation(conv_id))


def test_metrics_panel_mid_stream(snap_compare, store: ConversationStore) -> None:
    chunks = ["Streaming ", "a **reply**", " with ", "more ", "to come", "…"]
    reply = ScriptedReply(chunks, hold_at=4)
    engine = ScriptedEngine([reply], model_name="qwen2.5-coder-1.5b", device="npu")

    async def run_before(pilot: Pilot[None]) -> None:
        screen = await wait_for_chat(pilot)
        composer = screen.query_one(Composer)
        composer.text = "Stream something"
        await pilot.press("enter")
        await wait_until(pilot, reply.reached_hold.is_set, "the engine to hold")
        view = screen.query_one(AssistantMessage)
        await wait_until(pilot, lambda: view.content == "".join(chunks[:4]), "four chunks")
        await wait_until(
            pilot, lambda: _decode_text(screen).startswith("3 tok"), "metrics for 4 chunks"
        )
        await pilot.pause(0.2)

    app = make_app(engine, store)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def _decode_text(screen: ChatScreen) -> str:
    return str(screen.query_one("#m-decode").render())


def test_settings_modal(snap_compare, store: ConversationStore) -> None:
    conv_id = seed_conversation(store)

    async def run_before(pilot: Pilot[None]) -> None:
        await open_conversation(conv_id)(pilot)
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen), "modal")

    app = make_app(ScriptedEngine(), store)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare, store: ConversationStore) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await wait_for_chat(pilot)
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen), "help")

    settings = Settings(cursor_blink=False, keymap={"regenerate": "ctrl+g"})
    app = make_app(ScriptedEngine(), store, settings=settings)
    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


@pytest.mark.parametrize(
    "size", [(60, 20), (80, 24), (120, 40), (200, 60)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_layout_at_terminal_size(snap_compare, store: ConversationStore, size) -> None:
    """Panels collapse by width: the chat and the composer stay usable down to 60x20."""
    conv_id = seed_conversation(store)
    app = make_app(ScriptedEngine(), store)
    assert snap_compare(app, terminal_size=size, run_before=open_conversation(conv_id))
