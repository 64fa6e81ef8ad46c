"""A ChatEngine that plays back scripted replies, for UI tests that need no model.

It follows the `npuchat.engine.events.ChatEngine` contract exactly: events for one reply, ending
in exactly one terminal event; the cancel Event is honoured between steps (and while held at a
`hold_at` step), and the partial metrics go out with `Cancelled`. The metrics it reports are a
deterministic function of the request and the step, so snapshots are stable, and it records
every request so tests can check what the UI sent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Label

from npuchat.app.engine_port import ModelChoice
from npuchat.app.settings import Settings
from npuchat.app.store import ConversationStore
from npuchat.app.tui.app import NpuchatApp
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.message_list import AssistantMessage
from npuchat.engine.events import (
    Cancelled,
    ChatRequest,
    Event,
    Failed,
    Finished,
    Metrics,
    MetricsUpdate,
    Notice,
    StopReason,
    TokenDelta,
)


@dataclass
class ScriptedReply:
    """One reply: text chunks (one "token" each), optionally slowed, held or failing.

    - delay_s: sleep before each chunk (the real engine's per-token time).
    - hold_at: stop before chunk `hold_at` until `release` is set (or cancel is); lets a test
      look at the UI mid-stream deterministically.
    - notices: emitted before the first chunk.
    - fail: after the chunks, end with Failed(fail) instead of Finished.
    - prefill: (tokens done, total) progress reports sent before the first chunk, as the
      engine sends them while it reads a long prompt (at 400 tok/s).
    """

    chunks: Sequence[str]
    delay_s: float = 0.0
    hold_at: int | None = None
    notices: Sequence[Notice] = ()
    fail: str | None = None
    stop_reason: StopReason = "eos"
    prefill: Sequence[tuple[int, int]] = ()
    release: threading.Event = field(default_factory=threading.Event)
    reached_hold: threading.Event = field(default_factory=threading.Event)


ReplySource = Sequence[ScriptedReply] | Callable[[ChatRequest], ScriptedReply]


class ScriptedEngine:
    """Replies come from a list (in order; then "Reply N.") or from a function of the request.

    Several threads may call `generate` at once, as the port allows. With `concurrent=True`
    (the default) they all stream, like the concurrent engine; with `concurrent=False` a call
    made while another is running is answered `Failed(kind="busy")`, like a one-sequence
    ChatSession.

    With `background` set, background requests (the app's titles) are answered by it and
    recorded in `background_requests`, apart from the interactive `requests`; without it they
    are requests like any other. `make_app` sets `NO_TITLE` when a test scripts no titles, so
    the app's title requests do not take the replies scripted for the user's turns.
    """

    def __init__(
        self,
        replies: ReplySource = (),
        *,
        model_name: str = "scripted-1b",
        draft_name: str = "scripted-draft",
        device: str = "cpu",
        kv_capacity: int = 1024,
        kv_cache: tuple[str, int] = ("", 0),
        concurrent: bool = True,
        background: Callable[[ChatRequest], ScriptedReply] | None = None,
    ) -> None:
        self._replies = replies
        self._model = model_name
        self._draft = draft_name
        self._device = device
        self._kv_capacity = kv_capacity
        self._kv_dtype, self._kv_per_token = kv_cache  # ("int8", 6528): report KV bytes
        self._concurrent = concurrent
        self._lock = threading.Lock()
        self.background = background
        self.requests: list[ChatRequest] = []
        self.background_requests: list[ChatRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.busy_answers = 0
        self.cancelled = 0
        self.closed = False

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def draft_name(self) -> str:
        return self._draft

    @property
    def device(self) -> str:
        return self._device

    def close(self) -> None:
        """Like ChatSession.close(): the app calls it on an engine it replaces."""
        self.closed = True

    def _next_reply(self, request: ChatRequest, index: int) -> ScriptedReply:
        if callable(self._replies):
            return self._replies(request)
        if index < len(self._replies):
            return self._replies[index]
        return ScriptedReply([f"Reply {index + 1}."])

    def metrics_at(self, request: ChatRequest, step: int) -> Metrics:
        """Figures after `step` chunks: prompt size from the request, a decode rate that
        varies with the step (so a sparkline has a shape), speculative counters."""
        prompt = len(request.system_prompt) + sum(len(m.content) for m in request.messages)
        prompt_tokens = max(1, prompt // 4)
        reused = prompt_tokens // 2 if len(request.messages) > 1 else 0
        decode_tokens = max(0, step - 1)
        return Metrics(
            ttft_s=0.25,
            prefill_tokens=prompt_tokens - reused,
            prefill_tps=400.0,
            reused_tokens=reused,
            decode_tokens=decode_tokens,
            decode_tps=20.0 + 5.0 * (step % 4) if decode_tokens else 0.0,
            kv_used=min(self._kv_capacity, prompt_tokens + step),
            kv_capacity=self._kv_capacity,
            kv_max_capacity=4 * self._kv_capacity,
            kv_dtype=self._kv_dtype,
            kv_bytes_per_token=self._kv_per_token,
            kv_bytes=self._kv_per_token * self._kv_capacity,
            drafted=4 * decode_tokens,
            accepted=3 * decode_tokens,
            mean_accepted_len=3.0 if decode_tokens else 0.0,
            draft_k=4,
            model=self._model,
            draft=self._draft,
            device=self._device,
        )

    def generate(self, request: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        with self._lock:
            if self.in_flight and not self._concurrent:
                self.busy_answers += 1
                busy = True
            else:
                busy = False
                if request.priority == "background" and self.background is not None:
                    self.background_requests.append(request)
                    index = -1
                else:
                    self.requests.append(request)
                    index = len(self.requests) - 1
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if busy:
            yield Failed("a reply is already being generated", kind="busy")
            return
        try:
            if index < 0:
                assert self.background is not None
                reply = self.background(request)
            else:
                reply = self._next_reply(request, index)
            yield from self._play(reply, request, cancel)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _play(
        self, reply: ScriptedReply, request: ChatRequest, cancel: threading.Event
    ) -> Iterator[Event]:
        yield from reply.notices
        for done, total in reply.prefill:
            yield MetricsUpdate(Metrics(prefill_tokens=done, prefill_total=total, prefill_tps=400))
        metrics = self.metrics_at(request, 0)
        for step, chunk in enumerate(reply.chunks):
            if reply.hold_at is not None and step == reply.hold_at:
                reply.reached_hold.set()
                while not reply.release.wait(0.01):
                    if cancel.is_set():
                        break
            if reply.delay_s:
                time.sleep(reply.delay_s)
            if cancel.is_set():
                with self._lock:
                    self.cancelled += 1
                yield Cancelled(metrics)
                return
            yield TokenDelta(chunk)
            metrics = self.metrics_at(request, step + 1)
            yield MetricsUpdate(metrics)
        if reply.fail is not None:
            yield Failed(reply.fail)
            return
        yield Finished(reply.stop_reason, metrics)


def NO_TITLE(request: ChatRequest) -> ScriptedReply:
    """An empty answer to a title request: the conversation keeps its automatic title."""
    return ScriptedReply([])


def instant_loader(engine: ScriptedEngine) -> Callable[..., ScriptedEngine]:
    """An EngineLoader that reports two stages and returns `engine` at once."""

    def load(spec: object, progress: Callable[[str, float], None]) -> ScriptedEngine:
        progress("Loading scripted model", 0.5)
        progress("Ready", 1.0)
        return engine

    return load


# ---- harness for pilot and snapshot tests -----------------------------------------------------

FIXED_NOW = datetime(2026, 3, 14, 15, 9, 26, tzinfo=UTC)


class StepClock:
    """Deterministic clock for the store: starts at FIXED_NOW, one second later per reading."""

    def __init__(self, start: datetime = FIXED_NOW) -> None:
        self.now = start

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


def make_app(
    engine: ScriptedEngine | None,
    store: ConversationStore,
    *,
    settings: Settings | None = None,
    config_path: Path | None = None,
    loader: Callable[..., ScriptedEngine] | None = None,
    models: Sequence[ModelChoice] | None = None,
) -> NpuchatApp:
    """An app over a scripted engine (or any `loader`), fixed clock, no cursor blink."""
    if loader is None:
        assert engine is not None, "give an engine or a loader"
        loader = instant_loader(engine)
    if engine is not None and engine.background is None:
        engine.background = NO_TITLE
    return NpuchatApp(
        settings or Settings(cursor_blink=False),
        store,
        loader,
        config_path=config_path,
        clock=lambda: FIXED_NOW,
        models=(lambda: list(models)) if models is not None else None,
    )


async def wait_until(
    pilot: Pilot[None], condition: Callable[[], bool], what: str, timeout: float = 10.0
) -> None:
    """Let the app run until `condition()` holds; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def wait_for_chat(pilot: Pilot[None]) -> ChatScreen:
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen), "the chat screen")
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen)
    await pilot.pause()
    return screen


