"""Speculative decoding: exact at temperature 0, the target's distribution above it, caches in
sync after rollback and on every session path, adaptive k from measured costs, the `--draft`
option end to end."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import real_models
from scipy import stats
from synthetic import write_synthetic_gguf

from npuchat.app.cli import main
from npuchat.engine import speculative
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
from npuchat.engine.sampler import Sampler, distribution, draw
from npuchat.engine.sequence import Sequence as KVSequence
from npuchat.engine.session import ChatSession, SessionOptions
from npuchat.engine.speculative import CostModel, SpeculativeDecoder

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


def _complete(session: ChatSession, ids: Sequence[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    last = None
    for ev in session.complete(list(ids), params, threading.Event()):
        if isinstance(ev, TokenDelta):
            out.extend(ev.ids)
        last = ev
    assert isinstance(last, Finished), last
    return out


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts; every other one repeats a stretch, so the lookup drafter finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = [int(t) for t in rng.integers(3, vocab, int(rng.integers(4, 16)))]
        out.append(p + p[: len(p) // 2 + 2] if i % 2 else p)
    return out


# --------------------------------------------------------------------------- exactness, greedy


def _decode_and_verify(m: Model, prompt: list[int], tokens: list[int]) -> list[tuple[Any, Any]]:
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
        pairs = _decode_and_verify(m, prompt, [5, 17, 42, 99, 7, 64])  # crosses C = 16
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
    plain = [_complete(target, p, GREEDY) for p in prompts]
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
    target.speculative = spec  # not use_drafters: the shared draft model must stay open
    drafted = accepted = 0
    try:
        for p, ref in zip(prompts, plain, strict=True):
            assert _complete(target, p, GREEDY) == ref
            drafted += spec.stats.drafted
            accepted += spec.stats.accepted
    finally:
        target.speculative = None
        if other is not None:
            other.close()
    assert drafted > 0
    if mode != "other":
        assert accepted > 0  # the related draft and lookup get some right: the paths ran


def test_sampled_output_is_reproducible_and_in_sync(target: ChatSession) -> None:
    """Temperature > 0 with lookup: the cache always matches the tokens the session records."""
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=30, repeat_penalty=1.1)
    spec = SpeculativeDecoder(target.model, [LookupDrafter()], fixed_k=3)
    target.speculative = spec
    try:
        prompt = _prompts(target.model.config.vocab_size, 2, seed=3)[1]
        a = _complete(target, prompt, params)
        b = _complete(target, prompt, params)
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


# --------------------------------------------------------------------------- distribution


class MarkovModel:
    """A stand-in target/draft over a tiny vocabulary: logits depend on the last token only.

    Implements the part of `Model` that speculation uses, so the whole decoder (drafting,
    verify, acceptance, rollback) runs on a distribution that can be computed exactly.
    """

    def __init__(self, table: np.ndarray, verify_k: int = 4) -> None:
        self.table = table
        self.verify_k = verify_k
        self.max_capacity = 10_000
        self.tokens: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def length(self, row: int = 0) -> int:
        return len(self.tokens)

    def rollback(self, n: int, row: int = 0) -> None:
        del self.tokens[n:]

    def prefill(self, ids: Sequence[int], row: int = 0) -> np.ndarray:
        self.tokens.extend(ids)
        return self.table[self.tokens[-1]].copy()

    def decode(self, token: int, row: int = 0) -> np.ndarray:
        return self.prefill([token])

    def verify(self, ids: Sequence[int], row: int = 0) -> np.ndarray:
        self.tokens.extend(ids)
        return np.stack([self.table[t] for t in ids])

    def close(self) -> None:
        pass


VOCAB = 5
N_OUT = 3
TRIALS = 3000
WARPED = SamplingParams(temperature=0.8, top_k=4, top_p=0.97, min_p=0.0, repeat_penalty=1.3)


def _tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    p = rng.normal(0, 1.5, (VOCAB, VOCAB))
    q = p + rng.normal(0, 1.5, (VOCAB, VOCAB))  # a related but different draft
    return p, q


CONTEXT = [2, 1, 2, 0]  # lookup has something to match: "2 …" and "1 2"


def _exact_target(p_table: np.ndarray, params: SamplingParams) -> np.ndarray:
    """P(x1..x3 | CONTEXT) of plain sampling: the product of the sampler's distributions."""
    probs = np.zeros(VOCAB**N_OUT)
    for i, seq in enumerate(itertools.product(range(VOCAB), repeat=N_OUT)):
        hist, last, pr = list(CONTEXT), CONTEXT[-1], 1.0
        for x in seq:
            pr *= distribution(p_table[last], params, hist)[x]
            hist.append(x)
            last = x
        probs[i] = pr
    return probs


