"""The benchmark suite behind `npuchat bench`: the one implementation of every published figure.

Why a suite and not ad-hoc timing: the traps of §9.2 of the seed (no warm-up, a single token, a
single run) give numbers that flatter or slander the engine at random. So every figure here is
measured after a warm-up run of the same shape, repeated, and reported as a `Figure` (median with
min and max). The report is a plain JSON-able dict that grows section by section, so an
interrupted run (Ctrl+C) still shows everything measured up to that point.

Sections (see `BenchRun`):
- start: cold start (graph build into an empty cache) vs cached start, each in a new process so
  the time is what a user waits for; that process then runs prefill, decode and verify once and
  reports its peak RSS (the memory a chat costs with every graph shape in use);
- prefill: tok/s and ms for prompts of 128..2048 tokens (up to the model's capacity);
- decode: tok/s at context lengths 128..2048;
- chat: end-to-end TTFT and total tok/s of chat requests over a fixed prompt set;
- prefix_reuse: TTFT cold vs a second conversation sharing the system prompt vs a new process
  that finds the prefix on disk;
- speculation: decode tok/s target-only vs each drafter mode, acceptance, and whether the tokens
  equal target-only's (greedy: they must);
- memory: peak RSS, weight bytes, KV bytes per token and per capacity variant;
- llama_bench (optional): llama.cpp's `llama-bench` on the same GGUF and thread count, with our
  figure divided by its figure for each matching test.

Child processes run `python -m npuchat.engine.bench CHILD_SPEC.json` (see `_child_main`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from .drafters import Drafter, LookupDrafter
from .errors import NpuchatError
from .events import ChatMessage, ChatRequest, Failed, Finished, SamplingParams, TokenDelta
from .gguf_reader import GGUFFile
from .model import Model, default_capacities
from .session import ChatSession
from .speculative import SpeculativeDecoder

SCHEMA_VERSION = 1
Progress = Callable[[str, int, int], None]
"""(what is running, steps done, steps in the whole run)."""

EDIT_CODE = '''\
def compute_total(items, tax_rate):
    """Return the total price of the items, tax included."""
    subtotal = 0.0
    for item in items:
        price = item["price"]
        quantity = item.get("quantity", 1)
        subtotal += price * quantity
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def cheapest(items):
    """Return the cheapest item, or None for an empty list."""
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''

PROMPTS: dict[str, str] = {
    "code": "Write a Python function that merges two sorted lists into one sorted list, "
    "with a docstring and a few doctests.",
    "edit": "Rename `compute_total` to `total_price` and add type hints to both functions. "
    "Reply with the complete updated code only.\n\n```python\n" + EDIT_CODE + "```",
    "chat": "What are the main differences between TCP and UDP? Answer in a short paragraph.",
}
CHAT_SYSTEM = "You are a helpful coding assistant."
SYSTEM_PARAGRAPH = (
    "You are a senior Python reviewer. Prefer small functions with clear names, type hints on "
    "every public function, docstrings that explain why rather than what, and tests that fail "
    "when behaviour breaks. Point out hidden state, needless copies and work done on hot paths. "
)


@dataclass(frozen=True)
class SuiteConfig:
    """How much to measure. `quick` is for a look (and tests); `full` feeds the README."""

    name: str
    prefill_sizes: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_tokens: int  # timed decode steps per repeat
    repeats: int
    cold_repeats: int  # each one builds every graph again
    start_repeats: int  # cached starts (a new process each)
    reply_tokens: int  # max tokens of chat and speculation replies
    system_tokens: int  # length of the prefix-reuse system prompt
    prompts: tuple[str, ...]


SUITES: dict[str, SuiteConfig] = {
    "quick": SuiteConfig("quick", (128, 512), (128, 1024), 16, 3, 1, 2, 24, 256, tuple(PROMPTS)),
    "full": SuiteConfig(
        "full", (128, 512, 1024, 2048), (128, 1024, 2048), 64, 5, 2, 5, 128, 1000, tuple(PROMPTS)
    ),
}


@dataclass(frozen=True)
class Figure:
    """One measured quantity: median, min and max over `n` repeats (after warm-up)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Figure:
        if not samples:
            raise ValueError("a figure needs at least one sample")
        values = [float(s) for s in samples]
        return cls(statistics.median(values), min(values), max(values), len(values))

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size (None where the OS does not tell)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux counts KiB


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the figures: CPU, cores, OS, versions, load at the start."""
    import onnxruntime  # type: ignore[import-untyped]

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    try:
        from importlib.metadata import version

        npuchat_version = version("npuchat")
    except Exception:
        npuchat_version = "unknown"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "npuchat": npuchat_version,
        "load_average_1m": load,
    }


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
        if i:  # run 0 is the warm-up (first-run allocations of this shape and capacity)
            samples.append(time.perf_counter() - t)
    model.rollback(0)
    return samples


def time_decode(model: Model, context: int, steps: int, repeats: int) -> list[float]:
    """Decode tok/s of `steps` greedy steps starting at `context` cached tokens."""
    vocab = model.config.vocab_size
    model.rollback(0)
    model.prefill(token_ids(vocab, context, seed=2))
    first = token_ids(vocab, 1, seed=3)[0]
    samples = []
    for i in range(repeats + 1):
        model.rollback(context)
        token = first
        t = time.perf_counter()
        for _ in range(steps):
            token = int(model.decode(token).argmax())
        if i:
            samples.append(steps / (time.perf_counter() - t))
    model.rollback(0)
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


def ask(
    session: ChatSession, system: str, user: str, max_tokens: int, *, ignore_eos: bool = False
) -> Reply:
    """One greedy chat request; its engine metrics plus wall time and the reply's token ids.

    `ignore_eos` makes every reply `max_tokens` long (as llama-bench's tg tests do), so
    throughput compares like with like whatever the model would have answered.
    """
    request = ChatRequest(
        "bench",
        system,
        (ChatMessage("user", user),),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    ids: list[int] = []
    final: Finished | None = None
    stop_ids = session.stop_ids
    if ignore_eos:
        session.stop_ids = set()
    t = time.perf_counter()
    try:
        for event in session.generate(request, threading.Event()):
            if isinstance(event, TokenDelta):
                ids.extend(event.ids)
            elif isinstance(event, Failed):
                raise NpuchatError(f"benchmark request failed: {event.message}")
            elif isinstance(event, Finished):
                final = event
    finally:
        session.stop_ids = stop_ids
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
    )


def system_prompt(session: ChatSession, tokens: int, tag: str) -> str:
    """A system prompt of about `tokens` tokens that starts with `tag`, so each tag is new."""
    text = f"Session {tag}. "
    while len(session.tokenizer.encode(text)) < tokens:
        text += SYSTEM_PARAGRAPH
    return text


def _first_difference(ids: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where `ids` and `reference` differ (None: identical)."""
    for i, (a, b) in enumerate(zip(ids, reference, strict=False)):
        if a != b:
            return i
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


# --------------------------------------------------------------------------- llama-bench


def run_llama_bench(
    binary: str | Path,
    gguf: Path,
    threads: int,
    prompt_sizes: Sequence[int],
    decode_tokens: int,
    depths: Sequence[int],
    repeats: int,
) -> dict[str, Any]:
    """llama.cpp's `llama-bench -o json` on the same file and threads: tok/s per test.

    Returns {"prefill": {n_prompt: {"tps", "stddev"}}, "decode": {depth: {...}}, ...}. Decode at
    a context > 0 needs `-d` (llama.cpp builds since 2025); an older binary leaves those out.
    """
    base = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-o", "json"]
    out: dict[str, Any] = {"binary": str(binary), "prefill": {}, "decode": {}, "notes": []}
    runs = [[*base, "-p", ",".join(map(str, prompt_sizes)), "-n", str(decode_tokens)]]
    deep = [d for d in depths if d > 0]
    if deep:
        runs.append([*base, "-p", "0", "-n", str(decode_tokens), "-d", ",".join(map(str, deep))])
    for cmd in runs:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise NpuchatError(f"--llama-bench {binary}: cannot run it ({exc})") from exc
        if res.returncode:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            out["notes"].append(f"{' '.join(cmd[1:])} failed: {tail[0]}")
            continue
        try:
            rows = json.loads(res.stdout)
        except json.JSONDecodeError as exc:
            raise NpuchatError(
                f"--llama-bench {binary}: its output is not JSON ({exc}); is it llama-bench?"
            ) from exc
        for row in rows:
            tps = {"tps": float(row["avg_ts"]), "stddev": float(row.get("stddev_ts", 0.0))}
            out.setdefault("build", row.get("build_commit"))
            out.setdefault("threads", row.get("n_threads"))
            if row.get("n_prompt") and not row.get("n_gen"):
                out["prefill"][int(row["n_prompt"])] = tps
            elif row.get("n_gen") and not row.get("n_prompt"):
                out["decode"][int(row.get("n_depth", 0))] = tps
    return out


def llama_ratios(report: dict[str, Any], llama: dict[str, Any]) -> None:
    """Add `llama_tps` and `ratio` (ours / llama.cpp) to each matching prefill/decode row.

    Our decode at context 128 is matched with llama.cpp's tg at depth 0 (its tg128 spans
    contexts 0..128); larger contexts with the same depth, when the binary measured it.
    """
    for row in report.get("prefill", []):
        ref = llama["prefill"].get(row["tokens"])
        if ref:
            row["llama_tps"] = ref["tps"]
            row["ratio"] = row["tps"]["median"] / ref["tps"]
    for row in report.get("decode", []):
        ref = llama["decode"].get(0 if row["context"] <= 128 else row["context"])
        if ref:
            row["llama_tps"] = ref["tps"]
            row["ratio"] = row["tps"]["median"] / ref["tps"]


# --------------------------------------------------------------------------- the run


class BenchRun:
    """One `npuchat bench` run; `report` holds every figure measured so far (JSON-able).

    The caller measures start-up first (`measure_start`, before anything is built in
    `cache_dir`), then opens the engine from that same cache, `attach`es it and calls
    `measure_all`. Work is counted in steps for the progress display.
    """

    def __init__(
        self,
        config: SuiteConfig,
        *,
        gguf: Path,
        name: str,
        device: str,
        threads: int | None,
        cache_dir: Path,
        progress: Progress | None = None,
    ) -> None:
        self.config = config
        self.gguf = gguf
        self.name = name
        self.device = device
        self.threads = threads
        self.cache_dir = cache_dir
        self._progress = progress or (lambda what, done, total: None)
        self._done = 0
        self.session: ChatSession | None = None
        self.drafters: list[Drafter] = []
        with GGUFFile(gguf) as g:
            cfg = g.config
        self.context_length = cfg.context_length
        self.report: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "suite": config.name,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "model": {
                "name": name,
                "gguf": str(gguf),
                "gguf_bytes": gguf.stat().st_size,
                "arch": cfg.arch,
                "n_layers": cfg.n_layers,
                "context_length": cfg.context_length,
                "device": device,
                "threads": threads or os.cpu_count(),
            },
            "repeats": config.repeats,
            "warmup_runs": 1,
            "interrupted": False,
            "skipped": [],
        }

    # ------------------------------------------------------------------ plumbing

    @property
    def total_steps(self) -> int:
        c = self.config
        spec_modes = 4
        return (
            c.cold_repeats
            + c.start_repeats
            + len(c.prefill_sizes)
            + len(c.decode_contexts)
            + len(c.prompts)
            + 3
            + len(c.prompts) * spec_modes
            + 1
        )

    def _step(self, what: str, count: int = 1) -> None:
        self._done += count
        self._progress(what, self._done, self.total_steps)

    def _announce(self, what: str) -> None:
        self._progress(what, self._done, self.total_steps)

    def _child(self, kind: str, **spec: Any) -> dict[str, Any]:
        """Run `kind` in a new Python process; its one-line JSON answer."""
        spec_file = self.cache_dir / f"child-{kind}.json"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        spec_file.write_text(
            json.dumps(
                {
                    "kind": kind,
                    "gguf": str(self.gguf),
                    "name": self.name,
                    "device": self.device,
                    "threads": self.threads,
                    **spec,
                }
            )
        )
        spawned = time.time()  # wall clock: the child reports when it was ready on it
        res = subprocess.run(
            [sys.executable, "-m", "npuchat.engine.bench", str(spec_file)],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode:
            tail = "\n".join(res.stderr.strip().splitlines()[-5:])
            raise NpuchatError(f"benchmark child process ({kind}) failed:\n{tail}")
        answer: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
        answer["spawned"] = spawned
        return answer

    # ------------------------------------------------------------------ sections

    def measure_start(self) -> None:
        """Cold start (empty graph cache: build) vs cached start, each in a new process."""
        c = self.config
        graphs = self.cache_dir / "graphs"
        cold: list[dict[str, Any]] = []
        for i in range(c.cold_repeats):
            self._announce(f"cold start {i + 1}/{c.cold_repeats} (building graphs)")
            cold.append(self._child("start", cache_dir=str(graphs / f"cold-{i}")))
            self._step("cold start")
        cached: list[dict[str, Any]] = []
        for i in range(c.start_repeats):
            self._announce(f"cached start {i + 1}/{c.start_repeats}")
            cached.append(self._child("start", cache_dir=str(self.main_cache)))
            self._step("cached start")

        def ready(runs: list[dict[str, Any]]) -> dict[str, float | int]:
            return Figure.of([r["ready_wall"] - r["spawned"] for r in runs]).as_dict()

        self.report["start"] = {
            "cold_s": Figure.of([r["load_s"] for r in cold]).as_dict(),
            "cached_s": Figure.of([r["load_s"] for r in cached]).as_dict(),
            # from spawning the process (interpreter, imports) to a loaded model
            "cold_process_s": ready(cold),
            "cached_process_s": ready(cached),
            "cold_graph_builds": min(r["graph_builds"] for r in cold),
            "cached_graph_builds": max(r["graph_builds"] for r in cached),
        }
        peaks = [r["peak_rss_bytes"] for r in cached if r["peak_rss_bytes"]]
        kv = cached[0]["kv_bytes_in_use"]
        weights = self.gguf.stat().st_size
        memory: dict[str, Any] = {
            "weight_bytes": weights,
            "kv_bytes_per_token": cached[0]["kv_bytes_per_token"],
            "kv_bytes_by_capacity": cached[0]["kv_bytes_by_capacity"],
            # issue 3's target: peak RSS with every graph shape run ≤ 1.3 × GGUF + KV in use
            "kv_bytes_in_use": kv,
            "rss_budget_bytes": int(1.3 * weights + kv),
        }
        if peaks:
            peak = Figure.of(peaks)
            memory["peak_rss_bytes"] = peak.as_dict()
            memory["peak_rss_vs_budget"] = peak.median / memory["rss_budget_bytes"]
        self.report["memory"] = memory

    @property
    def main_cache(self) -> Path:
        """The graph cache the first cold start built; the rest of the run uses it."""
        return self.cache_dir / "graphs" / "cold-0"

    def attach(self, session: ChatSession) -> None:
        """Use this session (opened from `main_cache`); its drafters serve the speculation part.

        Plain figures run without speculation; the chat figure runs as the user configured it.
        """
        self.session = session
        spec = session.speculative
        self.drafters = list(spec.drafters) if spec is not None else []
        self.report["model"]["draft"] = session.draft_name
        self.report["model"]["capacities"] = [
            c for c in default_capacities(self.context_length) if c <= session.model.max_capacity
        ]

    def measure_all(self) -> None:
        self.measure_prefill()
        self.measure_decode()
        self.measure_chat()
        self.measure_prefix_reuse()
        self.measure_speculation()
        self.report["memory"]["suite_peak_rss_bytes"] = peak_rss_bytes()
        self._step("done")

    def _model(self) -> Model:
        if self.session is None:
            raise NpuchatError("attach a session before measuring")
        return self.session.model

    def measure_prefill(self) -> None:
        """Must run before any chat request: it writes the cache behind the session's back and
        leaves it empty, which is the state a fresh session expects."""
        model = self._model()
        rows = self.report.setdefault("prefill", [])
        for n in self.config.prefill_sizes:
            if n > model.max_capacity:
                self.report["skipped"].append(f"prefill {n}: above the capacity")
                self._step(f"prefill {n}")
                continue
            self._announce(f"prefill {n} tokens")
            secs = time_prefill(
                model, token_ids(model.config.vocab_size, n, 1), self.config.repeats
            )
            rows.append(
                {
                    "tokens": n,
                    "tps": Figure.of([n / s for s in secs]).as_dict(),
                    "ms": Figure.of([1000 * s for s in secs]).as_dict(),
                }
            )
            self._step(f"prefill {n}")

    def measure_decode(self) -> None:
        model = self._model()
        steps = self.config.decode_tokens
        rows = self.report.setdefault("decode", [])
        for ctx in self.config.decode_contexts:
            if ctx + steps + 1 > model.max_capacity:
                self.report["skipped"].append(f"decode at {ctx}: above the capacity")
                self._step(f"decode at {ctx}")
                continue
            self._announce(f"decode at context {ctx}")
            tps = time_decode(model, ctx, steps, self.config.repeats)
            rows.append(
                {
                    "context": ctx,
                    "tokens": steps,
                    "capacity": model.capacity,
                    "tps": Figure.of(tps).as_dict(),
                }
            )
            self._step(f"decode at {ctx}")

    def measure_chat(self) -> None:
        """Each request is a new conversation of a running app: the system prompt's KV is
        reused (as the app does), the user message is new (a running number keeps repeats from
        reusing the previous request's tokens)."""
        session = self.session
        assert session is not None
        c = self.config
        ttft: list[float] = []
        tps: list[float] = []
        tokens = 0
        counter = 0
        for name in c.prompts:
            self._announce(f"chat: {name} prompt")
            for i in range(c.repeats + 1):
                counter += 1
                user = f"({counter}) {PROMPTS[name]}"
                reply = ask(session, CHAT_SYSTEM, user, c.reply_tokens, ignore_eos=True)
                if i:
                    ttft.append(reply.ttft_s)
                    tps.append((reply.decode_tokens + 1) / reply.wall_s)
                    tokens += reply.decode_tokens + 1
            self._step(f"chat {name}")
        self.report["chat"] = {
            "prompts": list(c.prompts),
            "max_tokens": c.reply_tokens,
            "draft": session.draft_name,
            "ttft_s": Figure.of(ttft).as_dict(),
            "total_tps": Figure.of(tps).as_dict(),
            "reply_tokens_mean": tokens / len(ttft),
            "eos_ignored": True,
        }

    def measure_prefix_reuse(self) -> None:
        """Cold (a new system prompt), shared (a second conversation with that system prompt),
        and restart (a new process finding the prefix on disk), `repeats` of each."""
        session = self.session
        assert session is not None
        c = self.config
        target = min(c.system_tokens, session.model.max_capacity // 2)
        warm = system_prompt(session, target, "warm-up")
        ask(session, warm, "Review: x = 1", 4)  # warm-up: a cold request, then a shared one
        ask(session, warm, "Review: y = 2", 4)
        cold: list[Reply] = []
        shared: list[Reply] = []
        systems = []
        for i in range(c.repeats):
            self._announce(f"prefix reuse {i + 1}/{c.repeats}")
            system = system_prompt(session, target, f"{i}-{os.getpid()}")
            systems.append(system)
            cold.append(ask(session, system, "Review: def add(a, b): return a+b", 4))
            shared.append(ask(session, system, "Review: def sub(a, b): return a-b", 4))
        self._step("prefix reuse")
        self._announce("prefix reuse after a restart (new process)")
        child = self._child(
            "restart", cache_dir=str(self.main_cache), systems=systems, warmup_tokens=target
        )
        self._step("prefix reuse after restart")
        cold_t = Figure.of([r.ttft_s for r in cold])
        shared_t = Figure.of([r.ttft_s for r in shared])
        restart_t = Figure.of(child["ttft_s"])
        self.report["prefix_reuse"] = {
            "system_tokens": len(session.system_prefix(systems[0])),
            "cold_ttft_s": cold_t.as_dict(),
            "shared_ttft_s": shared_t.as_dict(),
            "restart_ttft_s": restart_t.as_dict(),
            "shared_vs_cold": shared_t.median / cold_t.median,
            "restart_vs_cold": restart_t.median / cold_t.median,
            "cold_prefill_tokens": cold[0].prefill_tokens,
            "shared_reused_tokens": min(r.reused_tokens for r in shared),
            "restart_reused_tokens": min(child["reused_tokens"]),
        }
        self._step("prefix reuse done")

    def measure_speculation(self) -> None:
        """Decode tok/s of each drafter mode against target-only on the prompt set (greedy, so
        every mode must produce target-only's tokens: `exact` says whether it did)."""
        session = self.session
        assert session is not None
        c = self.config
        lookup: list[Drafter] = [d for d in self.drafters if isinstance(d, LookupDrafter)]
        models = [d for d in self.drafters if not isinstance(d, LookupDrafter)]
        modes: dict[str, list[Drafter]] = {"target": []}
        if lookup:
            modes["lookup"] = lookup[:1]
        if models:
            modes["draft"] = models[:1]
        if lookup and models:
            modes["both"] = [*lookup[:1], *models[:1]]
        section: dict[str, Any] = {"modes": list(modes), "prompts": []}
        if len(modes) == 1:
            section["available"] = False
            section["reason"] = "no drafter loaded (--draft none)"
        else:
            section["available"] = True
        self.report["speculation"] = section
        configured = session.speculative
        decoders = {
            m: SpeculativeDecoder(session.model, ds) if ds else None for m, ds in modes.items()
        }
        try:
            for name in c.prompts:
                self._announce(f"speculation: {name} prompt")
                row: dict[str, Any] = {"prompt": name}
                reference: list[int] | None = None
                for mode, decoder in decoders.items():
                    session.speculative = decoder
                    # the same request each time: the prompt's KV is reused, decode is timed
                    runs = [
                        ask(session, CHAT_SYSTEM, PROMPTS[name], c.reply_tokens, ignore_eos=True)
                        for _ in range(c.repeats + 1)
                    ][1:]
                    if reference is None:
                        reference = runs[0].ids
                    drafted = sum(r.drafted for r in runs)
                    accepted = sum(r.accepted for r in runs)
                    tps = [r.decode_tps for r in runs if r.decode_tokens > 0]
                    diffs = [_first_difference(r.ids, reference) for r in runs]
                    row[mode] = {
                        "decode_tps": Figure.of(tps).as_dict() if tps else None,
                        "drafted": drafted,
                        "accepted": accepted,
                        "acceptance": accepted / drafted if drafted else 0.0,
                        "exact": all(d is None for d in diffs),
                        # reply token index where a run first left target-only's tokens
                        "first_difference": min((d for d in diffs if d is not None), default=None),
                    }
                    base = row["target"]["decode_tps"]
                    if mode != "target" and base and row[mode]["decode_tps"]:
                        row[mode]["vs_target"] = row[mode]["decode_tps"]["median"] / base["median"]
                    self._step(f"speculation {name} {mode}")
                self._step(f"speculation {name}", 4 - len(decoders))
                section["prompts"].append(row)
        finally:
            session.speculative = configured

    def compare_llama(self, binary: str | Path) -> None:
        c = self.config
        self._announce("llama-bench")
        prefill = [r["tokens"] for r in self.report.get("prefill", [])]
        depths = [r["context"] for r in self.report.get("decode", [])]
        llama = run_llama_bench(
            binary,
            self.gguf,
            int(self.report["model"]["threads"]),
            prefill or list(c.prefill_sizes[:1]),
            c.decode_tokens,
            depths,
            c.repeats,
        )
        llama_ratios(self.report, llama)
        llama["prefill"] = {str(k): v for k, v in llama["prefill"].items()}
        llama["decode"] = {str(k): v for k, v in llama["decode"].items()}
        self.report["llama_bench"] = llama


# --------------------------------------------------------------------------- child processes


def _child_start(spec: dict[str, Any]) -> dict[str, Any]:
    """Load (building the graphs if the cache is empty), then run every graph shape once."""
    t = time.perf_counter()
    model = Model.load(
        spec["gguf"],
        cache_dir=Path(spec["cache_dir"]),
        device=spec["device"],
        threads=spec["threads"],
        verify_k=8,
    )
    load_s = time.perf_counter() - t
    ready_wall = time.time()
    builds = model.graph_builds
    exercise(model, min(512, model.max_capacity // 2))
    kv_in_use = model.kv_bytes  # the capacity variant the exercise moved to
    per_token = kv_in_use // model.capacity
    caps = [c for c in default_capacities(model.config.context_length) if c <= model.max_capacity]
    out = {
        "load_s": load_s,
        "ready_wall": ready_wall,
        "graph_builds": builds,
        "peak_rss_bytes": peak_rss_bytes(),
        "kv_bytes_per_token": per_token,
        "kv_bytes_by_capacity": {str(c): per_token * c for c in caps},
        "kv_bytes_in_use": kv_in_use,
    }
    model.close()
    return out


def _child_restart(spec: dict[str, Any]) -> dict[str, Any]:
    """First request for each system prompt in a new process: its prefix comes from disk."""
    session = ChatSession.open(
        Path(spec["gguf"]),
        name=spec["name"],
        cache_dir=Path(spec["cache_dir"]),
        device=spec["device"],
        threads=spec["threads"],
        verify_k=8,
    )
    try:
        warm = system_prompt(session, spec["warmup_tokens"], f"restart-warm-up-{os.getpid()}")
        ask(session, warm, "Review: x = 1", 4)
        replies = [ask(session, s, "Review: def mul(a, b): return a*b", 4) for s in spec["systems"]]
    finally:
        session.close()
    return {
        "ttft_s": [r.ttft_s for r in replies],
        "reused_tokens": [r.reused_tokens for r in replies],
    }


def _child_main(argv: Sequence[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    run = {"start": _child_start, "restart": _child_restart}[spec["kind"]]
    print(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
