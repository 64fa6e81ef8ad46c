"""The timers behind every benchmark figure: raw model prefill/decode, one chat request through
the session, and what a reader needs to judge the numbers (machine, peak RSS).

Each timer runs a warm-up of the same shape first (first-run allocations of a shape and capacity
would otherwise land in the figure) and returns raw samples; `Figure.of` summarizes them.
Shared by `npuchat bench` and the scripts under `benchmarks/`.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .bench_report import Figure, Machine, ModeFigures
from .cpu_info import cpu_model_and_flags
from .errors import NpuchatError
from .events import ChatMessage, ChatRequest, Failed, Finished, SamplingParams, TokenDelta
from .model import Model
from .session import ChatSession

CHAT_SYSTEM = "You are a helpful coding assistant."
SYSTEM_PARAGRAPH = (
    "You are a senior Python reviewer. Prefer small functions with clear names, type hints on "
    "every public function, docstrings that explain why rather than what, and tests that fail "
    "when behaviour breaks. Point out hidden state, needless copies and work done on hot paths. "
)


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size (None where the OS does not tell)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux counts KiB


def machine_info() -> Machine:
    """What a reader needs to judge the figures: CPU, its SIMD flags, cores, OS, versions, load
    at the start."""
    import onnxruntime  # type: ignore[import-untyped]

    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            name, flags = cpu_model_and_flags(f.read())
        cpu = name or cpu
    except OSError:
        pass
    try:
        from importlib.metadata import version

        npuchat_version = version("npuchat")
    except Exception:
        npuchat_version = "unknown"
    return Machine(
        cpu=cpu,
        cores=os.cpu_count(),
        os=platform.platform(),
        python=platform.python_version(),
        onnxruntime=onnxruntime.__version__,
        npuchat=npuchat_version,
        load_average_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        cpu_flags=flags,
    )


def token_ids(vocab: int, n: int, seed: int) -> list[int]:
    """Ordinary-looking ids away from the special tokens at either end of the vocabulary."""
    lo, hi = min(256, vocab // 4), min(vocab, 30000)
    return [int(t) for t in np.random.default_rng(seed).integers(lo, hi, n)]


# --------------------------------------------------------------------------- raw model figures


def time_prefill(model: Model, ids: Sequence[int], repeats: int) -> list[float]:
    """Seconds to prefill `ids` into an empty cache, `repeats` times after one warm-up."""
    samples = []
    for i in range(repeats + 1):
        model.rollback(0)
        t = time.perf_counter()
        model.prefill(ids)
        if i:  # run 0 is the warm-up
            samples.append(time.perf_counter() - t)
    model.rollback(0)
    return samples


def _back_to(model: Model, context: int, ids: Sequence[int], row: int = 0) -> None:
    """Roll the row back to its `context` prefilled tokens, or prefill them again where a
    sliding-window layer's ring no longer holds them (`kv_ring`)."""
    if model.usable(context, row) == context:
        model.rollback(context, row=row)
    else:
        model.rollback(0, row=row)
        model.prefill(ids, row=row)


def time_decode(model: Model, context: int, steps: int, repeats: int) -> list[float]:
    """Decode tok/s of `steps` greedy steps starting at `context` cached tokens."""
    vocab = model.config.vocab_size
    model.rollback(0)
    model.prefill(token_ids(vocab, context, seed=2))
    first = token_ids(vocab, 1, seed=3)[0]
    samples = []
    for i in range(repeats + 1):
        _back_to(model, context, token_ids(vocab, context, seed=2))
        token = first
        t = time.perf_counter()
        for _ in range(steps):
            token = int(model.decode(token).argmax())
        if i:
            samples.append(steps / (time.perf_counter() - t))
    model.rollback(0)
    return samples


