"""Where a cold prompt's prefill goes: ONNX Runtime's per-op time over its chunks, by op type.

    python benchmarks/prefill_profile.py MODEL.gguf [--tokens 1000] [--chunk 128] [--threads 1]

Loads the model (graphs from `--cache-dir`, built on first use), prefills `--tokens` ordinary
token ids from an empty cache in chunks of `--chunk` after a 16-token warm-up, and prints the
wall and process CPU time of the prefill, then each op type's share of the kernel time of those
chunks (QMatMul: the matmuls; Attention / MatMul, Softmax: attention; the rest: norms, rotary,
copies) and the matmuls' time by shape. ONNX Runtime's profiler (`NPUCHAT_ORT_PROFILE`) adds
a little per op; at one thread the shares are CPU shares. A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "npuchat-pp")
    ap.add_argument("--top", type=int, default=12, help="op types and nodes to list")
    args = ap.parse_args()
    trace = Path(tempfile.mkdtemp(prefix="prefill-profile-"))
    os.environ["NPUCHAT_ORT_PROFILE"] = str(trace / "ort")
    from npuchat.engine.bench_timers import token_ids
    from npuchat.engine.model import Model

    model = Model.load(
        args.model, cache_dir=args.cache_dir, threads=args.threads, prefill_chunk=args.chunk
    )
    ids = token_ids(model.config.vocab_size, args.tokens, 1)
    model.prefill(ids[:16])  # first-run allocations stay out of the figures
    model.rollback(0)
    runs_before = 1 + (16 - 1) // args.chunk  # the warm-up's graph runs
    wall, cpu = time.perf_counter(), time.process_time()
    model.prefill(ids)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    session = model._session
    assert session is not None, "the CPU graph runs in one ONNX Runtime session"
    events = json.loads(Path(session.end_profiling()).read_text())
    model.close()
    runs = [e for e in events if e.get("name") == "model_run"][runs_before:]
    start = runs[0]["ts"] if runs else 0
    by_op: dict[str, float] = defaultdict(float)
    by_shape: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            by_op[e["args"]["op_name"]] += e["dur"] / 1e3
            if e["args"]["op_name"] == "QMatMul":  # by shape: K -> weight rows (N, or 2N: glu)
                k, n = e["args"]["input_type_shape"][0]["float"][-1], _rows(e["args"])
                by_shape[f"QMatMul {k} -> {n}"] += e["dur"] / 1e3
    total = sum(by_op.values())
    print(
        f"{args.model.name}: prefill of {args.tokens} tokens in {len(runs)} chunks of "
        f"{args.chunk}, {args.threads} thread(s): wall {wall:.2f} s, CPU {cpu:.2f} s "
        f"({cpu / args.tokens * 1e3:.1f} ms/token); kernels {total / 1e3:.2f} s of "
        f"{sum(r['dur'] for r in runs) / 1e6:.2f} s of graph runs"
    )
    for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {op:34s} {ms:9.1f} ms  {100 * ms / total:5.1f}%")
    print("QMatMul by shape (K -> weight rows; every layer's together):")
    for shape, ms in sorted(by_shape.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {shape:34s} {ms:9.1f} ms  {100 * ms / total:5.1f}%")
    shutil.rmtree(trace, ignore_errors=True)


def _rows(node_args: dict[str, Any]) -> int:
    """The weight rows of a QMatMul event: the W input's first dimension."""
    return int(next(iter(node_args["input_type_shape"][1].values()))[0])


if __name__ == "__main__":
    main()
