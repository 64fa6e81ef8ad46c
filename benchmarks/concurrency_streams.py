"""What every section of `concurrency.py` uses: the model, an engine on it, a request, a stream
that records when each token arrives, a long prompt, and the figures as they are measured.

Kept apart so that the sections can live in modules of their own (`concurrency_paste.py`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from npuchat.engine.catalog import Catalog
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import ChatMessage, ChatRequest, Event, SamplingParams, TokenDelta
from npuchat.engine.paths import Paths
from npuchat.engine.pull import pull
from npuchat.engine.session import ChatSession

LONG_TOKENS = 2000
PROMPTS = [
    "Write a detailed essay about the history of computing, from the abacus to modern GPUs.",
    "Explain, step by step and at length, how a compiler turns source code into machine code.",
    "Describe in detail how the internet routes a packet from one continent to another.",
    "Write a long tutorial on writing a web server in Python, with code and explanations.",
]


def model_path(name: str) -> Path:
    try:
        return Catalog.load(Paths.from_env()).resolve(name)
    except Exception:
        root = Path.home() / ".cache" / "npuchat-test"
        path, _ = pull(Catalog.load(Paths(root, root, root, root / "models")), name)
        return path


def open_engine(
    path: Path, cache: Path, slots: int, threads: int, caps: list[int]
) -> ConcurrentEngine:
    session = ChatSession.open(
        path,
        name=path.stem,
        cache_dir=cache,
        threads=threads,
        capacities=caps,
        batch_max=slots,
        kv_dtype="auto",  # as the app's
    )
    return ConcurrentEngine(session, max_queue=16)


def request(conv: str, text: str, tokens: int, priority: str = "interactive") -> ChatRequest:
    # every reply runs to `tokens` (an early end-of-turn would leave a stream's window empty)
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return ChatRequest(conv, "", (ChatMessage("user", text),), sampling, priority)  # type: ignore[arg-type]


class Stream(threading.Thread):
    def __init__(self, engine: ConcurrentEngine, req: ChatRequest) -> None:
        super().__init__(daemon=True)
        self.engine, self.req = engine, req
        self.cancel = threading.Event()
        self.times: list[float] = []
        self.events: list[Event] = []

    def run(self) -> None:
        for ev in self.engine.generate(self.req, self.cancel):
            self.events.append(ev)
            if isinstance(ev, TokenDelta) and ev.ids:
                self.times.extend([time.perf_counter()] * len(ev.ids))

    @property
    def final(self) -> Event:
        return self.events[-1]


def long_text(engine: ConcurrentEngine, tokens: int) -> str:
    words = [
        "the",
        "engine",
        "keeps",
        "every",
        "conversation",
        "in",
        "its",
        "own",
        "slot",
        "and",
        "decodes",
        "them",
        "together",
    ]
    text: list[str] = []
    i = 0
    while len(engine.tokenizer.encode(" ".join(text))) < tokens:
        text.extend(words[j % len(words)] + str(i) for j in range(50))
        i += 1
    return " ".join(text)


class Figures(dict[str, float]):
    """Prints each figure as it is measured, so a long run that fails late keeps what it had."""

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, value)
        print(f"  {key:34s} {value:10.3f}", flush=True)
