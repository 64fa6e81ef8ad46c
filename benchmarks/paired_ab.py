"""Two ways of running the same model, side by side in one process: a change against what it
replaced, on real models.

    python benchmarks/paired_ab.py MODEL.gguf [...] --compare attention|k-layout
        [--rounds 24] [--context 128] [--threads 2]

`attention`: `npuchat.RopeAttention` (the default graph) against the seventeen ops per layer it
replaces (`GraphSpec.fused_attention=False`). `k-layout`: Q4_K, Q6_K, Q8_0 and Q5_0 matrices
regrouped eight rows at a time (the default) against the GGUF's own rows
(`GraphSpec.regroup_k=False`). Loads each model twice with the native kernels and alternates
the two round by round: decode steps (16 per round, after a warm-up step, at the given context)
and every fourth round a 512-token prefill.
Prints wall and process-CPU milliseconds per token (median, 25th percentile, minimum) and
prefill tok/s (median) for each side; the machine's speed drifts from minute to minute, so only
the paired figures mean much. A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuchat.engine.bench_timers import machine_info, token_ids
from npuchat.engine.graph_inputs import GraphSpec
from npuchat.engine.model import Model

DECODE_STEPS = 16


@dataclass(frozen=True)
class Variant:
    label: str
    graph: tuple[tuple[str, bool], ...] = ()  # GraphSpec fields this side sets


COMPARISONS = {
    "attention": (
        Variant("fused RopeAttention"),
        Variant("separate ops", graph=(("fused_attention", False),)),
    ),
    "k-layout": (
        Variant("K rows regrouped x8"),
        Variant("K rows as in the GGUF", graph=(("regroup_k", False),)),
    ),
}


def _load(path: Path, cache: Path, threads: int, side: Variant) -> Model:
    cpu = GraphSpec.cpu
    try:
        GraphSpec.cpu = classmethod(  # type: ignore[method-assign]
            lambda cls, *a, **k: replace(cpu(*a, **k), **dict(side.graph))
        )
        return Model.load(path, cache_dir=cache / side.label.replace(" ", "-"), threads=threads)
    finally:
        GraphSpec.cpu = cpu  # type: ignore[method-assign]


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return (
        f"median {statistics.median(ordered):.2f} p25 {ordered[len(ordered) // 4]:.2f} "
        f"min {ordered[0]:.2f}"
    )


def compare(
    path: Path, sides: tuple[Variant, Variant], rounds: int, context: int, threads: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        models = {side: _load(path, Path(tmp), threads, side) for side in sides}
        vocab = models[sides[0]].config.vocab_size
        prompt = token_ids(vocab, max(context, 512), 1)
        wall: dict[Variant, list[float]] = {side: [] for side in sides}
        cpu: dict[Variant, list[float]] = {side: [] for side in sides}
        prefill: dict[Variant, list[float]] = {side: [] for side in sides}
        for m in models.values():
            m.prefill(prompt[:context])
        for r in range(rounds):
            for side, m in models.items():
                m.rollback(context)
                token = prompt[0]
                m.decode(token)
                m.rollback(context)
                t, c = time.perf_counter(), time.process_time()
                for _ in range(DECODE_STEPS):
                    token = int(m.decode(token).argmax())
                wall[side].append((time.perf_counter() - t) / DECODE_STEPS * 1e3)
                cpu[side].append((time.process_time() - c) / DECODE_STEPS * 1e3)
                if r % 4 == 0:
                    m.rollback(0)
                    t = time.perf_counter()
                    m.prefill(prompt[:512])
                    prefill[side].append(512 / (time.perf_counter() - t))
                    m.rollback(0)
                    m.prefill(prompt[:context])
        for m in models.values():
            m.close()
    print(f"{path.name}: decode at context {context}, {rounds} rounds of {DECODE_STEPS} steps")
    width = max(len(side.label) for side in sides)
    for side in sides:
        print(
            f"  {side.label:<{width}} wall ms/token {_spread(wall[side])} | CPU ms/token "
            f"{statistics.median(cpu[side]):.2f} | prefill 512 "
            f"{statistics.median(prefill[side]):.1f} tok/s"
        )
    a, b = sides
    ratio = statistics.median(wall[b]) / statistics.median(wall[a])
    speed = statistics.median(prefill[a]) / statistics.median(prefill[b])
    print(f"  {b.label} / {a.label}: decode wall (medians) {ratio:.3f}, prefill {speed:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--compare", choices=sorted(COMPARISONS), required=True)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    info = machine_info()
    print(
        f"{info.cpu} ({', '.join(info.cpu_flags)}), {info.cores} cores, load {info.load_average_1m}"
    )
    for path in args.models:
        compare(path, COMPARISONS[args.compare], args.rounds, args.context, args.threads)


if __name__ == "__main__":
    main()
