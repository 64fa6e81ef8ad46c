"""Concurrency benchmark: several streams on one model, measured side by side in one run.

    python benchmarks/concurrency.py [--model qwen2.5-coder-0.5b --model qwen2.5-coder-1.5b]
                                     [--threads 2] [--tokens 48] [--json F]
                                     [--only aggregate,background,shared,paste,switch,rss]
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
* three requests for one ~1,000-token prompt started together (serve's `n` = 3): the time until
  all three have their first token, and the prompt tokens the steps computed, with rows shared
  (`peer_prefix`: one prefills, the others copy) and without, alternating over two rounds of
  each (a new prompt each round);
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

from concurrency_paste import PASTE_TOKENS, paste_figures, paste_line
from concurrency_rss import rss
from concurrency_streams import (
    LONG_TOKENS,
    PROMPTS,
    Figures,
    Stream,
    long_text,
    model_path,
    open_engine,
    request,
)

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import ChatMessage, ChatRequest, Finished, SamplingParams, TokenDelta
from npuchat.engine.step_trace import log as step_log

AGGREGATE_ROUNDS = 5  # rounds of 1, 2 and 4 streams (`aggregate_figures`)


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


SECTIONS = ("aggregate", "background", "shared", "paste", "switch", "rss")
SHARED_TOKENS = 1000  # the prompt three requests share (`shared_figures`)


def measure(
    path: Path, cache: Path, threads: int, tokens: int, sections: set[str]
) -> dict[str, float]:
    out = Figures()
    if sections & {"aggregate", "background", "shared"}:
        engine = open_engine(path, cache, 4, threads, [512, 1024, 2048, 4096])
        try:
            list(engine.generate(request("warm", "hi", 4), threading.Event()))  # graphs built
            if "aggregate" in sections:
                aggregate_figures(engine, tokens, out)
            if "background" in sections:
                background_figures(engine, tokens, out)
            if "shared" in sections:
                shared_figures(engine, out)
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


def shared_figures(engine: ConcurrentEngine, out: Figures) -> None:
    """Three streams of one prompt at once, rows shared or not, alternating (module doc)."""
    text = long_text(engine, SHARED_TOKENS)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    computed: dict[bool, list[int]] = {True: [], False: []}
    for r, share in enumerate((True, False, False, True)):
        engine.share_rows = share
        prompt = f"Round {r}. {text}\n\nSummarize the text above."
        streams = [Stream(engine, request(f"shared{r}-{i}", prompt, 16)) for i in range(3)]
        t0 = time.perf_counter()
        for s in streams:
            s.start()
        for s in streams:
            s.join()
        ends = [s.final for s in streams]
        assert all(isinstance(e, Finished) for e in ends), ends
        ttft[share].append(max(s.times[0] for s in streams) - t0)
        computed[share].append(sum(e.metrics.prefill_tokens for e in ends))  # type: ignore[union-attr]
    engine.share_rows = True
    for share, tag in ((True, "shared"), (False, "apart")):
        out[f"shared_prompt_last_ttft_s_{tag}"] = statistics.median(ttft[share])
        out[f"shared_prompt_prefilled_{tag}"] = statistics.median(computed[share])
    out["shared_prompt_ttft_x"] = (
        out["shared_prompt_last_ttft_s_shared"] / out["shared_prompt_last_ttft_s_apart"]
    )


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
        line = paste_line(name, figures)
        if line is not None:
            print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
