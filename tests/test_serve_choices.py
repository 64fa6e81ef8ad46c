"""`n` choices of one request: run side by side on the engine, each equal to the same request
run alone with its own seed, answered whole with their usage added up."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import serving

from npuchat.app.serve.responses import Reply, usage_of
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import Metrics
from npuchat.engine.session import ChatSession

USER = [{"role": "user", "content": "Hi"}]


def test_each_choice_is_a_request_of_its_own_seed() -> None:
    engine = ScriptedEngine(
        [ScriptedReply(["a", "b"]), ScriptedReply(["c"]), ScriptedReply(["d", "e", "f"])]
    )
    with serving(engine) as (_, client):
        r = client.chat.completions.create(
            model="scripted-1b", messages=USER, n=3, seed=41, temperature=1.0
        )
        with pytest.raises(openai.BadRequestError, match="choices"):
            client.chat.completions.create(model="scripted-1b", messages=USER, n=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert sorted(c.message.content or "" for c in r.choices) == ["ab", "c", "def"]
    assert sorted(q.sampling.seed for q in engine.requests) == [41, 42, 43]
    assert len({q.conversation_id for q in engine.requests}) == 3  # a KV slot each
    assert r.usage is not None and r.usage.completion_tokens == 6


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=11)


def test_choices_run_together_equal_each_seed_alone(path: Path, tmp_path: Path) -> None:
    """Sampled, two choices at once (batched on two KV slots) are the replies the same request
    gets alone with seeds 7 and 8, and differ, streamed the same side by side (chunks told
    apart by index, usage added up); greedy, two choices are the same reply."""
    session = ChatSession.open(
        path, name="syn", cache_dir=tmp_path, capacities=[256], accuracy_level=0, batch_max=2
    )
    engine = ConcurrentEngine(session, max_queue=4)
    ask: dict[str, Any] = {"model": "syn", "messages": USER, "max_tokens": 12}
    with serving(engine, context_length=256, slots=None) as (_, client):
        both = client.chat.completions.create(**ask, n=2, seed=7, temperature=1.0)
        alone = [
            client.chat.completions.create(**ask, seed=s, temperature=1.0).choices[0]
            for s in (7, 8)
        ]
        chunks = list(
            client.chat.completions.create(
                **ask,
                n=2,
                seed=7,
                temperature=1.0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed_text = list(
            client.completions.create(
                model="syn",
                prompt="the fox",
                n=2,
                max_tokens=6,
                temperature=0,
                stream=True,
                echo=True,
            )
        )
        greedy = client.chat.completions.create(**ask, n=2, temperature=0)
        text = client.completions.create(
            model="syn", prompt="the fox", n=2, max_tokens=6, temperature=0
        )
    engine.close()
    got = [c.message.content for c in both.choices]
    assert got == [c.message.content for c in alone] and got[0] != got[1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert [c.index for c in text.choices] == [0, 1]
    streamed = ["", ""]
    finishes = [None, None]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert streamed == got and finishes == ["length", "length"]
    assert chunks[-1].usage is not None and both.usage is not None
    assert chunks[-1].usage.completion_tokens == both.usage.completion_tokens == 24
    by_index = ["", ""]
    for chunk in streamed_text:
        for c in chunk.choices:
            by_index[c.index] += c.text
    assert by_index == ["the fox" + c.text for c in text.choices]


def test_a_choice_refused_busy_answers_429_and_frees_the_others_slot() -> None:
    """One slot and no queue: the second choice cannot wait, the request is a 429, the first
    choice is cancelled (within a step of its 50), and the slot serves the next request."""
    engine = ScriptedEngine(
        [ScriptedReply(["x"] * 50, delay_s=0.02), ScriptedReply(["y"]), ScriptedReply(["ok"])]
    )
    with serving(engine, slots=1, max_queue=0) as (_, client):
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="scripted-1b", messages=USER, n=2)
        deadline = time.monotonic() + 0.5  # the 50 steps of the first choice take 1 s
        while True:
            try:
                r = client.chat.completions.create(model="scripted-1b", messages=USER)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the cancelled choice kept its slot"
                time.sleep(0.02)
    assert r.choices[0].message.content in ("y", "ok")


def test_a_choice_that_fails_mid_stream_ends_the_stream_with_its_error() -> None:
    engine = ScriptedEngine([ScriptedReply(["a", "b"]), ScriptedReply(["c"], fail="boom")])
    with serving(engine, slots=None) as (_, client):
        stream = client.chat.completions.create(
            model="scripted-1b", messages=USER, n=2, stream=True
        )
        with pytest.raises(openai.APIError, match="boom"):
            for _ in stream:
                pass


def test_choices_prefill_their_prompt_once(path: Path, tmp_path: Path) -> None:
    """Three choices of a 200-token prompt: one prefills it, the others copy its rows and run
    only its last token (`npuchat_prefill_tokens_total`: P + 2, not 3P); the usage counts the
    prompt once, none of it cached on a fresh engine."""
    session = ChatSession.open(
        path, name="syn", cache_dir=tmp_path, capacities=[512], accuracy_level=0, batch_max=4
    )
    engine = ConcurrentEngine(session, max_queue=4)
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 9)
    with serving(engine, context_length=512, slots=None) as (server, client):
        r = client.completions.create(
            model="syn", prompt=prompt, n=3, max_tokens=4, temperature=1.0, seed=5
        )
        figures = httpx.get(server.url + "/metrics").text
    engine.close()
    assert r.usage is not None and r.usage.prompt_tokens > 150
    details = r.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0
    want = f"npuchat_prefill_tokens_total {r.usage.prompt_tokens + 2}"
    assert want in figures.splitlines()


def test_a_completion_longer_than_the_context_is_a_400(path: Path, tmp_path: Path) -> None:
    session = ChatSession.open(path, name="syn", cache_dir=tmp_path, capacities=[128])
    engine = ConcurrentEngine(session)
    with serving(engine, context_length=128, slots=None) as (_, client):
        with pytest.raises(openai.BadRequestError, match="context length is 128 tokens") as e:
            client.completions.create(model="syn", prompt="the quick brown fox " * 40)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
        ok = client.completions.create(model="syn", prompt="the fox", max_tokens=3)
    engine.close()
    assert ok.choices[0].finish_reason == "length"


def test_usage_counts_the_prompt_as_the_choice_that_prefilled_it() -> None:
    """Whichever choice index copied the others' rows, the usage's cached tokens are the
    request's (none here), the prompt is counted once and every choice's tokens are added; a
    choice that ended before its prompt (no figures) does not stand for the prompt."""
    copier = Reply(tokens=5, metrics=Metrics(prefill_tokens=1, reused_tokens=199))
    prefiller = Reply(tokens=3, metrics=Metrics(prefill_tokens=200))
    cut = Reply(tokens=0)
    usage = usage_of([copier, prefiller, cut])
    assert usage["prompt_tokens"] == 200
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (usage["completion_tokens"], usage["total_tokens"]) == (8, 208)
