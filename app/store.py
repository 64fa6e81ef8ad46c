"""Conversations and messages in SQLite, under the data dir.

Why SQLite: every message is committed the moment it is sent, and a streaming reply as it
streams, so a crash or a killed terminal never loses what was on screen, and WAL mode keeps
those small commits cheap. Opening, schema versions and damage checks live in `store_schema`.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import Metrics, StopReason

from . import store_schema
from .store_records import (
    Conversation,
    ConversationSettings,
    ExportFormat,
    MessageStatus,
    Role,
    StoredMessage,
    conversation_from_row,
    default_title,
    message_from_row,
    metrics_to_json,
)
from .store_schema import (
    check_and_migrate,
    connect,
    damaged,
    with_retries,
)

T = TypeVar("T")

Clock = Callable[[], datetime]

_CONVERSATION_COLUMNS = "id, title, created_at, updated_at, settings"
_MESSAGE_COLUMNS = (
    "id, conversation_id, role, content, status, created_at, metrics, error, stop_reason,"
    " token_limit"
)


def _utc_now() -> datetime:
    return datetime.now(UTC)


class ConversationStore:
    """All reads and writes of conversations. One instance per open database file.

    Use it from one thread (the UI's): sqlite3 enforces that, which catches misuse early. Every
    write is its own committed transaction, retried while another process holds the lock; a
    database found damaged is never written to again by this instance.
    """

    def __init__(
        self,
        db: sqlite3.Connection,
        path: Path | None,
        clock: Clock,
        busy_deadline_s: float | None = None,
    ) -> None:
        self._db = db
        self.path = path
        self._clock = clock
        self._name = str(path) if path is not None else ":memory:"
        self.busy_deadline_s = (
            store_schema.BUSY_DEADLINE_S if busy_deadline_s is None else busy_deadline_s
        )
        self._damage: str | None = None

    # ---- opening -------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        clock: Clock | None = None,
        busy_deadline_s: float | None = None,
    ) -> ConversationStore:
        """Open (creating or migrating) the database at `path`; refuse a damaged or foreign
        one with a one-line error that names the file (see `store_schema`)."""
        db = connect(path)
        store = cls(db, path, clock or _utc_now, busy_deadline_s)
        try:
            with_retries(str(path), lambda: check_and_migrate(db, str(path)), store.busy_deadline_s)
        except BaseException:
            db.close()
            raise
        return store

    @classmethod
    def in_memory(cls, *, clock: Clock | None = None) -> ConversationStore:
        db = sqlite3.connect(":memory:", isolation_level=None)
        check_and_migrate(db, ":memory:")
        return cls(db, None, clock or _utc_now)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, action: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return with_retries(self._name, lambda: action(self._db), self.busy_deadline_s)
        except sqlite3.DatabaseError as exc:
            self._damage = str(exc)
            raise damaged(self._name, str(exc)) from exc

    def _write(
        self, action: Callable[[sqlite3.Connection], T], deadline_s: float | None = None
    ) -> T:
        """Run `action` in one committed transaction; retried whole while the file is locked."""
        if self._damage is not None:
            raise damaged(self._name, self._damage)

        def attempt() -> T:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = action(self._db)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            return result

        deadline = self.busy_deadline_s if deadline_s is None else deadline_s
        try:
            return with_retries(self._name, attempt, deadline)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.IntegrityError):
                raise
            self._damage = str(exc)
            raise damaged(self._name, str(exc)) from exc

    def _now(self) -> str:
        return self._clock().isoformat()

    # ---- conversations -------------------------------------------------------------------

    def create_conversation(
        self, title: str = "", settings: ConversationSettings | None = None
    ) -> Conversation:
        now = self._now()
        conv_id = uuid.uuid4().hex
        self._write(
            lambda db: db.execute(
                "INSERT INTO conversations (id, title, created_at, updated_at, settings)"
                " VALUES (?, ?, ?, ?, ?)",
                (conv_id, title, now, now, (settings or ConversationSettings()).to_json()),
            )
        )
        return self.get_conversation(conv_id)

    def get_conversation(self, conversation_id: str) -> Conversation:
        row = self._read(
            lambda db: db.execute(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
        )
        if row is None:
            raise NpuchatError(f"conversation {conversation_id} does not exist")
        return conversation_from_row(row)

    def list_conversations(self, limit: int = -1) -> list[Conversation]:
        """Most recently updated first; at most `limit` of them (-1: all)."""
        rows = self._read(
            lambda db: db.execute(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations"
                " ORDER BY updated_at DESC, rowid DESC LIMIT ?",
                (limit,),
            ).fetchall()
        )
        return [conversation_from_row(r) for r in rows]

    def search(self, text: str, limit: int = -1) -> list[Conversation]:
        """Conversations whose title or any message contains `text` (case-insensitive), most
        recently updated first; at most `limit` of them (-1: all)."""
        if not text.strip():
            return self.list_conversations(limit)
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._read(
            lambda db: db.execute(
                "SELECT id, title, created_at, updated_at, settings FROM conversations c"
                " WHERE c.title LIKE :p ESCAPE '\\'"
                " OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id"
                "            AND m.content LIKE :p ESCAPE '\\')"
                " ORDER BY updated_at DESC, rowid DESC LIMIT :limit",
                {"p": pattern, "limit": limit},
            ).fetchall()
        )
        return [conversation_from_row(r) for r in rows]

    def rename(self, conversation_id: str, title: str) -> None:
        self._update_conversation(conversation_id, "title = ?", (title.strip(),))

    def update_settings(self, conversation_id: str, settings: ConversationSettings) -> None:
        self._update_conversation(conversation_id, "settings = ?", (settings.to_json(),))

    def delete_conversation(self, conversation_id: str) -> None:
        def delete(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

        self._write(delete)

    def _update_conversation(self, conversation_id: str, assignment: str, args: tuple) -> None:
        now = self._now()
        cur = self._write(
            lambda db: db.execute(
                f"UPDATE conversations SET {assignment}, updated_at = ? WHERE id = ?",
                (*args, now, conversation_id),
            )
        )
        if cur.rowcount == 0:
            raise NpuchatError(f"conversation {conversation_id} does not exist")

    # ---- messages ------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: str,
        role: Role,
        content: str,
        status: MessageStatus = "complete",
        metrics: Metrics | None = None,
        error: str = "",
    ) -> StoredMessage:
        """Append and commit a message; the first user message also becomes the title if the
        conversation has none yet."""
        now = self._now()

        def insert(db: sqlite3.Connection) -> int | None:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, status, metrics, error,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, status, metrics_to_json(metrics), error, now),
            )
            db.execute(
                "UPDATE conversations SET updated_at = ?,"
                " title = CASE WHEN title = '' AND ? = 'user' THEN ? ELSE title END"
                " WHERE id = ?",
                (now, role, default_title(content), conversation_id),
            )
            return cur.lastrowid

        message_id = self._write(insert)
        assert message_id is not None
        return self.get_message(message_id)

    def update_message(
        self,
        message_id: int,
        *,
        content: str,
        status: MessageStatus,
        metrics: Metrics | None = None,
        error: str = "",
        stop_reason: StopReason | None = None,
        token_limit: int = 0,
        deadline_s: float | None = None,
    ) -> StoredMessage:
        """Overwrite a (streaming) reply: called periodically with status "partial" and once
        more when the reply ends, with why it ended and the token limit it had. `deadline_s`
        bounds the wait for a locked file (a periodic save can give up and let the next one
        catch up)."""
        self._write(
            lambda db: db.execute(
                "UPDATE messages SET content = ?, status = ?, metrics = ?, error = ?,"
                " stop_reason = ?, token_limit = ? WHERE id = ?",
                (
                    content,
                    status,
                    metrics_to_json(metrics),
                    error,
                    stop_reason or "",
                    token_limit,
                    message_id,
                ),
            ),
            deadline_s,
        )
        return self.get_message(message_id)

    def get_message(self, message_id: int) -> StoredMessage:
        row = self._read(
            lambda db: db.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?",
                (message_id,),
            ).fetchone()
        )
        if row is None:
            raise NpuchatError(f"message {message_id} does not exist")
        return message_from_row(row)

    def messages(self, conversation_id: str) -> list[StoredMessage]:
        rows = self._read(
            lambda db: db.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            ).fetchall()
        )
        return [message_from_row(r) for r in rows]

    def truncate_from(self, conversation_id: str, message_id: int) -> None:
        """Delete `message_id` and every later message (regenerate, edit-and-continue)."""
        self._write(
            lambda db: db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                (conversation_id, message_id),
            )
        )

    # ---- export --------------------------------------------------------------------------

    def export(self, conversation_id: str, path: Path, fmt: ExportFormat | None = None) -> Path:
        """Write one conversation to `path` as Markdown or JSON (chosen by `fmt`, else by the
        file suffix: .json is JSON, anything else Markdown). Returns the absolute path."""
        conv = self.get_conversation(conversation_id)
        msgs = self.messages(conversation_id)
        fmt = fmt or ("json" if path.suffix.lower() == ".json" else "markdown")
        from .store_export import export_json, export_markdown

        text = export_json(conv, msgs) if fmt == "json" else export_markdown(conv, msgs)
        path = path.expanduser().resolve()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise NpuchatError(f"cannot write {path}: {exc.strerror}; choose another path") from exc
        return path


__all__ = ["ConversationStore", "MessageStatus"]  # MessageStatus: callers that write rows
