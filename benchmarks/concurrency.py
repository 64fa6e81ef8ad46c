"""Concurrency benchmark: several streams on one model, measured side by side in one run.

    python benchmarks/concurrency.py [--model qwen2.5-coder-0.5b --model qwen2.5-coder-1.5b]
                                     [--threads 2] [--tokens 48] [--json F]
                                     [--only aggregate,background,paste,switch,rss]
                                     [--trace STEPS.log]

For each model, through `ConcurrentEngine` (the engine the app uses), greedy, no drafts:

* aggregate decode tok/s with 1, 2 and 4 streams started together (tokens of all streams
  inside the window where every stream is decoding, over that window), and the ratios to one
  (five rounds of the three, ratios within each round; the median and the rounds' range);
* per-stream decode tok/s of an interactive reply while a background reply runs, against the
  same reply alone;
* the longest gap between two tokens of a streaming reply while another conversation prefills a
  ~2,000-token prompt (`--paste-tokens`), from the paste's arrival until its request has ended
  and the stream has decoded three more tokens (what the paste's end costs counts too), against
  that stream's median gap before the prefill started (printed plainly at the end per model),
  and its 99th percentile; beside it the control: the same stream alone on a fresh engine for as
  many tokens, its longest and 99th-percentile gap against its own median gap over its first
  tokens (what this machine's noise gives with no paste at all), and the paste's longest gap
  against the control's median gap over the same tokens;
  the same from the per-step trace in process CPU time (a busy machine stretches wall time, not
  that; at 2 threads it counts ORT's spinning too: read it at `--threads 1`), also each mixed
  step against the stream's plain decode steps nearest it, in CPU and in wall time (the stream
  grows by a token a step meanwhile, and its own steps with it); and how long the prompt took
  against it alone;
* TTFT of the next turn of a ~2,000-token conversation after two other conversations ran,
  against its cold TTFT: with 4 slots (it kept its row) and with 1 slot (paged out to the
  prefix store and back); and that turn again after a restart (its KV read back from disk);
* peak RSS of a child process that loads the model with 1 or 4 slots at capacity 4,096, fills
  every slot and runs a decode step over them, beside its RSS once loaded and the KV bytes (the
  load's own peak, prepacking the weights, is reset first: it does not depend on the slots).

Graphs are built before anything is timed; each model gets a private prefix folder, so the cold
figures are cold.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from concurrency_rss import rss

from npuchat.engine.catalog import Catalog
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Event,
    Finished,
    SamplingParams,
    TokenDelta,
)
from npuchat.engine.paths import Paths
from npuchat.engine.pull import pull
from npuchat.engine.session import ChatSession
from npuchat.engine.step_trace import StepRecord
from npuchat.engine.step_trace import log as step_log

LONG_TOKENS = 2000
PASTE_TOKENS = [LONG_TOKENS]  # the paste's length (`--paste-tokens`)
AGGREGATE_ROUNDS = 5  # rounds of 1, 2 and 4 streams (`aggregate_figures`)
USUAL_TOKENS = 32  # the stream's tokens before the paste comes: its usual gap (`paste_gaps`)
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


def aggregate(engine: ConcurrentEngine, n: int, tokens: int, tag: str) -> float:
    streams = [Stream(engine, request(f"{tag}{i}", PROMPTS[i % 4], tokens)) for i in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        s.join()
    start = max(s.times[0] for s in streams)
    end = min(s.times[-1] for s in streams)
    inside = sum(sum(1 for t in s.times if start < t <= end) for s in streams)
    return inside / (end - start) if end > start else 0.0


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


SECTIONS = ("aggregate", "background", "paste", "switch", "rss")


def measure(
    path: Path, cache: Path, threads: int, tokens: int, sections: set[str]
) -> dict[str, float]:
    out = Figures()
    if sections & {"aggregate", "background"}:
        engine = open_engine(path, cache, 4, threads, [512, 1024, 2048, 4096])
        try:
            list(engine.generate(request("warm", "hi", 4), threading.Event()))  # graphs built
            if "aggregate" in sections:
                aggregate_figures(engine, tokens, out)
            if "background" in sections:
                background_figures(engine, tokens, out)
        finally:
            engine.close()
    if "paste" in sections:
        paste_figures(path, cache, threads, tokens, out)
    if "switch" in sections:
        switch_figures(path, cache, threads, out)
    return out


def aggregate_figures(engine: ConcurrentEngine, tokens: int, out: Figures) -> None:
    """1, 2 and 4 streams in turn, `AGGREGATE_ROUNDS` times: each round's ratios are taken
    within the round (this VM's memory speed drifts from minute to minute, and a window of 48
    tokens is a second or two), then the median of the rounds, with their min and max."""
    tps: dict[int, list[float]] = {1: [], 2: [], 4: []}
    for r in range(AGGREGATE_ROUNDS):
        for n in tps:
            tps[n].append(aggregate(engine, n, tokens, f"agg{r}-{n}-"))
    for n, values in tps.items():
        out[f"aggregate_{n}_tps"] = statistics.median(values)
    for n in (2, 4):
        ratios = sorted(a / b for a, b in zip(tps[n], tps[1], strict=True))
        out[f"aggregate_{n}_x"] = statistics.median(ratios)
        out[f"aggregate_{n}_x_min"], out[f"aggregate_{n}_x_max"] = ratios[0], ratios[-1]


def background_figures(engine: ConcurrentEngine, tokens: int, out: Figures) -> None:
    alone = Stream(engine, request("fg-alone", PROMPTS[0], tokens))
    alone.run()
    bg = Stream(engine, request("bg", PROMPTS[1], 10 * tokens, "background"))
    bg.start()
    while not bg.times:
        time.sleep(0.01)
    fg = Stream(engine, request("fg", PROMPTS[0], tokens))
    fg.run()
    bg.cancel.set()
    bg.join()
    assert isinstance(alone.final, Finished) and isinstance(fg.final, Finished)
    out["interactive_alone_tps"] = alone.final.metrics.decode_tps
    out["interactive_with_bg_tps"] = fg.final.metrics.decode_tps
    out["interactive_with_bg_x"] = out["interactive_with_bg_tps"] / max(
        out["interactive_alone_tps"], 1e-9
    )


def paste_figures(path: Path, cache: Path, threads: int, tokens: int, out: Figures) -> None:
    """The paste alone, then beside a stream, each on an engine of its own (a row left holding
    the first paste would keep the cache at a large capacity for the stream)."""
    caps = [512, 1024, 2048, 4096]
    engine = open_engine(path, cache, 4, threads, caps)
    try:
        list(engine.generate(request("warm", "hi", 4), threading.Event()))
        alone = Stream(engine, request("paste-alone", long_text(engine, PASTE_TOKENS[0]), 2))
        alone.run()
        assert isinstance(alone.final, Finished), alone.final
    finally:
        engine.close()
    shutil.rmtree(cache / "prefixes", ignore_errors=True)  # not read back from disk
    engine = open_engine(path, cache, 4, threads, caps)
    try:
        gaps = paste_beside_a_stream(engine, tokens, out)
    finally:
        engine.close()
    shutil.rmtree(cache / "prefixes", ignore_errors=True)
    engine = open_engine(path, cache, 4, threads, caps)
    try:
        control_gaps(engine, gaps, out)
    finally:
        engine.close()
    out["long_prefill_alone_ttft_s"] = alone.final.metrics.ttft_s
    out["long_prefill_x_alone"] = out["long_prefill_ttft_s"] / out["long_prefill_alone_ttft_s"]


class StepLog(logging.Handler):
    """Collects the scheduler's per-step records (`step_trace`) with the time they ended."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.steps: list[tuple[float, StepRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        step = getattr(record, "step", None)
        if isinstance(step, StepRecord):
            self.steps.append((time.perf_counter(), step))


