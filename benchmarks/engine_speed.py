"""Engine speed on real GGUF files: load cold vs cached, prefill, decode, peak RSS, over repeats.

    python benchmarks/engine_speed.py MODEL [MODEL ...] [--threads 2] [--repeats 3]
        [--kernels on,off] [--kv-dtype auto] [--llama-bench PATH [--llama-cpu]] [--json RUN.json]
    python benchmarks/engine_speed.py --table RUN.json     # the README's table of that run

MODEL is a GGUF path or the name of an installed model (`<models_dir>/<name>.gguf`). Each
repeat runs two fresh processes per model and kernel mode (`benchmarks/engine_speed_worker.py`):
`cold` builds the graphs into an empty cache, `run` loads them from it and measures prefill of a
512-token prompt and decode at context 128 and 1024. Repeats go round every model and mode in
turn (an alternating A/B: a machine whose speed drifts moves every side alike), and every figure
is printed as median (min-max) over them. `--kernels on,off` runs each model with the native
kernels and without (`NPUCHAT_KERNELS`); `--profile` adds ONNX Runtime's per-op-type time of one
decode step; `--floor` the model's matmuls alone. `--llama-bench` runs llama.cpp's `llama-bench
-p 512 -n 128 -r 1` on the same file and threads before each repeat of that model (alternating
with ours, as the repeats do) and prints ratios of the medians (`--llama-cpu`: also by process
CPU time per token, the ratio that holds on a loaded machine); `benchmarks/build_llama_bench.sh`
builds one from PyPI. The CPU model and its SIMD flags are printed with the figures: the kernels
(ours and llama.cpp's) depend on them.

A script that prints figures, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from npuchat.engine.kv_layout import KV_CHOICES

WORKER = Path(__file__).with_name("engine_speed_worker.py")


def _resolve(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_file():
        return path.resolve()
    from npuchat.engine.paths import Paths

    candidate = Paths.from_env().models_dir / f"{model}.gguf"
    if candidate.is_file():
        return candidate
    sys.exit(f"no GGUF at {model} and no installed model of that name ({candidate})")


def _phase(
    model: Path, phase: str, cache: Path, args: argparse.Namespace, kernels: str
) -> dict[str, Any]:
    cmd = [sys.executable, str(WORKER), str(model), phase, str(cache), "--kv-dtype", args.kv_dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    for flag in ("profile", "floor", "no_row_padding"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    env = dict(os.environ, NPUCHAT_KERNELS=kernels) if kernels else None
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = res.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        sys.exit(f"{phase} phase failed for {model}:\n{res.stderr[-2000:]}")
    if res.returncode:  # it measured, then died on the way out
        print(f"  ({phase} phase exited {res.returncode}: {res.stderr.strip()[-120:]})")
    return dict(json.loads(lines[-1]))


def _llama(args: argparse.Namespace, model: Path) -> tuple[dict[str, list[float]], str | None]:
    """One repeat of llama.cpp's pp512 and tg128 on the same file and threads (`-r 1`), and
    with `--llama-cpu` its process CPU time per token (`llama_bench.llama_cpu_ms`): samples by
    key, run beside each repeat of ours so that a machine whose speed drifts moves both."""
    from npuchat.engine.bench_speed import llama_summary
    from npuchat.engine.llama_bench import llama_cpu_ms, run_llama_bench

    bench = run_llama_bench(args.llama_bench, model, args.threads, [512], 128, [], 1)
    for note in bench.notes:
        print(f"llama-bench: {note}", file=sys.stderr)
    cpu = {}
    if args.llama_cpu:
        cpu = llama_cpu_ms(args.llama_bench, model, args.threads, 512, 128, 1)
    samples = {key: [figure.median] for key, figure in llama_summary(bench, cpu).items()}
    return samples, bench.build


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every phase (default 3)")
    ap.add_argument("--llama-bench", metavar="PATH")
    ap.add_argument("--llama-cpu", action="store_true", help="ratios by CPU time per token too")
    ap.add_argument("--profile", action="store_true", help="per-op time of one decode step")
    ap.add_argument(
        "--no-row-padding",
        action="store_true",
        help="no row padding in decode steps (not exact against verify; shows what it costs)",
    )
    ap.add_argument(
        "--floor", action="store_true", help="time the model's matmuls alone (at 1 and 2 rows)"
    )
    ap.add_argument(
        "--kernels",
        default="",
        help="NPUCHAT_KERNELS modes to run side by side, e.g. on,off (default: as set)",
    )
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_CHOICES,
        help="the K/V cache's dtype (default auto: as the app's)",
    )
    ap.add_argument("--json", metavar="FILE", type=Path, help="write the whole run to FILE")
    ap.add_argument("--table", metavar="FILE", type=Path, help="print the README table of a run")
    args = ap.parse_args()
    if args.table is None and not args.models:
        ap.error("give one or more models (or --table RUN.json)")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def main() -> None:
    args = _arguments()
    from npuchat.engine.bench_report import Figure
    from npuchat.engine.bench_speed import (
        SpeedRow,
        SpeedRun,
        markdown_table,
        read_speed_run,
        summarize,
        text_lines,
    )
    from npuchat.engine.bench_timers import machine_info
    from npuchat.engine.errors import NpuchatError
    from npuchat.engine.hashing import model_sha256

    if args.table is not None:
        try:
            print(markdown_table(read_speed_run(args.table)), end="")
        except NpuchatError as exc:
            sys.exit(str(exc))
        return
    machine = machine_info()
    print(
        f"{machine.cpu} ({', '.join(machine.cpu_flags) or 'flags unknown'}), {machine.cores} "
        f"cores; threads={args.threads} repeats={args.repeats} load average="
        f"{machine.load_average_1m or 0:.2f} onnxruntime={machine.onnxruntime}"
    )
    paths = {name: _resolve(name) for name in args.models}
    modes = args.kernels.split(",")
    phases: dict[tuple[str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    llama: dict[str, dict[str, list[float]]] = {name: {} for name in args.models}
    llama_build = None
    for r in range(args.repeats):  # round-robin: every model and mode (and llama.cpp) per repeat
        for name in args.models:
            if args.llama_bench:
                samples, llama_build = _llama(args, paths[name])
                for key, values in samples.items():
                    llama[name].setdefault(key, []).extend(values)
            for mode in modes:
                with tempfile.TemporaryDirectory() as cache:
                    model_sha256(paths[name], Path(cache))  # as after `npuchat pull`
                    cold = _phase(paths[name], "cold", Path(cache), args, mode)
                    run = _phase(paths[name], "run", Path(cache), args, mode)
                phases.setdefault((name, mode), []).append((cold, run))
                print(
                    f"  repeat {r + 1}/{args.repeats} {paths[name].name} {mode or 'kernels'}: "
                    f"prefill {run['prefill512_tps']:.1f}, decode {run['decode128_tps']:.1f} "
                    "tok/s",
                    flush=True,
                )
    home = str(Path.home())
    speed = SpeedRun(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine,
        threads=args.threads,
        repeats=args.repeats,
        command="python " + " ".join(shlex.quote(a) for a in sys.argv).replace(home, "~"),
    )
    speed.llama_build = llama_build
    for name in args.models:
        figures = {key: Figure.of(values) for key, values in llama[name].items()}
        for mode in modes:
            runs = phases[(name, mode)]
            row = SpeedRow(
                model=paths[name].name,
                gguf_bytes=paths[name].stat().st_size,
                kernels=str(runs[0][1]["kernels"]),
                mode=mode,
                repeats=len(runs),
                cold=summarize([c for c, _ in runs]),
                run=summarize([r for _, r in runs]),
                kv_bytes=int(runs[0][1]["kv_bytes"]),
                llama=figures,
            )
            speed.rows.append(row)
            print("\n" + "\n".join(text_lines(row)), flush=True)
    print("\n" + markdown_table(speed), end="")
    if args.json is not None:
        speed.write(args.json)
        print(f"\nwritten to {args.json} (`--table {args.json}` prints the table again)")


if __name__ == "__main__":
    main()
