"""Conversations and messages in SQLite, under the data dir.

Why SQLite: every message is committed the moment it is sent or finished (and a streaming reply
is saved periodically), so a crash or a killed terminal never loses a committed message, and WAL
mode keeps those small commits cheap. The schema version lives in `PRAGMA user_version`; older
databases are migrated forward in one transaction, and a database written by a newer npuchat (or
something that is not an npuchat database at all) is refused and left untouched.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import Metrics

Role = Literal["system", "user", "assistant"]
MessageStatus = Literal["complete", "stopped", "partial", "error"]
ExportFormat = Literal["markdown", "json"]
MESSAGE_STATUSES: tuple[str, ...] = ("complete", "stopped", "partial", "error")

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class ConversationSettings:
    """Per-conversation generation settings. Empty model/draft mean "the app's default"."""

    system_prompt: str = "You are a helpful assistant."
    model: str = ""
    draft: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    max_tokens: int = 1024
    seed: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ConversationSettings:
        """Read stored settings; unknown keys (from a later version) are ignored, missing ones
        take their defaults, so old rows keep working as fields are added."""
        data = json.loads(text) if text else {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str
    created_at: datetime
    updated_at: datetime
    settings: ConversationSettings = field(default_factory=ConversationSettings)


@dataclass(frozen=True)
class StoredMessage:
    id: int
    conversation_id: str
    role: Role
    content: str
    status: MessageStatus
    created_at: datetime
    metrics: Metrics | None = None
    error: str = ""


def metrics_to_json(metrics: Metrics | None) -> str | None:
    return None if metrics is None else json.dumps(asdict(metrics), sort_keys=True)


def metrics_from_json(text: str | None) -> Metrics | None:
    if not text:
        return None
    data = json.loads(text)
    known = {f.name for f in fields(Metrics)}
    return Metrics(**{k: v for k, v in data.items() if k in known})


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


# MIGRATIONS[i] upgrades schema version i to i + 1. Append, never edit a released step.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_create_v1,)
SCHEMA_VERSION = len(MIGRATIONS)


class ConversationStore:
    """All reads and writes of conversations. One instance per open database file.

    Use it from one thread (the UI's): sqlite3 enforces that, which catches misuse early.
    """

    def __init__(self, db: sqlite3.Connection, path: Path | None, clock: Clock) -> None:
        self._db = db
        self.path = path
        self._clock = clock

    # ---- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path, *, clock: Clock | None = None) -> ConversationStore:
        """Open (creating or migrating) the database at `path`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            db = sqlite3.connect(path, isolation_level=None)
        except sqlite3.Error as exc:
            raise NpuchatError(f"cannot open conversation database {path}: {exc}") from exc
        try:
            _prepare(db, str(path))
        except BaseException:
            db.close()
            raise
        return cls(db, path, clock or _utc_now)

    @classmethod
    def in_memory(cls, *, clock: Clock | None = None) -> ConversationStore:
        db = sqlite3.connect(":memory:", isolation_level=None)
        _prepare(db, ":memory:")
        return cls(db, None, clock or _utc_now)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _now(self) -> str:
        return self._clock().isoformat()

    # ---- conversations -------------------------------------------------------------------

    def create_conversation(
        self, title: str = "", settings: ConversationSettings | None = None
    ) -> Conversation:
        now = self._now()
        conv_id = uuid.uuid4().hex
        with self._tx() as db:
            db.execute(
                "INSERT INTO conversations (id, title, created_at, updated_at, settings)"
                " VALUES (?, ?, ?, ?, ?)",
                (conv_id, title, now, now, (settings or ConversationSettings()).to_json()),
            )
        return self.get_conversation(conv_id)

    def get_conversation(self, conversation_id: str) -> Conversation:
        row = self._db.execute(
            "SELECT id, title, created_at, updated_at, settings FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            raise NpuchatError(f"conversation {conversation_id} does not exist")
        return _conversation(row)

    def list_conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        rows = self._db.execute(
            "SELECT id, title, created_at, updated_at, settings FROM conversations"
            " ORDER BY updated_at DESC, rowid DESC"
        ).fetchall()
        return [_conversation(r) for r in rows]

    def search(self, text: str) -> list[Conversation]:
        """Conversations whose title or any message contains `text` (case-insensitive)."""
        if not text.strip():
            return self.list_conversations()
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._db.execute(
            "SELECT id, title, created_at, updated_at, settings FROM conversations c"
            " WHERE c.title LIKE :p ESCAPE '\\'"
            " OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id"
            "            AND m.content LIKE :p ESCAPE '\\')"
            " ORDER BY updated_at DESC, rowid DESC",
            {"p": pattern},
        ).fetchall()
        return [_conversation(r) for r in rows]

    def rename(self, conversation_id: str, title: str) -> None:
        self._update_conversation(conversation_id, "title = ?", (title.strip(),))

    def update_settings(self, conversation_id: str, settings: ConversationSettings) -> None:
        self._update_conversation(conversation_id, "settings = ?", (settings.to_json(),))

    def delete_conversation(self, conversation_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _update_conversation(self, conversation_id: str, assignment: str, args: tuple) -> None:
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE conversations SET {assignment}, updated_at = ? WHERE id = ?",
                (*args, self._now(), conversation_id),
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
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, status, metrics, error,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, status, metrics_to_json(metrics), error, now),
            )
            message_id = cur.lastrowid
            db.execute(
                "UPDATE conversations SET updated_at = ?,"
                " title = CASE WHEN title = '' AND ? = 'user' THEN ? ELSE title END"
                " WHERE id = ?",
                (now, role, default_title(content), conversation_id),
            )
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
    ) -> StoredMessage:
        """Overwrite a (streaming) reply: called periodically with status "partial" and once
        more when the reply ends."""
        with self._tx() as db:
            db.execute(
                "UPDATE messages SET content = ?, status = ?, metrics = ?, error = ? WHERE id = ?",
                (content, status, metrics_to_json(metrics), error, message_id),
            )
        return self.get_message(message_id)

    def get_message(self, message_id: int) -> StoredMessage:
        row = self._db.execute(
            "SELECT id, conversation_id, role, content, status, created_at, metrics, error"
            " FROM messages WHERE id = ?",
            (message_id,),
        ).fetchone()
        if row is None:
            raise NpuchatError(f"message {message_id} does not exist")
        return _message(row)

    def messages(self, conversation_id: str) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT id, conversation_id, role, content, status, created_at, metrics, error"
            " FROM messages WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()
        return [_message(r) for r in rows]

    def truncate_from(self, conversation_id: str, message_id: int) -> None:
        """Delete `message_id` and every later message (regenerate, edit-and-continue)."""
        with self._tx() as db:
            db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                (conversation_id, message_id),
            )

    # ---- export --------------------------------------------------------------------------

    def export(self, conversation_id: str, path: Path, fmt: ExportFormat | None = None) -> Path:
        """Write one conversation to `path` as Markdown or JSON (chosen by `fmt`, else by the
        file suffix: .json is JSON, anything else Markdown). Returns the absolute path."""
        conv = self.get_conversation(conversation_id)
        msgs = self.messages(conversation_id)
        fmt = fmt or ("json" if path.suffix.lower() == ".json" else "markdown")
        text = export_json(conv, msgs) if fmt == "json" else export_markdown(conv, msgs)
        path = path.expanduser().resolve()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise NpuchatError(f"cannot write {path}: {exc.strerror}; choose another path") from exc
        return path


