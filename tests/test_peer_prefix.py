"""A prompt that starts like another row's copies that row's K/V (`peer_prefix`): the same
replies as the request run alone, the shared part prefilled once when requests arrive together
(the `n` choices of one request), and no row copied that a sliding window no longer holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from synthetic import write_synthetic_gguf

from npuchat.engine import peer_prefix
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Event,
    Finished,
    MetricsUpdate,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.session import ChatSession

WINDOW = 8  # the sliding-window model's; its ring holds WINDOW + CHUNK slots
CHUNK = 16


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    window = WINDOW if arch == "gemma3" else None
    d = tmp_path_factory.mktemp(f"peer-{arch}")
    return write_synthetic_gguf(d / "m.gguf", arch, seed=11, sliding_window=window)


def _engine(
    path: Path, cache: Path, share_rows: bool = True, kv_dtype: str = "auto"
) -> ConcurrentEngine:
    session = ChatSession.open(
        path,
        name="synthetic",
        cache_dir=cache,
        capacities=[128, 512],
        prefill_chunk=CHUNK,
        batch_max=4,
        kv_dtype=kv_dtype,
    )
    engine = ConcurrentEngine(session, share_rows=share_rows)
    engine.scheduler.record_steps = True
    return engine


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 200, n)]


def _ids(events: list[Event]) -> list[int]:
    return [i for e in events if isinstance(e, TokenDelta) for i in e.ids]


def _finished(events: list[Event]) -> Finished:
    last = events[-1]
    assert isinstance(last, Finished), last
    return last


def _prefilled(engine: ConcurrentEngine) -> int:
    """Prompt tokens the engine's steps computed (prefill steps and mixed steps' prompt part)."""
    total = 0
    for kind, what, _priority in engine.scheduler.steps:
        if kind == "prefill":
            total += int(what)  # type: ignore[call-overload]
        elif kind == "mixed":
            total += int(what[1])  # type: ignore[index]
    return total


def _alone(
    like: ConcurrentEngine,
    path: Path,
    cache: Path,
    prompts: list[list[int]],
    params: list[SamplingParams],
) -> list[list[int]]:
    """Each prompt run by itself on an engine that shares nothing (K/V stored as `like`'s)."""
    engine = _engine(path, cache, share_rows=False, kv_dtype=like.model.kv_dtype)
    try:
        return [
            _ids(list(engine.complete(p, s, threading.Event())))
            for p, s in zip(prompts, params, strict=True)
        ]
    finally:
        engine.close()


class _PausedReader(threading.Thread):
    """A request read in its own thread that stops reading at the first event `pause_at`
    accepts, until `go` is set (its prompt or reply then waits: it runs as it is read)."""

    def __init__(self, engine: ConcurrentEngine, ids: list[int], params: SamplingParams,
                 pause_at: Callable[[Event], bool]) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.engine, self.ids, self.params, self.pause_at = engine, ids, params, pause_at
        self.paused, self.go = threading.Event(), threading.Event()
        self.events: list[Event] = []

    def run(self) -> None:
        for ev in self.engine.complete(self.ids, self.params, threading.Event()):
            self.events.append(ev)
            if self.pause_at(ev) and not self.paused.is_set():
                self.paused.set()
                self.go.wait(60)


def _claimed(engine: ConcurrentEngine) -> None:
    """Wait until some row is prefilling a prompt it claimed (`RowPeers.claim`)."""
    deadline = time.monotonic() + 30
    while not any(s.prompt for s in engine.slots.owner if s is not None):
        assert time.monotonic() < deadline, "no request claimed its prompt"
        time.sleep(0.001)


@pytest.fixture(params=["auto", "int8"])
def engine(
    model_path: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[ConcurrentEngine]:
    """The engine under test; int8 rows carry their scales when copied (`kv_layout`)."""
    e = _engine(model_path, tmp_path / "shared", kv_dtype=request.param)
    yield e
    e.close()


def test_same_prompt_arriving_together_is_prefilled_once(
    engine: ConcurrentEngine, model_path: Path, tmp_path: Path
) -> None:
    """Three requests for one 150-token prompt at once (how serve runs `n` = 3, each choice
    with its own seed): one prefills it, the other two wait and copy its rows (149 reused: a
    prompt's last token is always run); each reply equals its request run alone."""
    prompt = _tokens(150, 1)
    params = [
        SamplingParams(temperature=4.0, top_k=0, top_p=1.0, min_p=0.0, seed=s, max_tokens=12)
        for s in (1, 2, 3)
    ]
    events: list[list[Event]] = [[], [], []]

    def run(i: int) -> None:
        events[i].extend(engine.complete(prompt, params[i], threading.Event()))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    reused = sorted(_finished(e).metrics.reused_tokens for e in events)
    assert reused == [0, 149, 149]
    assert _prefilled(engine) == 150 + 1 + 1
    want = _alone(engine, model_path, tmp_path / "alone", [prompt] * 3, params)
    assert [_ids(e) for e in events] == want
    assert len({tuple(w) for w in want}) > 1  # the seeds made different replies


def test_prompt_copies_from_a_streaming_row(
    engine: ConcurrentEngine, model_path: Path, tmp_path: Path
) -> None:
    """While one reply streams (its consumer paused after the first token), a prompt sharing
    its first 60 tokens copies them; one sharing only its first 20 copies them on a model
    without a sliding window, and prefills them on one whose ring no longer holds the rows
    before them. Every reply equals its request run alone."""
    base = _tokens(60, 2)
    first = [*base, *_tokens(10, 3)]
    near = [*base, *_tokens(12, 4)]
    far = [*base[:20], *_tokens(30, 5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    reader = _PausedReader(engine, first, greedy, lambda ev: isinstance(ev, TokenDelta))
    reader.start()
    assert reader.paused.wait(60)
    got = [list(engine.complete(p, greedy, threading.Event())) for p in (near, far)]
    reader.go.set()
    reader.join(timeout=60)
    streamed = reader.events
    sliding = engine.model.config.swa_layers and any(engine.model.config.swa_layers)
    assert _finished(got[0]).metrics.reused_tokens == 60
    assert _finished(got[1]).metrics.reused_tokens == (0 if sliding else 20)
    want = _alone(engine, model_path, tmp_path / "alone", [first, near, far], [greedy] * 3)
    assert [_ids(streamed), _ids(got[0]), _ids(got[1])] == want


def test_cancelled_prefill_releases_its_waiters(
    engine: ConcurrentEngine, model_path: Path, tmp_path: Path
) -> None:
    """A request waiting for another row's prefill of its prompt goes on by itself when that
    prefill is cancelled: it prefills what was not written, and its reply is the one alone."""
    prompt = _tokens(400, 6)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    cancel = threading.Event()
    first: list[Event] = []
    t = threading.Thread(
        target=lambda: first.extend(engine.complete(prompt, greedy, cancel)), daemon=True
    )
    t.start()
    _claimed(engine)
    second: list[Event] = []
    t2 = threading.Thread(
        target=lambda: second.extend(engine.complete(prompt, greedy, threading.Event())),
        daemon=True,
    )
    t2.start()
    time.sleep(0.01)
    cancel.set()
    t.join(timeout=60)
    t2.join(timeout=60)
    assert not t2.is_alive()
    assert _prefilled(engine) < 2 * 400
    assert [_ids(second)] == _alone(engine, model_path, tmp_path / "alone", [prompt], [greedy])


def test_a_prefill_whose_reader_stopped_is_not_waited_for(
    engine: ConcurrentEngine, model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt runs only as its events are read: when the first request's reader stops
    after the first progress report, the second request with the same prompt stops waiting
    once no row has been written for `STALL_S`, and prefills the rest itself."""
    monkeypatch.setattr(peer_prefix, "STALL_S", 0.3)
    prompt = _tokens(150, 7)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    reader = _PausedReader(engine, prompt, greedy, lambda ev: isinstance(ev, MetricsUpdate))
    reader.start()
    assert reader.paused.wait(60)
    t0 = time.monotonic()
    second = list(engine.complete(prompt, greedy, threading.Event()))
    waited = time.monotonic() - t0
    reader.go.set()
    reader.join(timeout=60)
    assert 0.3 <= waited < 30
    assert 0 < _finished(second).metrics.reused_tokens < 149  # what the first had written
    assert [_ids(second)] == _alone(engine, model_path, tmp_path / "alone", [prompt], [greedy])


def test_an_interactive_request_does_not_wait_for_a_background_prefill(
    engine: ConcurrentEngine, model_path: Path, tmp_path: Path
) -> None:
    """A background request is prefilling a prompt when an interactive one with the same
    prompt arrives: the interactive one copies what is written and prefills the rest itself,
    ahead of the background prefill (which runs at background pace), instead of waiting."""
    words = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog")
    text = " ".join(words[i * 7 % 9] + str(i % 13) for i in range(400))
    while len(engine.tokenizer.encode(text)) > 440:
        text = text[: len(text) * 9 // 10]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    user = (ChatMessage("user", text),)
    first: list[Event] = []
    bg_request = ChatRequest("bg", "", user, greedy, "background")
    bg = threading.Thread(
        target=lambda: first.extend(engine.generate(bg_request, threading.Event())), daemon=True
    )
    bg.start()
    _claimed(engine)
    second = list(engine.generate(ChatRequest("fg", "", user, greedy), threading.Event()))
    bg.join(timeout=60)
    prompt_len = _finished(first).metrics.prefill_tokens + _finished(first).metrics.reused_tokens
    assert _finished(second).metrics.reused_tokens < prompt_len - 1
    assert _ids(second) == _ids(first)