def paste_beside_a_stream(engine: ConcurrentEngine, tokens: int, out: Figures) -> int:
    """The paste's figures (`paste_gaps`); returns the stream's gaps while the paste was read."""
    steps = StepLog()
    step_log.addHandler(steps)
    level = step_log.level
    step_log.setLevel(logging.DEBUG)
    try:
        return paste_gaps(engine, tokens, out, steps)
    finally:
        step_log.removeHandler(steps)
        step_log.setLevel(level)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def control_gaps(engine: ConcurrentEngine, gaps: int, out: Figures) -> None:
    """The paste's stream alone for `gaps` gaps after its first `USUAL_TOKENS` tokens: its
    longest and p99 gap against its median gap over those first tokens, as `paste_gaps` takes
    them. On this 2-core VM a stream alone has steps of 2-3x its median now and then, so the
    paste's figure is read against this one. Also the paste's longest gap against the median
    gap of this stream over the same tokens (what "normal" is at the length the stream had)."""
    list(engine.generate(request("warm", "hi", 4), threading.Event()))
    alone = Stream(engine, request("stream", PROMPTS[2], USUAL_TOKENS + gaps))
    alone.run()
    spans = [b - a for a, b in zip(alone.times, alone.times[1:], strict=False)]
    normal = statistics.median(spans[: USUAL_TOKENS - 1])
    after = spans[USUAL_TOKENS - 1 :]
    if not after:  # the paste beside the stream left no gap to compare with
        return
    out["alone_gap_normal_s"] = normal
    out["alone_gap_max_x"] = max(after) / normal
    out["alone_gap_p99_x"] = p99(after) / normal
    # the paste's longest gap against this stream's own median over the same stretch of tokens
    # (the stream's steps grow with its length, with or without a paste beside it)
    out["alone_gap_median_s"] = statistics.median(after)
    out["gap_x_alone_median"] = out["gap_max_during_prefill_s"] / out["alone_gap_median_s"]


