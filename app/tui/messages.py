"""Textual messages that worker threads post to the UI (post_message is thread-safe)."""

from __future__ import annotations

from textual.message import Message

from npuchat.app.engine_port import EngineSpec
from npuchat.engine.events import ChatEngine


class LoadProgress(Message):
    """The engine loader reported a stage (text) and how far it is (0..1)."""

    def __init__(self, stage: str, fraction: float) -> None:
        super().__init__()
        self.stage = stage
        self.fraction = fraction


class EngineLoaded(Message):
    def __init__(self, spec: EngineSpec, engine: ChatEngine) -> None:
        super().__init__()
        self.spec = spec
        self.engine = engine


class EngineLoadFailed(Message):
    def __init__(self, spec: EngineSpec, message: str) -> None:
        super().__init__()
        self.spec = spec
        self.message = message


class GenerationEnded(Message):
    """The worker saw the terminal event: drain the reply buffer now, not at the next tick."""


class TitleGenerated(Message):
    """A background title request ended; `title` is "" when there is nothing to show."""

    def __init__(self, conversation_id: str, title: str) -> None:
        super().__init__()
        self.conversation_id = conversation_id
        self.title = title
