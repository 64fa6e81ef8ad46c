"""`npuchat.RopeAttention` against the separate ops it replaces, on real models, in one process.

    python benchmarks/rope_attention_ab.py MODEL.gguf [...] [--rounds 24] [--context 128]
        [--threads 2]

Loads each model twice with the native kernels, once with the fused op (the default graph) and
once with the seventeen ops per layer it replaces (`GraphSpec.fused_attention=False`), and
alternates them round by round: decode steps (16 per round, after a warm-up step, at the given
context) and every fourth round a 512-token prefill. Prints wall and process-CPU milliseconds
per token (median, 25th percentile, minimum) and prefill tok/s (median) for each side; the
machine's speed drifts from minute to minute, so only the paired figures mean much. A script
that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuchat.engine.bench_timers import machine_info, token_ids
from npuchat.engine.graph_inputs import GraphSpec
from npuchat.engine.model import Model

DECODE_STEPS = 16


def _load(path: Path, cache: Path, threads: int, fused: bool) -> Model:
    cpu = GraphSpec.cpu
    try:
        GraphSpec.cpu = classmethod(  # type: ignore[method-assign]
            lambda cls, *a, **k: replace(cpu(*a, **k), fused_attention=fused)
        )
        return Model.load(path, cache_dir=cache / str(fused), threads=threads)
    finally:
        GraphSpec.cpu = cpu  # type: ignore[method-assign]


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return (
        f"median {statistics.median(ordered):.2f} p25 {ordered[len(ordered) // 4]:.2f} "
        f"min {ordered[0]:.2f}"
    )


def compare(path: Path, rounds: int, context: int, threads: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        models = {fused: _load(path, Path(tmp), threads, fused) for fused in (True, False)}
        vocab = models[True].config.vocab_size
        prompt = token_ids(vocab, max(context, 512), 1)
        wall: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        prefill: dict[bool, list[float]] = {True: [], False: []}
        for m in models.values():
            m.prefill(prompt[:context])
        for r in range(rounds):
            for fused, m in models.items():
                m.rollback(context)
                token = prompt[0]
                m.decode(token)
                m.rollback(context)
                t, c = time.perf_counter(), time.process_time()
                for _ in range(DECODE_STEPS):
                    token = int(m.decode(token).argmax())
                wall[fused].append((time.perf_counter() - t) / DECODE_STEPS * 1e3)
                cpu[fused].append((time.process_time() - c) / DECODE_STEPS * 1e3)
                if r % 4 == 0:
                    m.rollback(0)
                    t = time.perf_counter()
                    m.prefill(prompt[:512])
                    prefill[fused].append(512 / (time.perf_counter() - t))
                    m.rollback(0)
                    m.prefill(prompt[:context])
        for m in models.values():
            m.close()
    print(f"{path.name}: decode at context {context}, {rounds} rounds of {DECODE_STEPS} steps")
    for fused in (True, False):
        label = "fused RopeAttention" if fused else "separate ops       "
        print(
            f"  {label} wall ms/token {_spread(wall[fused])} | CPU ms/token "
            f"{statistics.median(cpu[fused]):.2f} | prefill 512 "
            f"{statistics.median(prefill[fused]):.1f} tok/s"
        )
    ratio = statistics.median(wall[False]) / statistics.median(wall[True])
    print(f"  separate / fused decode wall (medians): {ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    info = machine_info()
    print(
        f"{info.cpu} ({', '.join(info.cpu_flags)}), {info.cores} cores, load {info.load_average_1m}"
    )
    for path in args.models:
        compare(path, args.rounds, args.context, args.threads)


if __name__ == "__main__":
    main()
