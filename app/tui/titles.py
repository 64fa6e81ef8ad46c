"""Conversation titles written by the model in the background.

After the first reply of a conversation the model is asked for a short title, as a background
request (`priority="background"`) over the same conversation, so its prefix KV is reused and
the follow-up turn still finds the conversation in the cache. A user message sent while a
title runs cancels it (the user's reply matters more); a title that lands after the user
renamed the chat is dropped.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from textual.worker import Worker, WorkerCancelled, WorkerError

from npuchat.app.store import ConversationStore
from npuchat.app.store_records import ConversationSettings, StoredMessage, default_title
from npuchat.app.tui.generation import build_request
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    ChatEngine,
    ChatMessage,
    ChatRequest,
    Failed,
    Finished,
    SamplingParams,
    TokenDelta,
)

TITLE_INSTRUCTION = (
    "Write a title of at most six words for this conversation. Reply with the title only."
)
TITLE_TOKENS = 16
MAX_TITLE_CHARS = 60


def title_request(
    conversation_id: str, settings: ConversationSettings, history: Sequence[StoredMessage]
) -> ChatRequest:
    """The conversation so far plus the title instruction, greedy and short."""
    base = build_request(conversation_id, settings, history)
    return replace(
        base,
        messages=(*base.messages, ChatMessage("user", TITLE_INSTRUCTION)),
        sampling=SamplingParams(temperature=0.0, max_tokens=TITLE_TOKENS),
        priority="background",
    )


def clean_title(text: str) -> str:
    """The model's answer as a one-line title: the first non-empty line that is not a lead-in
    ("Here's a possible title:"), without quotes, Markdown marks, a "Title:" label or a final
    full stop; "" if nothing is left (a lead-in alone is no title)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = next((ln for ln in lines if not ln.endswith(":")), "")
    line = re.sub(r"^(#+\s*|\*+|title\s*:\s*)", "", line, flags=re.IGNORECASE)
    line = line.strip(" \t*_`\"'“”‘’").rstrip(".")
    line = re.sub(r"\s+", " ", line).strip()
    if len(line) > MAX_TITLE_CHARS:
        line = line[: MAX_TITLE_CHARS - 1].rstrip() + "…"
    return line


def generate_title(engine: ChatEngine, request: ChatRequest, cancel: threading.Event) -> str:
    """Worker-thread body: the cleaned title, or "" if the engine failed, was busy or stopped."""
    text = ""
    try:
        for event in engine.generate(request, cancel):
            if isinstance(event, TokenDelta):
                text += event.text
            elif isinstance(event, Finished):
                return clean_title(text)
            elif isinstance(event, Failed):
                return ""
    except NpuchatError:
        return ""
    return ""


@dataclass
class TitleJob:
    conversation_id: str
    cancel: threading.Event = field(default_factory=threading.Event)
    worker: Worker[None] | None = None


class TitleJobs:
    """The background titles in flight, so that a user message can cancel them first."""

    def __init__(self, spawn: Callable[[ChatEngine, ChatRequest, TitleJob], Worker[None]]) -> None:
        self._spawn = spawn
        self._jobs: dict[str, TitleJob] = {}

    def after_reply(
        self, engine: ChatEngine, store: ConversationStore, conversation_id: str
    ) -> None:
        """Ask for a title once the first reply of a conversation that still has its
        automatic title (the start of the first message) is complete."""
        if conversation_id in self._jobs:
            return
        history = store.messages(conversation_id)
        users = [m for m in history if m.role == "user"]
        replies = [m for m in history if m.role == "assistant" and m.status == "complete"]
        conv = store.get_conversation(conversation_id)
        if len(users) != 1 or not replies or conv.title != default_title(users[0].content):
            return
        job = TitleJob(conversation_id)
        self._jobs[conversation_id] = job
        request = title_request(conversation_id, conv.settings, history)
        job.worker = self._spawn(engine, request, job)

    def landed(self, store: ConversationStore, conversation_id: str, title: str) -> bool:
        """Save a generated title unless the user renamed the chat (or deleted it) meanwhile;
        True if saved."""
        job = self._jobs.pop(conversation_id, None)
        if not title or job is None or job.cancel.is_set():
            return False
        try:
            conv = store.get_conversation(conversation_id)
            users = [m for m in store.messages(conversation_id) if m.role == "user"]
        except NpuchatError:
            return False
        if not users or conv.title != default_title(users[0].content):
            return False
        store.rename(conversation_id, title)
        return True

    def running(self, conversation_id: str) -> bool:
        return conversation_id in self._jobs

    async def cancel_all(self) -> None:
        """Stop every title and wait until the engine has let go of them (a one-sequence
        engine would answer the user's request "busy" otherwise)."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.set()
        for job in jobs:
            if job.worker is not None:
                with contextlib.suppress(WorkerError, WorkerCancelled):
                    await job.worker.wait()
            self._jobs.pop(job.conversation_id, None)
