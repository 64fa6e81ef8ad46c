"""Speculative decoding under a JSON schema on the synthetic models of every architecture: a
greedy reply with drafts (the grammar's forced tokens and prompt lookup) is the reply plain
constrained decoding gives, token for token, and each of its tokens is the reference forward
pass's likeliest among those the schema allows (outside near ties)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from reference_forward import ReferenceModel

from npuchat.engine.drafters import LookupDrafter
from npuchat.engine.events import ChatMessage, ChatRequest, Finished, SamplingParams, TokenDelta
from npuchat.engine.grammar import constraint_for
from npuchat.engine.session import ChatSession
from npuchat.engine.speculative import SpeculativeDecoder

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["name", "colour", "tags"],
        "additionalProperties": False,
    }
)
PROMPT = 'Reply like {"name": "Ada", "colour": "green", "tags": ["a", "b"]}. Now you.'
TIE = 1e-3  # a reference step whose top two allowed logits are closer than this is a near tie


def _reply(session: ChatSession) -> tuple[list[int], Finished]:
    params = SamplingParams(temperature=0.0, max_tokens=400, json_schema=SCHEMA)
    request = ChatRequest("c", "", (ChatMessage("user", PROMPT),), params)
    events = list(session.generate(request, threading.Event()))
    final = events[-1]
    assert isinstance(final, Finished), final
    return [t for e in events if isinstance(e, TokenDelta) for t in e.ids], final


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_a_greedy_reply_under_a_schema_is_the_same_with_drafts(
    synthetic_gguf: Callable[..., Path], tmp_path: Path, arch: str
) -> None:
    path = synthetic_gguf(arch, seed=11)
    session = ChatSession.open(
        path, name="syn", cache_dir=tmp_path, capacities=[512], accuracy_level=0
    )
    try:
        plain, _ = _reply(session)
        spec = SpeculativeDecoder(session.model, [LookupDrafter()], fixed_k=3)
        session.speculative = spec
        drafted, final = _reply(session)
        cached = session.cached_tokens
        tokenizer = session.tokenizer
    finally:
        session.close()
    assert drafted == plain
    assert final.stop_reason == "eos"
    json.loads(tokenizer.decode(drafted))  # the whole value, and nothing after it
    assert spec.stats.accepted > 0 and spec.stats.rounds > 0
    # the cache ends before the reply's last token, as after plain decoding
    prompt = cached[: len(cached) - (len(drafted) - 1)]
    assert cached[len(prompt) :] == drafted[:-1]
    rows = ReferenceModel(path).logits(prompt + drafted[:-1])[len(prompt) - 1 :]
    shape = constraint_for(tokenizer, SCHEMA)
    assert shape is not None
    checked = 0
    for row, token in zip(rows, drafted, strict=True):
        allowed = shape.allowed()[: len(row)]
        scores = np.where(allowed, row.astype(np.float64), -np.inf)
        top2 = np.sort(scores)[-2:]
        if allowed.sum() > 1 and top2[1] - top2[0] > TIE:
            assert token == int(np.argmax(scores))
            checked += 1
        assert shape.consume(token)
    assert shape.done and checked >= len(drafted) // 4
