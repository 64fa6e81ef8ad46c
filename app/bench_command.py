"""`npuchat bench`: the benchmark suite (`npuchat.engine.bench`) as a command.

It shows progress while it runs (minutes on a real model), prints rich tables and a bar chart of
tok/s against context length, writes the report as JSON with `--json FILE`, and with
`--llama-bench PATH` runs llama.cpp's `llama-bench` on the same GGUF and threads and prints
ours ÷ theirs next to each figure. Ctrl+C stops the run and prints what was measured so far.

`python -m npuchat.app.bench_command --readme A.json [B.json ...]` turns `--json` reports into the
README's Performance section (Markdown), so every published figure comes from a rerunnable run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from npuchat.engine.bench import SUITES, BenchRun
from npuchat.engine.errors import NpuchatError
from npuchat.engine.pull import pull

from .context import AppContext
from .engine_factory import check_draft, open_engine, resolve_device
from .engine_port import EngineSpec
from .progress import RichPullProgress

MIB = 2**20
CHART_WIDTH = 40


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="bench_model", help="model name (default: from settings)")
    p.add_argument(
        "--draft",
        dest="bench_draft",
        default="default",
        help="drafts for the speculation figures: NAME, NAME+lookup, lookup or none "
        "(default: the model's catalog draft, plus lookup)",
    )
    p.add_argument("--device", dest="bench_device", choices=["npu", "cpu", "auto"])
    p.add_argument("--suite", choices=sorted(SUITES), default="quick", help="default: quick")
    p.add_argument("--threads", dest="bench_threads", type=int, help="default: from settings")
    p.add_argument("--json", dest="bench_json", type=Path, metavar="FILE", help="write the report")
    p.add_argument(
        "--llama-bench",
        dest="llama_bench",
        metavar="PATH",
        help="llama.cpp's llama-bench binary: run it on the same GGUF and print ratios",
    )


def cmd_bench(ctx: AppContext, args: argparse.Namespace, console: Console) -> int:
    model = args.bench_model or ctx.settings.model
    device = resolve_device(args.bench_device or ctx.settings.device)
    check_draft(args.bench_draft)
    threads = args.bench_threads or ctx.settings.threads or None
    if threads is not None and threads < 1:
        raise NpuchatError("--threads must be at least 1")
    llama = None
    if args.llama_bench:
        llama = shutil.which(args.llama_bench)
        if llama is None:
            raise NpuchatError(
                f"--llama-bench {args.llama_bench}: no such executable; pass the path of "
                "llama.cpp's llama-bench binary"
            )
    if args.bench_json is not None and not args.bench_json.parent.is_dir():
        raise NpuchatError(f"--json {args.bench_json}: its folder does not exist")
    path, _ = pull(ctx.catalog, model, progress=RichPullProgress(Console(stderr=True)))
    work = Path(tempfile.mkdtemp(prefix="npuchat-bench-"))
    err = Console(stderr=True)
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )
    task = bar.add_task("starting", total=None)

    def progress(what: str, done: int, total: int) -> None:
        bar.update(task, description=what, completed=done, total=total)

    run = BenchRun(
        SUITES[args.suite],
        gguf=path,
        name=model,
        device=device,
        threads=threads,
        cache_dir=work,
        progress=progress,
    )
    session = None
    try:
        with bar:
            run.measure_start()
            bench_ctx = replace(
                ctx,
                paths=replace(ctx.paths, cache_dir=run.main_cache),
                settings=replace(ctx.settings, threads=threads or 0),
            )
            session = open_engine(bench_ctx, EngineSpec(model, args.bench_draft, device))
            run.attach(session)
            run.measure_all()
            if llama is not None:
                run.compare_llama(llama)
    except KeyboardInterrupt:
        run.report["interrupted"] = True
    finally:
        if session is not None:
            session.close()
        shutil.rmtree(work, ignore_errors=True)
    console.print(render(run.report))
    if args.bench_json is not None:
        args.bench_json.write_text(json.dumps(run.report, indent=2) + "\n")
        err.print(f"report written to {args.bench_json}")
    return 130 if run.report["interrupted"] else 0


# --------------------------------------------------------------------------- terminal output


def _fig(f: dict[str, Any] | None, scale: float = 1.0, digits: int = 1) -> str:
    if not f:
        return "-"
    return f"{f['median'] * scale:.{digits}f}"


def _spread(f: dict[str, Any] | None, scale: float = 1.0, digits: int = 1) -> str:
    if not f:
        return "-"
    return f"{f['min'] * scale:.{digits}f}–{f['max'] * scale:.{digits}f}"


def _ratio(row: dict[str, Any]) -> tuple[str, str]:
    if "ratio" not in row:
        return "-", "-"
    return f"{row['llama_tps']:.1f}", f"{row['ratio']:.2f}×"


def header(report: dict[str, Any]) -> Text:
    m, mach = report["model"], report["machine"]
    text = Text()
    text.append(f"{m['name']}", style="bold")
    text.append(
        f"  {m['arch']}, {m['n_layers']} layers, GGUF {m['gguf_bytes'] / MIB:.0f} MiB · "
        f"{m['device']} · {m['threads']} threads · suite {report['suite']} · "
        f"median (min–max) of {report['repeats']} runs after a warm-up\n"
    )
    load = mach.get("load_average_1m")
    text.append(
        f"{mach['cpu']} ({mach['cores']} cores) · {mach['os']} · onnxruntime "
        f"{mach['onnxruntime']} · {report['date']}"
        + (f" · load average {load:.2f} at start" if load is not None else ""),
        style="dim",
    )
    return text


def _speed_tables(report: dict[str, Any]) -> list[Table]:
    def table(title: str, key: str, first: str, last: str, rows: list[dict[str, Any]]) -> Table:
        """Prefill and decode share a layout: a size column, tok/s, spread, one more figure."""
        t = Table(title=title, title_justify="left")
        for col in (first, "tok/s", "min–max", last):
            t.add_column(col, justify="right")
        if llama:
            t.add_column("llama.cpp tok/s", justify="right")
            t.add_column("× llama.cpp", justify="right")
        for row in rows:
            extra = _fig(row["ms"]) if key == "tokens" else str(row["capacity"])
            cells = [str(row[key]), _fig(row["tps"]), _spread(row["tps"]), extra]
            t.add_row(*cells, *(_ratio(row) if llama else ()))
        return t

    llama = "llama_bench" in report
    return [
        table("Prefill", "tokens", "prompt tokens", "ms", report.get("prefill", [])),
        table("Decode", "context", "context", "KV capacity", report.get("decode", [])),
    ]


def _stat_row(t: Table, label: str, f: dict[str, Any], note: str, *args: Any, **kw: Any) -> None:
    """One figure as median, min–max and a note (args as for `_fig`)."""
    t.add_row(label, _fig(f, *args, **kw), _spread(f, *args, **kw), note)


def _summary_table(report: dict[str, Any]) -> Table:
    t = Table(title="Start, chat, prefix reuse, memory", title_justify="left")
    t.add_column("figure")
    t.add_column("median", justify="right")
    t.add_column("min–max", justify="right")
    t.add_column("note")
    if start := report.get("start"):
        builds = start["cold_graph_builds"]
        _stat_row(
            t,
            "cold start to ready (s)",
            start["cold_s"],
            f"new process, empty cache: {builds} graph build(s)",
            digits=2,
        )
        _stat_row(
            t,
            "cached start to ready (s)",
            start["cached_s"],
            f"new process, {start['cached_graph_builds']} builds",
            digits=2,
        )
        _stat_row(
            t,
            "cached start incl. Python (s)",
            start["cached_process_s"],
            "from spawning the process: interpreter, imports, load",
            digits=2,
        )
    if chat := report.get("chat"):
        note = f"{len(chat['prompts'])} prompts × {chat['max_tokens']} tokens"
        if chat["draft"]:
            note += f", draft {chat['draft']}"
        _stat_row(t, "chat TTFT (s)", chat["ttft_s"], "", digits=3)
        _stat_row(t, "chat total tok/s", chat["total_tps"], note)
    if pr := report.get("prefix_reuse"):
        _stat_row(
            t,
            "TTFT cold (s)",
            pr["cold_ttft_s"],
            f"new {pr['system_tokens']}-token system prompt",
            digits=3,
        )
        _stat_row(
            t,
            "TTFT shared system prompt (s)",
            pr["shared_ttft_s"],
            f"{pr['shared_vs_cold']:.3f}× cold",
            digits=3,
        )
        _stat_row(
            t,
            "TTFT after restart (s)",
            pr["restart_ttft_s"],
            f"{pr['restart_vs_cold']:.3f}× cold (prefix from disk, new process)",
            digits=3,
        )
    if mem := report.get("memory"):
        if "peak_rss_bytes" in mem:
            budget = mem["rss_budget_bytes"] / MIB
            _stat_row(
                t,
                "peak RSS (MiB)",
                mem["peak_rss_bytes"],
                f"{mem['peak_rss_vs_budget']:.2f}× budget 1.3 × GGUF + KV in use "
                f"({budget:.0f} MiB)",
                1 / MIB,
                0,
            )
        t.add_row("weights (MiB)", f"{mem['weight_bytes'] / MIB:.0f}", "", "GGUF file size")
        caps = ", ".join(
            f"{c}: {b / MIB:.0f}" for c, b in mem["kv_bytes_by_capacity"].items() if int(c) >= 1024
        )
        t.add_row(
            "KV bytes per token",
            f"{mem['kv_bytes_per_token']}",
            "",
            f"MiB by capacity: {caps}" if caps else "",
        )
    return t


def _speculation(report: dict[str, Any]) -> Table | Text | None:
    spec = report.get("speculation")
    if spec is None:
        return None
    if not spec["available"]:
        return Text(f"Speculation: not available ({spec['reason']})", style="dim")
    t = Table(title="Speculation (greedy, decode tok/s)", title_justify="left")
    for col in ("prompt", "mode", "tok/s", "min–max", "× target", "acceptance", "exact"):
        t.add_column(col, justify="left" if col in ("prompt", "mode") else "right")
    for row in spec["prompts"]:
        for mode in spec["modes"]:
            r = row.get(mode)
            if r is None:
                continue
            vs = (
                f"{r['vs_target']:.2f}"
                if "vs_target" in r
                else ("1.00" if mode == "target" else "-")
            )
            acc = f"{100 * r['acceptance']:.0f}% of {r['drafted']}" if r["drafted"] else "-"
            t.add_row(
                row["prompt"],
                mode,
                _fig(r["decode_tps"]),
                _spread(r["decode_tps"]),
                vs,
                acc,
                "yes" if r["exact"] else f"NO (from token {r['first_difference']})",
            )
    return t


def chart(report: dict[str, Any], width: int = CHART_WIDTH) -> Text:
    """Horizontal bars of tok/s against prompt length (prefill) and context (decode)."""
    rows = [("prefill", r["tokens"], r["tps"]["median"]) for r in report.get("prefill", [])]
    rows += [("decode", r["context"], r["tps"]["median"]) for r in report.get("decode", [])]
    text = Text("tok/s against context length\n", style="bold")
    if not rows:
        return text.append("(nothing measured)", style="dim")
    for kind in ("prefill", "decode"):
        mine = [r for r in rows if r[0] == kind]
        if not mine:
            continue
        top = max(v for _, _, v in mine)
        for _, n, value in mine:
            filled = max(1, round(width * value / top)) if top > 0 else 0
            text.append(f"{kind:7} {n:>5} │", style="dim")
            text.append("█" * filled, style="cyan" if kind == "prefill" else "green")
            text.append(f" {value:.1f}\n")
    return text


def render(report: dict[str, Any]) -> Group:
    parts: list[Any] = [header(report)]
    if report.get("interrupted"):
        parts.append(Text("interrupted: the figures below are what was measured", style="yellow"))
    parts += _speed_tables(report)
    parts.append(chart(report))
    parts.append(_summary_table(report))
    if (spec := _speculation(report)) is not None:
        parts.append(spec)
    notes = list(report.get("skipped", []))
    notes += report.get("llama_bench", {}).get("notes", [])
    if notes:
        parts.append(Text("skipped: " + "; ".join(notes), style="dim"))
    return Group(*parts)


# --------------------------------------------------------------------------- README section


def readme_section(reports: Sequence[dict[str, Any]]) -> str:
    """The README's Performance section (Markdown) from one `--json` report per model."""
    if not reports:
        raise NpuchatError("--readme needs at least one report written by `npuchat bench --json`")
    first = reports[0]
    mach = first["machine"]
    load = mach.get("load_average_1m")
    lines = [
        "## Performance",
        "",
        f"Measured by `npuchat bench --suite {first['suite']} --json` on {first['date'][:10]}: "
        f"{mach['cpu']} ({mach['cores']} cores), {mach['os']}, onnxruntime "
        f"{mach['onnxruntime']}, {first['model']['threads']} threads, device "
        f"{first['model']['device']}"
        + (f", load average {load:.1f} at the start" if load is not None else "")
        + f". Medians of {first['repeats']} runs after a warm-up; rerun the command to check "
        "them on your machine.",
        "",
    ]
    llama = any("llama_bench" in r for r in reports)
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
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in reports:
        pre = {row["tokens"]: row for row in r.get("prefill", [])}
        dec = {row["context"]: row for row in r.get("decode", [])}

        def cell(row: dict[str, Any] | None) -> str:
            if row is None:
                return "-"
            out = f"{row['tps']['median']:.1f}"
            return out + (f" ({row['ratio']:.2f}× llama.cpp)" if "ratio" in row else "")

        start, mem, chat = r.get("start", {}), r.get("memory", {}), r.get("chat")
        starts = (
            f"{start['cold_s']['median']:.1f} / {start['cached_s']['median']:.2f}" if start else "-"
        )
        peak = mem.get("peak_rss_bytes")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"]["name"],
                    f"{r['model']['gguf_bytes'] / MIB:.0f}",
                    cell(pre.get(512)),
                    cell(dec.get(128)),
                    cell(dec.get(1024)),
                    f"{chat['ttft_s']['median']:.2f}" if chat else "-",
                    f"{chat['total_tps']['median']:.1f}" if chat else "-",
                    starts,
                    f"{peak['median'] / MIB:.0f}" if peak else "-",
                ]
            )
            + " |"
        )
    if llama:
        lines += ["", "Ratios are ours ÷ llama.cpp's `llama-bench`, run in the same command."]
    reuse = [r for r in reports if "prefix_reuse" in r]
    if reuse:
        lines += [
            "",
            "Prefix reuse (TTFT with a long system prompt):",
            "",
            "| model | system tokens | cold s | shared s (× cold) | after restart s (× cold) |",
            "|---|---|---|---|---|",
        ]
        for r in reuse:
            p = r["prefix_reuse"]
            lines.append(
                f"| {r['model']['name']} | {p['system_tokens']} | "
                f"{p['cold_ttft_s']['median']:.2f} | {p['shared_ttft_s']['median']:.3f} "
                f"({p['shared_vs_cold']:.3f}×) | {p['restart_ttft_s']['median']:.3f} "
                f"({p['restart_vs_cold']:.3f}×) |"
            )
    spec = [r for r in reports if r.get("speculation", {}).get("available")]
    if spec:
        lines += [
            "",
            "Speculative decoding (greedy, decode tok/s; × target-only):",
            "",
            "| model | prompt | " + " | ".join(["target", "lookup", "draft", "both"]) + " |",
            "|---|---|---|---|---|---|",
        ]
        for r in spec:
            for row in r["speculation"]["prompts"]:
                cells = []
                for mode in ("target", "lookup", "draft", "both"):
                    m = row.get(mode)
                    if not m or not m["decode_tps"]:
                        cells.append("-")
                        continue
                    c = f"{m['decode_tps']['median']:.1f}"
                    if "vs_target" in m:
                        c += f" ({m['vs_target']:.2f}×, {100 * m['acceptance']:.0f}% acc.)"
                    if not m["exact"]:
                        c += " **not exact**"
                    cells.append(c)
                lines.append(
                    f"| {r['model']['name']} | {row['prompt']} | " + " | ".join(cells) + " |"
                )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the README's Performance section.")
    ap.add_argument("--readme", nargs="+", type=Path, required=True, metavar="REPORT.json")
    args = ap.parse_args(argv)
    reports = []
    for path in args.readme:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"npuchat: error: cannot read report {path}: {exc}", file=sys.stderr)
            return 2
    sys.stdout.write(readme_section(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
