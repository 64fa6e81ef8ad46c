"""Cancel latency during a long prefill: how long Esc waits when the running prefill chunk is
ended (`RunOptions.terminate`, `engine/run_abort.py`) against waiting for the chunk's end, side
by side in one run.

    python benchmarks/cancel_latency.py [--model qwen2.5-coder-1.5b | --gguf F] [--threads 2]
                                        [--trials 3] [--cache DIR]

Through `ConcurrentEngine`, greedy: a prompt of about 3.5 prefill chunks, one conversation per
trial (nothing reused but the system prefix). The cancel is set while the second chunk runs, at
(i + 0.5) / trials of the first chunk's time after the first chunk ended; the figure is the
time from setting it to the request's `Cancelled`. "chunk end" runs the same trials with the
abort switched off (the scheduler's `abortable` replaced by a no-op), as the engine did before.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from npuchat.engine import scheduler
from npuchat.engine.catalog import Catalog
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Finished,
    MetricsUpdate,
    SamplingParams,
)
from npuchat.engine.paths import Paths
from npuchat.engine.session import ChatSession


def _request(conv: str, text: str) -> ChatRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    return ChatRequest(conv, "", (ChatMessage("user", text),), sampling)


def _prompt(engine: ConcurrentEngine, trial: str, tokens: int) -> str:
    words = f"{trial} the engine reads every word of a long prompt before it answers".split()
    text = []
    while len(engine.tokenizer.encode(" ".join(text))) < tokens:
        text.extend(words)
    return " ".join(text)


def _cancel_in_second_chunk(
    engine: ConcurrentEngine, req: ChatRequest, at: float
) -> tuple[float, float]:
    """(seconds from the cancel to `Cancelled`, the first chunk's seconds); the cancel is set
    `at` (a fraction) of the first chunk's time into the second chunk."""
    cancel, events, ended = threading.Event(), list[Event](), threading.Event()

    def consume() -> None:
        for ev in engine.generate(req, cancel):
            events.append(ev)
        ended.set()

    threading.Thread(target=consume, daemon=True).start()
    while not (progress := [e for e in events if isinstance(e, MetricsUpdate)]):
        time.sleep(0.001)
    m = progress[0].metrics
    chunk_s = m.prefill_tokens / m.prefill_tps
    time.sleep(at * chunk_s)
    cancel.set()
    t0 = time.perf_counter()
    ended.wait()
    assert isinstance(events[-1], Cancelled), events[-1]
    return time.perf_counter() - t0, chunk_s


@contextlib.contextmanager
def _no_abort() -> Iterator[None]:
    real = scheduler.abortable
    scheduler.abortable = lambda cancel: contextlib.nullcontext(None)  # type: ignore[assignment]
    try:
        yield
    finally:
        scheduler.abortable = real


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--gguf", type=Path, help="a GGUF file instead of an installed model")
    ap.add_argument("--cache", type=Path, help="graph cache folder (default: the app's)")
    args = ap.parse_args()
    paths = Paths.from_env()
    path = args.gguf or Catalog.load(paths).resolve(args.model)
    session = ChatSession.open(
        path, name=path.stem, cache_dir=args.cache or paths.cache, threads=args.threads,
        capacities=[1024], batch_max=2,
    )  # fmt: skip
    engine = ConcurrentEngine(session)
    try:
        chunk = session.model.prefill_chunk
        warm = list(
            engine.generate(_request("warm", _prompt(engine, "warm", chunk)), threading.Event())
        )
        assert isinstance(warm[-1], Finished), warm[-1]  # graphs and buffers are ready
        figures: dict[str, list[float]] = {"ended": [], "chunk end": []}
        chunks: list[float] = []
        for i in range(args.trials):
            for mode in figures:
                text = _prompt(engine, f"{mode}{i}", chunk * 7 // 2)
                with _no_abort() if mode == "chunk end" else contextlib.nullcontext():
                    at = (i + 0.5) / args.trials
                    req = _request(f"{mode}{i}", text)
                    waited, chunk_s = _cancel_in_second_chunk(engine, req, at)
                figures[mode].append(waited)
                chunks.append(chunk_s)
        print(f"{path.stem}: a {chunk}-token prefill chunk took {statistics.median(chunks):.2f} s")
        for mode, values in figures.items():
            shown = ", ".join(f"{v * 1000:.0f}" for v in values)
            median = statistics.median(values) * 1000
            print(f"  cancel -> Cancelled, {mode:9}: median {median:6.0f} ms ({shown})")
        ratio = statistics.median(figures["ended"]) / statistics.median(figures["chunk end"])
        print(f"  ended / chunk end: {ratio:.3f}x")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
