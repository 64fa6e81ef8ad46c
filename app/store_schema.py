"""Opening the conversation database safely: schema versions, damage checks, busy retries.

Why a separate module: these are the rules that decide whether a file on disk may be used at
all, and they must hold before the first write. A file is used only if it is a readable npuchat
database of a version this build understands and SQLite's `quick_check` finds it sound; anything
else (an empty file, another program's database, a newer schema, bytes overwritten in the middle)
is refused with its path and the command that moves it aside, and is never written to. Once a
database turns out damaged while in use, the store stops writing to it for the rest of the run.
"""

from __future__ import annotations

import shlex
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from npuchat.engine.errors import IntegrityError, NpuchatError

from .store_records import ConversationSettings, metrics_from_json

T = TypeVar("T")

BUSY_TIMEOUT_S = 2.0
"""SQLite's own wait for a lock held by another process, per attempt."""
BUSY_DEADLINE_S = 30.0
"""How long a write keeps retrying a locked database before giving up with an error."""


def _create_v1(db: sqlite3.Connection) -> None:
    # One execute per statement: executescript() would commit the migration's transaction.
    for statement in _V1_SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)


_V1_SCHEMA = """
        CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            settings TEXT NOT NULL
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            status TEXT NOT NULL
                CHECK (status IN ('complete', 'stopped', 'partial', 'error')),
            metrics TEXT,
            error TEXT NOT NULL DEFAULT '',
            created_at TEXT NOT NULL
        );
        CREATE INDEX messages_by_conversation ON messages (conversation_id, id);
        CREATE INDEX conversations_by_update ON conversations (updated_at);
"""


def _add_stop_reason_v2(db: sqlite3.Connection) -> None:
    """Why a reply ended, and the token limit it was given, kept with the reply: a reply cut
    by its limit must still say so (and offer to continue) after a restart or a change of the
    conversation's max_tokens. Replies written before this column get the answer version 1 of
    the app inferred from them: a complete reply that used its conversation's whole budget."""
    db.execute(
        "ALTER TABLE messages ADD COLUMN stop_reason TEXT NOT NULL DEFAULT ''"
        " CHECK (stop_reason IN ('', 'eos', 'stop_string', 'max_tokens', 'length'))"
    )
    db.execute("ALTER TABLE messages ADD COLUMN token_limit INTEGER NOT NULL DEFAULT 0")
    rows = db.execute(
        "SELECT m.id, m.metrics, c.settings FROM messages m"
        " JOIN conversations c ON c.id = m.conversation_id"
        " WHERE m.role = 'assistant' AND m.status = 'complete' AND m.metrics IS NOT NULL"
    ).fetchall()
    for message_id, metrics, settings in rows:
        limit = _cut_by(metrics, settings)
        if limit:
            db.execute(
                "UPDATE messages SET stop_reason = 'max_tokens', token_limit = ? WHERE id = ?",
                (limit, message_id),
            )


def _cut_by(metrics: str, settings: str) -> int:
    """The token limit a version-1 reply used up (0: it ended before it, or cannot tell)."""
    try:
        m = metrics_from_json(metrics)
        limit = ConversationSettings.from_json(settings).max_tokens
    except (ValueError, TypeError):
        return 0  # a row this build cannot read is left as it is
    return limit if m is not None and 0 < limit <= m.decode_tokens + 1 else 0


# MIGRATIONS[i] upgrades schema version i to i + 1. Append, never edit a released step.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_create_v1, _add_stop_reason_v2)
SCHEMA_VERSION = len(MIGRATIONS)


class DatabaseDamagedError(IntegrityError):
    """The conversation database cannot be trusted; nothing more is written to it."""


class DatabaseBusyError(NpuchatError):
    """Another process held the database lock for longer than the retry deadline."""