def reply_settled(screen: ChatScreen, count: int) -> Callable[[], bool]:
    """True once `count` assistant replies exist on screen and none is generating."""

    def settled() -> bool:
        return screen.generating is False and len(screen.query(AssistantMessage)) == count

    return settled


def metric(screen: ChatScreen, row: str) -> str:
    """What the metrics panel shows in `row` (state, ttft, model, ...)."""
    return str(screen.query_one(f"#m-{row}", Label).render())


Scenario = Callable[[Pilot[None], ChatScreen], Awaitable[None]]


def run_chat(app: NpuchatApp, scenario: Scenario, size: tuple[int, int] = (120, 40)) -> None:
    """Run `scenario` against the app's chat screen in a terminal of `size`."""

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            screen = await wait_for_chat(pilot)
            await scenario(pilot, screen)

    asyncio.run(main())


async def send(pilot: Pilot[None], text: str) -> None:
    """Type `text` into the composer (set at once) and press Enter."""
    composer = pilot.app.screen.query_one(Composer)
    composer.focus()
    composer.text = text
    await pilot.press("enter")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ConversationStore]:
    """A conversation database in the test's folder, on the deterministic clock."""
    s = ConversationStore.open(tmp_path / "data" / "conversations.sqlite3", clock=StepClock())
    yield s
    s.close()
