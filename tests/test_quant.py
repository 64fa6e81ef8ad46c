"""GGUF blocks → MatMulNBits form: checked against gguf-py's own dequantizers (independent code)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from onnx import helper, numpy_helper
from synthetic import TENSOR_TYPES, ggml_type, quantize_tensor

from npuchat.engine.quant import (
    BLOCK,
    concat_rows,
    decode_tensor,
    dequantize_rows,
    pack_nbits,
)

Q = GGMLQuantizationType
N, K = 48, 512


def _weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of different magnitude so per-block scales differ widely.
    return (rng.standard_normal((N, K)) * rng.uniform(0.01, 2.0, (N, 1))).astype(np.float32)


def _encoded(type_name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    qtype = ggml_type(type_name)
    return np.asarray(quantize_tensor(_weights(), qtype)).view(np.uint8).reshape(-1), qtype


def _random_q5_k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random but valid Q5_K blocks (gguf-py has no Q5_K encoder): small positive d and dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // 256, 176), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-3, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


EXACT_TYPES = [t for t in TENSOR_TYPES if t != "q6_k"]


@pytest.mark.parametrize("type_name", EXACT_TYPES)
def test_decode_is_exact_for_fixture_types(type_name: str) -> None:
    raw, qtype = _encoded(type_name)
    m = decode_tensor(raw, qtype, N, K)
    ref = dequantize(raw.reshape(N, -1), qtype).reshape(N, K)
    np.testing.assert_array_equal(m.dequantize(), ref.astype(np.float32))


@pytest.mark.parametrize("qtype", [Q.Q5_1, Q.Q5_K])
def test_decode_is_exact_for_other_asymmetric_types(qtype: GGMLQuantizationType) -> None:
    if qtype == Q.Q5_K:
        raw = _random_q5_k(N, K)
    else:
        raw = np.asarray(quantize(_weights(), qtype)).view(np.uint8).reshape(-1)
    m = decode_tensor(raw, qtype, N, K)
    assert m.bits == 8 and m.mins is not None
    ref = dequantize(raw.reshape(N, -1), qtype).reshape(N, K).astype(np.float32)
    # Re-centring adds mid·scale to the offset in float32: one rounding step of |w|.
    np.testing.assert_allclose(m.dequantize(), ref, rtol=0, atol=4e-7 * np.abs(ref).max())


def test_q6_k_requantization_error_is_below_an_8_bit_step() -> None:
    raw, qtype = _encoded("q6_k")
    m = decode_tensor(raw, qtype, N, K)
    ref = dequantize(raw.reshape(N, -1), qtype).reshape(N, K // BLOCK, BLOCK)
    err = np.abs(m.dequantize().reshape(ref.shape) - ref)
    step = np.abs(ref).max(axis=2, keepdims=True) / 127.0  # symmetric int8 step per block
    assert (err <= step / 2 + 1e-7).all()
    assert err.max() > 0  # it is a requantization, not a copy


@pytest.mark.parametrize("type_name", ["q4_0", "q4_1", "q4_k", "q8_0", "q5_0"])
def test_pack_matches_matmulnbits_semantics(type_name: str) -> None:
    """ONNX Runtime's MatMulNBits on the packed tensors (+ offsets) equals x @ Wᵀ (float)."""
    raw, qtype = _encoded(type_name)
    m = decode_tensor(raw, qtype, N, K)
    nb = pack_nbits(m)
    node = helper.make_node(
        "MatMulNBits",
        ["x", "B", "S"],
        ["y"],
        domain="com.microsoft",
        K=K,
        N=N,
        bits=m.bits,
        block_size=BLOCK,
        accuracy_level=0,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", 1, [3, K])],
        [helper.make_tensor_value_info("y", 1, [3, N])],
        [numpy_helper.from_array(nb.b, "B"), numpy_helper.from_array(nb.scales, "S")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    if nb.mins is not None:
        y = y + x.reshape(3, K // BLOCK, BLOCK).sum(-1) @ nb.mins.T
    ref = dequantize(raw.reshape(N, -1), qtype).reshape(N, K).astype(np.float64)
    expect = x.astype(np.float64) @ ref.T
    np.testing.assert_allclose(y, expect, rtol=0, atol=1e-4 * np.abs(expect).max())


def test_rows_and_concat_keep_the_values() -> None:
    raw, qtype = _encoded("q4_k")
    m = decode_tensor(raw, qtype, N, K)
    perm = np.random.default_rng(2).permutation(N)
    np.testing.assert_array_equal(m.rows(perm).dequantize(), m.dequantize()[perm])
    both = concat_rows([m.rows(slice(0, 10)), m.rows(slice(10, N))])
    np.testing.assert_array_equal(both.dequantize(), m.dequantize())
    raw0, qtype0 = _encoded("q4_0")
    with pytest.raises(ValueError, match="one kind"):
        concat_rows([m, decode_tensor(raw0, qtype0, N, K)])


@pytest.mark.parametrize("type_name", ["q8_0", "q5_0", "q4_k", "f16"])
def test_host_embedding_rows(type_name: str) -> None:
    raw, qtype = _encoded(type_name)
    ids = np.array([5, 0, 47, 5])
    full = dequantize(raw.reshape(N, -1), qtype).reshape(N, K)
    np.testing.assert_array_equal(dequantize_rows(raw, qtype, K, ids), full[ids])
