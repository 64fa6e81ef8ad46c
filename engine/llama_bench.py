"""llama.cpp's `llama-bench` as a reference: run it on the same GGUF and thread count, and put
its tok/s next to ours (`ratio` = ours / llama.cpp's) on each matching prefill and decode row."""

from __future__ import annotations

import json
import resource
import subprocess
from collections.abc import Sequence
from pathlib import Path

from .bench_report import BenchReport, LlamaBenchFigures, LlamaFigure
from .errors import NpuchatError


def run_llama_bench(
    binary: str | Path,
    gguf: Path,
    threads: int,
    prompt_sizes: Sequence[int],
    decode_tokens: int,
    depths: Sequence[int],
    repeats: int,
) -> LlamaBenchFigures:
    """llama.cpp's `llama-bench -o json` on the same file and threads: tok/s per test.

    Decode at a context > 0 needs `-d` (llama.cpp builds since 2025); an older binary leaves
    those out, with a note saying which run failed.
    """
    base = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-o", "json"]
    out = LlamaBenchFigures(binary=str(binary))
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
            out.notes.append(f"{' '.join(cmd[1:])} failed: {tail[0]}")
            continue
        try:
            rows = json.loads(res.stdout)
        except json.JSONDecodeError as exc:
            raise NpuchatError(
                f"--llama-bench {binary}: its output is not JSON ({exc}); is it llama-bench?"
            ) from exc
        for row in rows:
            samples = [float(t) for t in row.get("samples_ts") or []]
            tps = LlamaFigure(float(row["avg_ts"]), float(row.get("stddev_ts", 0.0)), samples)
            out.build = out.build or row.get("build_commit")
            out.threads = out.threads or row.get("n_threads")
            if row.get("n_prompt") and not row.get("n_gen"):
                out.prefill[str(int(row["n_prompt"]))] = tps
            elif row.get("n_gen") and not row.get("n_prompt"):
                out.decode[str(int(row.get("n_depth", 0)))] = tps
    return out


def _children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def llama_cpu_ms(
    binary: str | Path, gguf: Path, threads: int, prompt: int, gen: int, repeats: int
) -> dict[str, float]:
    """llama.cpp's process CPU time per token (ms) of a `prompt`-token prefill and a `gen`-token
    decode (`pp{prompt}_cpu_ms`, `tg{gen}_cpu_ms`): on a loaded machine the figure to set beside
    ours, where wall-time tok/s measures the load. Each test runs alone without warm-up; a
    one-token run first gives the CPU of loading the model, which is subtracted."""
    base = [str(binary), "-m", str(gguf), "-t", str(threads), "--no-warmup", "-o", "json"]

    def cpu(*extra: str) -> float:
        start = _children_cpu_s()
        try:
            res = subprocess.run([*base, *extra], capture_output=True, text=True, check=False)
        except OSError as exc:
            raise NpuchatError(f"--llama-bench {binary}: cannot run it ({exc})") from exc
        if res.returncode:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise NpuchatError(f"llama-bench {' '.join(extra)} failed: {tail[0]}")
        return _children_cpu_s() - start

    load = cpu("-p", "0", "-n", "1", "-r", "1")
    r = str(repeats)
    pp = cpu("-p", str(prompt), "-n", "0", "-r", r) - load
    tg = cpu("-p", "0", "-n", str(gen), "-r", r) - load
    return {
        f"pp{prompt}_cpu_ms": pp / (repeats * prompt) * 1e3,
        f"tg{gen}_cpu_ms": tg / (repeats * gen) * 1e3,
    }


def add_llama_ratios(report: BenchReport, llama: LlamaBenchFigures) -> None:
    """Set `llama_tps` and `ratio` on each prefill/decode row llama-bench measured too.

    Our decode at context 128 is matched with llama.cpp's tg at depth 0 (its tg128 spans
    contexts 0..128); larger contexts with the same depth, when the binary measured it.
    """
    for p in report.prefill:
        ref = llama.prefill.get(str(p.tokens))
        if ref:
            p.llama_tps, p.ratio = ref.tps, p.tps.median / ref.tps
    for d in report.decode:
        ref = llama.decode.get(str(0 if d.context <= 128 else d.context))
        if ref:
            d.llama_tps, d.ratio = ref.tps, d.tps.median / ref.tps
