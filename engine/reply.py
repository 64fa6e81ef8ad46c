"""One reply's decode loop on a sequence: sample, stream text, stop, measure.

Shared by the single-stream `ChatSession` and the concurrent engine: the prompt is already
prefilled into `seq` (what was reused and what was run is in the arguments), and this loop turns
the logits after it into `Event`s until a stop, the length limit or a cancel. With a speculative
decoder it advances by draft-and-verify rounds while `speculate()` allows (the concurrent engine
allows it only while the sequence runs alone), otherwise by single decode steps. A request for
log probabilities drafts too (each token's comes from the verify row it was chosen from, which is
what its own decode step would have given), and so does one held to a JSON schema (`shape`): the
decoder checks drafts against the grammar.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace

import numpy as np

from .events import (
    Cancelled,
    Event,
    Finished,
    Metrics,
    MetricsUpdate,
    SamplingParams,
    StopReason,
    TokenDelta,
    TokenLogprob,
)
from .grammar import Constraint, Later, next_token
from .logprobs import token_logprob
from .sampler import Sampler
from .sequence import Sequence
from .speculative import SpeculativeDecoder
from .stop_matcher import StopMatcher
from .tokenizer import StreamDecoder

__all__ = ["METRICS_INTERVAL_S", "prefill_prompt", "stream_reply"]

METRICS_INTERVAL_S = 0.1  # live metrics at most ~10 Hz


def prefill_prompt(
    seq: Sequence, todo: list[int], progress: Metrics, clock: Callable[[], float]
) -> Generator[MetricsUpdate, None, np.ndarray]:
    """Prefill `todo` (not empty) chunk by chunk and return the logits after it; between
    chunks, how far it is (`progress` filled in), for the front end's long-prompt meter."""
    t0, step = clock(), seq.model.prefill_chunk
    for start in range(0, len(todo), step):
        done = min(len(todo), start + step)
        logits = seq.prefill(todo[start:done], more=len(todo) - done)
        if done == len(todo):
            return logits
        elapsed = clock() - t0
        tps = done / elapsed if elapsed > 0 else 0.0
        yield MetricsUpdate(
            replace(progress, prefill_tokens=done, prefill_tps=tps, prefill_total=len(todo))
        )
    raise ValueError("nothing to prefill")  # `restore` never reuses a prompt's last token


