"""What the conversation store holds, as frozen values: conversations, messages, settings.

Apart from `store` (the SQLite reads and writes) so that the UI, the exporter and the tests can
name and build these values without the database, and so the JSON forms of settings and metrics
(how a row stores them, tolerant of keys from other versions) live next to the types.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Literal

from npuchat.engine.events import Metrics, SamplingParams, StopReason
from npuchat.engine.grammar import ANY_OBJECT

Role = Literal["system", "user", "assistant"]
MessageStatus = Literal["complete", "stopped", "partial", "error"]
ExportFormat = Literal["markdown", "json"]
ReplyFormat = Literal["text", "json"]


@dataclass(frozen=True)
class ConversationSettings:
    """Per-conversation generation settings. Empty model/draft mean "the app's default"."""

    system_prompt: str = "You are a helpful assistant."
    model: str = ""
    draft: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 1024
    seed: int | None = None
    reply_format: ReplyFormat = "text"  # "json": every reply is one JSON object (JSON mode)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def sampling(self) -> SamplingParams:
        """The engine's sampling parameters for a reply of this conversation."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            max_tokens=self.max_tokens,
            seed=self.seed,
            json_schema=ANY_OBJECT if self.reply_format == "json" else None,
        )

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
    stop_reason: StopReason | None = None
    """Why a complete reply ended (None: not ended, or written before the store kept it)."""
    token_limit: int = 0
    """The reply's max_tokens, kept with it: a reply cut by it says which limit cut it."""

    @property
    def cut_at(self) -> int:
        """The token limit that cut this reply short (0: it was not cut)."""
        cut = self.status == "complete" and self.stop_reason == "max_tokens"
        return self.token_limit if cut else 0


def metrics_to_json(metrics: Metrics | None) -> str | None:
    return None if metrics is None else json.dumps(asdict(metrics), sort_keys=True)


def metrics_from_json(text: str | None) -> Metrics | None:
    if not text:
        return None
    data = json.loads(text)
    known = {f.name for f in fields(Metrics)}
    return Metrics(**{k: v for k, v in data.items() if k in known})


def default_title(first_user_message: str, limit: int = 60) -> str:
    """The first line of the first user message, shortened to `limit` characters."""
    line = next((ln.strip() for ln in first_user_message.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def conversation_from_row(row: tuple) -> Conversation:
    return Conversation(
        id=row[0],
        title=row[1],
        created_at=datetime.fromisoformat(row[2]),
        updated_at=datetime.fromisoformat(row[3]),
        settings=ConversationSettings.from_json(row[4]),
    )


def message_from_row(row: tuple) -> StoredMessage:
    return StoredMessage(
        id=row[0],
        conversation_id=row[1],
        role=row[2],
        content=row[3],
        status=row[4],
        created_at=datetime.fromisoformat(row[5]),
        metrics=metrics_from_json(row[6]),
        error=row[7],
        stop_reason=row[8] or None,
        token_limit=row[9],
    )
