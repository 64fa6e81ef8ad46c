"""Log probabilities of sampled tokens (OpenAI's `logprobs`): the model's own distribution at
each step, checked against the numpy reference forward pass, and served in OpenAI's shapes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from reference_forward import ReferenceModel, log_softmax
from serve_helpers import serving

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.drafters import LookupDrafter
from npuchat.engine.events import ChatMessage, ChatRequest, SamplingParams, TokenDelta
from npuchat.engine.logprobs import token_logprob
from npuchat.engine.session import ChatSession
from npuchat.engine.speculative import SpeculativeDecoder

NAME = "synthetic-logprobs"


def test_token_logprob_is_the_log_softmax_with_the_likeliest_first() -> None:
    rng = np.random.default_rng(3)
    logits = (4 * rng.normal(size=50)).astype(np.float32)
    logits[7] = logits[3] = logits.max() + 1  # a tie at the top: the lower id first
    ref = log_softmax(logits.astype(np.float64))
    e = token_logprob(logits, 11, 5, lambda t: bytes([65 + t % 26]))
    assert (e.token, e.text, e.piece) == (11, "L", b"L")
    assert e.logprob == pytest.approx(ref[11], abs=1e-9)
    order = sorted(range(50), key=lambda t: (-ref[t], t))[:5]
    assert [t.token for t in e.top] == order and order[:2] == [3, 7]
    assert [t.logprob for t in e.top] == pytest.approx([ref[t] for t in order], abs=1e-9)
    assert len(token_logprob(logits, 0, 80, lambda t: b"x").top) == 50  # no more than exist
    half = token_logprob(logits, 1, 0, lambda t: "é".encode()[:1])  # half a character
    assert half.text == "\ufffd" and half.piece == b"\xc3" and half.top == ()


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=11)


@pytest.fixture()
def session(path: Path, tmp_path: Path) -> Iterator[ChatSession]:
    s = ChatSession.open(path, name=NAME, cache_dir=tmp_path, capacities=[256], accuracy_level=0)
    yield s
    s.close()


def test_a_sampled_reply_carries_the_models_own_logprobs(path: Path, session: ChatSession) -> None:
    """Sampled at temperature 0.7 with a lookup drafter that drafts every round it can: each
    token comes with its log probability under the model's logits at that step (the reference
    forward pass over the prompt and the reply, untouched by the temperature) and its three
    likeliest alternatives, drafted tokens too (from the verify rows they were chosen by)."""
    spec = SpeculativeDecoder(session.model, [LookupDrafter()], fixed_k=3)
    session.speculative = spec
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True, logprobs=3)
    request = ChatRequest("c", "", (ChatMessage("user", "hello hello hello world"),), params)
    deltas = [e for e in session.generate(request, threading.Event()) if isinstance(e, TokenDelta)]
    ids = [t for d in deltas for t in d.ids]
    entries = [e for d in deltas for e in d.logprobs]
    assert len(ids) == 12 and [e.token for e in entries] == ids
    assert spec.stats.accepted > 0, spec.stats  # drafted tokens are among those checked
    cached = session.cached_tokens
    prompt = cached[: len(cached) - (len(ids) - 1)]
    logits = ReferenceModel(path).logits(prompt + ids[:-1])[len(prompt) - 1 :]
    want = [log_softmax(row) for row in logits.astype(np.float64)]
    tempered = [log_softmax(row / 0.7) for row in logits.astype(np.float64)]
    for row, hot, e, t in zip(want, tempered, entries, ids, strict=True):
        assert e.logprob == pytest.approx(row[t], abs=1e-3)
        assert abs(hot[t] - row[t]) > 1e-2  # what a tempered figure would be instead
        assert [a.token for a in e.top] == list(np.argsort(-row, kind="stable")[:3])
        assert e.piece == session.tokenizer.piece_bytes(t)


def _engine(path: Path, cache: Path) -> ConcurrentEngine:
    session = ChatSession.open(
        path, name=NAME, cache_dir=cache, capacities=[256], accuracy_level=0, batch_max=2
    )
    return ConcurrentEngine(session, max_queue=4)


def test_served_logprobs_in_openais_shapes(path: Path, tmp_path: Path) -> None:
    """Chat, whole and streamed, and a completion: the openai client reads every figure; the
    streamed chunks carry the same entries as the whole reply, the tokens' bytes make up the
    text, and each greedy token is the likeliest of its alternatives."""
    engine = _engine(path, tmp_path)
    user = [{"role": "user", "content": "the quick fox"}]
    ask = {"model": NAME, "messages": user, "temperature": 0, "max_tokens": 8}
    with serving(engine, context_length=256, slots=None) as (_, client):
        whole = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
        chunks = list(
            client.chat.completions.create(**ask, logprobs=True, top_logprobs=2, stream=True)
        )
        plain = client.chat.completions.create(**ask)
        text = client.completions.create(
            model=NAME, prompt="the quick fox", temperature=0, max_tokens=6, logprobs=2
        )
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(**ask, top_logprobs=2)
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(**ask, logprobs=True, top_logprobs=21)
    engine.close()
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    joined = b"".join(bytes(t.bytes or []) for t in content)
    assert joined.decode(errors="replace") == choice.message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    streamed = [
        e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    # (the second request reuses the first's cached prompt: K/V computed in another chunking)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(
        max(top.values()) == pytest.approx(v)
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
