"""`npuchat.QMatMul` against numpy: the weights dequantized by gguf-py (independent code), the
activations quantized per block by the rule the op documents (d = max|x| / 127, round half to
even), the product in float64. Importable by the tests; run as a script it checks every type in
a fresh process (`NPUCHAT_KERNEL_ISA=scalar`, `avx2`, ... there tests that table) and prints JSON:
the errors, the rows that differ alone and among others, and digests of the outputs (the VNNI
tables must give the AVX2 tables' bits)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from onnx import TensorProto, helper, numpy_helper
from synthetic import ggml_type, quantize_tensor

from npuchat.engine.custom_ops import DOMAIN, kernel_library, register_kernels
from npuchat.engine.graph_native import pair_halves, regroup_rows

TYPES = ["q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q6_k"]
REGROUPED = ("q4_k", "q6_k", "q8_0", "q5_0", "q4_1")  # the types whose rows may come in eights
N, K = 80, 512  # N is not a multiple of the op's task size


def weights(n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)


def blocks(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The GGUF bytes of `w`, one row of blocks per output feature."""
    return np.asarray(quantize_tensor(w, qtype)).view(np.uint8).reshape(w.shape[0], -1)


def quantized_activations(x: np.ndarray, block: int) -> np.ndarray:
    xb = x.reshape(x.shape[0], -1, block).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    safe = np.where(amax == 0, 1, amax).astype(np.float32)
    q = np.clip(np.rint(xb * (np.float32(127) / safe)), -127, 127)
    return (q * (safe / np.float32(127))).reshape(x.shape).astype(np.float64)


def reference(x: np.ndarray, raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    k = x.shape[-1]
    w = dequantize(raw, qtype).reshape(raw.shape[0], k).astype(np.float64)
    block = 256 if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K) else 32
    return quantized_activations(x, block) @ w.T


def session(
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    k: int,
    threads: int = 2,
    scale: float = 1.0,
    scaled_rows: int = 0,
    bias: np.ndarray | None = None,
    **overrides: int,
) -> ort.InferenceSession:
    n = raw.shape[0] * (8 if overrides.get("layout") else 1)  # regrouped: a row per eight
    attrs = {"ggml_type": int(qtype), "N": n, "K": k, **overrides}
    inputs, inits = ["x", "w"], [numpy_helper.from_array(raw, "w")]
    if bias is not None:
        inputs.append("bias")
        inits.append(numpy_helper.from_array(bias.astype(np.float32), "bias"))
    node = helper.make_node(
        "QMatMul", inputs, ["y"], domain=DOMAIN, scale=scale, scaled_rows=scaled_rows, **attrs
    )
    graph = helper.make_graph(
        [node],
        "qmatmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],  # any rank
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    register_kernels(so, kernel_library())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def relative_errors(rows: int = 5) -> dict[str, float]:
    """Per type: max |op - reference| / max |reference| over a few rows."""
    x = np.random.default_rng(1).standard_normal((rows, K)).astype(np.float32)
    out = {}
    for name in TYPES:
        qtype = ggml_type(name)
        raw = blocks(weights(), qtype)
        y = session(raw, qtype, K).run(None, {"x": x})[0]
        ref = reference(x, raw, qtype)
        out[name] = float(np.abs(y - ref).max() / np.abs(ref).max())
    return out


def rows_and_digests() -> tuple[list[str], dict[str, str]]:
    """Per type and width (short rows go four at a time in the one-row kernels, long ones alone):
    the cases where a row alone differs from the same row among nine, and a digest of the bytes."""
    mismatches, digests = [], {}
    for name in TYPES:
        qtype = ggml_type(name)
        for k in (256, 1024) if name in TYPES[:4] else (512, 1024):
            raw = blocks(weights(75, k, seed=7), qtype)
            x = np.random.default_rng(8).standard_normal((9, k)).astype(np.float32)
            op = session(raw, qtype, k, threads=1)
            many = op.run(None, {"x": x})[0]
            alone = np.stack([op.run(None, {"x": x[i : i + 1]})[0][0] for i in range(9)])
            mismatches += [
                f"{name} K={k} row {i}" for i in range(9) if not np.array_equal(alone[i], many[i])
            ]
            digests[f"{name}/{k}"] = hashlib.sha256(many.tobytes() + alone.tobytes()).hexdigest()
    digests["swiglu"] = hashlib.sha256(swiglu_extremes()[0].tobytes()).hexdigest()
    return mismatches, digests


GATES = [-300.0, -90.0, -87.0, -20.0, -1.5, -1e-3, -0.0, 0.0, 1e-3, 0.7, 20.0, 90.0, 300.0]


def swiglu_extremes() -> tuple[np.ndarray, np.ndarray]:
    """(the op's output, float64 silu(gate) * up) of a glu QMatMul whose bias puts the gates
    at `GATES` (both sides of exp's floor, zero, large) and up at 1.5 in every row."""
    n = 8 * (len(GATES) // 8 + 1)  # whole groups of eight, and a tail past the named gates
    gates = np.resize(np.array(GATES, np.float32), n)
    bias = np.concatenate([gates, np.full(n, 1.5, np.float32)])
    raw = blocks(weights(2 * n, 256, seed=13) * 1e-6, ggml_type("q8_0"))
    x = np.random.default_rng(14).standard_normal((3, 256)).astype(np.float32)
    y = session(raw, ggml_type("q8_0"), 256, bias=bias, glu=1).run(None, {"x": x})[0]
    z = reference(x, raw, ggml_type("q8_0")) + bias.astype(np.float64)
    gate, up = z[:, :n], z[:, n:]
    return y, gate / (1.0 + np.exp(-gate)) * up


def layout_mismatches() -> list[str]:
    """Rows as the graph builder may write them must give the numbers of the GGUF's rows at
    every row count: Q4_K, Q6_K, Q8_0, Q5_0 and Q4_1 regrouped eight at a time (`regroup_rows`,
    layout 1), and a SwiGLU's gate|up rows paired in eights (`pair_halves`, `paired`), for every
    type. The cases that differ."""
    mismatches = []
    cases = [(t, k, 0) for t in REGROUPED for k in (512, 1024)] + [(t, 512, 1) for t in TYPES]
    for name, k, glu in cases:
        qtype = ggml_type(name)
        raw = blocks(weights(96, k, seed=11), qtype)
        x = np.random.default_rng(12).standard_normal((11, k)).astype(np.float32)
        plain = session(raw, qtype, k, glu=glu)
        variants = {}
        if glu:
            variants["paired"] = session(pair_halves(raw), qtype, k, glu=1, paired=1)
        if name in REGROUPED:
            grouped = regroup_rows(raw, qtype)
            variants["regrouped"] = session(grouped, qtype, k, glu=glu, layout=1)
            if glu:
                both = regroup_rows(pair_halves(raw), qtype)
                variants["regrouped, paired"] = session(both, qtype, k, glu=1, layout=1, paired=1)
        for rows in (1, 2, 3, 4, 5, 6, 7, 9, 11):
            a = plain.run(None, {"x": x[:rows]})[0]
            for label, op in variants.items():
                if not np.array_equal(a, op.run(None, {"x": x[:rows]})[0]):
                    mismatches.append(f"{name} K={k} glu={glu}: {rows} rows {label}")
    return mismatches


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    lib = kernel_library()
    mismatches, digests = rows_and_digests()
    mismatches += layout_mismatches()
    result = {"isa": lib.isa, "errors": relative_errors(), "mismatches": mismatches}
    print(json.dumps({**result, "digests": digests}))
