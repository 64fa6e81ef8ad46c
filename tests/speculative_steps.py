"""Two ways the speculative tests run a model: a session's greedy/sampled token ids, and decode
logits beside verify rows at the same positions (the synthetic and the real-model tests share
them; speculation is exact only if the two agree bit for bit).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from npuchat.engine.events import Finished, SamplingParams, TokenDelta
from npuchat.engine.model import Model
from npuchat.engine.session import ChatSession
from npuchat.engine.speculative import SpeculativeDecoder


def complete_ids(session: ChatSession, ids: Sequence[int], params: SamplingParams) -> list[int]:
    """The token ids `session` streams for `ids`; the run must finish (not fail or stop)."""
    out: list[int] = []
    last = None
    for ev in session.complete(list(ids), params, threading.Event()):
        if isinstance(ev, TokenDelta):
            out.extend(ev.ids)
        last = ev
    assert isinstance(last, Finished), last
    return out


def assert_speculation_exact(
    session: ChatSession,
    spec: SpeculativeDecoder,
    prompts: Sequence[Sequence[int]],
    plain: Sequence[list[int]],
    params: SamplingParams,
) -> tuple[int, int]:
    """Each prompt through `session` with `spec` gives `plain`'s ids; (drafted, accepted)."""
    drafted = accepted = 0
    session.speculative = spec
    try:
        for p, ref in zip(prompts, plain, strict=True):
            assert complete_ids(session, p, params) == ref
            drafted += spec.stats.drafted
            accepted += spec.stats.accepted
    finally:
        session.speculative = None
    return drafted, accepted


def decode_and_verify(m: Model, prompt: list[int], tokens: list[int]) -> list[tuple[Any, Any]]:
    """(decode logits, verify row) at every position after `prompt`, plus a split verify."""
    m.rollback(0)
    m.prefill(prompt)
    decoded = [m.decode(t) for t in tokens]
    m.rollback(len(prompt))
    rows = list(m.verify(tokens))
    m.rollback(len(prompt))
    half = len(tokens) // 2
    rows_split = list(m.verify(tokens[:half])) + list(m.verify(tokens[half:]))
    return list(zip(decoded, rows, strict=True)) + list(zip(decoded, rows_split, strict=True))
