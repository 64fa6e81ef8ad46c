"""Speculative decoding on synthetic models: exact at temperature 0 (verify rows equal decode
logits bit for bit, the output equals the target's alone), caches in sync after rollback and on
every session path, adaptive k on a real session, the `--draft` option end to end.

The sampled distribution is `test_speculative_sampling.py`, the cost model and lookup drafter
`test_speculative_costs.py`, the real models `test_speculative_realmodel.py`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from speculative_steps import assert_speculation_exact, complete_ids, decode_and_verify
from synthetic import write_synthetic_gguf

from npuchat.app.cli import main
from npuchat.engine.drafters import Draft, Drafter, LookupDrafter, ModelDrafter
from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Finished,
    MetricsUpdate,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.model import Model
from npuchat.engine.sampler import Sampler
from npuchat.engine.sequence import Sequence as KVSequence
from npuchat.engine.session import ChatSession, SessionOptions
from npuchat.engine.speculative import SpeculativeDecoder

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


# --------------------------------------------------------------------------- synthetic pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-layer target, a 1-layer draft sharing its embeddings and first layer (same seed, so
    the same first draws: a related but weaker model), and an unrelated draft (other seed)."""
    d = tmp_path_factory.mktemp("spec-pair")
    return {
        "target": write_synthetic_gguf(d / "target.gguf", "qwen2", seed=11, n_layers=3),
        "draft": write_synthetic_gguf(d / "draft.gguf", "qwen2", seed=11, n_layers=1),
        "other": write_synthetic_gguf(d / "other.gguf", "qwen2", seed=12, n_layers=1),
        "llama": write_synthetic_gguf(d / "llama.gguf", "llama", seed=3, n_layers=1),
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spec-cache")


def _session(path: Path, cache: Path) -> ChatSession:
    return ChatSession.open(
        path,
        name=path.stem,
        cache_dir=cache,
        options=SessionOptions(persist_prefixes=False),
        verify_k=8,
        capacities=[128, 256],
    )


@pytest.fixture(scope="module")
def target(pair: dict[str, Path], cache: Path) -> Iterator[ChatSession]:
    s = _session(pair["target"], cache)
    yield s
    s.close()


@pytest.fixture(scope="module")
def draft_model(pair: dict[str, Path], cache: Path) -> Iterator[Model]:
    m = Model.load(pair["draft"], cache_dir=cache, capacities=[256])
    yield m
    m.close()


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts; every other one repeats a stretch, so the lookup drafter finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = [int(t) for t in rng.integers(3, vocab, int(rng.integers(4, 16)))]
        out.append(p + p[: len(p) // 2 + 2] if i % 2 else p)
    return out


# --------------------------------------------------------------------------- exactness, greedy


@pytest.mark.parametrize(
    ("arch", "tensor_type"),
    [
        ("qwen2", "q4_0"),
        ("llama", "q4_1"),
        ("phi3", "q4_k"),
        ("qwen2", "q8_0"),
        ("llama", "f16"),
        ("qwen3", "q4_k"),
        ("gemma3", "q4_1"),  # window 8: the later rows slide
    ],
)
def test_verify_rows_equal_decode_logits_bit_for_bit(
    arch: str, tensor_type: str, tmp_path: Path, cache: Path
) -> None:
    """Row i of verify is exactly what decode returns at that position, at the default int8
    activations, for 4-bit, 8-bit and float weights: speculation cannot change a token."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, tensor_type=tensor_type, seed=5)
    with Model.load(path, cache_dir=cache, verify_k=8, capacities=[16, 64]) as m:
        prompt = [int(t) for t in np.random.default_rng(1).integers(3, 200, 12)]
        pairs = decode_and_verify(m, prompt, [5, 17, 42, 99, 7, 64])  # crosses C = 16
    for ref, row in pairs:
        assert np.array_equal(row, ref)


@pytest.mark.parametrize("mode", ["draft", "other", "lookup", "both"])
def test_greedy_output_equals_target_only(
    mode: str,
    target: ChatSession,
    pair: dict[str, Path],
    cache: Path,
    draft_model: Model,
) -> None:
    vocab = target.model.config.vocab_size
    prompts = _prompts(vocab, 12, seed=len(mode))
    target.use_drafters([])
    plain = [complete_ids(target, p, GREEDY) for p in prompts]
    drafters: list[Drafter] = []
    if mode in ("lookup", "both"):
        drafters.append(LookupDrafter())
    other = None
    if mode in ("draft", "both"):
        drafters.append(ModelDrafter(draft_model, "draft"))
    if mode == "other":
        other = Model.load(pair["other"], cache_dir=cache, capacities=[256])
        drafters.append(ModelDrafter(other, "other"))
    spec = SpeculativeDecoder(target.model, drafters, fixed_k=4)
    try:  # not use_drafters: the shared draft model must stay open
        drafted, accepted = assert_speculation_exact(target, spec, prompts, plain, GREEDY)
    finally:
        if other is not None:
            other.close()
    assert drafted > 0
    if mode != "other":
        assert accepted > 0  # the related draft and lookup get some right: the paths ran


def test_greedy_with_presence_and_frequency_penalties_equals_target_only(
    target: ChatSession, draft_model: Model
) -> None:
    """The penalties change greedy decoding (the seen tokens' logits go down), and verify rows
    accepted under them give the target-only tokens: the acceptance applies them row by row
    with each accepted draft added to the history, as the plain sampler does."""
    vocab = target.model.config.vocab_size
    prompts = _prompts(vocab, 8, seed=31)
    params = replace(GREEDY, presence_penalty=1.5, frequency_penalty=0.75)
    target.use_drafters([])
    unpenalised = [complete_ids(target, p, GREEDY) for p in prompts]
    plain = [complete_ids(target, p, params) for p in prompts]
    assert plain != unpenalised
    spec = SpeculativeDecoder(
        target.model, [LookupDrafter(), ModelDrafter(draft_model, "draft")], fixed_k=4
    )
    drafted, accepted = assert_speculation_exact(target, spec, prompts, plain, params)
    assert drafted > 0 and accepted > 0


def test_a_logit_bias_of_minus_100_bans_a_token_and_speculation_stays_exact(
    target: ChatSession, draft_model: Model
) -> None:
    """The token greedy decoding writes most often never comes out under a bias of -100, and
    drafts accepted under the bias give the target-only tokens."""
    vocab = target.model.config.vocab_size
    prompts = _prompts(vocab, 8, seed=37)
    target.use_drafters([])
    unbiased = [complete_ids(target, p, GREEDY) for p in prompts]
    common = Counter(t for ids in unbiased for t in ids).most_common(1)[0][0]
    params = replace(GREEDY, logit_bias=((common, -100.0), (common + 1, 2.0)))
    plain = [complete_ids(target, p, params) for p in prompts]
    assert all(common not in ids for ids in plain)
    spec = SpeculativeDecoder(
        target.model, [LookupDrafter(), ModelDrafter(draft_model, "draft")], fixed_k=4
    )
    drafted, accepted = assert_speculation_exact(target, spec, prompts, plain, params)
    assert drafted > 0 and accepted > 0


def test_adaptive_lookup_cut_to_its_chosen_k_equals_target_only(target: ChatSession) -> None:
    """The lookup drafter proposes before k is chosen and its draft is cut to k (the decoder's
    own path, no fixed k): greedy output is still the target's alone. A clock that makes every
    step cost the same makes drafting pay, so the path runs."""
    vocab = target.model.config.vocab_size
    prompts = _prompts(vocab, 12, seed=21)
    target.use_drafters([])
    plain = [complete_ids(target, p, GREEDY) for p in prompts]
    ticks = itertools.count()
    spec = SpeculativeDecoder(target.model, [LookupDrafter()], clock=lambda: float(next(ticks)))
    spec.calibrate(target.seq)
    drafted, accepted = assert_speculation_exact(target, spec, prompts, plain, GREEDY)
    assert drafted > 0 and accepted > 0
    assert 0 < spec.costs.alpha["lookup"] < 1  # measured: some drafts were rejected


def test_sampled_output_is_reproducible_and_in_sync(target: ChatSession) -> None:
    """Temperature > 0 with lookup: the cache always matches the tokens the session records."""
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=30, repeat_penalty=1.1)
    spec = SpeculativeDecoder(target.model, [LookupDrafter()], fixed_k=3)
    target.speculative = spec
    try:
        prompt = _prompts(target.model.config.vocab_size, 2, seed=3)[1]
        a = complete_ids(target, prompt, params)
        b = complete_ids(target, prompt, params)
    finally:
        target.speculative = None
    assert a == b
    assert target.model.n_past == len(target.cached_tokens)
    assert target.cached_tokens == [*prompt, *a[:-1]][: len(target.cached_tokens)]


# --------------------------------------------------------------------------- session paths


def test_draft_stays_in_sync_across_edits_regenerate_and_cancel(
    target: ChatSession, draft_model: Model
) -> None:
    """Multi-turn, an edited first message, a regenerate and a cancelled reply: every reply
    equals plain decoding, and the draft cache holds a prefix of the target's sequence."""
    drafter = ModelDrafter(draft_model, "draft")
    convs = [
        ("hello world", ()),
        ("the quick brown fox", ("hello world", "x")),
        ("the quick brown fox", ("hello there", "x")),  # an edit early in the conversation
        ("the quick brown fox", ("hello there", "x")),  # regenerate
    ]

    def request(user: str, history: tuple[str, ...]) -> ChatRequest:
        msgs = []
        if history:
            msgs = [ChatMessage("user", history[0]), ChatMessage("assistant", history[1])]
        return ChatRequest("c", "sys", (*msgs, ChatMessage("user", user)), GREEDY)

    def run(cancel_after: int | None = None, req: ChatRequest | None = None) -> list[int]:
        cancel = threading.Event()
        out: list[int] = []
        for ev in target.generate(req, cancel):  # type: ignore[arg-type]
            if isinstance(ev, TokenDelta):
                out.extend(ev.ids)
                if cancel_after is not None and len(out) >= cancel_after:
                    cancel.set()
        return out

    target.speculative = None
    plain = [run(req=request(*c)) for c in convs]
    target.speculative = SpeculativeDecoder(target.model, [drafter], fixed_k=3)
    try:
        run(cancel_after=5, req=request("a cancelled one", ()))
        for c, ref in zip(convs, plain, strict=True):
            assert run(req=request(*c)) == ref
            seq = target.cached_tokens
            assert drafter.seq.tokens == seq[: len(drafter.seq.tokens)]
            assert draft_model.n_past == len(drafter.seq.tokens)
    finally:
        target.speculative = None


def test_rollback_after_partial_acceptance_equals_prefilled_cache(
    pair: dict[str, Path], cache: Path
) -> None:
    """Draft [right, wrong, ...]: one accepted; the cache then continues exactly like a cache
    built by prefilling the accepted sequence."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 200, 10)]
    with Model.load(pair["target"], cache_dir=cache, verify_k=8, capacities=[128]) as ref:
        first = int(np.argmax(ref.prefill(prompt)))
        right = int(np.argmax(ref.decode(first)))
        wrong = (right + 1) % ref.config.vocab_size

        class Scripted(Drafter):
            name = "scripted"

            def propose(self, *a: object, **kw: object) -> Draft:
                return Draft([right, wrong, 3, 4])

        with Model.load(pair["target"], cache_dir=cache, verify_k=8, capacities=[128]) as m:
            seq = KVSequence(m)
            seq.prefill(prompt)
            spec = SpeculativeDecoder(m, [Scripted()], fixed_k=4)
            sampler = Sampler(GREEDY, [*prompt, first])
            committed, new = spec.advance(seq, first, sampler, budget=10)
            assert committed == [first, right] and new[0] == right and len(new) == 2
            assert m.n_past == len(prompt) + 2
            ref.rollback(0)
            ref.prefill([*prompt, first, right])
            expected = ref.kv_export(0, ref.n_past)
            got = m.kv_export(0, m.n_past)
            for a, b in zip(got.k + got.v, expected.k + expected.v, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-4)
            np.testing.assert_allclose(m.decode(new[1]), ref.decode(new[1]), atol=1e-4)


# --------------------------------------------------------------------------- adaptive k


def test_adaptive_k_learns_that_a_slow_draft_does_not_pay(target: ChatSession) -> None:
    """A drafter whose proposals are always wrong ends up unused: k = 0 nearly every round."""

    class Wrong(Drafter):
        name = "wrong"

        def __init__(self) -> None:
            from npuchat.engine.drafters import _Stats

            self.stats = _Stats(step_s=0.0, prefill_token_s=0.0)

        def propose(self, context, k, params, history, rng) -> Draft:  # type: ignore[override]
            time.sleep(0.005)  # a draft step that costs about as much as the target's
            return Draft([(context[-1] + 1) % 50 + 3] * k, sync_s=0.005)

    ticks = itertools.count()
    # every timed target step "takes" 1 ms, decode or verify (a machine where verify is free),
    # so the test does not depend on this machine's load; drafting costs 5 ms
    spec = SpeculativeDecoder(target.model, [Wrong()], clock=lambda: next(ticks) * 1e-3)
    target.speculative = spec
    try:
        prompt = _prompts(target.model.config.vocab_size, 1, seed=9)[0]
        params = SamplingParams(temperature=0.0, max_tokens=120)
        out = complete_ids(target, prompt, params)
    finally:
        target.speculative = None
    assert len(out) > 60
    assert spec.stats.rounds <= 24  # a few tries, then a retry every EXPLORE_EVERY rounds


# --------------------------------------------------------------------------- CLI / factory


@pytest.fixture()
def imported(pair: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("target", "draft", "llama"):
        assert main(["import", str(pair[name]), "--name", f"syn-{name}"]) == 0
    capsys.readouterr()


def _json_run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[list[int], dict]:
    import json

    assert main(["run", "-p", "the quick brown fox", "-n", "20", "--json", "-t", "0", *args]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return [r["id"] for r in rows[:-1]], rows[-1]["metrics"]


def test_cli_draft_modes_give_the_same_tokens(
    imported: None, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", "syn-target"]
    plain, m0 = _json_run([*base, "--draft", "none"], capsys)
    assert m0["draft"] == "" and m0["drafted"] == 0
    for draft in ("lookup", "syn-draft", "syn-draft+lookup", "default", ""):
        ids, m = _json_run([*base, "--draft", draft], capsys)
        assert ids == plain, draft
        expected = {"": "", "default": "lookup", "syn-draft+lookup": "lookup+syn-draft"}
        assert m["draft"] == expected.get(draft, draft)


@pytest.mark.parametrize(
    ("draft", "needle"),
    [
        ("syn-llama", "vocabulary differs"),
        ("qwen2.5-coder-0.5b", "not installed"),
        ("a+b", "one draft model"),
        ("nope", "unknown model"),
    ],
)
def test_cli_refuses_bad_drafts(
    imported: None, draft: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--model", "syn-target", "-p", "x", "--draft", draft]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_live_metrics_report_speculation(target: ChatSession) -> None:
    target.speculative = SpeculativeDecoder(target.model, [LookupDrafter()], fixed_k=4)
    try:
        prompt = _prompts(target.model.config.vocab_size, 2, seed=4)[1]
        events = list(target.complete(prompt, GREEDY, threading.Event()))
    finally:
        target.speculative = None
    final = events[-1]
    assert isinstance(final, Finished)
    m = final.metrics
    assert m.draft == "lookup" and m.drafted >= m.accepted >= 0 and m.drafted > 0
    assert 0.0 <= m.mean_accepted_len <= 4.0 and (m.mean_accepted_len > 0) == (m.accepted > 0)
    assert m.draft_k in range(0, 5)
    assert 0.0 <= m.draft_time_share < 1.0
    assert any(isinstance(e, MetricsUpdate) for e in events)
