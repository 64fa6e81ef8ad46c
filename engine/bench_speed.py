"""`benchmarks/engine_speed.py`'s records: every repeat's figures per model and kernel mode,
summarized as median (min-max), llama.cpp's figures from the same run, and the README table.

A run is written whole (`--json FILE`) and the README's table is printed from that file
(`--table FILE`), so a published table is one run's output and can be regenerated from it.
Ratios are ours / llama.cpp's medians (> 1: we are faster); the CPU-time ratio is theirs /
ours per token (> 1: we spend less).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .bench_report import Figure, LlamaBenchFigures, Machine, from_plain
from .errors import NpuchatError

SPEED_SCHEMA = 1
MIB = 2**20


def flatten(figures: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of one phase's figures as dotted keys (`floor_ms.m1`); booleans and
    strings (which kernels, whether it built) are not figures and stay out."""
    out: dict[str, float] = {}
    for key, value in figures.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


def summarize(repeats: Sequence[Mapping[str, Any]]) -> dict[str, Figure]:
    """Median / min / max of every figure over the repeats that measured it (a profile's op
    can be missing from one repeat: it counts over the others)."""
    samples: dict[str, list[float]] = {}
    for figures in repeats:
        for key, value in flatten(figures).items():
            if math.isfinite(value):
                samples.setdefault(key, []).append(value)
    return {key: Figure.of(values) for key, values in samples.items()}


def llama_summary(bench: LlamaBenchFigures, cpu_ms: Mapping[str, float]) -> dict[str, Figure]:
    """llama-bench's pp512 / tg128 over its `-r` repetitions (its own samples when the build
    prints them, else its mean alone) and its CPU time per token when measured."""
    out: dict[str, Figure] = {}
    for key, figure in (("pp512", bench.prefill.get("512")), ("tg128", bench.decode.get("0"))):
        if figure is not None:
            out[key] = Figure.of(figure.samples or [figure.tps])
    for key, value in cpu_ms.items():
        out[key] = Figure.of([value])
    return out


@dataclass
class SpeedRow:
    """One model under one kernel mode: its cold and cached phases over `repeats` runs."""

    model: str
    gguf_bytes: int
    kernels: str  # what the engine reported it ran (`Model.kernels`)
    mode: str  # the NPUCHAT_KERNELS value it ran under ("" = as set)
    repeats: int
    cold: dict[str, Figure]
    run: dict[str, Figure]
    kv_bytes: int
    llama: dict[str, Figure] = field(default_factory=dict)

    @property
    def rss_target_mib(self) -> float:
        return 1.3 * self.gguf_bytes / MIB + self.kv_bytes / MIB

    def ratio(self, ours: str, theirs: str) -> float | None:
        """Ours / llama.cpp's median tok/s (None without llama.cpp's figure)."""
        if ours not in self.run or theirs not in self.llama:
            return None
        return self.run[ours].median / self.llama[theirs].median

    def cpu_ratio(self, ours: str, theirs: str) -> float | None:
        """llama.cpp's CPU per token / ours (None unless `--llama-cpu` measured it)."""
        if ours not in self.run or theirs not in self.llama:
            return None
        return self.llama[theirs].median / self.run[ours].median


@dataclass
class SpeedRun:
    date: str
    machine: Machine
    threads: int
    repeats: int
    command: str
    llama_build: str | None = None
    rows: list[SpeedRow] = field(default_factory=list)
    schema: int = SPEED_SCHEMA

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")