def move_aside_hint(path: str) -> str:
    """The one command that moves a refused database (and its WAL) out of the way."""
    q = shlex.quote(path)
    return (
        f"move it aside to start a new history: mv {q} {shlex.quote(path + '.damaged')}"
        f" (and {shlex.quote(path + '-wal')} if present)"
    )


def damaged(name: str, why: str) -> DatabaseDamagedError:
    return DatabaseDamagedError(
        f"the conversation database {name} is damaged ({why}); nothing was written to it;"
        f" {move_aside_hint(name)}"
    )


def is_busy(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def with_retries(name: str, action: Callable[[], T], deadline_s: float = BUSY_DEADLINE_S) -> T:
    """Run `action`, retrying while another process holds the lock, up to `deadline_s`.

    SQLite's busy timeout already waits inside each attempt; the loop on top keeps a long-held
    lock (another npuchat committing a big export, a `sqlite3` shell left in a transaction) from
    turning into a lost message.
    """
    end = time.monotonic() + deadline_s
    while True:
        try:
            return action()
        except sqlite3.Error as exc:
            if not is_busy(exc):
                raise
            if time.monotonic() >= end:
                raise DatabaseBusyError(
                    f"the conversation database {name} stayed locked by another process for"
                    f" {deadline_s:.0f} s; close the other program (or finish its transaction)"
                    " and try again"
                ) from exc
            time.sleep(0.05)


def connect(path: Path) -> sqlite3.Connection:
    """Connect to an existing database, or create a new one where no file exists.

    An existing empty file is refused: SQLite would silently make it a new database, and an
    empty file where a history should be is more likely a truncated copy than a fresh start.
    """
    name = str(path)
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise NpuchatError(f"{name} is not a regular file; {move_aside_hint(name)}")
        wal = Path(name + "-wal")
        if path.stat().st_size == 0 and not (wal.exists() and wal.stat().st_size > 0):
            raise damaged(name, "the file is empty")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        db = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
    except sqlite3.Error as exc:
        raise NpuchatError(f"cannot open conversation database {name}: {exc}") from exc
    return db


def check_and_migrate(
    db: sqlite3.Connection,
    name: str,
    migrations: tuple[Callable[[sqlite3.Connection], None], ...] = MIGRATIONS,
) -> None:
    """Check the schema version and the file's soundness, migrate forward if older.

    Everything that can refuse the file runs before the first write (the WAL switch included).
    """
    version = len(migrations)
    try:
        found = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        if is_busy(exc):
            raise
        raise NpuchatError(
            f"{name} is not an SQLite database ({exc}); {move_aside_hint(name)}"
        ) from exc
    if found < 0:
        raise NpuchatError(
            f"{name} has schema version {found}, which no npuchat writes; it was left"
            f" untouched; {move_aside_hint(name)}"
        )
    if found > version:
        raise NpuchatError(
            f"{name} has schema version {found}, newer than this npuchat understands"
            f" ({version}); upgrade npuchat (the file was left untouched)"
        )
    try:
        problems = [row[0] for row in db.execute("PRAGMA quick_check(5)").fetchall()]
        tables = {
            row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    except sqlite3.DatabaseError as exc:
        if is_busy(exc):
            raise
        raise damaged(name, str(exc)) from exc
    if problems != ["ok"]:
        raise damaged(name, "; ".join(problems)[:200])
    if found == 0 and tables:
        raise NpuchatError(
            f"{name} holds tables but no npuchat schema version; it is not an npuchat"
            f" history (the file was left untouched); {move_aside_hint(name)}"
        )
    if found > 0 and not {"conversations", "messages"} <= tables:
        raise NpuchatError(
            f"{name} says schema version {found} but lacks npuchat's tables (the file was left"
            f" untouched); {move_aside_hint(name)}"
        )
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("PRAGMA journal_mode = WAL")
    if found < version:
        db.execute("BEGIN IMMEDIATE")
        try:
            for step in migrations[found:]:
                step(db)
            db.execute(f"PRAGMA user_version = {version}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    db.execute("PRAGMA synchronous = NORMAL")