def _speculative_counts(params: SamplingParams, trials: int, k: int, lookup: bool) -> np.ndarray:
    p_table, q_table = _tables()
    target, draft = MarkovModel(p_table), MarkovModel(q_table)
    drafters: list[Drafter] = [LookupDrafter(max_ngram=2, min_ngram=1)] if lookup else []
    drafters.append(ModelDrafter(draft, "markov"))  # type: ignore[arg-type]
    spec = SpeculativeDecoder(target, drafters, fixed_k=k)  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    counts = np.zeros(VOCAB**N_OUT)
    context = CONTEXT
    sampler = Sampler(params, context)
    sampler.rng = rng
    seq = KVSequence(target)  # type: ignore[arg-type]
    for _ in range(trials):
        seq.rollback(0)
        seq.prefill(context)
        sampler.history = list(context)
        first = draw(sampler.probs(p_table[context[-1]]), rng)
        sampler.accept(first)
        out = [first]
        while len(out) < N_OUT:
            _, new = spec.advance(seq, out[-1], sampler, N_OUT - len(out))
            out += new
        counts[np.ravel_multi_index(out[:N_OUT], (VOCAB,) * N_OUT)] += 1
    return counts


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5  # pool the rare outcomes into one cell
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize(
    ("params", "lookup"),
    [(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), False), (WARPED, True)],
)
def test_sampled_distribution_equals_target_only(params: SamplingParams, lookup: bool) -> None:
    probs = _exact_target(_tables()[0], params)
    counts = _speculative_counts(params, trials=TRIALS, k=3, lookup=lookup)
    assert _chi2_pvalue(counts, probs) > 1e-3


def test_broken_acceptance_rule_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails when rejected drafts are resampled from p instead of p − q."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    probs = _exact_target(_tables()[0], params)
    monkeypatch.setattr(speculative, "residual", lambda p, q, x: p)
    counts = _speculative_counts(params, trials=TRIALS, k=3, lookup=False)
    assert _chi2_pvalue(counts, probs) < 1e-6


# --------------------------------------------------------------------------- adaptive k


def _costs(t_dec: float, verify: dict[int, float], alpha: float, name: str) -> CostModel:
    c = CostModel(max_k=8)
    c.record_decode(t_dec)
    for w, t in verify.items():
        c.record_verify(w, t)
    c.alpha[name] = alpha
    c.sync_s[name] = 0.0
    return c


class _Free(Drafter):
    name = "free"  # a drafter whose costs the test sets

    def __init__(self, step_s: float) -> None:
        from npuchat.engine.drafters import _Stats

        self.stats = _Stats(step_s=step_s, prefill_token_s=step_s)


def test_cost_model_turns_speculation_off_when_verify_is_not_cheaper() -> None:
    # measured verify costs of the 1.5B model on a 2-core CPU: a (k+1)-verify is far from free
    cpu = {2: 0.074, 3: 0.096, 5: 0.125, 9: 0.234}
    slow = _costs(0.063, cpu, 0.6, "free")
    slow.sync_s["free"] = 0.028  # the 0.5B draft: a step ~45% of a target step
    assert slow.choose_k(_Free(0.028), [1, 2], 8) == 0
    # an NPU: verifying k+1 tokens costs about one step; the same draft pays, and deeper
    npu = {w: 0.063 * (1 + 0.03 * w) for w in range(2, 10)}
    fast = _costs(0.063, npu, 0.6, "free")
    fast.sync_s["free"] = 0.028 / 4
    assert fast.choose_k(_Free(0.028 / 4), [1, 2], 8) >= 2
    # a free drafter (lookup) with high acceptance pays even on this CPU, a hopeless one not
    assert _costs(0.063, cpu, 0.95, "free").choose_k(_Free(0.0), [1, 2], 8) >= 2
    assert _costs(0.063, cpu, 0.1, "free").choose_k(_Free(0.0), [1, 2], 8) == 0


def test_catch_up_must_pay_for_itself() -> None:
    """A draft that would pay per token is not used if prefilling the prompt into it costs
    more than it can win back over the reply."""
    npu = {w: 0.063 * (1 + 0.03 * w) for w in range(2, 10)}
    c = _costs(0.063, npu, 0.8, "d")

    class Behind(_Free):
        name = "d"

        def catch_up(self, context: Sequence[int]) -> int:
            return len(context)

    d = Behind(0.005)
    assert c.choose_k(d, list(range(10)), 127) > 0
    assert c.choose_k(d, list(range(4000)), 127) == 0
    assert c.choose_k(d, list(range(10)), 127) > 0


