"""Esc during a long prefill: a cancel ends the graph run under way (ONNX Runtime's
`RunOptions.terminate`), not the next chunk boundary, and leaves the cache and the sequence
consistent, on a synthetic model wide enough that one prefill chunk takes about a second."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from synthetic import write_synthetic_gguf

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Finished,
    MetricsUpdate,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.session import ChatSession

CHUNK = 128
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)  # 3 chunks


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConcurrentEngine]:
    folder = tmp_path_factory.mktemp("wide")
    path = write_synthetic_gguf(
        folder / "wide.gguf", "qwen2", n_layers=12, d_model=512, ffn_dim=1536, seed=11
    )
    session = ChatSession.open(
        path, name="wide", cache_dir=folder / "cache", capacities=[512], prefill_chunk=CHUNK,
        batch_max=2, accuracy_level=0,
    )  # fmt: skip
    # the same prompt in two conversations: without `share_rows` off, the second would copy
    # the first's rows (`peer_prefix`) and have nothing to prefill, so nothing to cancel
    e = ConcurrentEngine(session, share_rows=False)
    yield e
    e.close()


def _request(conv: str) -> ChatRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=6)
    return ChatRequest(conv, "", (ChatMessage("user", PROMPT),), sampling)


def _ids(events: list[Event]) -> list[int]:
    return [i for e in events if isinstance(e, TokenDelta) for i in e.ids]


def test_cancel_ends_the_running_prefill_chunk_and_the_retry_equals_a_fresh_run(
    engine: ConcurrentEngine,
) -> None:
    fresh = list(engine.generate(_request("fresh"), threading.Event()))
    final = fresh[-1]
    assert isinstance(final, Finished)
    m = final.metrics
    assert m.prefill_tokens > 2 * CHUNK
    chunk_s = CHUNK * 1 / m.prefill_tps  # one chunk's run, measured on this machine now

    cancel = threading.Event()
    events: list[Event] = []
    ended = threading.Event()

    def consume() -> None:
        for ev in engine.generate(_request("cut"), cancel):
            events.append(ev)
        ended.set()

    threading.Thread(target=consume, daemon=True).start()
    # the first chunk is done (its progress report is out): the second one is running
    deadline = time.monotonic() + 60
    while not any(isinstance(e, MetricsUpdate) for e in events):
        assert time.monotonic() < deadline, "no prefill progress"
        time.sleep(0.002)
    time.sleep(chunk_s / 4)
    cancel.set()
    t_cancel = time.perf_counter()
    assert ended.wait(60)
    waited = time.perf_counter() - t_cancel
    assert isinstance(events[-1], Cancelled) and not _ids(events)
    # without ending the run, the cancel would wait for the rest of the chunk (3/4 of it)
    assert waited < chunk_s / 4, f"cancel took {waited:.2f} s; a chunk takes {chunk_s:.2f} s"

    again = list(engine.generate(_request("cut"), threading.Event()))
    done = again[-1]
    assert isinstance(done, Finished)
    assert _ids(again) == _ids(fresh)
    # the finished first chunk was kept, the ended second one was run again from its start
    first = next(e.metrics for e in events if isinstance(e, MetricsUpdate))
    assert done.metrics.reused_tokens == first.reused_tokens + CHUNK
