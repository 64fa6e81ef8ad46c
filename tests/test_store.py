"""The SQLite conversation store: schema versioning, commits, search, export."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from npuchat.app.store import ConversationStore
from npuchat.app.store_records import ConversationSettings, default_title
from npuchat.app.store_schema import MIGRATIONS, SCHEMA_VERSION, check_and_migrate
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import Metrics


class StepClock:
    """A clock that advances one second per reading, so ordering by time is deterministic."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "conversations.sqlite3"


def test_new_database_gets_schema_version_and_wal(db_path: Path) -> None:
    ConversationStore.open(db_path).close()
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 1
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"conversations", "messages"} <= tables


def test_newer_schema_is_refused_and_file_untouched(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute("CREATE TABLE future (x)")
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    before = hashlib.sha256(db_path.read_bytes()).hexdigest()
    with pytest.raises(NpuchatError, match="newer") as info:
        ConversationStore.open(db_path)
    assert "\n" not in str(info.value)
    assert hashlib.sha256(db_path.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in db_path.parent.iterdir()) == [db_path.name]


def test_foreign_database_is_refused(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute("CREATE TABLE something_else (x)")
    raw.commit()
    raw.close()
    with pytest.raises(NpuchatError, match="not an npuchat history"):
        ConversationStore.open(db_path)


def test_garbage_file_is_refused(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(NpuchatError, match="not an SQLite database"):
        ConversationStore.open(db_path)
    assert db_path.read_bytes() == b"this is not sqlite at all" * 100


def test_messages_are_committed_and_survive_reopen(db_path: Path) -> None:
    settings = ConversationSettings(system_prompt="Be terse.", temperature=0.0, seed=7)
    store = ConversationStore.open(db_path, clock=StepClock())
    conv = store.create_conversation(settings=settings)
    store.add_message(conv.id, "user", "What is 2+2?\nShow work.")
    reply = store.add_message(conv.id, "assistant", "", status="partial")
    store.update_message(reply.id, content="It is", status="partial")
    # Simulate a crash: the connection is never closed cleanly, a second one reads.
    other = ConversationStore.open(db_path)
    msgs = other.messages(conv.id)
    assert [(m.role, m.content, m.status) for m in msgs] == [
        ("user", "What is 2+2?\nShow work.", "complete"),
        ("assistant", "It is", "partial"),
    ]
    metrics = Metrics(ttft_s=0.5, decode_tokens=3, decode_tps=12.5, model="m", device="cpu")
    store.update_message(reply.id, content="It is 4.", status="complete", metrics=metrics)
    again = other.messages(conv.id)[1]
    assert again.content == "It is 4." and again.status == "complete"
    assert again.metrics == metrics
    loaded = other.get_conversation(conv.id)
    assert loaded.title == "What is 2+2?"
    assert loaded.settings == settings
    other.close()
    store.close()


def test_a_version_1_database_is_migrated_and_keeps_which_replies_were_cut(
    db_path: Path,
) -> None:
    """A history written before stop reasons were stored: every row is kept, and a complete
    reply that used its conversation's whole token budget is marked cut by that limit."""
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path, isolation_level=None)
    check_and_migrate(raw, str(db_path), MIGRATIONS[:1])  # the schema as version 1 wrote it
    assert raw.execute("PRAGMA user_version").fetchone()[0] == 1
    now = "2026-01-02T03:04:05+00:00"
    for conv, settings in (("a", '{"max_tokens": 64}'), ("b", "{}")):
        raw.execute(
            "INSERT INTO conversations VALUES (?, ?, ?, ?, ?)", (conv, conv, now, now, settings)
        )
    rows = [  # (conversation, status, decode_tokens or None for no metrics)
        ("a", "complete", 63),  # 64 tokens: a's limit
        ("a", "complete", 10),
        ("b", "complete", 1023),  # 1,024 tokens: the default limit
        ("b", "stopped", 1023),
        ("b", "complete", None),
    ]
    for conv, status, tokens in rows:
        metrics = None if tokens is None else json.dumps({"decode_tokens": tokens, "ttft_s": 0.1})
        raw.execute(
            "INSERT INTO messages (conversation_id, role, content, status, metrics, error,"
            " created_at) VALUES (?, 'assistant', ?, ?, ?, '', ?)",
            (conv, f"reply {tokens}", status, metrics, now),
        )
    raw.close()

    store = ConversationStore.open(db_path)
    got = [m for conv in ("a", "b") for m in store.messages(conv)]
    assert [(m.content, m.status) for m in got] == [
        (f"reply {tokens}", status) for _, status, tokens in rows
    ]
    assert [m.cut_at for m in got] == [64, 0, 1024, 0, 0]
    assert got[0].metrics is not None and got[0].metrics.ttft_s == 0.1
    store.update_message(
        got[1].id, content="more", status="complete", stop_reason="max_tokens", token_limit=9
    )
    store.close()
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    raw.close()
    with ConversationStore.open(db_path) as again:
        assert [m.cut_at for m in again.messages("a")] == [64, 9]


def test_title_comes_from_first_user_message_only() -> None:
    store = ConversationStore.in_memory(clock=StepClock())
    conv = store.create_conversation()
    store.add_message(conv.id, "user", "\n  first question  \nmore")
    store.add_message(conv.id, "user", "second question")
    assert store.get_conversation(conv.id).title == "first question"
    store.rename(conv.id, "  Renamed  ")
    assert store.get_conversation(conv.id).title == "Renamed"
    assert default_title("x" * 100, limit=10) == "x" * 9 + "…"


def test_list_search_delete_and_truncate() -> None:
    store = ConversationStore.in_memory(clock=StepClock())
    a = store.create_conversation()
    store.add_message(a.id, "user", "Tell me about Rust lifetimes")
    store.add_message(a.id, "assistant", "A 100% safe_borrow story")
    b = store.create_conversation()
    store.add_message(b.id, "user", "Python decorators")
    # b was updated last, so it comes first.
    assert [c.id for c in store.list_conversations()] == [b.id, a.id]
    assert [c.id for c in store.search("rust")] == [a.id]
    assert [c.id for c in store.search("DECORATORS")] == [b.id]
    assert [c.id for c in store.search("100%")] == [a.id]
    assert store.search("1000%") == []  # % is literal, not a wildcard
    assert [c.id for c in store.search("safe_b")] == [a.id]
    assert store.search("safexb") == []  # _ is literal too
    assert len(store.search("  ")) == 2

    msgs = store.messages(a.id)
    store.truncate_from(a.id, msgs[1].id)
    assert [m.content for m in store.messages(a.id)] == ["Tell me about Rust lifetimes"]

    store.delete_conversation(a.id)
    assert [c.id for c in store.list_conversations()] == [b.id]
    with pytest.raises(NpuchatError):
        store.get_conversation(a.id)
    with pytest.raises(NpuchatError):
        store.rename(a.id, "gone")


def test_settings_round_trip_ignores_unknown_keys() -> None:
    store = ConversationStore.in_memory()
    conv = store.create_conversation()
    new = ConversationSettings(model="qwen2.5-coder-0.5b", top_k=5, max_tokens=64, seed=None)
    store.update_settings(conv.id, new)
    assert store.get_conversation(conv.id).settings == new
    text = json.dumps({"top_k": 3, "from_the_future": True})
    assert ConversationSettings.from_json(text) == ConversationSettings(top_k=3)


def test_export_markdown_and_json(tmp_path: Path) -> None:
    store = ConversationStore.in_memory(clock=StepClock())
    conv = store.create_conversation(settings=ConversationSettings(system_prompt="Sys."))
    store.add_message(conv.id, "user", "Show code")
    store.add_message(
        conv.id,
        "assistant",
        "```python\nprint(1)\n```",
        status="stopped",
        metrics=Metrics(ttft_s=0.25),
    )
    md_path = store.export(conv.id, tmp_path / "out" / "chat.md")
    md = md_path.read_text()
    assert md_path.is_absolute()
    assert md.startswith("# Show code\n")
    assert "**System:** Sys." in md
    assert "## You\n\nShow code" in md
    assert "## Assistant (stopped)\n\n```python\nprint(1)\n```" in md

    doc = json.loads(store.export(conv.id, tmp_path / "chat.json").read_text())
    assert doc["title"] == "Show code"
    assert doc["settings"]["system_prompt"] == "Sys."
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"]
    assert doc["messages"][1]["status"] == "stopped"
    assert doc["messages"][1]["metrics"]["ttft_s"] == 0.25


def test_export_to_unwritable_path_is_one_line_error(tmp_path: Path) -> None:
    store = ConversationStore.in_memory()
    conv = store.create_conversation()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NpuchatError, match="cannot write") as info:
        store.export(conv.id, blocker / "sub" / "chat.md")
    assert "\n" not in str(info.value)
