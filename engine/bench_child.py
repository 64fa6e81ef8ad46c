"""The benchmark's child processes: start-up and "after a restart" are what a user waits for in a
new process (interpreter, imports, graph load), so they are measured in one.

The parent writes a `ChildSpec` as JSON and runs `python -m npuchat.engine.bench_child SPEC`; the
child prints one JSON line, a `StartAnswer` or a `RestartAnswer`, which the parent turns into
the report's start-up and memory figures (`start_figures`, `memory_figures`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from .bench_report import Figure, MemoryFigures, StartFigures, from_plain
from .bench_timers import ask, exercise, peak_rss_bytes, system_prompt
from .draft_models import VERIFY_K
from .errors import NpuchatError
from .model import Model, default_capacities
from .npu_sizes import binary_bytes, gguf_tensor_bytes
from .session import ChatSession

A = TypeVar("A")


@dataclass
class ChildSpec:
    kind: str  # "start" or "restart"
    gguf: str
    name: str
    device: str
    threads: int | None
    cache_dir: str
    systems: list[str] = field(default_factory=list)  # restart: one request per system prompt
    warmup_tokens: int = 0
    kv_dtype: str = "f32"


@dataclass
class StartAnswer:
    load_s: float
    ready_wall: float  # wall clock when the model was loaded (the parent knows when it spawned)
    graph_builds: int
    peak_rss_bytes: int | None
    kv_bytes_per_token: int
    kv_bytes_by_capacity: dict[str, int]
    kv_bytes_in_use: int
    context_binary_bytes: int = 0  # device npu: the compiled folder's QNN context binaries
    kv_dtype: str = "f32"


@dataclass
class RestartAnswer:
    ttft_s: list[float]
    reused_tokens: list[int]


def run_child(spec: ChildSpec, answer: type[A], spec_file: Path) -> tuple[A, float]:
    """Run `spec` in a new Python process; its answer and the wall time it was spawned at."""
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(asdict(spec)))
    spawned = time.time()  # wall clock: the child reports when it was ready on it
    res = subprocess.run(
        [sys.executable, "-m", "npuchat.engine.bench_child", str(spec_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode:
        tail = "\n".join(res.stderr.strip().splitlines()[-5:])
        raise NpuchatError(f"benchmark child process ({spec.kind}) failed:\n{tail}")
    return from_plain(answer, json.loads(res.stdout.strip().splitlines()[-1])), spawned


def start_figures(
    cold: list[tuple[StartAnswer, float]], cached: list[tuple[StartAnswer, float]]
) -> StartFigures:
    """Cold and cached starts from the children's answers, each with the time it spawned."""

    def ready(runs: list[tuple[StartAnswer, float]]) -> Figure:
        return Figure.of([a.ready_wall - spawned for a, spawned in runs])

    return StartFigures(
        cold_s=Figure.of([a.load_s for a, _ in cold]),
        cached_s=Figure.of([a.load_s for a, _ in cached]),
        cold_process_s=ready(cold),
        cached_process_s=ready(cached),
        cold_graph_builds=min(a.graph_builds for a, _ in cold),
        cached_graph_builds=max(a.graph_builds for a, _ in cached),
    )


def memory_figures(gguf: Path, cached: list[tuple[StartAnswer, float]]) -> MemoryFigures:
    """What the model costs in memory: weights, KV per capacity, and the cached starts' peak
    RSS against the budget of 1.3x the GGUF plus the KV cache in use."""
    first = cached[0][0]
    weights = gguf.stat().st_size
    memory = MemoryFigures(
        weight_bytes=weights,
        kv_bytes_per_token=first.kv_bytes_per_token,
        kv_bytes_by_capacity=first.kv_bytes_by_capacity,
        kv_bytes_in_use=first.kv_bytes_in_use,
        rss_budget_bytes=int(1.3 * weights + first.kv_bytes_in_use),
        tensor_bytes=gguf_tensor_bytes(gguf),
        context_binary_bytes=first.context_binary_bytes or None,
        kv_dtype=first.kv_dtype,
    )
    peaks = [a.peak_rss_bytes for a, _ in cached if a.peak_rss_bytes]
    if peaks:
        memory.peak_rss_bytes = Figure.of(peaks)
        memory.peak_rss_vs_budget = memory.peak_rss_bytes.median / memory.rss_budget_bytes
    return memory


def _start(spec: ChildSpec) -> StartAnswer:
    """Load (building the graphs if the cache is empty), then run every graph shape once."""
    t = time.perf_counter()
    model = Model.load(
        spec.gguf,
        cache_dir=Path(spec.cache_dir),
        device=spec.device,
        threads=spec.threads,
        verify_k=VERIFY_K,
        kv_dtype=spec.kv_dtype,
    )
    load_s = time.perf_counter() - t
    ready_wall = time.time()
    builds = model.graph_builds
    binaries = sum(binary_bytes(model.graph_dir).values()) if spec.device == "npu" else 0
    exercise(model, min(512, model.max_capacity // 2))
    kv_in_use = model.kv_bytes  # the capacity variant the exercise moved to
    per_token = model.kv_bytes_per_token
    caps = [c for c in default_capacities(model.config.context_length) if c <= model.max_capacity]
    model.close()
    return StartAnswer(
        load_s=load_s,
        ready_wall=ready_wall,
        graph_builds=builds,
        peak_rss_bytes=peak_rss_bytes(),
        kv_bytes_per_token=per_token,
        kv_bytes_by_capacity={str(c): per_token * c for c in caps},
        kv_bytes_in_use=kv_in_use,
        context_binary_bytes=binaries,
        kv_dtype=model.kv_dtype,
    )


def _restart(spec: ChildSpec) -> RestartAnswer:
    """First request for each system prompt in a new process: its prefix comes from disk."""
    session = ChatSession.open(
        Path(spec.gguf),
        name=spec.name,
        cache_dir=Path(spec.cache_dir),
        device=spec.device,
        threads=spec.threads,
        verify_k=VERIFY_K,
        kv_dtype=spec.kv_dtype,
    )
    try:
        warm = system_prompt(session, spec.warmup_tokens, f"restart-warm-up-{os.getpid()}")
        ask(session, warm, "Review: x = 1", 4)
        replies = [ask(session, s, "Review: def mul(a, b): return a*b", 4) for s in spec.systems]
    finally:
        session.close()
    return RestartAnswer([r.ttft_s for r in replies], [r.reused_tokens for r in replies])


def main(argv: Sequence[str]) -> int:
    spec = from_plain(ChildSpec, json.loads(Path(argv[0]).read_text()))
    answer = _start(spec) if spec.kind == "start" else _restart(spec)
    print(json.dumps(asdict(answer)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