def time_batched_decode(
    model: Model, streams: int, context: int, steps: int, repeats: int
) -> list[float]:
    """Aggregate decode tok/s of `streams` sequences stepped together (`Model.decode_batch`),
    each `steps` greedy steps from `context` cached tokens of its own."""
    vocab = model.config.vocab_size
    for row in range(streams):
        model.rollback(0, row=row)
        model.prefill(token_ids(vocab, context, seed=10 + row), row=row)
    firsts = token_ids(vocab, streams, seed=3)
    samples = []
    for i in range(repeats + 1):
        for row in range(streams):
            _back_to(model, context, token_ids(vocab, context, seed=10 + row), row)
        tokens = list(firsts)
        t = time.perf_counter()
        for _ in range(steps):
            tokens = [int(x) for x in model.decode_batch(tokens).argmax(axis=1)]
        if i:
            samples.append(streams * steps / (time.perf_counter() - t))
    for row in range(streams):
        model.rollback(0, row=row)
    return samples


def exercise(model: Model, prompt_tokens: int) -> None:
    """Run every graph shape a chat uses once (prefill, decode, verify), for the memory figure."""
    vocab = model.config.vocab_size
    model.rollback(0)
    model.prefill(token_ids(vocab, prompt_tokens, seed=1))
    token = 0
    for _ in range(8):
        token = int(model.decode(token).argmax())
    if model.verify_k:
        model.verify(token_ids(vocab, model.verify_k + 1, seed=4))
    model.rollback(0)


# --------------------------------------------------------------------------- chat figures


@dataclass(frozen=True)
class Reply:
    ids: list[int]
    wall_s: float
    ttft_s: float
    reused_tokens: int
    prefill_tokens: int
    decode_tokens: int
    decode_tps: float
    drafted: int
    accepted: int
    mean_accepted_len: float
    draft_time_share: float


def ask(
    session: ChatSession,
    system: str,
    user: str,
    max_tokens: int,
    *,
    ignore_eos: bool = False,
    json_schema: str | None = None,
) -> Reply:
    """One greedy chat request; its engine metrics plus wall time and the reply's token ids.

    `ignore_eos` makes every reply `max_tokens` long (as llama-bench's tg tests do), so
    throughput compares like with like whatever the model would have answered; `json_schema`
    holds the reply to that schema.
    """
    sampling = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, json_schema=json_schema
    )
    request = ChatRequest("bench", system, (ChatMessage("user", user),), sampling)
    ids: list[int] = []
    final: Finished | None = None
    t = time.perf_counter()
    for event in session.generate(request, threading.Event()):
        if isinstance(event, TokenDelta):
            ids.extend(event.ids)
        elif isinstance(event, Failed):
            raise NpuchatError(f"benchmark request failed: {event.message}")
        elif isinstance(event, Finished):
            final = event
    wall = time.perf_counter() - t
    if final is None:
        raise NpuchatError("benchmark request ended without finishing")
    m = final.metrics
    return Reply(
        ids,
        wall,
        m.ttft_s,
        m.reused_tokens,
        m.prefill_tokens,
        m.decode_tokens,
        m.decode_tps,
        m.drafted,
        m.accepted,
        m.mean_accepted_len,
        m.draft_time_share,
    )


def system_prompt(session: ChatSession, tokens: int, tag: str) -> str:
    """A system prompt of about `tokens` tokens that starts with `tag`, so each tag is new."""
    text = f"Session {tag}. "
    while len(session.tokenizer.encode(text)) < tokens:
        text += SYSTEM_PARAGRAPH
    return text


def first_difference(ids: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where `ids` and `reference` differ (None: identical)."""
    for i, (a, b) in enumerate(zip(ids, reference, strict=False)):
        if a != b:
            return i
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


def mode_figures(
    runs: list[Reply], reference: list[int], target: ModeFigures | None
) -> ModeFigures:
    """One drafter mode's figures from its timed replies, against target-only's tokens."""
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    tps = [r.decode_tps for r in runs if r.decode_tokens > 0]
    diffs = [first_difference(r.ids, reference) for r in runs]
    out = ModeFigures(
        decode_tps=Figure.of(tps) if tps else None,
        drafted=drafted,
        accepted=accepted,
        acceptance=accepted / drafted if drafted else 0.0,
        exact=all(d is None for d in diffs),
        first_difference=min((d for d in diffs if d is not None), default=None),
    )
    base = target.decode_tps if target is not None else None
    if base is not None and out.decode_tps is not None:
        out.vs_target = out.decode_tps.median / base.median
    return out
