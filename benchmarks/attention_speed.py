"""The native `npuchat.Attention` op against the ONNX Runtime subgraph the CPU graph used
before it (Slice of the window, MatMul with K^T, Add mask, Softmax, MatMul with V), by process
CPU time per call, alternating the two in each round.

    python benchmarks/attention_speed.py [--threads 1] [--rounds 7] [--hkv 2 --group 7 --dh 64]

Shapes are one layer's (a Qwen2.5-Coder-0.5B layer by default): decode rows at a context,
a stream's decode row beside a prompt's rows in one batch (the stream's mask shows only its own
slots of the window), and causal prefill chunks at a context. Prints median ms per call and
native / ONNX (below 1: the op is faster). A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from npuchat.engine.custom_ops import DOMAIN, kernel_library, register_kernels
from npuchat.engine.layer_inputs import MASK_NEG

CASES = [  # name, batch rows (S tokens at context n), window A
    ("decode @1024", [(1, 1024)], 1024),
    ("decode @4096", [(1, 4096)], 4096),
    ("stream 300 + 1 prompt token @2000", [(1, 300), (1, 2000)], 2048),
    ("stream 300 + 4 prompt tokens @2000", [(4, 300), (4, 2000)], 2048),
    ("16-token chunk @1000", [(16, 1000)], 1024),
    ("128-token chunk @1000", [(128, 1000)], 1152),
    ("128-token chunk @2000", [(128, 2000)], 2176),
]


def session(graph: helper.GraphProto, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    register_kernels(so, kernel_library())
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def graphs(threads: int) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    f = TensorProto.FLOAT
    io = [helper.make_tensor_value_info(n, f, None) for n in ("q", "k", "v", "mask")]
    native = helper.make_graph(
        [
            helper.make_node(
                "Attention", ["q", "k", "v", "mask"], ["y"], domain=DOMAIN, hidden=MASK_NEG
            )
        ],
        "native",
        io,
        [helper.make_tensor_value_info("y", f, None)],
    )
    window = helper.make_tensor_value_info("a", TensorProto.INT64, [1])
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [2])
    nodes = [
        helper.make_node("Slice", ["k", "zero", "a", "axis"], ["kw"]),
        helper.make_node("Slice", ["v", "zero", "a", "axis"], ["vw"]),
        helper.make_node("Transpose", ["kw"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Add", ["s", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vw"], ["y"]),
    ]
    onnx_graph = helper.make_graph(
        nodes, "onnx", [*io, window], [helper.make_tensor_value_info("y", f, None)], [zero, axis]
    )
    return session(native, threads), session(onnx_graph, threads)


def feeds(
    rows: list[tuple[int, int]], a: int, hkv: int, group: int, dh: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Rows left-padded to the longest S; row b's S_b tokens sit at its last S_b positions and
    see its n_b - S_b earlier slots plus themselves, causally."""
    rng = np.random.default_rng(0)
    b, s = len(rows), max(t for t, _ in rows)
    cap = max(a, max(n for _, n in rows))
    mask = np.full((b, 1, s, a), MASK_NEG, np.float32)
    for bi, (t, n) in enumerate(rows):
        for j in range(t):
            mask[bi, 0, s - t + j, : n - t + j + 1] = 0.0
    q = (rng.standard_normal((b, hkv, group * s, dh)) / np.sqrt(dh)).astype(np.float32)
    k = rng.standard_normal((b, hkv, cap, dh)).astype(np.float32)
    v = rng.standard_normal((b, hkv, cap, dh)).astype(np.float32)
    tiled = np.tile(mask, (1, 1, group, 1))
    native = {"q": q, "k": k, "v": v, "mask": mask}
    return native, {**native, "mask": tiled, "a": np.array([a], np.int64)}


def cpu_ms(sess: ort.InferenceSession, feed: dict[str, np.ndarray]) -> float:
    t0 = time.process_time()
    sess.run(None, feed)
    return 1000 * (time.process_time() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--group", type=int, default=7, help="query heads per KV head")
    ap.add_argument("--dh", type=int, default=64)
    args = ap.parse_args()
    native, onnx_sess = graphs(args.threads)
    print(f"hkv {args.hkv}, group {args.group}, dh {args.dh}, {args.threads} thread(s)")
    print(f"{'case':38} {'native ms':>10} {'onnx ms':>9} {'native/onnx':>12}")
    for name, rows, a in CASES:
        fn, fo = feeds(rows, a, args.hkv, args.group, args.dh)
        y_native, y_onnx = native.run(None, fn)[0], onnx_sess.run(None, fo)[0]
        visible = fo["mask"].max(-1, keepdims=True) > MASK_NEG  # padded rows: zeros vs uniform
        err = float(np.abs(np.where(visible, y_native - y_onnx, 0)).max())
        tn, to = [], []
        for _ in range(args.rounds):
            tn.append(cpu_ms(native, fn))
            to.append(cpu_ms(onnx_sess, fo))
        mn, mo = statistics.median(tn), statistics.median(to)
        print(f"{name:38} {mn:10.3f} {mo:9.3f} {mn / mo:11.2f}x  (max diff {err:.1e})")


if __name__ == "__main__":
    main()
