"""One measuring phase of `benchmarks/engine_speed.py`, run in a fresh process per phase and
repeat so that load times are real and the peak RSS (VmHWM) belongs to that phase alone:

    python benchmarks/engine_speed_worker.py MODEL.gguf {cold,run} CACHE_DIR [--threads N] ...

`cold` loads into an empty cache (the graphs are built); `run` loads from that cache and measures
prefill of a 512-token prompt, decode at context 128 and 1024, and the Python overhead per decode
step (wall time of `Model.decode` minus ONNX Runtime's run); `--profile` adds ONNX Runtime's
per-op-type time of one decode step, `--floor` the model's matmuls alone. It prints one JSON
object, its figures, as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from npuchat.engine.kv_layout import KV_CHOICES

DECODE_TOKENS = 32


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One phase in this process; returns its figures."""
    from npuchat.engine.bench_timers import token_ids
    from npuchat.engine.model import Model

    t0 = time.perf_counter()
    model = Model.load(
        args.model, cache_dir=Path(args.cache_dir), threads=args.threads, kv_dtype=args.kv_dtype
    )
    load_s = time.perf_counter() - t0
    model.exact_decode = not args.no_row_padding
    kernels = f"{model.kernels}; K/V {model.kv_dtype}"
    out: dict[str, Any] = {"load_s": load_s, "built": model.graph_builds, "kernels": kernels}
    if args.phase == "cold":
        out["peak_rss_mib"] = _status_mib("VmHWM")
        print(json.dumps(out), flush=True)
        return out
    vocab = model.config.vocab_size

    prompt = token_ids(vocab, 512, 1)
    model.prefill(prompt[:16])  # warm-up (first-run allocations), then from an empty cache
    model.rollback(0)
    t, c = time.perf_counter(), time.process_time()
    model.prefill(prompt)
    out["prefill512_tps"] = 512 / (time.perf_counter() - t)
    out["prefill512_cpu_ms"] = (time.process_time() - c) / 512 * 1e3

    session = model._session  # measure ONNX Runtime's share of a decode step
    assert session is not None
    run_time = [0.0]
    real_run = session.run_with_iobinding

    def timed_run(*a: Any, **kw: Any) -> Any:
        s = time.perf_counter()
        try:
            return real_run(*a, **kw)
        finally:
            run_time[0] += time.perf_counter() - s

    session.run_with_iobinding = timed_run  # type: ignore[method-assign]
    for ctx in args.contexts:
        if model.n_past < ctx:
            model.prefill(token_ids(vocab, ctx - model.n_past, 2))
        model.rollback(ctx)
        model.decode(prompt[0])  # warm-up at this capacity
        model.rollback(ctx)
        run_time[0] = 0.0
        t, c = time.perf_counter(), time.process_time()
        token = prompt[0]
        for _ in range(DECODE_TOKENS):
            token = int(model.decode(token).argmax())
        wall = time.perf_counter() - t
        out[f"decode{ctx}_tps"] = DECODE_TOKENS / wall
        out[f"decode{ctx}_cpu_ms"] = (time.process_time() - c) / DECODE_TOKENS * 1e3
        out[f"decode{ctx}_python_ms"] = (wall - run_time[0]) / DECODE_TOKENS * 1e3
        out[f"decode{ctx}_capacity"] = model.capacity
    out["kv_bytes"] = model.kv_bytes
    out["peak_rss_mib"] = _status_mib("VmHWM")
    out["rss_mib"] = _status_mib("VmRSS")
    if args.profile:
        out["profile"] = _profile(model, args.threads, 1 if model.exact_decode else 0)
    if args.floor:
        out["floor_ms"] = _matmul_floor(model.graph_dir, model.path, args.threads)
    # figures out before the teardown: a teardown that fails must not lose them
    print(json.dumps(out), flush=True)
    model.close()
    return out