def test_fruitless_retries_of_a_drafter_back_off() -> None:
    """A drafter that never pays is retried after 16 plain rounds, then 32, 64, … up to 256."""

    class Idle(Drafter):
        name = "idle"

        def catch_up(self, context: Sequence[int]) -> int:
            return 0

    costs, d, waits, n = CostModel(4), Idle(), [], 0
    for _ in range(2000):
        n += 1
        if costs.explore(d, [1, 2, 3]):
            waits.append(n)
            n = 0
    assert waits[:6] == [16, 32, 64, 128, 256, 256]
    costs.backoff["idle"], costs.idle["idle"] = 1, 0  # what the decoder does when it pays
    n = 0
    while not costs.explore(d, [1, 2, 3]):
        n += 1
    assert n + 1 == 16


def test_unmeasured_widths_are_estimated_from_measured_ones() -> None:
    c = _costs(0.06, {2: 0.08, 3: 0.1}, 0.5, "x")
    assert c.verify_cost(3) == pytest.approx(0.1)
    assert c.verify_cost(5) == pytest.approx(0.14)  # last slope, extrapolated
    assert _costs(0.06, {}, 0.5, "x").verify_cost(4) > 0.06


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
        out = _complete(target, prompt, params)
    finally:
        target.speculative = None
    assert len(out) > 60
    assert spec.stats.rounds <= 24  # a few tries, then a retry every EXPLORE_EVERY rounds


# --------------------------------------------------------------------------- lookup drafter


def test_lookup_drafter_proposes_the_latest_continuation() -> None:
    lk = LookupDrafter(max_ngram=3, min_ngram=2)
    rng = np.random.default_rng(0)
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lk.propose(seq, 3, GREEDY, seq, rng).tokens == [7, 8, 1]  # the latest "1 2 3"
    assert lk.propose([*seq, 7], 2, GREEDY, seq, rng).tokens == [8, 1]  # grows incrementally
    edited = [1, 2, 3, 4, 5, 9, 4, 5]
    assert lk.propose(edited, 2, GREEDY, edited, rng).tokens == [9, 4]  # re-indexed after edit
    assert lk.propose([6, 6, 0], 2, GREEDY, [], rng).tokens == []


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


# --------------------------------------------------------------------------- real pair


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_real_model_verify_rows_equal_decode_bit_for_bit(
    name: str, real_gguf: Callable[[str], Path]
) -> None:
    """The same on real files (Q4_1; Q5_0/Q8_0/Q4_K/Q6_K), where a one-row and a multi-row
    kernel would differ by 0.2–0.9 in the logits (measured before decode steps were padded);
    Gemma 3 (Q5_0/Q4_K/Q6_K/Q8_0) with its sliding and global layers."""
    graphs = real_models.cache_root() / "graphs"
    with Model.load(real_gguf(name), cache_dir=graphs, threads=2, verify_k=7) as m:
        prompt = [int(t) for t in np.random.default_rng(2).integers(100, 5000, 250)]
        pairs = _decode_and_verify(m, prompt, [2000, 2001, 345, 2003, 17, 999, 4242, 3])
    for ref, row in pairs:
        assert np.array_equal(row, ref)


@pytest.mark.realmodel
def test_real_pair_greedy_equals_target_only(
    real_gguf: Callable[[str], Path],
) -> None:
    """qwen2.5-coder-1.5b with its 0.5b draft plus lookup: the same tokens as target-only,
    with the int8-activation graphs the app runs, on code writing, code editing and chat."""
    graphs = real_models.cache_root() / "graphs"
    kw = {"cache_dir": graphs, "threads": 2, "capacities": [256]}
    session = ChatSession.open(
        real_gguf("qwen2.5-coder-1.5b"),
        name="qwen2.5-coder-1.5b",
        options=SessionOptions(persist_prefixes=False),
        verify_k=4,
        **kw,  # type: ignore[arg-type]
    )
    draft = Model.load(real_gguf("qwen2.5-coder-0.5b"), **kw)  # type: ignore[arg-type]
    prompts = [
        "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n",
        "Rename x to count:\n```python\nx = 0\nfor item in items:\n    x += 1\n```\n",
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    try:
        for text in prompts:
            ids = session.tokenizer.encode(text, parse_special=True)
            session.speculative = None
            plain = _complete(session, ids, params)
            session.speculative = SpeculativeDecoder(
                session.model, [LookupDrafter(), ModelDrafter(draft, "draft")], fixed_k=3
            )
            assert _complete(session, ids, params) == plain
            assert session.speculative.stats.accepted > 0
    finally:
        session.speculative = None
        session.close()
        draft.close()
