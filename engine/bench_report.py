"""The benchmark report's schema: typed records that `npuchat bench` fills and prints, written
as JSON with `--json` and read back (`read_report`) for the README's tables.

One schema for both directions, so a field the suite measures and a field the renderer reads
cannot drift apart. A section that was not measured (an interrupted run, no llama-bench) is None.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import types
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .errors import NpuchatError

SCHEMA_VERSION = 2
T = TypeVar("T")


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


@dataclass
class Machine:
    cpu: str
    cores: int | None
    os: str
    python: str
    onnxruntime: str
    npuchat: str
    load_average_1m: float | None
    cpu_flags: list[str] = field(default_factory=list)  # the SIMD sets the kernels may use


@dataclass
class ModelInfo:
    name: str
    gguf: str
    gguf_bytes: int
    arch: str
    n_layers: int
    context_length: int
    device: str
    threads: int
    draft: str = ""
    capacities: list[int] = field(default_factory=list)


@dataclass
class PrefillRow:
    tokens: int
    tps: Figure
    ms: Figure
    llama_tps: float | None = None  # llama-bench's figure for the same test
    ratio: float | None = None  # ours / llama.cpp's


@dataclass
class DecodeRow:
    context: int
    tokens: int
    capacity: int
    tps: Figure
    llama_tps: float | None = None
    ratio: float | None = None


@dataclass
class BatchedRow:
    """Decode with `streams` sequences in one graph step each: every stream's tokens per second
    together, and that over one stream's (the weights are read once per step for all)."""

    streams: int
    context: int
    tps: Figure
    ratio: float | None = None


@dataclass
class StartFigures:
    cold_s: Figure
    cached_s: Figure
    cold_process_s: Figure  # from spawning the process (interpreter, imports) to a loaded model
    cached_process_s: Figure
    cold_graph_builds: int
    cached_graph_builds: int


@dataclass
class MemoryFigures:
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_by_capacity: dict[str, int]
    kv_bytes_in_use: int
    rss_budget_bytes: int  # peak RSS with every graph shape run should stay under 1.3 x GGUF + KV
    peak_rss_bytes: Figure | None = None
    peak_rss_vs_budget: float | None = None
    suite_peak_rss_bytes: int | None = None
    tensor_bytes: int | None = None  # every tensor's data in the GGUF
    context_binary_bytes: int | None = None  # device npu: every QNN context binary of the set
    kv_dtype: str = "f32"  # how the cache stored K/V (`--kv-dtype`)


@dataclass
class ChatFigures:
    prompts: list[str]
    max_tokens: int
    draft: str
    ttft_s: Figure
    total_tps: Figure
    reply_tokens_mean: float
    eos_ignored: bool


@dataclass
class PrefixReuseFigures:
    system_tokens: int
    cold_ttft_s: Figure
    shared_ttft_s: Figure
    restart_ttft_s: Figure
    shared_vs_cold: float
    restart_vs_cold: float
    cold_prefill_tokens: int
    shared_reused_tokens: int
    restart_reused_tokens: int


@dataclass
class ModeFigures:
    decode_tps: Figure | None
    drafted: int
    accepted: int
    acceptance: float
    exact: bool  # the same tokens as target-only (greedy: they must be)
    first_difference: int | None  # reply token index where a run first left target-only's
    vs_target: float | None = None


@dataclass
class SpeculationRow:
    prompt: str
    modes: dict[str, ModeFigures] = field(default_factory=dict)


@dataclass
class SpeculationFigures:
    modes: list[str]
    available: bool
    reason: str = ""
    prompts: list[SpeculationRow] = field(default_factory=list)


@dataclass
class LlamaFigure:
    tps: float
    stddev: float
    samples: list[float] = field(default_factory=list)  # tok/s of each `-r` repetition


@dataclass
class LlamaBenchFigures:
    binary: str
    prefill: dict[str, LlamaFigure] = field(default_factory=dict)  # by prompt tokens
    decode: dict[str, LlamaFigure] = field(default_factory=dict)  # by depth (context)
    notes: list[str] = field(default_factory=list)
    build: str | None = None
    threads: int | None = None


@dataclass
class BenchReport:
    suite: str
    date: str
    machine: Machine
    model: ModelInfo
    repeats: int
    schema: int = SCHEMA_VERSION
    warmup_runs: int = 1
    interrupted: bool = False
    skipped: list[str] = field(default_factory=list)
    start: StartFigures | None = None
    memory: MemoryFigures | None = None
    prefill: list[PrefillRow] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    batched: list[BatchedRow] = field(default_factory=list)
    chat: ChatFigures | None = None
    prefix_reuse: PrefixReuseFigures | None = None
    speculation: SpeculationFigures | None = None
    llama_bench: LlamaBenchFigures | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def from_plain(cls: type[T], data: Any) -> T:
    """A dataclass from what `asdict` made of it (nested records, lists, dicts, optionals)."""
    return typing.cast(T, _convert(cls, data))


def _convert(tp: Any, data: Any) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(data, dict):
            raise TypeError(f"{tp.__name__}: expected an object, got {type(data).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        return tp(**{k: _convert(hints[k], v) for k, v in data.items() if k in names})
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if data is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner, data)
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_convert(item, v) for v in data]
    if origin is dict:
        _, value = typing.get_args(tp)
        return {str(k): _convert(value, v) for k, v in data.items()}
    if tp is float and isinstance(data, int):
        return float(data)
    if isinstance(tp, type) and not isinstance(data, tp):
        raise TypeError(f"expected {tp.__name__}, got {type(data).__name__}")
    return data


def read_report(path: Path) -> BenchReport:
    """A report written by `npuchat bench --json` (a clear error for anything else)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise NpuchatError(f"cannot read report {path}: {exc}") from exc
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != SCHEMA_VERSION:
        raise NpuchatError(
            f"{path}: report schema {schema!r}, this npuchat reads {SCHEMA_VERSION}; "
            "rerun `npuchat bench --json` to make a new one"
        )
    try:
        return from_plain(BenchReport, data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise NpuchatError(f"{path}: not a benchmark report ({exc})") from exc