def paste_gaps(engine: ConcurrentEngine, tokens: int, out: Figures, steps: StepLog) -> int:
    list(engine.generate(request("warm", "hi", 4), threading.Event()))
    text = long_text(engine, PASTE_TOKENS[0])
    streaming = Stream(engine, request("stream", PROMPTS[2], 100 * tokens))
    streaming.start()
    while len(streaming.times) < USUAL_TOKENS:
        time.sleep(0.01)
    t_long = time.perf_counter()
    big = Stream(engine, request("paste", text, 2))
    big.run()
    t_first = big.times[0] if big.times else time.perf_counter()
    n_end = len(streaming.times) + 3  # and the stream's next tokens after the paste's request
    while len(streaming.times) < n_end and streaming.is_alive():  # ended (what its end costs)
        time.sleep(0.01)
    t_done = streaming.times[-1]
    streaming.cancel.set()
    streaming.join()
    pairs = list(zip(streaming.times, streaming.times[1:], strict=False))
    before = [b - a for a, b in pairs if b <= t_long]
    during = [b - a for a, b in pairs if t_long < b <= t_done]
    out["gap_normal_s"] = statistics.median(before)
    out["gap_max_during_prefill_s"] = max(during) if during else float("nan")
    out["gap_median_during_prefill_s"] = statistics.median(during) if during else float("nan")
    out["gap_x"] = out["gap_max_during_prefill_s"] / out["gap_normal_s"]
    out["gap_p99_x"] = p99(during) / out["gap_normal_s"] if during else float("nan")
    out["long_prefill_ttft_s"] = t_first - t_long
    # the same in process CPU time, which a busy machine does not stretch: the dearest step
    # while the prompt was read, against the stream's decode steps before it
    usual = [r.cpu_s for t, r in steps.steps if t <= t_long and r.kind == "decode"]
    cpu = sorted(r.cpu_s for t, r in steps.steps if t_long < t <= t_done)
    if usual and cpu:
        out["step_cpu_usual_s"] = statistics.median(usual)
        out["step_cpu_max_x"] = cpu[-1] / out["step_cpu_usual_s"]
        out["step_cpu_p99_x"] = p99(cpu) / out["step_cpu_usual_s"]
    # the stream grows by a token a step while the prompt is read (its own steps get dearer
    # with its length): each mixed step against the plain decode steps nearest it in time, by
    # CPU time and by wall time (the latter what the stream's reader waits)
    during_steps = [r for t, r in steps.steps if t_long < t <= t_done]
    for clock in ("cpu", "wall"):
        plain = [
            (i, step_seconds(r, clock)) for i, r in enumerate(during_steps) if r.kind == "decode"
        ]
        own = []
        for i, r in enumerate(during_steps):
            near = sorted(plain, key=lambda p: abs(p[0] - i))[:9]
            if r.kind == "mixed" and near:
                own.append(step_seconds(r, clock) / statistics.median(c for _, c in near))
        if own:
            own.sort()
            out[f"step_{clock}_x_own_median"] = statistics.median(own)
            out[f"step_{clock}_x_own_p99"] = p99(own)
            out[f"step_{clock}_x_own_max"] = own[-1]
    return len(during)


def step_seconds(r: StepRecord, clock: str) -> float:
    return r.cpu_s if clock == "cpu" else r.wall_s