def read_speed_run(path: Path) -> SpeedRun:
    """A run written by `engine_speed.py --json` (a one-line error for anything else)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise NpuchatError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != SPEED_SCHEMA:
        raise NpuchatError(f"{path}: not an engine_speed.py --json run (schema {SPEED_SCHEMA})")
    try:
        return from_plain(SpeedRun, data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise NpuchatError(f"{path}: not an engine_speed.py --json run ({exc})") from exc


def spread(f: Figure, digits: int = 1) -> str:
    """`median (min-max)`; a single sample is its value alone."""
    if f.n == 1 or f.min == f.max:
        return f"{f.median:.{digits}f}"
    return f"{f.median:.{digits}f} ({f.min:.{digits}f}-{f.max:.{digits}f})"


def _vs(row: SpeedRow, ours: str, theirs: str, cpu_ours: str) -> str:
    ratio = row.ratio(ours, theirs)
    if ratio is None:
        return ""
    text = f"  ({ratio:.2f}x llama.cpp {spread(row.llama[theirs])}"
    cpu = row.cpu_ratio(cpu_ours, f"{theirs}_cpu_ms")
    if cpu is not None:
        theirs_ms = row.llama[f"{theirs}_cpu_ms"].median
        text += f"; by CPU {cpu:.2f}x of its {theirs_ms:.1f} ms/token"
    return text + ")"


def text_lines(row: SpeedRow) -> list[str]:
    """The per-model block the script prints as it goes."""
    run, cold = row.run, row.cold
    lines = [
        f"{row.model}  ({row.gguf_bytes / MIB:.0f} MiB), kernels: {row.kernels}, "
        f"median (min-max) of {row.repeats}",
        f"  load: cold {spread(cold['load_s'], 2)} s (build, peak RSS "
        f"{spread(cold['peak_rss_mib'], 0)} MiB), cached {spread(run['load_s'], 2)} s",
        f"  prefill 512 tokens: {spread(run['prefill512_tps'])} tok/s "
        f"(CPU {spread(run['prefill512_cpu_ms'])} ms/token)"
        + _vs(row, "prefill512_tps", "pp512", "prefill512_cpu_ms"),
    ]
    for ctx in (128, 1024):
        lines.append(
            f"  decode @ {ctx}: {spread(run[f'decode{ctx}_tps'])} tok/s "
            f"(CPU {spread(run[f'decode{ctx}_cpu_ms'])} ms/token, capacity "
            f"{run[f'decode{ctx}_capacity'].median:.0f}, Python "
            f"{spread(run[f'decode{ctx}_python_ms'], 2)} ms/step)"
            + (_vs(row, "decode128_tps", "tg128", "decode128_cpu_ms") if ctx == 128 else "")
        )
    lines.append(
        f"  peak RSS {spread(run['peak_rss_mib'], 0)} MiB (steady "
        f"{spread(run['rss_mib'], 0)}); target 1.3 x GGUF + KV = {row.rss_target_mib:.0f} MiB"
    )
    if "floor_ms.m1" in run:
        m1, m2 = run["floor_ms.m1"], run["floor_ms.m2"]
        lines.append(
            f"  matmuls alone: {spread(m1)} ms at one row, {spread(m2)} ms at two "
            f"(= {1e3 / m2.median:.1f} tok/s if nothing else ran)"
        )
    ops = {k.removeprefix("profile."): f for k, f in run.items() if k.startswith("profile.")}
    if ops:
        total = sum(f.median for f in ops.values())
        lines.append(f"  one decode step by op type (median ms, sum {total:.1f}):")
        for op, f in sorted(ops.items(), key=lambda kv: -kv[1].median)[:10]:
            lines.append(f"    {op:34s} {f.median:7.2f}  {100 * f.median / total:5.1f}%")
    return lines


def _cell(row: SpeedRow, ours: str, theirs: str) -> str:
    ratio = row.ratio(ours, theirs)
    text = spread(row.run[ours])
    return text + (f" ({ratio:.2f}×)" if ratio is not None else "")


def markdown_table(run: SpeedRun) -> str:
    """The README's table of one run: a line on the machine and the command, then one row per
    model and kernel mode; tok/s as median (min-max) over the repeats, × = ratio of medians to
    llama.cpp's in the same run."""
    m = run.machine
    flags = ", ".join(m.cpu_flags) or "flags unknown"
    load = f", load average {m.load_average_1m:.1f} at the start" if m.load_average_1m else ""
    llama = f"; llama.cpp {run.llama_build}" if run.llama_build else ""
    out = [
        f"`{run.command}` ({run.date}, {m.cpu} ({flags}), {m.cores} cores, {run.threads} "
        f"threads{load}, onnxruntime {m.onnxruntime}{llama}; median (min-max) of "
        f"{run.repeats} runs each, × = ours / llama.cpp's median in the same run):",
        "",
        "| model | kernels | cold / cached start s | prefill 512 tok/s | decode @128 tok/s | "
        "decode @1024 tok/s | peak RSS MiB (target) | llama.cpp pp512 / tg128 tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in run.rows:
        r = row.run
        ref = " / ".join(spread(row.llama[k]) for k in ("pp512", "tg128") if k in row.llama)
        cells = [
            row.model.removesuffix(".gguf"),
            row.kernels.split(",")[0],  # which kernels, without the library's path
            f"{spread(row.cold['load_s'], 2)} / {spread(r['load_s'], 2)}",
            _cell(row, "prefill512_tps", "pp512"),
            _cell(row, "decode128_tps", "tg128"),
            spread(r["decode1024_tps"]),
            f"{spread(r['peak_rss_mib'], 0)} ({row.rss_target_mib:.0f})",
            ref or "-",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
