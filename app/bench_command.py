"""`npuchat bench`: the benchmark suite (`npuchat.engine.bench`) as a command.

It shows progress while it runs (minutes on a real model), prints rich tables and a bar chart of
tok/s against context length, writes the report as JSON with `--json FILE`, and with
`--llama-bench PATH` runs llama.cpp's `llama-bench` on the same GGUF and threads and prints
ours ÷ theirs next to each figure. Ctrl+C stops the run and prints what was measured so far.

`python -m npuchat.app.bench_command --readme A.json [B.json ...]` turns `--json` reports into the
README's Performance section (`bench_readme`), so every published figure comes from a rerunnable
run. The tables themselves are `bench_render`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from npuchat.engine.bench import BenchRun
from npuchat.engine.bench_report import read_report
from npuchat.engine.bench_suites import SUITES
from npuchat.engine.devices import pick_device
from npuchat.engine.errors import NpuchatError
from npuchat.engine.pull import pull

from .bench_readme import readme_section
from .bench_render import render
from .context import AppContext
from .engine_factory import BATCH_MAX, check_draft, open_engine
from .engine_port import EngineSpec
from .progress import RichPullProgress

MIB = 2**20
CHART_WIDTH = 40


def cmd_bench(ctx: AppContext, args: argparse.Namespace, console: Console) -> int:
    model = args.bench_model or ctx.settings.model
    device = pick_device(args.bench_device or ctx.settings.device)
    draft = "default" if args.bench_draft is None else args.bench_draft
    check_draft(draft)
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
        kv_dtype=args.bench_kv_dtype or ctx.settings.kv_dtype,
    )
    session = None
    try:
        with bar:
            run.measure_start()
            bench_ctx = replace(
                ctx,
                paths=replace(ctx.paths, cache_dir=run.main_cache),
                settings=replace(
                    ctx.settings,
                    threads=threads or 0,
                    kv_dtype=args.bench_kv_dtype or ctx.settings.kv_dtype,
                ),
            )
            spec = EngineSpec(model, draft, device)
            session = open_engine(bench_ctx, spec, batch_max=BATCH_MAX.get(device, 1))
            run.attach(session)
            run.measure_all()
            if llama is not None:
                run.compare_llama(llama)
    except KeyboardInterrupt:
        run.report.interrupted = True
    finally:
        if session is not None:
            session.close()
        shutil.rmtree(work, ignore_errors=True)
    console.print(render(run.report))
    if args.bench_json is not None:
        args.bench_json.write_text(run.report.to_json())
        err.print(f"report written to {args.bench_json}")
    return 130 if run.report.interrupted else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the README's Performance section.")
    ap.add_argument("--readme", nargs="+", type=Path, required=True, metavar="REPORT.json")
    args = ap.parse_args(argv)
    try:
        sys.stdout.write(readme_section([read_report(path) for path in args.readme]))
    except NpuchatError as exc:
        print(f"npuchat: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
