"""The concurrent engine on synthetic models: priorities, preemption and parking, cancel, the
bounded queue, conversations keeping their KV, and a stress test with nothing lost or mixed up:
replies against the same request run alone (batched numerics: `test_batched_numerics.py`)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from synthetic import write_synthetic_gguf

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Failed,
    Finished,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.scheduler import BACKGROUND, INTERACTIVE
from npuchat.engine.session import ChatSession

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("m") / "chat.gguf", "qwen2", seed=7)


def _engine(path: Path, cache: Path, batch_max: int = 4, **kw: object) -> ConcurrentEngine:
    session = ChatSession.open(
        path,
        name="synthetic",
        cache_dir=cache,
        capacities=[128, 512],
        prefill_chunk=16,
        batch_max=batch_max,
    )
    return ConcurrentEngine(session, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(chat_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConcurrentEngine]:
    e = _engine(chat_path, tmp_path_factory.mktemp("cache"))
    yield e
    e.close()


def _req(conv: str, text: str, priority: str = "interactive", **kw: object) -> ChatRequest:
    sampling = SamplingParams(**{**GREEDY.__dict__, **kw})  # type: ignore[arg-type]
    return ChatRequest(conv, "", (ChatMessage("user", text),), sampling, priority)  # type: ignore[arg-type]


def _ids(events: list[Event]) -> list[int]:
    return [i for e in events if isinstance(e, TokenDelta) for i in e.ids]


class _Stream(threading.Thread):
    """One request consumed in its own thread, as a front end does."""

    def __init__(
        self, engine: ConcurrentEngine, req: ChatRequest, cancel_after: int = -1, delay: float = 0
    ) -> None:
        super().__init__(daemon=True)
        self.engine, self.req, self.cancel_after = engine, req, cancel_after
        self.delay = delay  # a slow consumer: the reply outlasts the test's checks
        self.cancel = threading.Event()
        self.events: list[Event] = []
        self.first_token_at = 0.0

    def run(self) -> None:
        for ev in self.engine.generate(self.req, self.cancel):
            self.events.append(ev)
            time.sleep(self.delay)
            if isinstance(ev, TokenDelta) and ev.ids and not self.first_token_at:
                self.first_token_at = time.perf_counter()
            if 0 <= self.cancel_after <= len(_ids(self.events)):
                self.cancel.set()


def _streaming(*streams: _Stream) -> None:
    """Start the streams and wait until each has streamed its first token."""
    for s in streams:
        s.start()
    while not all(_ids(s.events) for s in streams):
        time.sleep(0.005)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "hello",
        "world",
        "model",
        "token",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_stress_many_requests_nothing_lost_or_mixed_up(chat_path: Path, tmp_path: Path) -> None:
    """8 requests of random lengths, started together, some cancelled at random points: each
    finished stream is exactly the same request run alone; each cancelled one is a prefix."""
    rng = random.Random(4)
    reqs = [
        _req(f"c{i}", _words(i, rng.randint(3, 60)), max_tokens=rng.randint(4, 30))
        for i in range(8)
    ]
    cancels = [rng.choice([-1, -1, rng.randint(0, 6)]) for _ in reqs]
    engine = _engine(chat_path, tmp_path / "a", max_queue=8)
    try:
        streams = [_Stream(engine, r, c) for r, c in zip(reqs, cancels, strict=True)]
        rng.shuffle(streams)
        for s in streams:
            s.start()
        for s in streams:
            s.join(timeout=120)
            assert not s.is_alive()
        assert engine.scheduler.running() == 0
    finally:
        engine.close()
    alone_engine = _engine(chat_path, tmp_path / "b", batch_max=1)
    try:
        for s in streams:
            want = _ids(list(alone_engine.generate(s.req, threading.Event())))
            got = _ids(s.events)
            terminal = s.events[-1]
            if isinstance(terminal, Finished):
                assert got == want, f"{s.req.conversation_id}: {got} != alone {want}"
            else:
                assert isinstance(terminal, Cancelled) and s.cancel_after >= 0
                assert got == want[: len(got)]
    finally:
        alone_engine.close()


def test_background_yields_to_interactive_within_one_step(engine: ConcurrentEngine) -> None:
    """While a background reply decodes, an interactive request's prefill runs at once: at most
    one engine step of background work happens between its arrival and its first prefill."""
    sched = engine.scheduler
    bg = _Stream(engine, _req("bg", _words(1, 20), "background", max_tokens=200, ignore_eos=True))
    _streaming(bg)
    sched.steps.clear()
    sched.record_steps = True
    fg = _Stream(engine, _req("fg", _words(2, 120), max_tokens=4))
    fg.start()
    fg.join(timeout=60)
    sched.record_steps = False
    bg.cancel.set()
    bg.join(timeout=60)
    assert isinstance(fg.events[-1], Finished)
    log = list(sched.steps)
    start = next(i for i, s in enumerate(log) if s == ("submit", "prefill", INTERACTIVE))
    first = next(i for i, s in enumerate(log) if s[0] == "prefill" and s[2] == INTERACTIVE)
    between = [s for s in log[start + 1 : first] if s[0] != "submit"]
    assert len(between) <= 1, between
    # until the interactive prefill is done, background work is paused
    done = max(i for i, s in enumerate(log) if s[0] == "prefill" and s[2] == INTERACTIVE)
    assert all(s[2] != BACKGROUND or s[0] == "submit" for s in log[first : done + 1])
    assert isinstance(bg.events[-1], Cancelled)


def test_cancel_frees_the_slot_at_once(chat_path: Path, tmp_path: Path) -> None:
    """With one slot taken by a long reply, a second request waits; cancelling the first lets
    the second start right away."""
    engine = _engine(chat_path, tmp_path, batch_max=1)
    try:
        long = _Stream(
            engine, _req("a", _words(3, 10), max_tokens=400, ignore_eos=True), delay=0.01
        )
        _streaming(long)
        second = _Stream(engine, _req("b", _words(4, 10), max_tokens=3))
        second.start()
        time.sleep(0.2)
        assert not second.events, "the second request ran while the only slot was busy"
        t0 = time.perf_counter()
        long.cancel.set()
        second.join(timeout=30)
        assert isinstance(long.events[-1], Cancelled)
        assert isinstance(second.events[-1], Finished)
        assert second.first_token_at - t0 < 2.0
    finally:
        engine.close()


def test_full_queue_answers_busy(chat_path: Path, tmp_path: Path) -> None:
    """One slot, a queue of one: a third request is refused at once with kind "busy"."""
    engine = _engine(chat_path, tmp_path, batch_max=1, max_queue=1)
    try:
        running = _Stream(
            engine, _req("a", _words(5, 10), max_tokens=400, ignore_eos=True), delay=0.01
        )
        _streaming(running)
        waiting = _Stream(engine, _req("b", _words(6, 10), max_tokens=2))
        waiting.start()
        time.sleep(0.1)
        t0 = time.perf_counter()
        third = list(engine.generate(_req("c", "hello"), threading.Event()))
        assert time.perf_counter() - t0 < 1.0
        assert len(third) == 1 and isinstance(third[0], Failed) and third[0].kind == "busy"
        running.cancel.set()
        waiting.join(timeout=30)
        assert isinstance(waiting.events[-1], Finished)
    finally:
        engine.close()


def test_conversation_keeps_its_kv_across_others(chat_path: Path, tmp_path: Path) -> None:
    """Two slots, three conversations: the first one's next turn after the other two ran
    reuses its whole history (from its row or paged back in from the prefix store)."""
    engine = _engine(chat_path, tmp_path, batch_max=2)
    try:
        first = _req("one", _words(7, 80), max_tokens=6)
        events = list(engine.generate(first, threading.Event()))
        reply = "".join(e.text for e in events if isinstance(e, TokenDelta))
        for conv in ("two", "three"):
            list(engine.generate(_req(conv, _words(8, 40), max_tokens=6), threading.Event()))
        follow = ChatRequest(
            "one",
            "",
            (
                *first.messages,
                ChatMessage("assistant", reply),
                ChatMessage("user", "and then?"),
            ),
            GREEDY,
        )
        final = list(engine.generate(follow, threading.Event()))[-1]
        assert isinstance(final, Finished)
        history = len(engine.session.prompt_ids("", first.messages))
        assert final.metrics.reused_tokens >= history
    finally:
        engine.close()


def test_long_conversation_survives_a_restart(chat_path: Path, tmp_path: Path) -> None:
    """A long conversation's KV is written to disk when the engine closes; a new engine (a
    restart) continuing it imports its history instead of prefilling it."""
    first = _req("long", _words(9, 110), max_tokens=4)
    engine = _engine(chat_path, tmp_path)
    try:
        events = list(engine.generate(first, threading.Event()))
        assert isinstance(events[-1], Finished)
        history = len(engine.session.prompt_ids("", first.messages))
        assert 256 <= history < 400
    finally:
        engine.close()
    reply = "".join(e.text for e in events if isinstance(e, TokenDelta))
    follow = ChatRequest(
        "long",
        "",
        (*first.messages, ChatMessage("assistant", reply), ChatMessage("user", "more?")),
        GREEDY,
    )
    again = _engine(chat_path, tmp_path)
    try:
        final = list(again.generate(follow, threading.Event()))[-1]
    finally:
        again.close()
    assert isinstance(final, Finished)
    assert final.metrics.reused_tokens >= history - 1


def test_conversations_revisited_while_others_stream(chat_path: Path, tmp_path: Path) -> None:
    """More conversations than slots, each coming back for later turns while others stream:
    rows are evicted (paged out), swapped into batches and taken again all the time, and every
    reply still equals the same request run alone (greedy), token for token."""
    rng = random.Random(11)
    n_conv, turns, clients = 12, 3, 6
    engine = _engine(chat_path, tmp_path / "a", batch_max=4, max_queue=16)
    done: list[tuple[ChatRequest, list[int]]] = []
    errors: list[str] = []

    def client(convs: list[int]) -> None:
        history: dict[int, list[ChatMessage]] = {c: [] for c in convs}
        for _ in range(turns):
            for c in convs:
                msgs = [*history[c], ChatMessage("user", _words(100 * c + len(history[c]), 9))]
                sampling = SamplingParams(
                    temperature=0.0, max_tokens=rng.randint(6, 20), ignore_eos=True
                )
                req = ChatRequest(f"conv{c}", "", tuple(msgs), sampling)
                events = list(engine.generate(req, threading.Event()))
                if not isinstance(events[-1], Finished):
                    errors.append(f"conv{c}: {events[-1]}")
                    return
                ids = _ids(events)
                done.append((req, ids))
                text = "".join(e.text for e in events if isinstance(e, TokenDelta))
                history[c] = [*msgs, ChatMessage("assistant", text)]

    try:
        groups = [list(range(i, n_conv, clients)) for i in range(clients)]
        threads = [threading.Thread(target=client, args=(g,), daemon=True) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
            assert not t.is_alive()
    finally:
        engine.close()
    assert not errors, errors
    assert len(done) == n_conv * turns
    alone = _engine(chat_path, tmp_path / "b", batch_max=1)
    try:
        for req, got in done:
            want = _ids(list(alone.generate(req, threading.Event())))
            assert got == want, f"{req.conversation_id} turn {len(req.messages) // 2}"
    finally:
        alone.close()


def test_interactive_preempts_background_holding_every_slot(
    chat_path: Path, tmp_path: Path
) -> None:
    """Both slots run background replies: an interactive request does not wait for them. One
    background sequence is parked (its K/V kept in host memory), the interactive reply streams
    in its row, and the parked reply resumes afterwards: both background replies equal the
    same requests run alone, token for token; a parked reply can also be cancelled."""
    engine = _engine(chat_path, tmp_path / "a", batch_max=2, max_queue=4)
    bgs = [
        _Stream(
            engine,
            _req(f"bg{i}", _words(20 + i, 12), "background", max_tokens=60, ignore_eos=True),
            delay=0.01,
        )
        for i in range(2)
    ]
    try:
        _streaming(*bgs)
        fg = _Stream(engine, _req("fg", _words(30, 8), max_tokens=6, ignore_eos=True))
        fg.start()
        fg.join(timeout=60)
        assert isinstance(fg.events[-1], Finished)
        unfinished = [s for s in bgs if not isinstance(s.events[-1], Finished)]
        assert unfinished, "the interactive reply waited for a background one to finish"
        for s in bgs:
            s.join(timeout=120)
        assert engine.scheduler.running() == 0 and not engine._parked
        # a parked reply that is cancelled ends at once, and the engine stays usable
        hold = [
            _Stream(
                engine,
                _req(f"h{i}", _words(40 + i, 6), "background", max_tokens=400, ignore_eos=True),
                delay=0.01,
            )
            for i in range(2)
        ]
        _streaming(*hold)
        fg2 = _Stream(
            engine, _req("fg2", _words(31, 8), max_tokens=200, ignore_eos=True), delay=0.01
        )
        fg2.start()
        while not engine._parked:
            time.sleep(0.005)
        parked = next(s for s in hold if s.req.conversation_id == _parked_conv(engine))
        parked.cancel.set()
        parked.join(timeout=10)
        assert isinstance(parked.events[-1], Cancelled)
        fg2.cancel.set()
        for s in [*hold, fg2]:
            s.cancel.set()
            s.join(timeout=30)
            assert not s.is_alive()
    finally:
        engine.close()
    alone = _engine(chat_path, tmp_path / "b", batch_max=1)
    try:
        for s in bgs:
            assert _ids(s.events) == _ids(list(alone.generate(s.req, threading.Event())))
    finally:
        alone.close()


def _parked_conv(engine: ConcurrentEngine) -> str:
    seq = engine._parked[0]
    return engine._conversation[id(seq)]