def _matmul_floor(graph_dir: Path, gguf: Path, threads: int | None) -> dict[str, float]:
    """Milliseconds per step of the model's matmuls alone, at M = 1 and 2 rows (median of 8).

    Every `MatMulNBits`, offset `Gemm` and `QMatMul` of the built graph, with its real weights,
    fed from one constant input per K and nothing else: the floor that the kernels put under
    a decode step (M = 2: what an exact decode step pays for its 4-bit matmuls).
    """
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from npuchat.engine.custom_ops import kernels_for
    from npuchat.engine.gguf_initializers import gguf_initializers
    from npuchat.engine.runtime import session_options_for

    src = onnx.load(str(graph_dir / "decoder.onnx"), load_external_data=False)
    inits = {t.name: t for t in src.graph.initializer}
    nodes, feeds, outs = [], {}, []
    for node in src.graph.node:
        if node.op_type in ("MatMulNBits", "QMatMul"):  # x, then the weights' inputs
            k = next(a.i for a in node.attribute if a.name == "K")
            x, weights = f"x{k}", list(node.input[1:])
            if node.op_type == "QMatMul" and len(weights) > 2:  # a fused norm: no skip, x alone
                weights[2] = ""
        elif node.op_type == "Gemm":  # block sums, offsets [N, K/32]; no C input
            k = inits[node.input[1]].dims[1]
            x, weights = f"b{k}", [node.input[1]]
        else:
            continue
        feeds[x] = k
        out = f"{node.name}_out"
        copy = helper.make_node(
            node.op_type, [x, *weights], [out], name=node.name, domain=node.domain or None
        )
        copy.attribute.extend(node.attribute)
        nodes.append(copy)
        outs.append(out)
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(
        nodes,
        "matmul_floor",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", k]) for x, k in feeds.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
        initializer=[inits[i] for i in used if i in inits],
    )
    floor = helper.make_model(graph, opset_imports=list(src.opset_import))
    floor.ir_version = src.ir_version
    path = graph_dir / f"floor-{os.getpid()}.onnx"  # beside weights.bin, which it references
    onnx.save_model(floor, str(path))
    try:
        kernels = kernels_for(4).path if any(n.op_type == "QMatMul" for n in nodes) else None
        so = session_options_for("cpu", threads, kernels)
        shared = gguf_initializers(graph_dir / "decoder.onnx", gguf)  # blocks read in place
        if shared is not None:
            shared.add_to(so, used)
        sess = ort.InferenceSession(str(path), so)
    finally:
        path.unlink()
    result = {}
    for rows in (1, 2):
        io = sess.io_binding()
        for x, k in feeds.items():
            io.bind_cpu_input(x, np.random.default_rng(0).random((rows, k), np.float32))
        for o in outs:
            io.bind_output(o)
        for _ in range(2):
            sess.run_with_iobinding(io)
        times = []
        for _ in range(8):
            t = time.perf_counter()
            sess.run_with_iobinding(io)
            times.append(time.perf_counter() - t)
        result[f"m{rows}"] = float(np.median(times)) * 1e3
    return result


def _profile(model: Any, threads: int | None, pad: int) -> dict[str, float]:
    """Per-op-type milliseconds of one decode step at context 128 (median of 10 runs).

    Bound like `Model` binds its session: the cache outputs alias the cache inputs, so the
    in-place ScatterND is profiled without the copy an unbound output would cost.
    """
    import onnxruntime as ort

    from npuchat.engine.custom_ops import kernels_for
    from npuchat.engine.gguf_initializers import gguf_initializers
    from npuchat.engine.runtime import session_options_for

    so = session_options_for("cpu", threads, kernels_for(4).path)  # unused if the graph has none
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    shared = gguf_initializers(model.graph_dir / "decoder.onnx", model.path)
    if shared is not None:
        shared.add_to(so)
    sess = ort.InferenceSession(str(model.graph_dir / "decoder.onnx"), so)
    io = sess.io_binding()
    values = {}
    dims = {"B": 1, "S": 1, "BS": 1, "N": 1, "C": 256, "A": 256, "W": 256, "R": 1, "P": pad}
    for i in sess.get_inputs():
        shape = [dims.get(d, d) if isinstance(d, str) else d for d in i.shape]
        kinds = {"tensor(int64)": np.int64, "tensor(float16)": np.float16}  # f16: the K/V cache
        arr = np.zeros(shape, kinds.get(i.type, np.float32))
        values[i.name] = ort.OrtValue.ortvalue_from_numpy(arr)
        io.bind_ortvalue_input(i.name, values[i.name])
    for o in sess.get_outputs():
        if o.name.startswith("present_"):
            io.bind_ortvalue_output(o.name, values["past_" + o.name.removeprefix("present_")])
        else:
            io.bind_output(o.name)
    for _ in range(10):
        sess.run_with_iobinding(io)
    per_node: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in json.loads(Path(sess.end_profiling()).read_text()):
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_node[(e["args"]["op_name"], e["name"])].append(e["dur"] / 1e3)
    by_op: dict[str, float] = defaultdict(float)
    for (op, _), durs in per_node.items():
        by_op[op] += float(np.median(durs))
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("phase", choices=["cold", "run"])
    ap.add_argument("cache_dir")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--no-row-padding", action="store_true")
    ap.add_argument("--kv-dtype", default="auto", choices=KV_CHOICES)
    ap.add_argument(  # isa_ab.py: 128 alone (the 1024 prefill would double a run's time)
        "--contexts", type=lambda v: [int(c) for c in v.split(",")], default=[128, 1024]
    )
    worker(ap.parse_args())  # prints its figures


if __name__ == "__main__":
    main()
