"""`npuchat.QMatMul` (the GGUF's own blocks) against `MatMulNBits` (the engine's repacked form) on
real weight matrices, side by side, alternating, in one process.

    python benchmarks/qmatmul_speed.py MODEL.gguf [--rows 1,2,4,16] [--repeats 15] [--threads 2]
        [--tensors blk.0.attn_q.weight,blk.0.ffn_up.weight,blk.0.ffn_down.weight,output.weight]
        [--layout grouped|rows]

Both sides get the same weights, the same input rows and a 2-thread session: QMatMul reads the
blocks as the engine lays them out (`--layout grouped`: Q4_K, Q6_K, Q8_0 and Q5_0 rows regrouped
in eights for the eight-row kernels, `graph_native.regroup_rows`; `rows`: as they are in the
file, what the other types and a matrix whose rows are not a multiple of 16 get); MatMulNBits
gets what `engine.graph_weights` writes for them (4-bit with the block-offset Gemm for Q4_K,
Q6_K requantized to 8-bit) with `accuracy_level=4`, as the engine runs it. For each matrix and
row count it prints wall and process CPU time per call (min / median over the repeats) and the
ratio MatMulNBits / QMatMul (> 1: QMatMul faster). The sessions' threads do not spin between
runs (two sessions run alternately: one's spinning threads took the cores from the other's).
The weights are small enough to stay in L3 between calls: this measures the kernels' compute,
not a decode step's memory reads. On a loaded machine trust CPU time more than wall time. A
script that prints figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf import GGMLQuantizationType

from npuchat.engine.custom_ops import DOMAIN, kernel_library, register_kernels
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.graph_native import regroup_rows
from npuchat.engine.quant import decode_tensor, pack_nbits

DEFAULT_TENSORS = "blk.0.attn_q.weight,blk.0.ffn_up.weight,blk.0.ffn_down.weight,output.weight"


def _session(nodes: list, inits: list, k: int, n: int, threads: int, custom: bool):
    graph = helper.make_graph(
        nodes,
        "bench",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    if custom:
        opsets.append(helper.make_opsetid(DOMAIN, 1))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # module doc
    if custom:
        register_kernels(so, kernel_library())
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def qmatmul_session(
    raw: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int, threads: int, grouped: bool
):
    rows = np.ascontiguousarray(raw).reshape(n, -1)
    x8 = regroup_rows(rows, qtype) if grouped and n % 16 == 0 else None
    node = helper.make_node(
        "QMatMul", ["x", "w"], ["y"], domain=DOMAIN, ggml_type=int(qtype), N=n, K=k,
        scale=1.0, scaled_rows=0, layout=0 if x8 is None else 1,
    )  # fmt: skip
    w = numpy_helper.from_array(rows if x8 is None else x8, "w")
    return _session([node], [w], k, n, threads, custom=True)


def nbits_session(raw: np.ndarray, qtype, n: int, k: int, threads: int):
    m = decode_tensor(raw, qtype, n, k)
    nb = pack_nbits(m)
    inits = [numpy_helper.from_array(nb.b, "b"), numpy_helper.from_array(nb.scales, "s")]
    out = "y" if nb.mins is None else "mm"
    nodes = [
        helper.make_node(
            "MatMulNBits", ["x", "b", "s"], [out], domain="com.microsoft",
            K=k, N=n, bits=m.bits, block_size=32, accuracy_level=4,
        )
    ]  # fmt: skip
    if nb.mins is not None:
        inits += [
            numpy_helper.from_array(nb.mins, "mins"),
            numpy_helper.from_array(np.array([-1, k // 32, 32], np.int64), "shape"),
            numpy_helper.from_array(np.array([-1], np.int64), "axis"),
        ]
        nodes += [
            helper.make_node("Reshape", ["x", "shape"], ["xb"]),
            helper.make_node("ReduceSum", ["xb", "axis"], ["bs"], keepdims=0),
            helper.make_node("Gemm", ["bs", "mins", "mm"], ["y"], transB=1),
        ]
    return _session(nodes, inits, k, n, threads, custom=False), m.bits


def _time(sess, x: np.ndarray) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    sess.run(None, {"x": x})
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tensors", default=DEFAULT_TENSORS)
    ap.add_argument("--rows", default="1,2,4,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layout", choices=["grouped", "rows"], default="grouped")
    args = ap.parse_args()
    os.environ.setdefault("NPUCHAT_KERNELS", "on")
    lib = kernel_library()
    if not lib.available:
        sys.exit(f"no kernels: {lib.reason}")
    info = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), "")
    flags = sorted({f for f in info.split() if f.startswith(("avx", "fma", "f16c"))})
    print(f"{cpu or platform.machine()}; {' '.join(flags)}; kernels {lib.isa}")
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, {args.repeats} repeats")
    g = GGUFFile(args.gguf)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'tensor':26} {'type':5} {'N x K':>13} {'M':>3} | {'QMatMul ms wall/cpu':>21} | "
          f"{'MatMulNBits ms wall/cpu':>23} | ratio wall cpu")  # fmt: skip
    for name in args.tensors.split(","):
        info = g.tensors.get(name) or g.tensors.get("token_embd.weight")
        k, n = info.shape[0], int(np.prod(info.shape[1:]))
        raw = g.raw(info.name)
        q = qmatmul_session(raw, info.ggml_type, n, k, args.threads, args.layout == "grouped")
        b, bits = nbits_session(raw, info.ggml_type, n, k, args.threads)
        for m in rows:
            x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            for s in (q, b):
                _time(s, x)  # warm-up: caches, arena
            tq, tb = [], []
            for _ in range(args.repeats):
                tq.append(_time(q, x))
                tb.append(_time(b, x))

            def fig(ts: list[tuple[float, float]], i: int) -> tuple[float, float]:
                v = [t[i] * 1e3 for t in ts]
                return min(v), statistics.median(v)

            qw, qc, bw, bc = fig(tq, 0), fig(tq, 1), fig(tb, 0), fig(tb, 1)
            label = f"{info.ggml_type.name}/{bits}b"
            print(
                f"{info.name:26} {label:8} {n:>6}x{k:<6} {m:>3} | "
                f"{qw[0]:6.2f} {qw[1]:6.2f} / {qc[1]:6.2f} | "
                f"{bw[0]:6.2f} {bw[1]:6.2f} / {bc[1]:6.2f} | "
                f"{bw[1] / qw[1]:5.2f}x {bc[1] / qc[1]:5.2f}x"
            )


if __name__ == "__main__":
    main()
