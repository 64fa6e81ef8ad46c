"""JSON mode: the byte automaton against Python's own JSON parser, the constrained choice of the
next token, and replies that stay a JSON object on a synthetic model and parse on a real one."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from npuchat.engine.drafters import LookupDrafter
from npuchat.engine.events import ChatMessage, ChatRequest, Finished, SamplingParams, TokenDelta
from npuchat.engine.json_prefix import MAX_BLANKS, MAX_DEPTH, JsonPrefix
from npuchat.engine.json_sampling import JsonConstraint
from npuchat.engine.sampler import Sampler
from npuchat.engine.session import ChatSession


def _doc(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.35:
        return rng.choice([0, -7, 2.5, -1e-7, 6.02e23, True, False, None, 'q"\\/\n\té\u2603'])
    if r < 0.65:
        return [_doc(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}é": _doc(rng, depth + 1) for i in range(rng.randint(0, 3))}


def test_every_prefix_of_a_json_object_is_taken_and_only_the_whole_is_done() -> None:
    """300 objects as Python's json writes them (compact, indented, ASCII-escaped or not), fed
    one byte at a time: no byte is refused, and the state says done exactly at the end."""
    rng = random.Random(7)
    for _ in range(300):
        text = json.dumps(
            {"x": _doc(rng), "y": _doc(rng)},
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, 1, 2]),
        )
        state = JsonPrefix()
        for i, byte in enumerate(text.encode()):
            assert not state.done
            nxt = state.feed(bytes([byte]))
            assert nxt is not None, (text, i)
            state = nxt
        assert state.done, text


@pytest.mark.parametrize(
    "text",
    [
        "[]",  # not an object
        '"x"',
        " {}",  # the reply starts at its brace
        '{"a" 1}',
        '{"a":01}',
        '{"a":1,}',
        "{,}",
        '{"a":tru}',
        '{"a":1}x',  # text after the object
        '{"a":"\x01"}',  # a control character in a string
        '{"a":-}',
        '{"a":1.}',
        '{"a":1e}',
        '{"a":[1 2]}',
        '{"a":"\\x"}',
        '{"a":"\\u12g4"}',
        "{'a':1}",
        '{"a":NaN}',
    ],
)
def test_what_no_json_object_starts_with_is_refused(text: str) -> None:
    """Each is refused at some byte (where Python's parser, without its NaN extension, fails
    too) and never reads done."""

    def strict(text: str) -> None:
        parsed = json.loads(text, parse_constant=lambda c: json.JSONDecodeError(c, text, 0))
        if not text.startswith("{") or not isinstance(parsed, dict):
            raise ValueError("not an object from the first byte")
        if any(isinstance(v, ValueError) for v in parsed.values()):
            raise ValueError("NaN")

    with pytest.raises(ValueError):
        strict(text)
    state: JsonPrefix | None = JsonPrefix()
    for byte in text.encode():
        assert state is not None
        state = state.feed(bytes([byte]))
        if state is None:
            break
    assert state is None or not state.done


def test_whitespace_runs_and_nesting_are_bounded() -> None:
    """A model can loop on newlines, or open brackets forever, without breaking the format."""
    state = JsonPrefix().feed(b"{")
    assert state is not None
    assert state.feed(b"\n" * MAX_BLANKS) is not None
    assert state.feed(b"\n" * (MAX_BLANKS + 1)) is None
    assert state.feed(b'"a" :' + b" " * MAX_BLANKS + b"1") is not None  # a run, not a total
    deep = JsonPrefix().feed(b'{"a":' + b"[" * (MAX_DEPTH - 1))
    assert deep is not None and deep.feed(b"[") is None


PIECES = [b"{", b'"', b"a", b'":', b"1", b"}", b"x", b" ", b"", b"}\n", b'{"a', b"\xc3", b"\xa9"]


def _constraint() -> JsonConstraint:
    return JsonConstraint(lambda t: PIECES[t], {8})  # token 8: end of turn (no bytes)


def _ranked(*tokens: int) -> np.ndarray:
    """Logits that rank `tokens` in that order, every other token far below."""
    logits = np.full(len(PIECES), -10.0)
    for rank, t in enumerate(tokens):
        logits[t] = 9.0 - rank
    return logits


def test_greedy_takes_the_likeliest_token_that_fits() -> None:
    """Each step the likelier tokens break the format (text or a space before the brace, the
    end of turn before the object closes, a brace where a value goes); the likeliest that fits
    is taken, half characters inside a string included, until the object closes."""
    c = _constraint()
    sampler = Sampler(SamplingParams(temperature=0.0))
    steps = [
        (_ranked(6, 7, 8, 10, 0), 10),  # x, space, end of turn; then {"a
        (_ranked(8, 11), 11),  # half of é inside the key
        (_ranked(12), 12),
        (_ranked(8, 3), 3),  # ": ends the key
        (_ranked(5, 6, 9, 4), 4),  # }, x and }\n cannot stand for a value; 1 can
        (_ranked(6, 2, 9), 9),  # }\n ends the number and the object
    ]
    for logits, want in steps:
        assert not c.done
        assert c.choose(logits, sampler) == want
    assert c.done
    assert sampler.history == [want for _, want in steps]
    assert json.loads(b"".join(PIECES[w] for _, w in steps)) == {"aé": 1}


def test_sampled_choices_stay_within_the_tokens_that_fit() -> None:
    """At temperature 1 with top-k 3, over 400 seeds: only the tokens that fit come out, in
    proportion to their probabilities among those that fit; with top-k 1 keeping only a token
    that does not fit, the likeliest that fits is taken."""
    probs = np.full(len(PIECES), 1e-9)
    probs[[6, 0, 10]] = [0.5, 0.3, 0.2]  # x does not fit; { and {"a do
    logits = np.log(probs)
    counts = {0: 0, 10: 0}
    for seed in range(400):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=seed))
        token = _constraint().choose(logits, sampler)
        assert token in counts and sampler.history == [token]
        counts[token] += 1
    assert 0.53 < counts[0] / 400 < 0.67  # 0.3 / (0.3 + 0.2) = 0.6
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=1))
    assert _constraint().choose(logits, sampler) == 0


def test_a_token_that_fits_nowhere_ends_the_choice() -> None:
    c = JsonConstraint(lambda t: b"x", set())
    assert c.choose(np.zeros(4), Sampler(SamplingParams(temperature=0.0))) is None


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=11)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_synthetic_models_reply_stays_a_json_object(
    path: Path, tmp_path: Path, temperature: float
) -> None:
    """A model of random weights, in JSON mode with the lookup drafter on: every prefix of the
    reply is one of a JSON object, and a reply that ended on its own parses; no draft ran."""
    session = ChatSession.open(path, name="syn", cache_dir=tmp_path, capacities=[256])
    session.use_drafters([LookupDrafter()])
    try:
        for seed in range(3):
            params = SamplingParams(
                temperature=temperature, seed=seed, max_tokens=60, json_object=True
            )
            request = ChatRequest("c", "", (ChatMessage("user", f"hello {seed}"),), params)
            events = list(session.generate(request, threading.Event()))
            text = "".join(e.text for e in events if isinstance(e, TokenDelta))
            final = events[-1]
            assert isinstance(final, Finished)
            assert JsonPrefix().feed(text.encode()) is not None, text
            if final.stop_reason == "eos":
                assert isinstance(json.loads(text), dict)
            assert final.metrics.drafted == 0
    finally:
        session.close()
