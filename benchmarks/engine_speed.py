"""Engine speed on real GGUF files: load cold vs cached, prefill, decode, peak RSS.

    python benchmarks/engine_speed.py MODEL [MODEL ...] [--threads 2] [--llama-bench PATH]

MODEL is a GGUF path or the name of an installed model (`<models_dir>/<name>.gguf`). Every
phase runs in a fresh subprocess so that load times are real and the peak RSS (VmHWM) belongs to
that phase alone: `cold` builds the graphs into an empty cache, `run` loads them from the cache
and measures prefill of a 512-token prompt, decode at context 128 and at 1024, and the Python
overhead per decode step (wall time of `Model.decode` minus ONNX Runtime's run). With
`--profile` it also prints ONNX Runtime's per-op-type time for one decode step; with `--floor`,
the time of the model's matmuls alone (the floor ONNX Runtime's kernels put under a step); with
`--kernels on,off`, each model with the native kernels and without (`NPUCHAT_KERNELS`). With
`--llama-bench` it runs llama.cpp's `llama-bench -p 512 -n 128` on the same file and thread count
and prints the ratios side by side (`--llama-cpu`: also by process CPU time per token, the ratio
that holds on a loaded machine); `benchmarks/build_llama_bench.sh` builds one from PyPI.

A script that prints figures, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

DECODE_TOKENS = 32


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _resolve(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_file():
        return path.resolve()
    from npuchat.engine.paths import Paths

    candidate = Paths.from_env().models_dir / f"{model}.gguf"
    if candidate.is_file():
        return candidate
    sys.exit(f"no GGUF at {model} and no installed model of that name ({candidate})")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One phase in this process; returns its figures."""
    from npuchat.engine.bench_timers import token_ids
    from npuchat.engine.model import Model

    t0 = time.perf_counter()
    model = Model.load(args.model, cache_dir=Path(args.cache_dir), threads=args.threads)
    load_s = time.perf_counter() - t0
    model.exact_decode = not args.no_row_padding
    out: dict[str, Any] = {"load_s": load_s, "built": model.graph_builds, "kernels": model.kernels}
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
    for ctx in (128, 1024):
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
        arr = np.zeros(shape, np.int64 if "int64" in i.type else np.float32)
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


