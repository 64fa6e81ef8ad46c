"""Two kernel tables of `npuchat.QMatMul` against each other, paired in one process:

    python benchmarks/qmatmul_isa_pairs.py avx2,avx512vnni [--rounds 15]

The library is copied to one path per table, so that each copy makes its own choice (at its
first run, under its own NPUCHAT_KERNEL_ISA); then for each shape (SmolLM2's and Qwen's) the
tables' sessions run alternately, a few milliseconds each, by process CPU time at one thread.
On a loaded machine the load changes between rounds but hardly within a pair: the median of the
paired ratios (second table / first) is the figure that holds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from qmatmul_check import blocks, weights
from synthetic import ggml_type

from npuchat.engine.custom_ops import DOMAIN, kernel_library

SHAPES = [  # (type, N, K): SmolLM2's Q4_1 / Q8_0 rows, its head, Qwen's Q8_0 down, K types
    ("q4_1", 1536, 576),
    ("q8_0", 1536, 576),
    ("q8_0", 49152, 576),
    ("q8_0", 896, 4864),
    ("q4_k", 1536, 1536),
    ("q6_k", 1536, 1536),
    ("q5_0", 896, 896),
]


def _session(raw: np.ndarray, name: str, k: int, library: str) -> ort.InferenceSession:
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(
        "QMatMul", ["x", "w"], ["y"], domain=DOMAIN, ggml_type=int(ggml_type(name)),
        N=raw.shape[0], K=k, scale=1.0, scaled_rows=0,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(raw, "w")],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(library)
    model = helper.make_model(graph, opset_imports=opsets).SerializeToString()
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("isas", help="two tables, e.g. avx2,avx512vnni")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    isas = args.isas.split(",")
    lib = kernel_library().path
    assert lib is not None, kernel_library().reason
    tmp = Path(tempfile.mkdtemp())
    copies = [str(shutil.copy(lib, tmp / f"lib_{isa}.so")) for isa in isas]
    for name, n, k in SHAPES:
        raw = blocks(weights(n, k), ggml_type(name))
        sessions = []
        for isa, path in zip(isas, copies, strict=True):
            os.environ["NPUCHAT_KERNEL_ISA"] = isa  # read at this copy's first run
            s = _session(raw, name, k, path)
            s.run(None, {"x": np.ones((1, k), np.float32)})
            sessions.append(s)
        for m in (1, 16):
            x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
            reps = max(2, int(3e8 / (n * k * m)))
            us: list[list[float]] = [[] for _ in sessions]
            for _ in range(args.rounds):
                for i, s in enumerate(sessions):
                    c = time.process_time()
                    for _ in range(reps):
                        s.run(None, {"x": x})
                    us[i].append((time.process_time() - c) / reps * 1e6)
            ratio = float(np.median(np.array(us[1]) / np.array(us[0])))
            cells = "  ".join(f"{i} {np.median(v):8.1f} us" for i, v in zip(isas, us, strict=True))
            print(f"{name} {n}x{k} rows {m:2d}: {cells}  paired ratio {ratio:.3f}", flush=True)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
