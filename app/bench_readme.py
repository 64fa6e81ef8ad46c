"""`npuchat bench --json` reports -> the README's Performance section (Markdown), so every
published figure comes from a run anyone can repeat:
`python -m npuchat.app.bench_command --readme A.json [B.json ...]`."""

from __future__ import annotations

from collections.abc import Sequence

from npuchat.engine.bench_report import BenchReport, DecodeRow, PrefillRow
from npuchat.engine.errors import NpuchatError

MIB = 2**20
SPEC_COLUMNS = ("target", "lookup", "draft", "both")


def _speed(row: PrefillRow | DecodeRow | None) -> str:
    if row is None:
        return "-"
    out = f"{row.tps.median:.1f}"
    return out + (f" ({row.ratio:.2f}× llama.cpp)" if row.ratio is not None else "")


def _intro(first: BenchReport) -> list[str]:
    mach, model = first.machine, first.model
    load = mach.load_average_1m
    flags = "; " + " ".join(mach.cpu_flags) if mach.cpu_flags else ""
    return [
        "## Performance",
        "",
        f"Measured by `npuchat bench --suite {first.suite} --json` on {first.date[:10]}: "
        f"{mach.cpu} ({mach.cores} cores{flags}), {mach.os}, onnxruntime "
        f"{mach.onnxruntime}, {model.threads} threads, device {model.device}"
        + (f", load average {load:.1f} at the start" if load is not None else "")
        + f". Medians of {first.repeats} runs after a warm-up; rerun the command to check "
        "them on your machine.",
        "",
    ]


def _main_row(r: BenchReport) -> str:
    pre = {row.tokens: row for row in r.prefill}
    dec = {row.context: row for row in r.decode}
    start, chat = r.start, r.chat
    starts = f"{start.cold_s.median:.1f} / {start.cached_s.median:.2f}" if start else "-"
    peak = r.memory.peak_rss_bytes if r.memory else None
    cells = [
        r.model.name,
        f"{r.model.gguf_bytes / MIB:.0f}",
        _speed(pre.get(512)),
        _speed(dec.get(128)),
        _speed(dec.get(1024)),
        f"{chat.ttft_s.median:.2f}" if chat else "-",
        f"{chat.total_tps.median:.1f}" if chat else "-",
        starts,
        f"{peak.median / MIB:.0f}" if peak else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def _reuse_lines(reports: Sequence[BenchReport]) -> list[str]:
    lines = [
        "",
        "Prefix reuse (TTFT with a long system prompt):",
        "",
        "| model | system tokens | cold s | shared s (× cold) | after restart s (× cold) |",
        "|---|---|---|---|---|",
    ]
    for r in reports:
        p = r.prefix_reuse
        if p is None:
            continue
        lines.append(
            f"| {r.model.name} | {p.system_tokens} | {p.cold_ttft_s.median:.2f} | "
            f"{p.shared_ttft_s.median:.3f} ({p.shared_vs_cold:.3f}×) | "
            f"{p.restart_ttft_s.median:.3f} ({p.restart_vs_cold:.3f}×) |"
        )
    return lines


def _speculation_lines(reports: Sequence[BenchReport]) -> list[str]:
    lines = [
        "",
        "Speculative decoding (greedy, decode tok/s; × target-only):",
        "",
        "| model | prompt | " + " | ".join(SPEC_COLUMNS) + " |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        if r.speculation is None or not r.speculation.available:
            continue
        for row in r.speculation.prompts:
            cells = []
            for mode in SPEC_COLUMNS:
                m = row.modes.get(mode)
                if m is None or m.decode_tps is None:
                    cells.append("-")
                    continue
                c = f"{m.decode_tps.median:.1f}"
                if m.vs_target is not None:
                    c += f" ({m.vs_target:.2f}×, {100 * m.acceptance:.0f}% acc.)"
                if not m.exact:
                    c += " **not exact**"
                cells.append(c)
            lines.append(f"| {r.model.name} | {row.prompt} | " + " | ".join(cells) + " |")
    return lines


def readme_section(reports: Sequence[BenchReport]) -> str:
    """The README's Performance section (Markdown) from one report per model."""
    if not reports:
        raise NpuchatError("--readme needs at least one report written by `npuchat bench --json`")
    cols = [
        "model",
        "GGUF MiB",
        "prefill 512 tok/s",
        "decode @128 tok/s",
        "decode @1024 tok/s",
        "chat TTFT s",
        "chat tok/s",
        "cold / cached start s",
        "peak RSS MiB",
    ]
    lines = _intro(reports[0])
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += [_main_row(r) for r in reports]
    if any(r.llama_bench is not None for r in reports):
        lines += ["", "Ratios are ours ÷ llama.cpp's `llama-bench`, run in the same command."]
    if any(r.prefix_reuse is not None for r in reports):
        lines += _reuse_lines(reports)
    if any(r.speculation is not None and r.speculation.available for r in reports):
        lines += _speculation_lines(reports)
    return "\n".join(lines) + "\n"
