"""`npuchat bench` report -> the terminal: rich tables, a bar chart of tok/s against context
length, and ratios to llama.cpp where `--llama-bench` ran."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from npuchat.engine.bench_report import BenchReport, DecodeRow, Figure, PrefillRow

MIB = 2**20
CHART_WIDTH = 40


def _fig(f: Figure | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if f is None else f"{f.median * scale:.{digits}f}"


def _spread(f: Figure | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if f is None else f"{f.min * scale:.{digits}f}–{f.max * scale:.{digits}f}"


def _ratio(row: PrefillRow | DecodeRow) -> tuple[str, str]:
    if row.ratio is None or row.llama_tps is None:
        return "-", "-"
    return f"{row.llama_tps:.1f}", f"{row.ratio:.2f}×"


def header(report: BenchReport) -> Text:
    m, mach = report.model, report.machine
    text = Text()
    text.append(f"{m.name}", style="bold")
    text.append(
        f"  {m.arch}, {m.n_layers} layers, GGUF {m.gguf_bytes / MIB:.0f} MiB · "
        f"{m.device} · {m.threads} threads · suite {report.suite} · "
        f"median (min–max) of {report.repeats} runs after a warm-up\n"
    )
    load = mach.load_average_1m
    flags = "; " + " ".join(mach.cpu_flags) if mach.cpu_flags else ""
    text.append(
        f"{mach.cpu} ({mach.cores} cores{flags}) · {mach.os} · onnxruntime "
        f"{mach.onnxruntime} · {report.date}"
        + (f" · load average {load:.2f} at start" if load is not None else ""),
        style="dim",
    )
    return text


def _speed_table(
    title: str,
    first: str,
    last: str,
    rows: list[tuple[str, str, PrefillRow | DecodeRow]],
    llama: bool,
) -> Table:
    """Prefill and decode share a layout: a size column, tok/s, spread, one more figure."""
    t = Table(title=title, title_justify="left")
    for col in (first, "tok/s", "min–max", last):
        t.add_column(col, justify="right")
    if llama:
        t.add_column("llama.cpp tok/s", justify="right")
        t.add_column("× llama.cpp", justify="right")
    for size, extra, row in rows:
        cells = [size, _fig(row.tps), _spread(row.tps), extra]
        t.add_row(*cells, *(_ratio(row) if llama else ()))
    return t


def _speed_tables(report: BenchReport) -> list[Table]:
    llama = report.llama_bench is not None
    pre = [(str(r.tokens), _fig(r.ms), r) for r in report.prefill]
    dec = [(str(r.context), str(r.capacity), r) for r in report.decode]
    return [
        _speed_table("Prefill", "prompt tokens", "ms", list(pre), llama),
        _speed_table("Decode", "context", "KV capacity", list(dec), llama),
    ]


def _batched_table(report: BenchReport) -> Table | None:
    if not report.batched:
        return None
    t = Table(title="Streams decoded together (one step for all)", title_justify="left")
    for col in ("streams", "context", "tok/s (all)", "min–max", "× one stream"):
        t.add_column(col, justify="right")
    for r in report.batched:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}×"
        t.add_row(str(r.streams), str(r.context), _fig(r.tps), _spread(r.tps), ratio)
    return t


def _stat_row(
    t: Table, label: str, f: Figure | None, note: str, scale: float = 1.0, digits: int = 1
) -> None:
    """One figure as median, min–max and a note."""
    t.add_row(label, _fig(f, scale, digits), _spread(f, scale, digits), note)


def _summary_table(report: BenchReport) -> Table:
    t = Table(title="Start, chat, prefix reuse, memory", title_justify="left")
    t.add_column("figure")
    t.add_column("median", justify="right")
    t.add_column("min–max", justify="right")
    t.add_column("note")
    if start := report.start:
        builds = f"new process, empty cache: {start.cold_graph_builds} graph build(s)"
        _stat_row(t, "cold start to ready (s)", start.cold_s, builds, digits=2)
        cached = f"new process, {start.cached_graph_builds} builds"
        _stat_row(t, "cached start to ready (s)", start.cached_s, cached, digits=2)
        spawn = "from spawning the process: interpreter, imports, load"
        _stat_row(t, "cached start incl. Python (s)", start.cached_process_s, spawn, digits=2)
    if chat := report.chat:
        note = f"{len(chat.prompts)} prompts × {chat.max_tokens} tokens"
        if chat.draft:
            note += f", draft {chat.draft}"
        _stat_row(t, "chat TTFT (s)", chat.ttft_s, "", digits=3)
        _stat_row(t, "chat total tok/s", chat.total_tps, note)
    if pr := report.prefix_reuse:
        cold = f"new {pr.system_tokens}-token system prompt"
        _stat_row(t, "TTFT cold (s)", pr.cold_ttft_s, cold, digits=3)
        shared = f"{pr.shared_vs_cold:.3f}× cold"
        _stat_row(t, "TTFT shared system prompt (s)", pr.shared_ttft_s, shared, digits=3)
        restart = f"{pr.restart_vs_cold:.3f}× cold (prefix from disk, new process)"
        _stat_row(t, "TTFT after restart (s)", pr.restart_ttft_s, restart, digits=3)
    if mem := report.memory:
        if mem.peak_rss_bytes is not None and mem.peak_rss_vs_budget is not None:
            budget = mem.rss_budget_bytes / MIB
            note = f"{mem.peak_rss_vs_budget:.2f}× budget 1.3 × GGUF + KV in use ({budget:.0f} MiB)"
            _stat_row(t, "peak RSS (MiB)", mem.peak_rss_bytes, note, 1 / MIB, 0)
        t.add_row("weights (MiB)", f"{mem.weight_bytes / MIB:.0f}", "", "GGUF file size")
        if mem.context_binary_bytes and mem.tensor_bytes:
            ratio = mem.context_binary_bytes / mem.tensor_bytes
            note = f"{ratio:.2f}× the GGUF's tensor bytes ({mem.tensor_bytes / MIB:.1f} MiB)"
            binaries = f"{mem.context_binary_bytes / MIB:.1f}"
            t.add_row("NPU context binaries (MiB)", binaries, "", note)
        caps = ", ".join(
            f"{c}: {b / MIB:.0f}" for c, b in mem.kv_bytes_by_capacity.items() if int(c) >= 1024
        )
        by_cap = f"{mem.kv_dtype}; MiB by capacity: {caps}" if caps else mem.kv_dtype
        t.add_row("KV bytes per token", f"{mem.kv_bytes_per_token}", "", by_cap)
        in_use = f"{mem.kv_bytes_in_use / MIB:.1f}"
        t.add_row("KV in use (MiB)", in_use, "", "the cache's size after a 512-token prompt")
    return t


def _speculation(report: BenchReport) -> Table | Text | None:
    spec = report.speculation
    if spec is None:
        return None
    if not spec.available:
        return Text(f"Speculation: not available ({spec.reason})", style="dim")
    t = Table(title="Speculation (greedy, decode tok/s)", title_justify="left")
    for col in ("prompt", "mode", "tok/s", "min–max", "× target", "acceptance", "exact"):
        t.add_column(col, justify="left" if col in ("prompt", "mode") else "right")
    for row in spec.prompts:
        for mode in spec.modes:
            r = row.modes.get(mode)
            if r is None:
                continue
            if r.vs_target is not None:
                vs = f"{r.vs_target:.2f}"
            else:
                vs = "1.00" if mode == "target" else "-"
            acc = f"{100 * r.acceptance:.0f}% of {r.drafted}" if r.drafted else "-"
            exact = "yes" if r.exact else f"NO (from token {r.first_difference})"
            t.add_row(row.prompt, mode, _fig(r.decode_tps), _spread(r.decode_tps), vs, acc, exact)
    return t


def chart(report: BenchReport, width: int = CHART_WIDTH) -> Text:
    """Horizontal bars of tok/s against prompt length (prefill) and context (decode)."""
    groups = {
        "prefill": [(r.tokens, r.tps.median) for r in report.prefill],
        "decode": [(r.context, r.tps.median) for r in report.decode],
    }
    text = Text("tok/s against context length\n", style="bold")
    if not any(groups.values()):
        return text.append("(nothing measured)", style="dim")
    for kind, rows in groups.items():
        top = max((v for _, v in rows), default=0.0)
        for n, value in rows:
            filled = max(1, round(width * value / top)) if top > 0 else 0
            text.append(f"{kind:7} {n:>5} │", style="dim")
            text.append("█" * filled, style="cyan" if kind == "prefill" else "green")
            text.append(f" {value:.1f}\n")
    return text


def render(report: BenchReport) -> Group:
    parts: list[RenderableType] = [header(report)]
    if report.interrupted:
        parts.append(Text("interrupted: the figures below are what was measured", style="yellow"))
    parts += _speed_tables(report)
    if (batched := _batched_table(report)) is not None:
        parts.append(batched)
    parts.append(chart(report))
    parts.append(_summary_table(report))
    if (spec := _speculation(report)) is not None:
        parts.append(spec)
    notes = list(report.skipped)
    if report.llama_bench is not None:
        notes += report.llama_bench.notes
    if notes:
        parts.append(Text("skipped: " + "; ".join(notes), style="dim"))
    return Group(*parts)
