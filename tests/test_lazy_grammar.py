"""A grammar that holds only the part of a reply after a token (`SamplingParams.grammar_after`,
llama.cpp's lazy grammar: a tool call the model opens under `auto`), on a synthetic model,
greedy: free text up to the token, exactly as without the grammar; after it only what the
grammar allows (checked by a fresh matcher), ending where the grammar is complete; and the same
tokens with prompt-lookup drafts, whose accepted tokens past the trigger are dropped and
decoded again under the grammar."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from npuchat.app.serve.tools import bare_call_grammar
from npuchat.engine.drafters import Draft, Drafter, LookupDrafter, _Stats
from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Finished,
    SamplingParams,
    TokenDelta,
    ToolSpec,
)
from npuchat.engine.grammar import constraint_for, embedded_json
from npuchat.engine.session import ChatSession
from npuchat.engine.speculative import SpeculativeDecoder

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}
AFTER = f"start: {embedded_json(SCHEMA)}\n"  # the whitespace bound a reply's schema gets
PROMPT = "the quick fox the quick fox the quick fox"


class _Oracle(Drafter):
    """Drafts the free reply's next tokens: past the trigger they are what the model chooses
    without the grammar, so a round accepts tokens the grammar must then take back."""

    name = "oracle"
    free = True

    def __init__(self, prompt: int, reply: list[int]) -> None:
        self.stats = _Stats()
        self.prompt, self.reply = prompt, reply

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        history: Sequence[int],
        rng: np.random.Generator,
    ) -> Draft:
        so_far = list(context[self.prompt :])
        if so_far != self.reply[: len(so_far)]:
            return Draft([])
        return Draft(self.reply[len(so_far) : len(so_far) + k])


def _reply(
    session: ChatSession,
    after: tuple[str, str] | None,
    *starts: tuple[str, str],
) -> tuple[list[int], Finished]:
    params = SamplingParams(
        temperature=0.0, max_tokens=80, grammar_after=after, grammar_if_starts=starts
    )
    request = ChatRequest("c", "", (ChatMessage("user", PROMPT),), params)
    events = list(session.generate(request, threading.Event()))
    final = events[-1]
    assert isinstance(final, Finished), final
    return [t for e in events if isinstance(e, TokenDelta) for t in e.ids], final


@pytest.fixture
def session(synthetic_gguf: Callable[..., Path], tmp_path: Path) -> ChatSession:
    path = synthetic_gguf("qwen2", seed=11)
    return ChatSession.open(
        path, name="syn", cache_dir=tmp_path, capacities=[512], accuracy_level=0
    )


def test_the_part_after_the_token_is_held_and_the_rest_is_free(session: ChatSession) -> None:
    try:
        free, _ = _reply(session, None)
        # the trigger: a token the free reply writes a few tokens in
        at = next(i for i in range(3, len(free)) if free[i] not in free[:i])
        trigger = session.tokenizer.token_text(free[at])
        assert session.tokenizer.token_to_id(trigger) == free[at]
        held, final = _reply(session, (trigger, AFTER))
        spec = SpeculativeDecoder(session.model, [LookupDrafter()], fixed_k=3)
        session.speculative = spec
        drafted, _ = _reply(session, (trigger, AFTER))
        prompt = len(session.prompt_ids("", [ChatMessage("user", PROMPT)]))
        oracle = SpeculativeDecoder(session.model, [_Oracle(prompt, free)], fixed_k=4)
        session.speculative = oracle
        overrun, _ = _reply(session, (trigger, AFTER))
        untriggered, _ = _reply(session, ("<|endoftext|>", AFTER))  # never written: free
        tokenizer = session.tokenizer
    finally:
        session.close()
    assert held[: at + 1] == free[: at + 1]  # nothing held before the token
    assert held != free and final.stop_reason == "eos"
    rest = held[at + 1 :]
    shape = constraint_for(tokenizer, None, AFTER)
    assert shape is not None
    assert all(shape.consume(t) for t in rest) and shape.done  # a whole value, nothing after
    assert drafted == held and spec.stats.accepted > 0
    assert overrun == held  # accepted past the trigger, dropped and decoded under the grammar
    assert oracle.stats.accepted > at
    assert untriggered == free


def _squeezed(text: str) -> str:
    return "".join(text.split())


def test_a_reply_that_starts_so_is_held_from_its_first_token(session: ChatSession) -> None:
    """`grammar_if_starts`: the reply begins as the free one, and once its text (whitespace
    left out) starts with the given text, the whole of it is held to the grammar, the tokens
    already written included: here the free reply's opening as a literal, then a JSON value.
    A reply that starts otherwise stays free."""
    try:
        free, _ = _reply(session, None)
        tok = session.tokenizer
        k = next(
            i
            for i in range(1, len(free))
            if _squeezed(tok.decode(free[:i]))
            and len(_squeezed(tok.decode(free[: i + 1]))) > len(_squeezed(tok.decode(free[:i])))
        )
        opening = tok.decode(free[: k + 1])
        lark = f"start: OPENING {embedded_json(SCHEMA)}\nOPENING: {json.dumps(opening)}\n"
        starts = (_squeezed(opening), lark)
        held, final = _reply(session, None, starts)
        prompt = len(session.prompt_ids("", [ChatMessage("user", PROMPT)]))
        oracle = SpeculativeDecoder(session.model, [_Oracle(prompt, free)], fixed_k=4)
        session.speculative = oracle
        overrun, _ = _reply(session, None, starts)
        session.speculative = None
        other, _ = _reply(session, None, ("zz-not-how-it-starts", lark))
        # of several openings, the one the reply starts as holds it (the other one begins
        # the same way, so it is still a candidate when this one is met)
        among, _ = _reply(session, None, (starts[0] + "zz", AFTER), starts)
    finally:
        session.close()
    assert held[: k + 1] == free[: k + 1] and held != free and final.stop_reason == "eos"
    shape = constraint_for(tok, None, lark)
    assert shape is not None
    assert all(shape.consume(t) for t in held) and shape.done
    assert overrun == held and oracle.stats.accepted > k
    assert other == free and among == held


@pytest.mark.parametrize(
    ("text", "whole"),
    [
        ('```json\n{"name": "lookup", "arguments": {"word": "fox"}}\n```', True),
        ('```json\n{\n  "name": "lookup",\n  "arguments": {}\n}\n```', True),
        (
            '```json\n{"name": "lookup", "arguments": {}}\n'
            '{"name": "lookup", "arguments": {}}\n```',
            True,
        ),
        ('```json\n{"name": "lookup", "arguments": {}}\n```\nThat looks it up.', False),
        ('```json\n{"name": "rm", "arguments": {}}\n```', False),
    ],
)
def test_calls_in_a_json_code_block_are_held_to_the_tools(
    session: ChatSession, text: str, whole: bool
) -> None:
    """The grammar a reply opening a json code block with a call is held to (qwen2.5-coder
    writes its calls so under `auto`): calls to offered tools a line apart, then the block's
    end and nothing after."""
    tools = (ToolSpec("lookup", "", json.dumps({"type": "object"})),)
    lark = bare_call_grammar(tools, several=True, fenced=True)
    try:
        shape = constraint_for(session.tokenizer, None, lark)
        ids = session.tokenizer.encode(text, parse_special=False)
    finally:
        session.close()
    assert shape is not None
    assert (all(shape.consume(t) for t in ids) and shape.done) == whole