def stream_reply(
    seq: Sequence,
    logits: np.ndarray,
    *,
    ids: list[int],
    reused: int,
    params: SamplingParams,
    prefill_s: float,
    t_request: float,
    cancel: threading.Event,
    detok: StreamDecoder,
    stop_ids: set[int],
    speculative: SpeculativeDecoder | None,
    speculate: Callable[[], bool] | None,
    metrics: Metrics,
    shape: Constraint | None,
    clock: Callable[[], float],
    lazy: tuple[int, Later] | None = None,
    starts: list[tuple[str, Later]] | None = None,
) -> Iterator[Event]:
    """The events of one reply after its prompt `ids` (`logits`: after the last of them);
    `shape`: the JSON schema the reply is held to (None: free text); `lazy`: a token and the
    constraint the rest of the reply is held to once that token is written; `starts`: texts,
    each with the constraint the whole reply is held to if it starts so
    (`later_constraints`)."""
    base = replace(
        metrics,
        prefill_tokens=len(ids) - reused,
        prefill_tps=(len(ids) - reused) / prefill_s if prefill_s > 0 else 0.0,
        prefill_total=len(ids) - reused,
        reused_tokens=reused,
        kv_max_capacity=seq.max_capacity,
        kv_dtype=seq.model.kv_dtype,
        kv_bytes_per_token=seq.model.kv_bytes_per_token,
    )
    sampler = Sampler(params, ids)
    stops = StopMatcher(params.stop)
    want = params.logprobs

    def logprob(logits: np.ndarray, token: int) -> tuple[TokenLogprob, ...]:
        """`token`'s log probability under `logits` when asked for (the model's own)."""
        if want is None or token < 0:
            return ()
        return (token_logprob(logits, token, want, detok.piece),)

    if speculative is not None:
        speculative.new_reply()
    generated = 0
    t_first = 0.0
    last_emit = 0.0

    def current(now: float) -> Metrics:
        decode_s = now - t_first
        m = replace(
            base,
            ttft_s=t_first - t_request,
            decode_tokens=max(0, generated - 1),
            decode_tps=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            kv_used=seq.n_past,
            kv_capacity=seq.capacity,
            kv_bytes=seq.model.kv_bytes,
        )
        if speculative is None:
            return m
        st = speculative.stats
        return replace(
            m,
            drafted=st.drafted,
            accepted=st.accepted,
            mean_accepted_len=st.mean_accepted_len,
            draft_k=st.k,
            draft_time_share=st.draft_time_share,
            draft=speculative.name,
        )

    written: list[int] = []  # the reply's tokens and text while `starts` is undecided (the
    head = ""  # constraint it makes takes them)

    stop: StopReason | None = None
    # `queue`: the next reply tokens; all but the last are accepted drafts already in the cache;
    # `probs[j]`: queue[j]'s log probability entries, from the logits it was chosen by
    first = next_token(logits, sampler, shape)
    queue, probs = [first], [logprob(logits, first)]
    now = clock()

    def held_from(j: int, made: Constraint) -> None:
        """Hold the reply to `made` after queue[j]; drafts accepted past it are dropped (the
        cache and the sampler's history with them) and decoded again under it."""
        nonlocal shape, queue
        shape = made
        drop = len(queue) - 1 - j
        if drop > 0:
            seq.rollback(seq.n_past - drop)
            del sampler.history[-drop:]
            queue = queue[: j + 1]

    while True:
        for j, token in enumerate(queue):
            generated += 1
            now = clock()
            if generated == 1:
                t_first = now
            if (token in stop_ids and not params.ignore_eos) or token < 0:
                stop = "eos"
            else:
                piece = detok.push(token)
                if starts:
                    written.append(token)
                    head += piece
                text, hit = stops.feed(piece)
                yield TokenDelta(text, (token,), probs[j])
                if hit:
                    stop = "stop_string"
                elif shape is not None and j == len(queue) - 1 and shape.done:
                    # the value is complete: a reply under a schema ends there (a round of
                    # drafts ends with the token that completes it)
                    stop = "eos"
                elif generated >= params.max_tokens:
                    stop = "max_tokens"
            if stop is not None:
                # like plain decoding, the cache ends before the token that stopped the reply
                extra = len(queue) - 1 - j
                if extra > 0:
                    seq.rollback(seq.n_past - extra)
                break
            if lazy is not None and shape is None and token == lazy[0]:
                held_from(j, lazy[1]())
                break
            if starts and shape is None:
                begun = "".join(head.split())  # `{ "name"` and `{\n  "name"` start so too
                found = next((make for text, make in starts if begun.startswith(text)), None)
                if found is not None:
                    made, starts = found(), None
                    if all(made.consume(t) for t in written):  # else the reply stays free
                        held_from(j, made)
                        break
                else:  # those the reply may still start as
                    starts = [(text, m) for text, m in starts if text.startswith(begun)]
        if stop is not None:
            break
        token = queue[-1]
        if seq.n_past + 1 > seq.max_capacity:
            stop = "length"
            break
        if now - last_emit >= METRICS_INTERVAL_S:
            last_emit = now
            yield MetricsUpdate(current(now))
        if cancel.is_set():
            break
        if speculative is None or (speculate is not None and not speculate()):
            logits = seq.decode(token)
            first = next_token(logits, sampler, shape)
            queue, probs = [first], [logprob(logits, first)]
        else:
            budget = params.max_tokens - generated
            _, queue = speculative.advance(seq, token, sampler, budget, shape)
            rows = speculative.last_logits
            probs = [logprob(row, t) for row, t in zip(rows, queue, strict=True)]
    # a reply cut short (stopped, or at max_tokens) ends at a character boundary: the
    # bytes of a half-sampled character are dropped, never stored as U+FFFD
    cut = stop is None or stop == "max_tokens"
    tail = stops.flush() + ("" if cut else detok.flush()) if stop != "stop_string" else ""
    if tail:
        yield TokenDelta(tail)
    metrics = current(clock())
    yield MetricsUpdate(metrics)
    if stop is None:
        yield Cancelled(metrics)
    else:
        yield Finished(stop, metrics, stops.hit or "")
