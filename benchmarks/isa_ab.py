"""The native kernels' tables against each other on real models, beside llama.cpp:

    python benchmarks/isa_ab.py MODEL.gguf ... [--isas avx512vnni,avx2] [--rounds 3]
        [--llama-bench PATH]

Each round runs `engine_speed_worker.py run` once per table (NPUCHAT_KERNEL_ISA) at one thread
and at two, the tables alternating so that a loaded machine's changes fall on both alike; it
prints per table the median (min-max) process CPU time per token at one thread (decode at
context 128, prefill of 512 tokens) and tok/s at two. With --llama-bench, llama.cpp's CPU time
per token at one thread (`llama_cpu_ms`) and its tok/s at two follow, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("engine_speed_worker.py")
FIGURES = (  # (threads, worker key, label)
    (1, "decode128_cpu_ms", "decode CPU ms/tok @1t"),
    (1, "prefill512_cpu_ms", "prefill CPU ms/tok @1t"),
    (2, "decode128_tps", "decode tok/s @2t"),
    (2, "prefill512_tps", "prefill tok/s @2t"),
)


def _run(model: Path, cache: Path, threads: int, isa: str) -> dict[str, Any]:
    cmd = [sys.executable, str(WORKER), str(model), "run", str(cache), "--threads", str(threads)]
    cmd += ["--contexts", "128"]
    env = dict(os.environ, NPUCHAT_KERNELS="on", NPUCHAT_KERNEL_ISA=isa)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = res.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        sys.exit(f"the worker failed for {model} ({isa}):\n{res.stderr[-2000:]}")
    out = dict(json.loads(lines[-1]))
    if f"({isa})" not in out["kernels"]:  # the CPU lacks it: the op fell back to another table
        sys.exit(f"{model.name}: NPUCHAT_KERNEL_ISA={isa} ran {out['kernels']}")
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--isas", default="avx512vnni,avx2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--json", type=Path, help="write every sample to FILE")
    args = ap.parse_args()
    isas = args.isas.split(",")
    everything: dict[str, Any] = {}
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            _run(model, Path(tmp), 2, isas[0])  # builds the graphs once, not measured
            samples: dict[str, dict[str, list[float]]] = {i: {} for i in isas}
            for r in range(args.rounds):
                for isa in isas if r % 2 == 0 else isas[::-1]:
                    for threads in (1, 2):
                        out = _run(model, Path(tmp), threads, isa)
                        for t, key, _ in FIGURES:
                            if t == threads:
                                samples[isa].setdefault(key, []).append(float(out[key]))
        print(f"{model.name} ({args.rounds} rounds)")
        for _, key, label in FIGURES:
            print(f"  {label:24s}" + "".join(f"  {i} {_spread(samples[i][key])}" for i in isas))
        entry: dict[str, Any] = {"samples": samples}
        if args.llama_bench is not None:
            from npuchat.engine.llama_bench import llama_cpu_ms, run_llama_bench

            cpu = llama_cpu_ms(args.llama_bench, model, 1, 512, 128, 1)
            bench = run_llama_bench(args.llama_bench, model, 2, [512], 128, [], 2)
            entry["llama"] = {
                **cpu,
                "tg128_tps": bench.decode["0"].tps if "0" in bench.decode else None,
                "pp512_tps": bench.prefill["512"].tps if "512" in bench.prefill else None,
            }
            print(f"  llama.cpp: {json.dumps(entry['llama'])}")
        everything[model.name] = entry
        sys.stdout.flush()
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
