"""What a mixed step costs (a stream's decode token plus a prompt's chunk in one graph run), by
process CPU time, beside the stream's own decode step: where a paste's time goes.

    python benchmarks/mixed_steps.py [--model qwen2.5-coder-0.5b] [--threads 1]
                                     [--stream 300] [--pastes 0,1000,2000,3000]
                                     [--tokens 1,2,4] [--rounds 7] [--profile]
                                     [--kv-dtype f32|f16|int8] [--cache-dir DIR]
                                     [--chunk 128] [--attention native,onnx]

One model with 2 KV slots: row 1 holds a stream of `--stream` tokens, row 0 a prompt read up to
each of `--pastes` tokens (the rows' K/V are whatever the cache holds: attention costs the same
whatever the values). For each prompt length it prints the median CPU time of the stream's
decode step alone, of a batched decode of both rows, and of mixed steps carrying `--tokens`
prompt tokens (without the prompt's logits row, as the engine runs all but a part's last
chunk), each with attention over the slots the step's rows reach (`window`: what the engine
runs) and over the whole capacity (`full`: every step before the attention window), and the
ratios to the stream's decode step at its own window; `--chunk N`: also a prefill chunk of N
tokens on the prompt's row alone. `--attention native,onnx` loads the model twice, once with
the native `npuchat.Attention` op (what a float32 cache on the native kernels runs) and once
with ONNX Runtime's MatMul/Softmax subgraph, and measures the two alternately, round by round
(the window mode only). `--profile` prints instead ONNX Runtime's time per op type for each
kind of step at the longest prompt (profiled runs are slower; read the shares, not the sums).

A script that prints figures, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from concurrency import model_path

import npuchat.engine.cpu_steps as cpu_steps
import npuchat.engine.graph_builder as graph_builder
import npuchat.engine.runtime as runtime
from npuchat.engine.kv_layout import attention_window, default_capacities
from npuchat.engine.model import Model

CAPACITY = 4096


def cpu_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()  # a shape's first run sizes ONNX Runtime's buffers
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1000 * statistics.median(times)


def full_capacity(capacities: object, capacity: int, needed: int) -> int:
    return capacity  # attention over every slot of the cache, masked


def steps(
    m: Model, stream: int, paste: int, tokens: list[int], chunk: int = 0
) -> dict[str, Callable[[], object]]:
    kv = m._kv

    def at(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            kv.lengths[0], kv.lengths[1] = paste, stream
            return fn()

        return run

    out = {"decode": at(lambda: m.decode_batch([100], first_row=1))}
    if paste:
        out["decode2"] = at(lambda: m.decode_batch([100, 101], first_row=0))
        for n in tokens:
            ids = list(range(100, 100 + n))  # not a part's last: no logits row (the engine's)
            out[f"mix{n}"] = at(lambda c=ids: m.step_rows([c, [7]], 0, [False, True]))
        if chunk:
            out[f"chunk{chunk}"] = at(lambda: m.step_rows([list(range(100, 100 + chunk))]))
    return out


def onnx_attention(load: Callable[[], Model]) -> Model:
    """`load()` with the CPU graph's attention as ONNX Runtime's MatMul/Softmax subgraph, not
    the native op (the graph is built into the load's own cache)."""
    original = graph_builder.attend_inplace

    def without_native(*args: object, **kw: object) -> str:
        return original(*args[:10], **kw)  # type: ignore[arg-type]

    graph_builder.attend_inplace = without_native  # type: ignore[assignment]
    try:
        return load()
    finally:
        graph_builder.attend_inplace = original


def compare(models: dict[str, Model], args: argparse.Namespace, pastes: list[int]) -> None:
    """Each kind of step on each model in turn, round by round (median CPU ms per model)."""
    tokens = [int(t) for t in args.tokens.split(",")]
    names = list(models)
    for paste in pastes:
        kinds = {n: steps(m, args.stream, paste, tokens, args.chunk) for n, m in models.items()}
        row = [f"prompt {paste:5d}:"]
        for kind in kinds[names[0]]:
            times: dict[str, list[float]] = {n: [] for n in names}
            for n in names:
                kinds[n][kind]()  # a shape's first run sizes ONNX Runtime's buffers
            for _ in range(args.rounds):
                for n in names:
                    t0 = time.process_time()
                    kinds[n][kind]()
                    times[n].append(1000 * (time.process_time() - t0))
            med = {n: statistics.median(times[n]) for n in names}
            ratio = med[names[0]] / med[names[-1]]
            cells = " / ".join(f"{med[n]:.1f}" for n in names)
            row.append(f"{kind} {cells} ({ratio:.2f}x)")
        print("  " + "  ".join(row), flush=True)


def profile(m: Model, runs: dict[str, Callable[[], object]]) -> None:
    """ONNX Runtime's time per op type in the last of three runs of each kind of step."""
    for fn in runs.values():
        for _ in range(3):
            fn()
    path = Path(m._session.end_profiling())  # type: ignore[union-attr]
    events = json.loads(path.read_text())
    path.unlink()
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    mine = model_runs[-3 * len(runs) :]
    for k, name in enumerate(runs):
        run = mine[3 * k + 2]
        per_op: Counter[str] = Counter()
        for e in events:
            inside = run["ts"] <= e["ts"] <= run["ts"] + run["dur"]
            if inside and e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                per_op[e["args"].get("op_name", "?")] += e["dur"]
        total = sum(per_op.values())
        top = ", ".join(f"{op} {100 * d / total:.0f}%" for op, d in per_op.most_common(6))
        print(f"  {name:8s} {total / 1000:7.1f} ms profiled: {top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stream", type=int, default=300)
    ap.add_argument("--pastes", default="0,1000,2000,3000")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "f16", "int8"])
    ap.add_argument("--cache-dir", type=Path, help="graph cache (default: a fresh one)")
    ap.add_argument("--chunk", type=int, default=0, help="also a prefill chunk of N tokens")
    ap.add_argument("--attention", default="", help="native,onnx: both, measured alternately")
    args = ap.parse_args()
    pastes = [int(p) for p in args.pastes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.profile:
        options = runtime.session_options_for

        def profiled(*a: object, **kw: object) -> object:
            so = options(*a, **kw)  # type: ignore[arg-type]
            so.enable_profiling = True
            so.profile_file_prefix = str(Path(tempfile.gettempdir()) / "mixed_steps_profile")
            return so

        runtime.session_options_for = profiled  # type: ignore[assignment]
    path = model_path(args.model)
    caps = [c for c in default_capacities(CAPACITY) if c <= CAPACITY]
    with tempfile.TemporaryDirectory() as fresh:
        cache = args.cache_dir or Path(fresh)

        def load(folder: Path = cache) -> Model:
            m = Model.load(
                path,
                cache_dir=folder,
                threads=args.threads,
                batch_max=2,
                capacities=caps,
                kv_dtype=args.kv_dtype,
            )
            while not m.reserve(CAPACITY):  # the capacity a long prompt moves the cache to
                time.sleep(0.05)
            return m

        if args.attention:
            modes = args.attention.split(",")
            models = {
                mode: onnx_attention(lambda: load(Path(fresh) / "onnx"))
                if mode == "onnx"
                else load(Path(fresh) / "native")
                for mode in modes
            }
            first = models[modes[0]]
            print(f"{args.model}, {args.threads} thread(s), stream of {args.stream} tokens,")
            print(f"cache at {first.capacity} slots, {first.kernels}; process CPU ms, median")
            print(f"of {args.rounds} alternating rounds, {' / '.join(modes)} attention (ratio):")
            compare(models, args, pastes)
            for m in models.values():
                m.close()
            return
        m = load()
        print(f"{args.model}, {args.threads} thread(s), {args.kv_dtype} K/V,", end=" ")
        print(f"stream of {args.stream} tokens,")
        print(f"cache at {m.capacity} slots, {m.kernels}; process CPU ms, median of {args.rounds}")
        if args.profile:  # the attention window on (what the engine runs)
            print(f"ONNX Runtime per op type, prompt of {pastes[-1]} tokens:")
            profile(m, steps(m, args.stream, pastes[-1], tokens, args.chunk))
            m.close()
            return
        for paste in pastes:
            row = [f"prompt {paste:5d}:"]
            base = None
            for mode, window in (("window", attention_window), ("full", full_capacity)):
                cpu_steps.attention_window = window  # type: ignore[assignment]
                for name, fn in steps(m, args.stream, paste, tokens, args.chunk).items():
                    t = cpu_ms(fn, args.rounds)
                    base = t if base is None else base
                    row.append(f"{name}/{mode} {t:6.1f} ({t / base:.2f}x)")
            cpu_steps.attention_window = attention_window  # type: ignore[assignment]
            print("  " + "  ".join(row), flush=True)
        m.close()


if __name__ == "__main__":
    main()