def default_title(first_user_message: str, limit: int = 60) -> str:
    """The first line of the first user message, shortened to `limit` characters."""
    line = next((ln.strip() for ln in first_user_message.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def export_markdown(conv: Conversation, msgs: list[StoredMessage]) -> str:
    out = [f"# {conv.title or 'Untitled conversation'}", ""]
    out.append(f"*Created {conv.created_at:%Y-%m-%d %H:%M} UTC*")
    if conv.settings.system_prompt:
        out += ["", "**System:** " + conv.settings.system_prompt]
    for m in msgs:
        heading = {"user": "You", "assistant": "Assistant", "system": "System"}[m.role]
        if m.status != "complete":
            heading += f" ({m.status})"
        out += ["", f"## {heading}", "", m.content.rstrip()]
        if m.error:
            out += ["", f"> Error: {m.error}"]
    return "\n".join(out) + "\n"


def export_json(conv: Conversation, msgs: list[StoredMessage]) -> str:
    doc: dict[str, Any] = {
        "id": conv.id,
        "title": conv.title,
        "created_at": conv.created_at.isoformat(),
        "updated_at": conv.updated_at.isoformat(),
        "settings": asdict(conv.settings),
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "created_at": m.created_at.isoformat(),
                "metrics": None if m.metrics is None else asdict(m.metrics),
                "error": m.error,
            }
            for m in msgs
        ],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def _prepare(db: sqlite3.Connection, name: str) -> None:
    """Check the schema version, migrate forward if older, refuse if newer or foreign."""
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise NpuchatError(
            f"{name} is not an SQLite database ({exc}); move it away to start a new history"
        ) from exc
    if version > SCHEMA_VERSION:
        raise NpuchatError(
            f"{name} has schema version {version}, newer than this npuchat understands"
            f" ({SCHEMA_VERSION}); upgrade npuchat (the file was left untouched)"
        )
    if version == 0:
        tables = db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()
        if tables[0]:
            raise NpuchatError(
                f"{name} holds tables but no npuchat schema version; it is not an npuchat"
                " history (the file was left untouched); move it away"
            )
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("PRAGMA journal_mode = WAL")
    if version < SCHEMA_VERSION:
        db.execute("BEGIN IMMEDIATE")
        try:
            for step in MIGRATIONS[version:]:
                step(db)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    db.execute("PRAGMA synchronous = NORMAL")


def _conversation(row: tuple) -> Conversation:
    return Conversation(
        id=row[0],
        title=row[1],
        created_at=datetime.fromisoformat(row[2]),
        updated_at=datetime.fromisoformat(row[3]),
        settings=ConversationSettings.from_json(row[4]),
    )


def _message(row: tuple) -> StoredMessage:
    return StoredMessage(
        id=row[0],
        conversation_id=row[1],
        role=row[2],
        content=row[3],
        status=row[4],
        created_at=datetime.fromisoformat(row[5]),
        metrics=metrics_from_json(row[6]),
        error=row[7],
    )


__all__ = [
    "SCHEMA_VERSION",
    "Conversation",
    "ConversationSettings",
    "ConversationStore",
    "StoredMessage",
    "default_title",
    "export_json",
    "export_markdown",
]