def _phase(
    model: Path, phase: str, cache: Path, args: argparse.Namespace, kernels: str
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        str(model),
        "--worker",
        phase,
        "--cache-dir",
        str(cache),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.profile:
        cmd.append("--profile")
    if args.no_row_padding:
        cmd.append("--no-row-padding")
    if args.floor:
        cmd.append("--floor")
    env = dict(os.environ, NPUCHAT_KERNELS=kernels) if kernels else None
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = res.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        sys.exit(f"{phase} phase failed for {model}:\n{res.stderr[-2000:]}")
    if res.returncode:  # it measured, then died on the way out
        print(f"  ({phase} phase exited {res.returncode}: {res.stderr.strip()[-120:]})")
    return json.loads(lines[-1])


def _llama_bench(args: argparse.Namespace, model: Path) -> dict[str, float]:
    """llama.cpp's pp512 and tg128 on the same file and threads (what `npuchat bench` runs);
    `--llama-cpu`: also its process CPU time per token (`llama_bench.llama_cpu_ms`)."""
    from npuchat.engine.llama_bench import llama_cpu_ms, run_llama_bench

    figures = run_llama_bench(args.llama_bench, model, args.threads, [512], 128, [], 5)
    for note in figures.notes:
        print(f"llama-bench: {note}", file=sys.stderr)
    out = {}
    if args.llama_cpu:
        out.update(llama_cpu_ms(args.llama_bench, model, args.threads, 512, 128, 3))
    if "512" in figures.prefill:
        out["pp512"] = figures.prefill["512"].tps
    if "0" in figures.decode:
        out["tg128"] = figures.decode["0"].tps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
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
    ap.add_argument("--json", action="store_true", help="print one JSON object per model")
    ap.add_argument("--worker", choices=["cold", "run"], help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.phase = args.worker
        args.model = args.models[0]
        worker(args)  # prints its figures
        return
    print(
        f"threads={args.threads}  load average={os.getloadavg()[0]:.2f}  "
        f"onnxruntime={__import__('onnxruntime').__version__}"
    )
    from npuchat.engine.hashing import model_sha256

    runs = [(name, mode) for name in args.models for mode in args.kernels.split(",")]
    llama_runs: dict[Path, dict[str, float]] = {}
    for name, mode in runs:
        path = _resolve(name)
        with tempfile.TemporaryDirectory() as cache:
            model_sha256(path, Path(cache))  # as after `npuchat pull`, which hashed the file
            cold = _phase(path, "cold", Path(cache), args, mode)
            run = _phase(path, "run", Path(cache), args, mode)
        size_mib = path.stat().st_size / 2**20
        target = 1.3 * size_mib + run["kv_bytes"] / 2**20
        row = {
            "model": path.name,
            "gguf_mib": size_mib,
            "cold": cold,
            **run,
            "rss_target_mib": target,
        }
        if args.llama_bench:
            if path not in llama_runs:  # once per model, beside every kernel mode
                llama_runs[path] = _llama_bench(args, path)
            row["llama"] = llama_runs[path]
        if args.json:
            print(json.dumps(row))
            continue
        print(f"\n{path.name}  ({size_mib:.0f} MiB), kernels: {run['kernels']}")
        print(
            f"  load: cold {cold['load_s']:.1f} s (build, peak RSS {cold['peak_rss_mib']:.0f} "
            f"MiB), cached {run['load_s']:.2f} s (built {run['built']})"
        )
        llama = row.get("llama", {})

        def vs(value: float, key: str, cpu_ms: float, llama: dict[str, float] = llama) -> str:
            if key not in llama:
                return ""
            text = f"  ({value / llama[key]:.2f}x llama.cpp {llama[key]:.1f}"
            if f"{key}_cpu_ms" in llama:  # speed by CPU time: theirs / ours per token
                theirs = llama[f"{key}_cpu_ms"]
                text += f"; by CPU {theirs / cpu_ms:.2f}x of its {theirs:.1f} ms/token"
            return text + ")"

        print(
            f"  prefill 512 tokens: {run['prefill512_tps']:.1f} tok/s "
            f"(CPU {run['prefill512_cpu_ms']:.1f} ms/token)"
            + vs(run["prefill512_tps"], "pp512", run["prefill512_cpu_ms"])
        )
        for ctx in (128, 1024):
            print(
                f"  decode @ {ctx}: {run[f'decode{ctx}_tps']:.1f} tok/s "
                f"(CPU {run[f'decode{ctx}_cpu_ms']:.1f} ms/token, "
                f"capacity {run[f'decode{ctx}_capacity']}, Python "
                f"{run[f'decode{ctx}_python_ms']:.2f} ms/step)"
                + (
                    vs(run[f"decode{ctx}_tps"], "tg128", run[f"decode{ctx}_cpu_ms"])
                    if ctx == 128
                    else ""
                )
            )
        print(
            f"  peak RSS {run['peak_rss_mib']:.0f} MiB (steady {run['rss_mib']:.0f}); target "
            f"1.3 x GGUF + KV = {target:.0f} MiB"
        )
        if "floor_ms" in run:
            f = run["floor_ms"]
            print(
                f"  matmuls alone: {f['m1']:.1f} ms at one row, {f['m2']:.1f} ms at two "
                f"(= {1e3 / f['m2']:.1f} tok/s if nothing else ran)"
            )
        if "profile" in run:
            total = sum(run["profile"].values())
            print(f"  one decode step by op type (ms, sum {total:.1f}):")
            for op, ms in list(run["profile"].items())[:10]:
                print(f"    {op:34s} {ms:7.2f}  {100 * ms / total:5.1f}%")


if __name__ == "__main__":
    main()
