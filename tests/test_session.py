"""Conversation sessions on a synthetic model: KV reuse is exact, prefixes persist, cancellation,
the context policy, one generation at a time, stop strings."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npuchat.engine.events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Failed,
    Finished,
    Notice,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.model import Model
from npuchat.engine.session import ChatSession, SessionOptions
from npuchat.engine.stop_matcher import StopMatcher

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
WORDS = ["hello", "world", "the", "fox", "def", "return", "model", "small", "x", "42"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from synthetic import write_synthetic_gguf

    return write_synthetic_gguf(tmp_path_factory.mktemp("m") / "chat.gguf", "qwen2", seed=3)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _open(path: Path, cache: Path, **kw: object) -> ChatSession:
    kw.setdefault("capacities", [256])
    kw.setdefault("prefill_chunk", 16)
    # float activations: reuse must match a fresh prefill to float rounding. With int8
    # activations (the default) a 1-ulp difference between kernel paths can flip one rounding.
    kw.setdefault("accuracy_level", 0)
    return ChatSession.open(path, name="synthetic", cache_dir=cache, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def session(model_path: Path, cache_dir: Path) -> Iterator[ChatSession]:
    s = _open(model_path, cache_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def fresh(model_path: Path, cache_dir: Path) -> Iterator[Model]:
    """A second copy of the model, always prefilled from scratch (the reference for reuse)."""
    m = Model.load(
        model_path, cache_dir=cache_dir, capacities=[256], prefill_chunk=16, accuracy_level=0
    )
    yield m
    m.close()


def _run(s: ChatSession, req: ChatRequest, cancel: threading.Event | None = None) -> list[Event]:
    return list(s.generate(req, cancel or threading.Event()))


def _text(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenDelta))


def _final(events: list[Event]) -> Finished:
    last = events[-1]
    assert isinstance(last, Finished), last
    return last


def _req(system: str, *turns: tuple[str, str], sampling: SamplingParams = GREEDY) -> ChatRequest:
    msgs = tuple(ChatMessage(role, content) for role, content in turns)  # type: ignore[arg-type]
    return ChatRequest("c", system, msgs, sampling)


def _fresh_greedy(fresh: Model, ids: list[int], steps: int, stop_ids: set[int]) -> list[int]:
    fresh.rollback(0)
    logits = fresh.prefill(ids)
    out = []
    for _ in range(steps):
        t = int(np.argmax(logits))
        out.append(t)
        if t in stop_ids:
            break
        logits = fresh.decode(t)
    return out


def test_second_turn_prefills_only_the_new_message(session: ChatSession) -> None:
    first = _req("You are terse.", ("user", "hello world"))
    ev1 = _run(session, first)
    reply = _text(ev1)
    ids1 = session.prompt_ids(first.system_prompt, first.messages)
    second = _req(
        "You are terse.", ("user", "hello world"), ("assistant", reply), ("user", "the fox")
    )
    ids2 = session.prompt_ids(second.system_prompt, second.messages)
    m = _final(_run(session, second)).metrics
    assert m.reused_tokens >= len(ids1)
    assert m.prefill_tokens == len(ids2) - m.reused_tokens
    assert m.prefill_tokens < len(ids2) - len(ids1) + 4  # the new turn and its headers only
    assert m.kv_used == session.model.n_past and m.ttft_s > 0


turn_text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
actions = st.lists(
    st.tuples(st.sampled_from(["send", "edit", "regenerate", "switch"]), turn_text),
    min_size=2,
    max_size=6,
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(script=actions)
def test_reuse_equals_fresh_prefill(session: ChatSession, fresh: Model, script: list) -> None:
    """Whatever the edit history, the reply and the next-step logits equal a full prefill."""
    convs: dict[str, list[tuple[str, str]]] = {"a": [], "b": []}
    systems = {"a": "You are terse.", "b": "You write code."}
    current = "a"
    for action, text in script:
        turns = convs[current]
        if action == "switch":
            current = "b" if current == "a" else "a"
            turns = convs[current]
            turns.append(("user", text))
        elif action == "edit" and turns:
            users = [i for i, (r, _) in enumerate(turns) if r == "user"]
            del turns[users[0] :]
            turns.append(("user", text))
        elif action == "regenerate" and turns and turns[-1][0] == "assistant":
            turns.pop()
        elif not turns or turns[-1][0] == "assistant":
            turns.append(("user", text))
        if turns[-1][0] != "user":
            continue
        req = _req(systems[current], *turns)
        events = _run(session, req)
        final = _final(events)
        ids = session.prompt_ids(req.system_prompt, req.messages)
        expected = _fresh_greedy(fresh, ids, GREEDY.max_tokens, session.stop_ids)
        got = session.cached_tokens[len(ids) :]
        # the cache holds every generated token except the last one sampled
        assert got == expected[: len(got)] and len(got) == len(expected) - 1
        probe = ids[-1]
        mine = session.model.decode(probe)
        session.model.rollback(session.model.n_past - 1)
        fresh.rollback(0)
        ref = fresh.prefill([*session.cached_tokens, probe])
        np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-4 * float(np.abs(ref).max()))
        turns.append(("assistant", _text(events)))
        assert final.metrics.reused_tokens + final.metrics.prefill_tokens == len(ids)


def test_cancel_stops_within_one_step_and_session_stays_usable(
    session: ChatSession, fresh: Model
) -> None:
    cancel = threading.Event()
    req = _req("", ("user", "small model"), sampling=SamplingParams(temperature=0, max_tokens=50))
    deltas_after_cancel = 0
    events = []
    for ev in session.generate(req, cancel):
        events.append(ev)
        if isinstance(ev, TokenDelta):
            if cancel.is_set():
                deltas_after_cancel += 1
            cancel.set()
    assert isinstance(events[-1], (Cancelled, Finished))
    if isinstance(events[-1], Cancelled):
        assert deltas_after_cancel <= 1
    after = _final(_run(session, _req("", ("user", "the fox"))))
    assert after.stop_reason in ("eos", "max_tokens")


def test_one_generation_at_a_time(session: ChatSession) -> None:
    first = session.generate(_req("", ("user", "hello")), threading.Event())
    next(first)  # holds the model now
    second = list(session.generate(_req("", ("user", "world")), threading.Event()))
    assert len(second) == 1 and isinstance(second[0], Failed)
    assert "already being generated" in second[0].message
    list(first)
    assert isinstance(_run(session, _req("", ("user", "world")))[-1], Finished)


def test_context_policy_drops_oldest_turns(model_path: Path, cache_dir: Path) -> None:
    s = _open(model_path, cache_dir, capacities=[64])
    long_turns: list[tuple[str, str]] = []
    for i in range(6):
        long_turns += [("user", f"the fox {i} hello world"), ("assistant", "small model x 42")]
    events = _run(s, _req("Be brief.", *long_turns, ("user", "return 42")))
    notices = [e for e in events if isinstance(e, Notice)]
    assert any("oldest turns to fit 64 tokens" in n.text for n in notices), notices
    assert isinstance(events[-1], Finished)
    assert s.model.n_past <= 64

    too_long = _run(s, _req("", ("user", " ".join(["hello world"] * 80))))
    assert isinstance(too_long[-1], Failed) and "too long" in too_long[-1].message
    assert len(too_long[-1].message.splitlines()) == 1
    long_prompt = s.prompt_ids("", [ChatMessage("user", " ".join(["hello world"] * 80))])
    assert too_long[-1].too_long == (len(long_prompt), 64)

    # a request that may not drop turns (a server's) fails with the counts instead
    kept = _req("Be brief.", *long_turns, ("user", "return 42"))
    strict = _run(s, replace(kept, drop_turns=False))
    whole = s.prompt_ids("Be brief.", list(kept.messages))
    assert [type(e) for e in strict] == [Failed] and len(whole) > 64
    assert strict[0].too_long == (len(whole), 64) and strict[0].kind == "invalid"
    assert "conversation is too long" in strict[0].message

    fill = _run(s, _req("", ("user", "x"), sampling=SamplingParams(temperature=0, max_tokens=500)))
    final = fill[-1]
    assert isinstance(final, Finished)
    assert final.stop_reason in ("length", "eos")
    if final.stop_reason == "length":
        assert final.metrics.kv_used == 64
    s.close()


def test_system_prefix_survives_restart(model_path: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, threading
        from pathlib import Path
        from npuchat.engine.session import ChatSession
        from npuchat.engine.events import ChatRequest, ChatMessage, SamplingParams, Finished
        s = ChatSession.open(Path({str(model_path)!r}), name="m",
                             cache_dir=Path({str(tmp_path)!r}), capacities=[256], prefill_chunk=16)
        req = ChatRequest("c", "A long shared system prompt about small models and foxes.",
                          (ChatMessage("user", sys.argv[1]),),
                          SamplingParams(temperature=0, max_tokens=2))
        last = list(s.generate(req, threading.Event()))[-1]
        assert isinstance(last, Finished), last
        print(last.metrics.reused_tokens, len(s.system_prefix(req.system_prompt)))
        """
    )

    def run(msg: str) -> tuple[int, int]:
        out = subprocess.run(
            [sys.executable, "-c", script, msg], capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stderr
        a, b = out.stdout.split()
        return int(a), int(b)

    cold, prefix_len = run("hello world")
    assert cold == 0 and prefix_len > 10
    warm, _ = run("the fox")  # a new process, another user message
    assert warm == prefix_len


def test_stop_matcher_holds_back_partial_stop_strings() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("x") == ("STOx", False)
    assert m.feed("y STOP z") == ("y ", True)
    assert m.hit == "STOP"


def test_stop_matcher_ends_at_the_stop_string_that_begins_first() -> None:
    m = StopMatcher(["later", "now"])
    assert m.feed("a now and later") == ("a ", True)
    assert m.hit == "now"


def test_stop_string_ends_reply(session: ChatSession) -> None:
    base = _run(session, _req("", ("user", "hello"), sampling=SamplingParams(temperature=0)))
    text = _text(base)
    if len(text) < 4:
        pytest.skip("the synthetic reply is too short to cut")
    stop = text[2:4]
    sampling = SamplingParams(temperature=0, stop=(stop,))
    cut = _run(session, _req("", ("user", "hello"), sampling=sampling))
    assert _final(cut).stop_reason == "stop_string" and _final(cut).stop_string == stop
    assert _text(cut) == text[: text.find(stop)]


RunFn = Callable[[ChatSession, ChatRequest], list[Event]]


def test_keep_warm_ticks_while_idle_and_change_nothing(model_path: Path, cache_dir: Path) -> None:
    s = _open(model_path, cache_dir, options=SessionOptions(keep_warm_s=0.05))
    try:
        req = _req("You are terse.", ("user", "hello world"))
        first = _text(_run(s, req))
        n, tokens = s.model.n_past, s.cached_tokens
        deadline = time.monotonic() + 5
        while s.warm_ticks < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.warm_ticks >= 2
        assert s.model.n_past == n and s.cached_tokens == tokens
        for _ in range(3):  # replies start fine while ticks run, and are unchanged by them
            again = _run(s, req)
            assert isinstance(again[-1], Finished) and _text(again) == first
    finally:
        s.close()
