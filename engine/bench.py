"""The benchmark suite behind `npuchat bench`: what it measures, in which order, into one report.

Why a suite and not ad-hoc timing: a figure with no warm-up, from a single token or a single run
flatters or slanders the engine at random. So every figure here is measured after a warm-up run
of the same shape, repeated, and reported as a `Figure` (median with min and max). The report
(`bench_report.BenchReport`) grows section by section, so an interrupted run (Ctrl+C) still
shows everything measured up to that point.

Sections, in order:
- start: cold start (graph build into an empty cache) vs cached start, each in a new process
  (`bench_child`) so the time is what a user waits for; that process then runs prefill, decode
  and verify once and reports its peak RSS (the memory a chat costs with every graph shape);
- prefill: tok/s and ms for prompts of 128..2048 tokens (up to the model's capacity);
- decode: tok/s at context lengths 128..2048;
- chat: end-to-end TTFT and total tok/s of chat requests over a fixed prompt set;
- prefix_reuse: TTFT cold vs a second conversation sharing the system prompt vs a new process
  that finds the prefix on disk;
- speculation: decode tok/s target-only vs each drafter mode, acceptance, and whether the tokens
  equal target-only's (greedy: they must);
- llama_bench (optional): llama.cpp's `llama-bench` on the same GGUF and thread count
  (`llama_bench`), with our figure divided by its figure for each matching test.

The timers live in `bench_timers`; `benchmarks/*.py` use them for what this suite does not
measure (cost-model detail, matmul floors, idle prefix reuse).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from .bench_child import (
    ChildSpec,
    RestartAnswer,
    StartAnswer,
    memory_figures,
    run_child,
    start_figures,
)
from .bench_report import (
    BatchedRow,
    BenchReport,
    ChatFigures,
    DecodeRow,
    Figure,
    ModelInfo,
    PrefillRow,
    PrefixReuseFigures,
    SpeculationFigures,
    SpeculationRow,
)
from .bench_suites import BATCHED_STREAMS, PROMPTS, SPEC_MODES, SuiteConfig
from .bench_timers import (
    CHAT_SYSTEM,
    Reply,
    ask,
    machine_info,
    mode_figures,
    peak_rss_bytes,
    system_prompt,
    time_batched_decode,
    time_decode,
    time_prefill,
    token_ids,
)
from .drafters import Drafter, LookupDrafter
from .errors import NpuchatError
from .gguf_reader import GGUFFile
from .llama_bench import add_llama_ratios, run_llama_bench
from .model import Model, default_capacities
from .session import ChatSession
from .speculative import SpeculativeDecoder

Progress = Callable[[str, int, int], None]
"""(what is running, steps done, steps in the whole run)."""


class BenchRun:
    """One `npuchat bench` run; `report` holds every figure measured so far.

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
        kv_dtype: str = "f32",
    ) -> None:
        self.config, self.gguf, self.name = config, gguf, name
        self.device, self.threads, self.kv_dtype = device, threads, kv_dtype
        self.cache_dir = cache_dir
        self._progress = progress or (lambda what, done, total: None)
        self._done = 0
        self.session: ChatSession | None = None
        self.drafters: list[Drafter] = []
        with GGUFFile(gguf) as g:
            cfg = g.config
        self.context_length = cfg.context_length
        model = ModelInfo(
            name=name,
            gguf=str(gguf),
            gguf_bytes=gguf.stat().st_size,
            arch=cfg.arch,
            n_layers=cfg.n_layers,
            context_length=cfg.context_length,
            device=device,
            threads=threads or os.cpu_count() or 1,
        )
        self.report = BenchReport(
            suite=config.name,
            date=datetime.now(UTC).isoformat(timespec="seconds"),
            machine=machine_info(),
            model=model,
            repeats=config.repeats,
        )

    # ------------------------------------------------------------------ plumbing

    @property
    def total_steps(self) -> int:
        c = self.config
        return (
            c.cold_repeats
            + c.start_repeats
            + len(c.prefill_sizes)
            + len(c.decode_contexts)
            + len(BATCHED_STREAMS)
            + len(c.prompts)
            + 3
            + len(c.prompts) * SPEC_MODES
            + 1
        )

    def _step(self, what: str, count: int = 1) -> None:
        self._done += count
        self._progress(what, self._done, self.total_steps)

    def _announce(self, what: str) -> None:
        self._progress(what, self._done, self.total_steps)

    def _spec(
        self, kind: str, cache_dir: Path, systems: list[str] | None = None, warmup_tokens: int = 0
    ) -> ChildSpec:
        return ChildSpec(
            kind,
            str(self.gguf),
            self.name,
            self.device,
            self.threads,
            str(cache_dir),
            systems or [],
            warmup_tokens,
            self.kv_dtype,
        )

    # ------------------------------------------------------------------ sections

    def measure_start(self) -> None:
        """Cold start (empty graph cache: build) vs cached start, each in a new process."""
        c = self.config
        graphs = self.cache_dir / "graphs"
        spec_file = self.cache_dir / "child-start.json"
        cold: list[tuple[StartAnswer, float]] = []
        for i in range(c.cold_repeats):
            self._announce(f"cold start {i + 1}/{c.cold_repeats} (building graphs)")
            spec = self._spec("start", graphs / f"cold-{i}")
            cold.append(run_child(spec, StartAnswer, spec_file))
            self._step("cold start")
        cached: list[tuple[StartAnswer, float]] = []
        for i in range(c.start_repeats):
            self._announce(f"cached start {i + 1}/{c.start_repeats}")
            cached.append(run_child(self._spec("start", self.main_cache), StartAnswer, spec_file))
            self._step("cached start")

        self.report.start = start_figures(cold, cached)
        self.report.memory = memory_figures(self.gguf, cached)

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
        self.report.model.draft = session.draft_name
        self.report.model.capacities = [
            c for c in default_capacities(self.context_length) if c <= session.model.max_capacity
        ]

    def measure_all(self) -> None:
        self.measure_prefill()
        self.measure_decode()
        self.measure_batched()
        self.measure_chat()
        self.measure_prefix_reuse()
        self.measure_speculation()
        if self.report.memory is not None:
            self.report.memory.suite_peak_rss_bytes = peak_rss_bytes()
        self._step("done")

    def _session(self) -> ChatSession:
        if self.session is None:
            raise NpuchatError("attach a session before measuring")
        return self.session

    def _model(self) -> Model:
        return self._session().model

    def measure_prefill(self) -> None:
        """Must run before any chat request: it writes the cache behind the session's back and
        leaves it empty, which is the state a fresh session expects."""
        model = self._model()
        for n in self.config.prefill_sizes:
            if n > model.max_capacity:
                self.report.skipped.append(f"prefill {n}: above the capacity")
                self._step(f"prefill {n}")
                continue
            self._announce(f"prefill {n} tokens")
            ids = token_ids(model.config.vocab_size, n, 1)
            secs = time_prefill(model, ids, self.config.repeats)
            tps, ms = Figure.of([n / s for s in secs]), Figure.of([1000 * s for s in secs])
            self.report.prefill.append(PrefillRow(n, tps, ms))
            self._step(f"prefill {n}")

    def measure_decode(self) -> None:
        model = self._model()
        steps = self.config.decode_tokens
        for ctx in self.config.decode_contexts:
            if ctx + steps + 1 > model.max_capacity:
                self.report.skipped.append(f"decode at {ctx}: above the capacity")
                self._step(f"decode at {ctx}")
                continue
            self._announce(f"decode at context {ctx}")
            tps = Figure.of(time_decode(model, ctx, steps, self.config.repeats))
            self.report.decode.append(DecodeRow(ctx, steps, model.capacity, tps))
            self._step(f"decode at {ctx}")

    def measure_batched(self) -> None:
        """Several streams in one decode step (what the concurrent engine runs), 1/2/4."""
        model = self._model()
        ctx, steps = self.config.decode_contexts[0], self.config.decode_tokens
        for b in BATCHED_STREAMS:
            if b <= model.batch_max and ctx + steps + 1 <= model.max_capacity:
                self._announce(f"decode of {b} streams at once")
                tps = Figure.of(time_batched_decode(model, b, ctx, steps, self.config.repeats))
                one = self.report.batched[0].tps.median if self.report.batched else None
                ratio = tps.median / one if one else None
                self.report.batched.append(BatchedRow(b, ctx, tps, 1.0 if b == 1 else ratio))
            else:
                self.report.skipped.append(f"{b} streams at once: the engine holds fewer")
            self._step(f"{b} streams")

    def measure_chat(self) -> None:
        """Each request is a new conversation of a running app: the system prompt's KV is
        reused (as the app does), the user message is new (a running number keeps repeats from
        reusing the previous request's tokens)."""
        session = self._session()
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
        self.report.chat = ChatFigures(
            prompts=list(c.prompts),
            max_tokens=c.reply_tokens,
            draft=session.draft_name,
            ttft_s=Figure.of(ttft),
            total_tps=Figure.of(tps),
            reply_tokens_mean=tokens / len(ttft),
            eos_ignored=True,
        )

    def measure_prefix_reuse(self) -> None:
        """Cold (a new system prompt), shared (a second conversation with that system prompt),
        and restart (a new process finding the prefix on disk), `repeats` of each."""
        session = self._session()
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
        spec = self._spec("restart", self.main_cache, systems=systems, warmup_tokens=target)
        child, _ = run_child(spec, RestartAnswer, self.cache_dir / "child-restart.json")
        self._step("prefix reuse after restart")
        cold_t = Figure.of([r.ttft_s for r in cold])
        shared_t = Figure.of([r.ttft_s for r in shared])
        restart_t = Figure.of(child.ttft_s)
        self.report.prefix_reuse = PrefixReuseFigures(
            system_tokens=len(session.system_prefix(systems[0])),
            cold_ttft_s=cold_t,
            shared_ttft_s=shared_t,
            restart_ttft_s=restart_t,
            shared_vs_cold=shared_t.median / cold_t.median,
            restart_vs_cold=restart_t.median / cold_t.median,
            cold_prefill_tokens=cold[0].prefill_tokens,
            shared_reused_tokens=min(r.reused_tokens for r in shared),
            restart_reused_tokens=min(child.reused_tokens),
        )
        self._step("prefix reuse done")

    def _modes(self) -> dict[str, list[Drafter]]:
        lookup: list[Drafter] = [d for d in self.drafters if isinstance(d, LookupDrafter)]
        models = [d for d in self.drafters if not isinstance(d, LookupDrafter)]
        modes: dict[str, list[Drafter]] = {"target": []}
        if lookup:
            modes["lookup"] = lookup[:1]
        if models:
            modes["draft"] = models[:1]
        if lookup and models:
            modes["both"] = [*lookup[:1], *models[:1]]
        return modes

    def measure_speculation(self) -> None:
        """Decode tok/s of each drafter mode against target-only on the prompt set (greedy, so
        every mode must produce target-only's tokens: `exact` says whether it did). Each mode
        keeps one decoder across prompts, as a chat session would."""
        session = self._session()
        c = self.config
        modes = self._modes()
        section = SpeculationFigures(modes=list(modes), available=len(modes) > 1)
        if not section.available:
            section.reason = "no drafter loaded (--draft none)"
        self.report.speculation = section
        decoders: dict[str, SpeculativeDecoder | None] = {
            m: session.make_decoder(ds) if ds else None for m, ds in modes.items()
        }
        for name in c.prompts:
            self._announce(f"speculation: {name} prompt")
            row = SpeculationRow(name)
            reference: list[int] | None = None
            for mode, decoder in decoders.items():
                with session.decoding_with(decoder):
                    # the same request each time: the prompt's KV is reused, decode is timed
                    runs = [
                        ask(session, CHAT_SYSTEM, PROMPTS[name], c.reply_tokens, ignore_eos=True)
                        for _ in range(c.repeats + 1)
                    ][1:]
                if reference is None:
                    reference = runs[0].ids
                row.modes[mode] = mode_figures(runs, reference, row.modes.get("target"))
                self._step(f"speculation {name} {mode}")
            self._step(f"speculation {name}", SPEC_MODES - len(decoders))
            section.prompts.append(row)

    def compare_llama(self, binary: str | Path) -> None:
        c = self.config
        self._announce("llama-bench")
        prefill = [r.tokens for r in self.report.prefill]
        depths = [r.context for r in self.report.decode]
        llama = run_llama_bench(
            binary,
            self.gguf,
            self.report.model.threads,
            prefill or list(c.prefill_sizes[:1]),
            c.decode_tokens,
            depths,
            c.repeats,
        )
        add_llama_ratios(self.report, llama)
        self.report.llama_bench = llama
