"""What the app needs from a session, on a synthetic model: progress during a long prefill,
and a reply cut by max_tokens continued from the cached KV (`ChatRequest.continue_reply`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from npuchat.engine.events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Finished,
    MetricsUpdate,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.session import ChatSession

CHUNK = 16


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatSession]:
    from synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path_factory.mktemp("m") / "chat.gguf", "qwen2", seed=3)
    s = ChatSession.open(
        path, name="synthetic", cache_dir=tmp_path_factory.mktemp("cache"),
        capacities=[256], prefill_chunk=CHUNK, accuracy_level=0,
    )  # fmt: skip
    yield s
    s.close()


def _run(s: ChatSession, request: ChatRequest) -> list[Event]:
    return list(s.generate(request, threading.Event()))


def _request(messages: list[tuple[str, str]], max_tokens: int, **kw: object) -> ChatRequest:
    msgs = tuple(ChatMessage(role, text) for role, text in messages)  # type: ignore[arg-type]
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return ChatRequest(f"c{max_tokens}{kw}", "Be brief.", msgs, sampling, **kw)  # type: ignore[arg-type]


def test_a_long_prefill_reports_progress_before_the_first_token(session: ChatSession) -> None:
    events = _run(session, _request([("user", " ".join(["fox"] * 90))], 2))
    first_text = next(i for i, e in enumerate(events) if isinstance(e, TokenDelta))
    progress = [
        e.metrics for e in events[:first_text] if isinstance(e, MetricsUpdate)
    ]  # fmt: skip
    assert len(progress) >= 4
    total = progress[0].prefill_total
    done = [m.prefill_tokens for m in progress]
    assert done == sorted(done) and len(set(done)) == len(done)
    assert all(d % CHUNK == 0 and 0 < d < total for d in done)
    assert all(m.prefill_total == total and m.prefill_tps > 0 for m in progress)
    final = events[-1]
    assert isinstance(final, Finished)
    assert final.metrics.prefill_tokens == final.metrics.prefill_total == total


def test_continue_extends_the_cut_reply_from_the_cache(session: ChatSession) -> None:
    # A question whose greedy reply re-tokenizes to the ids it was sampled as (random
    # weights also sample half characters, which cannot come back the same way).
    question = [("user", "model small")]
    cut = _run(session, _request(question, 4))
    assert isinstance(cut[-1], Finished) and cut[-1].stop_reason == "max_tokens"
    ids = [i for e in cut if isinstance(e, TokenDelta) for i in e.ids]
    text = "".join(e.text for e in cut if isinstance(e, TokenDelta))
    assert session.tokenizer.encode(text) == ids
    prompt = cut[-1].metrics.reused_tokens + cut[-1].metrics.prefill_tokens
    more = _run(session, _request([*question, ("assistant", text)], 4, continue_reply=True))
    final = more[-1]
    assert isinstance(final, Finished)
    # The prompt and the reply's first tokens come from the cache; only the reply's last
    # token (sampled, never run: the reply stopped there) is prefilled.
    assert (final.metrics.reused_tokens, final.metrics.prefill_tokens) == (prompt + 3, 1)
    # ...and the continuation is what an uncut reply would have said next.
    longer = _run(session, _request(question, 8))
    longer_ids = [i for e in longer if isinstance(e, TokenDelta) for i in e.ids]
    more_ids = [i for e in more if isinstance(e, TokenDelta) for i in e.ids]
    assert ids + more_ids == longer_ids


def _complete_prefix(data: bytes) -> bytes:
    """`data` without a trailing incomplete UTF-8 sequence (the independent reference)."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        if lead & 0xC0 != 0x80:  # the start of the last sequence
            need = 1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else 4
            return data if need <= back else data[:-back]
    return data


def test_a_reply_cut_by_max_tokens_ends_at_a_character_boundary(session: ChatSession) -> None:
    cut_inside = 0
    for n in range(1, 13):
        events = _run(session, _request([("user", "hello world the fox")], n))
        ids = [i for e in events if isinstance(e, TokenDelta) for i in e.ids]
        text = "".join(e.text for e in events if isinstance(e, TokenDelta))
        data = b"".join(session.tokenizer.piece_bytes(i) for i in ids)
        whole = _complete_prefix(data)
        cut_inside += whole != data
        assert text == whole.decode("utf-8", errors="replace"), n
    assert cut_inside  # some limit fell inside a character, so the cut was exercised


def test_a_stopped_reply_ends_at_a_character_boundary(session: ChatSession) -> None:
    """Esc mid-character: the bytes of the half-sampled character are dropped, never shown
    (or stored) as U+FFFD."""
    stopped_inside = 0
    for n in range(1, 12):
        cancel, events = threading.Event(), list[Event]()
        for event in session.generate(_request([("user", "hello world the fox")], 16), cancel):
            events.append(event)
            if sum(len(e.ids) for e in events if isinstance(e, TokenDelta)) >= n:
                cancel.set()  # Esc after the n-th token
        assert isinstance(events[-1], Cancelled), n
        ids = [i for e in events if isinstance(e, TokenDelta) for i in e.ids]
        assert len(ids) == n
        text = "".join(e.text for e in events if isinstance(e, TokenDelta))
        data = b"".join(session.tokenizer.piece_bytes(i) for i in ids)
        whole = _complete_prefix(data)
        stopped_inside += whole != data
        assert text == whole.decode("utf-8", errors="replace"), n
    assert stopped_inside  # some stop fell inside a character, so the cut was exercised
