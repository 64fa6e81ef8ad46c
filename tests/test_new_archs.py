"""Chat sessions on the newer archs (synthetic Gemma 3 and Qwen3): the conversation's KV is
reused exactly across turns, including past a sliding window, and a Gemma file without a chat
template is chatted with in Gemma's turn format, with a notice saying so."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from synthetic import write_synthetic_gguf

from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Event,
    Finished,
    Notice,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.model import Model
from npuchat.engine.session import ChatSession

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _no_template(w: object) -> None:
    """Drop the chat template, as a base model's GGUF has none."""
    w.kv_data[0].pop("tokenizer.chat_template")  # type: ignore[attr-defined]


def _run(s: ChatSession, *turns: tuple[str, str], system: str = "Be brief.") -> list[Event]:
    msgs = tuple(ChatMessage(role, text) for role, text in turns)  # type: ignore[arg-type]
    return list(s.generate(ChatRequest("c", system, msgs, GREEDY), threading.Event()))


def _text(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenDelta))


def _final(events: list[Event]) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_second_turn_reuses_the_first_exactly(arch: str, tmp_path: Path) -> None:
    """The second turn prefills only its new tokens, and its reply equals a model that
    prefilled the whole second prompt from scratch (Gemma's window of 8 is long passed)."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, seed=4)
    kw = {"capacities": [256], "prefill_chunk": 16, "accuracy_level": 0}
    s = ChatSession.open(path, name="syn", cache_dir=tmp_path / "c", **kw)  # type: ignore[arg-type]
    try:
        first = _run(s, ("user", "hello world"))
        reply = _text(first)
        turns = [("user", "hello world"), ("assistant", reply), ("user", "the fox")]
        second = _run(s, *turns)
        ids = s.prompt_ids("Be brief.", tuple(ChatMessage(r, t) for r, t in turns))  # type: ignore[arg-type]
        m = _final(second).metrics
        assert m.reused_tokens >= len(
            s.prompt_ids("Be brief.", (ChatMessage("user", "hello world"),))
        )
        assert m.prefill_tokens == len(ids) - m.reused_tokens
        generated = s.cached_tokens[len(ids) :]
    finally:
        s.close()
    with Model.load(path, cache_dir=tmp_path / "c", **kw) as fresh:  # type: ignore[arg-type]
        logits = fresh.prefill(ids)
        expected = []
        for _ in generated:
            expected.append(int(np.argmax(logits)))
            logits = fresh.decode(expected[-1])
    assert generated == expected and len(ids) > 8


def test_gemma_without_template_chats_in_turn_format(tmp_path: Path) -> None:
    path = write_synthetic_gguf(tmp_path / "base.gguf", "gemma3", extra=_no_template)
    s = ChatSession.open(path, name="base", cache_dir=tmp_path / "c", capacities=[256])
    try:
        events = _run(s, ("user", "hello"))
        notices = [e.text for e in events if isinstance(e, Notice)]
        assert any("no chat template" in n and "Gemma turn format" in n for n in notices)
        ids = s.prompt_ids("Be brief.", (ChatMessage("user", "hello"),))
        text = s.tokenizer.decode(ids, special=True)
        assert (
            text
            == "<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n"
        )
        assert s.tokenizer.token_to_id("<end_of_turn>") in s.stop_ids
    finally:
        s.close()
