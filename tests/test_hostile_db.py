"""Hostile faults around the conversation database: kill -9 and SIGTERM mid-reply, a lock
held by another process, damaged and foreign files, and another process writing to the
conversation the app has open. What must hold: nothing the user saw is lost, nothing damaged
is written to, and every refusal is one line that names the file and says what to do."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine, ScriptedReply, make_app, wait_for_chat, wait_until
from textual.pilot import Pilot

from npuchat.app import store_schema
from npuchat.app.cli import main
from npuchat.app.store import ConversationStore
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.message_list import AssistantMessage, MessageView
from npuchat.engine.errors import NpuchatError
from npuchat.engine.paths import Paths

SLOW_CLI = Path(__file__).with_name("harness_cli.py")
RUN_ARGS = ("-n", "150", "--conversation", "new", "-t", "0")


def _db() -> Path:
    return Paths.from_env().database_file


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rows(conv_id: str) -> list[tuple[str, str, str]]:
    with ConversationStore.open(_db()) as store:
        return [(m.role, m.content, m.status) for m in store.messages(conv_id)]


# ---- npuchat run --conversation, killed while streaming ----------------------------------------


def _start_slow_run(prompt: str) -> subprocess.Popen[str]:
    env = dict(os.environ, NPUCHAT_TEST_TOKEN_DELAY_S="0.05", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [*(sys.executable, str(SLOW_CLI), "run", "--model", "syn", "-p", prompt), *RUN_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        bufsize=0,
    )


def _read_until(proc: subprocess.Popen[str], chars: int) -> Iterator[tuple[float, str]]:
    """(arrival time, text so far) for each chunk read, until `chars` characters arrived."""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), True)
    text = ""
    while len(text) < chars:
        chunk = os.read(proc.stdout.fileno(), 4096).decode("utf-8", "replace")
        assert chunk, "the reply ended before the test could interrupt it"
        text += chunk
        yield time.monotonic(), text


def _conversation_id(stderr: str) -> str:
    return stderr.split("conversation ")[1].split()[0]


def test_kill_9_mid_reply_keeps_the_question_and_the_reply_as_printed(syn: Path) -> None:
    proc = _start_slow_run("hello")
    seen = list(_read_until(proc, 200))
    time.sleep(0.3)
    killed_at = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    rest, err = proc.communicate(timeout=10)
    conv_id = _conversation_id(err)
    rows = _rows(conv_id)
    assert [r[0] for r in rows] == ["user", "assistant"]
    assert rows[0][1] == "hello"
    saved = rows[1][1]
    assert rows[1][2] == "partial"
    printed = seen[-1][1] + rest
    assert printed.startswith(saved)
    # Everything on screen more than ~0.5 s (plus one token's delay) before the kill is saved.
    due = [text for at, text in seen if at <= killed_at - 0.7]
    assert due and len(saved) >= len(due[-1].rstrip())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_mid_reply_saves_the_reply_as_stopped(syn: Path, sig: int) -> None:
    proc = _start_slow_run("hello")
    printed = list(_read_until(proc, 50))[-1][1]
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig
    assert "Traceback" not in err
    rows = _rows(_conversation_id(err))
    assert [(r[0], r[2]) for r in rows] == [("user", "complete"), ("assistant", "stopped")]
    assert rows[1][1] and (printed + rest).rstrip("\n") == rows[1][1]  # all it printed


# ---- a lock held by another process ----------------------------------------------------------


def _hold_lock(path: Path, seconds: float, started: threading.Event) -> threading.Thread:
    def hold() -> None:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE conversations SET title = title")
        started.set()
        time.sleep(seconds)
        db.execute("COMMIT")
        db.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    started.wait(5)
    return thread


def _new_conversation() -> str:
    with ConversationStore.open(_db()) as store:
        return store.create_conversation().id


def test_run_waits_for_a_lock_held_longer_than_sqlite_default(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conv_id = _new_conversation()
    holder = _hold_lock(_db(), 5.5, threading.Event())
    rc = main(["run", "--model", "syn", "-p", "hello", "-n", "3", "--conversation", conv_id])
    holder.join()
    assert rc == 0
    saved = [(r[0], r[2]) for r in _rows(conv_id)]
    assert saved == [("user", "complete"), ("assistant", "complete")]


def test_run_gives_up_on_a_lock_that_is_never_released_with_one_line(
    syn: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_schema, "BUSY_DEADLINE_S", 0.5)
    monkeypatch.setattr(store_schema, "BUSY_TIMEOUT_S", 0.1)
    conv_id = _new_conversation()
    holder = _hold_lock(_db(), 3.0, threading.Event())
    rc = main(["run", "--model", "syn", "-p", "hello", "-n", "3", "--conversation", conv_id])
    captured = capsys.readouterr()
    holder.join()
    assert rc == 2
    assert "locked by another process" in captured.err and str(_db()) in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""  # refused before generating: no reply printed and then lost


# ---- damaged and foreign database files ------------------------------------------------------


def _overwrite_middle(path: Path) -> None:
    with ConversationStore.open(path) as store:
        conv = store.create_conversation("damaged")
        for i in range(400):
            store.add_message(conv.id, "user", f"message {i} " * 20)
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2 - (size // 2) % 4096)
        f.write(b"\xa5" * 4096)


def _version(value: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        ConversationStore.open(path).close()
        db = sqlite3.connect(path)
        db.execute(f"PRAGMA user_version = {value}")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()

    return make


def _foreign_version_1(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (x)")
    db.execute("PRAGMA user_version = 1")
    db.close()


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _not_sqlite(path: Path) -> None:
    path.write_bytes(b"not a database at all" * 100)


DAMAGED = [
    pytest.param(_overwrite_middle, "is damaged", id="bytes-overwritten"),
    pytest.param(_version(-1), "schema version -1", id="user-version-negative"),
    pytest.param(_version(99), "newer than this npuchat", id="user-version-newer"),
    pytest.param(_foreign_version_1, "lacks npuchat's tables", id="foreign-with-version"),
    pytest.param(_empty, "the file is empty", id="zero-bytes"),
    pytest.param(_not_sqlite, "not an SQLite database", id="not-sqlite"),
]


@pytest.mark.parametrize(("damage", "needle"), DAMAGED)
@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["run", "--model", "syn", "-p", "hi", "--conversation", "new"], id="run-new"),
        pytest.param(["run", "--model", "syn", "-p", "hi", "--conversation", "x"], id="run-id"),
        pytest.param([], id="app"),
    ],
)
def test_a_damaged_database_is_refused_by_name_and_never_written(
    syn: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    needle: str,
    argv: list[str],
) -> None:
    path = _db()
    path.parent.mkdir(parents=True, exist_ok=True)
    damage(path)
    before = _digest(path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and str(path) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    if needle not in ("newer than this npuchat",):
        assert "mv " in err  # says how to move it aside
    assert _digest(path) == before
    assert not Path(str(path) + "-wal").exists() or Path(str(path) + "-wal").stat().st_size == 0


def test_damage_found_while_in_use_stops_all_writes(tmp_path: Path) -> None:
    """Damage that appears after the open-time check (another program writing over the file)
    is reported on the first read that meets it, and from then on nothing is written."""
    path = tmp_path / "c.db"
    _overwrite_middle(path)
    store = ConversationStore(sqlite3.connect(path, isolation_level=None), path, clock=_now)
    conv = store.list_conversations()[0]
    with pytest.raises(NpuchatError, match="is damaged"):
        store.search("no such text")
    before = _digest(path)
    with pytest.raises(NpuchatError, match="nothing was written"):
        store.add_message(conv.id, "user", "after the damage")
    assert _digest(path) == before
    store.close()


def _now() -> datetime:
    return datetime.now(UTC)


# ---- the app against another process and a locked file ----------------------------------------


async def _send(pilot: Pilot[None], text: str) -> None:
    composer = pilot.app.screen.query_one(Composer)
    composer.focus()
    composer.text = text
    await pilot.press("enter")


@pytest.fixture()
def file_store(tmp_path: Path) -> Iterator[ConversationStore]:
    store = ConversationStore.open(tmp_path / "conversations.db")
    yield store
    store.close()


def test_app_commits_streaming_text_within_half_a_second(file_store: ConversationStore) -> None:
    reply = ScriptedReply(["Streaming ", "text", " and more"], hold_at=2)
    app = make_app(ScriptedEngine([reply]), file_store)
    other = ConversationStore.open(file_store.path)  # type: ignore[arg-type]

    def stored() -> str:
        convs = other.list_conversations()
        msgs = other.messages(convs[0].id) if convs else []
        return msgs[-1].content if msgs and msgs[-1].role == "assistant" else ""

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            await _send(pilot, "hello")
            await wait_until(pilot, reply.reached_hold.is_set, "the reply to stream")
            view = screen.query(AssistantMessage).last()
            await wait_until(pilot, lambda: view.content == "Streaming text", "the text")
            shown_at = time.monotonic()
            await wait_until(pilot, lambda: stored() == "Streaming text", "a commit", 2.0)
            assert time.monotonic() - shown_at < 0.8
            reply.release.set()

    asyncio.run(run())
    other.close()


def test_app_shows_turns_another_process_added_before_regenerating(
    file_store: ConversationStore,
) -> None:
    engine = ScriptedEngine([ScriptedReply(["first reply"]), ScriptedReply(["regenerated"])])
    app = make_app(engine, file_store)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            await _send(pilot, "question one")
            await wait_until(pilot, lambda: not screen.generating and screen.conversation, "reply")
            assert screen.conversation is not None
            conv_id = screen.conversation.id
            with ConversationStore.open(file_store.path) as other:  # type: ignore[arg-type]
                other.add_message(conv_id, "user", "question from run")
                other.add_message(conv_id, "assistant", "reply from run")
            await pilot.press("ctrl+r")
            await pilot.pause(0.2)
            contents = [m.content for m in file_store.messages(conv_id)]
            assert "reply from run" in contents  # a reply the user never saw is not deleted
            shown = [v.content for v in screen.query(MessageView)]
            assert shown[-2:] == ["question from run", "reply from run"]
            await pilot.press("ctrl+r")  # now it regenerates what is on screen
            await wait_until(
                pilot,
                lambda: [v.content for v in screen.query(MessageView)][-1] == "regenerated",
                "the regenerated reply",
            )
            contents = [m.content for m in file_store.messages(conv_id)]
            assert contents == ["question one", "first reply", "question from run", "regenerated"]

    asyncio.run(run())


def test_app_keeps_the_typed_message_when_the_database_stays_locked(
    file_store: ConversationStore,
) -> None:
    file_store._db.execute("PRAGMA busy_timeout = 100")
    file_store.busy_deadline_s = 0.3
    app = make_app(ScriptedEngine([ScriptedReply(["never"])]), file_store)
    assert file_store.path is not None
    file_store.create_conversation("existing")

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            holder = _hold_lock(file_store.path, 2.0, threading.Event())  # type: ignore[arg-type]
            await _send(pilot, "do not lose me")
            await pilot.pause(0.8)
            assert screen.query_one(Composer).text == "do not lose me"
            assert not screen.query(MessageView)
            holder.join()

    asyncio.run(run())
    assert app.return_code in (None, 0)


def test_app_reports_damage_met_while_opening_a_chat_instead_of_crashing(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    _overwrite_middle(path)  # damage the open-time check would have refused; met while in use
    store = ConversationStore(sqlite3.connect(path, isolation_level=None), path, clock=_now)
    conv_id = store.list_conversations()[0].id
    app = make_app(ScriptedEngine(), store)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            await screen.open_conversation(conv_id)
            await pilot.pause(0.1)
            warnings = [n.message for n in app._notifications]
            assert any("is damaged" in w and str(path) in w for w in warnings), warnings
            assert screen.conversation is None  # nothing half-shown

    asyncio.run(run())
    store.close()