def switch_figures(path: Path, cache: Path, threads: int, out: Figures) -> None:
    for slots in (4, 1):
        shutil.rmtree(cache / "prefixes", ignore_errors=True)  # cold means cold
        engine = open_engine(path, cache, slots, threads, [4096])
        try:
            text = long_text(engine, LONG_TOKENS)
            first = list(engine.generate(request("long", text, 8), threading.Event()))
            cold = first[-1]
            assert isinstance(cold, Finished), cold
            reply = "".join(e.text for e in first if isinstance(e, TokenDelta))
            for conv in ("other1", "other2"):
                list(engine.generate(request(conv, PROMPTS[3], 8), threading.Event()))
            msgs = (
                ChatMessage("user", text),
                ChatMessage("assistant", reply),
                ChatMessage("user", "Summarize that in one line."),
            )
            again = ChatRequest("long", "", msgs, SamplingParams(temperature=0.0, max_tokens=8))
            back = list(engine.generate(again, threading.Event()))[-1]
            assert isinstance(back, Finished), back
            out[f"switch_cold_ttft_s_{slots}slot"] = cold.metrics.ttft_s
            out[f"switch_back_ttft_s_{slots}slot"] = back.metrics.ttft_s
            out[f"switch_back_x_{slots}slot"] = back.metrics.ttft_s / cold.metrics.ttft_s
        finally:
            engine.close()  # pages the long conversation out to disk
        if slots == 1:  # the same next turn after a restart: its KV comes back from disk
            engine = open_engine(path, cache, slots, threads, [4096])
            try:
                after = list(engine.generate(again, threading.Event()))[-1]
                assert isinstance(after, Finished), after
                out["restart_ttft_s"] = after.metrics.ttft_s
                out["restart_x_cold"] = after.metrics.ttft_s / cold.metrics.ttft_s
            finally:
                engine.close()
    shutil.rmtree(cache / "prefixes", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", action="append")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    ap.add_argument("--paste-tokens", type=int, default=LONG_TOKENS, help="the paste's length")
    ap.add_argument("--graphs", type=Path, help="a graph cache folder to reuse (not rebuilt)")
    ap.add_argument("--trace", type=Path, help="write the per-step trace (step_trace) here")
    args = ap.parse_args()
    PASTE_TOKENS[0] = args.paste_tokens
    sections = set(args.only.split(","))
    if sections - set(SECTIONS):
        ap.error(f"unknown sections {sorted(sections - set(SECTIONS))}; choose from {SECTIONS}")
    if args.trace:
        handler = logging.FileHandler(args.trace, mode="w")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        step_log.addHandler(handler)
        step_log.setLevel(logging.DEBUG)
    report = {}
    for name in args.model or ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]:
        path = model_path(name)
        print(name, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            if args.graphs:  # built graphs reused (the prefix folder stays private)
                (cache / "graphs").symlink_to(args.graphs.resolve(), target_is_directory=True)
            figures = measure(path, cache, args.threads, args.tokens, sections)
            for slots in (1, 4) if "rss" in sections else ():
                for key, value in rss(path, cache, slots, args.threads).items():
                    figures[f"{key}_{slots}slot_4096"] = value
        report[name] = dict(figures)
    for name, figures in report.items():  # the paste's figure, plainly (issue #15)
        if "gap_x" not in figures:
            continue
        line = (
            f"{name}: longest gap while a {PASTE_TOKENS[0]}-token prompt is read "
            f"{1e3 * figures['gap_max_during_prefill_s']:.0f} ms, the stream's median gap "
            f"before it {1e3 * figures['gap_normal_s']:.0f} ms: {figures['gap_x']:.2f}x "
            f"(median gap meanwhile {1e3 * figures['gap_median_during_prefill_s']:.0f} ms), "
            f"p99 {figures['gap_p99_x']:.2f}x"
        )
        if "alone_gap_max_x" in figures:  # the control (`control_gaps`)
            line += (
                f"; the same stream alone over as many tokens: longest "
                f"{figures['alone_gap_max_x']:.2f}x, p99 {figures['alone_gap_p99_x']:.2f}x; the "
                f"paste's longest gap against that stream's median gap over the same tokens "
                f"({1e3 * figures['alone_gap_median_s']:.0f} ms): "
                f"{figures['gap_x_alone_median']:.2f}x"
            )
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
