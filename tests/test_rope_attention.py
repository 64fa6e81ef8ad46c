"""`npuchat.RopeAttention`: one op for a layer's rotary, cache writes and attention, with the
separate ops' results bit for bit, and a clear error for indices a graph could feed it wrong."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from npuchat.engine.custom_ops import DOMAIN, kernels_for, register_kernels
from npuchat.engine.graph_inputs import GraphSpec
from npuchat.engine.model import Model

if shutil.which("g++") is None or shutil.which("npm") is None:
    pytest.skip("building the kernels needs g++ and npm", allow_module_level=True)

CASES = {  # qwen3 and gemma3: Q/K head norms; gemma3: sliding-window layers on rings
    "qwen2-q4_k_m": ("qwen2", {"default": "q4_k", "attn_v": "q6_k", "output": "q6_k"}),
    "llama-q4_1": ("llama", {"default": "q4_1", "token_embd": "q8_0"}),
    "phi3-q5_0": ("phi3", "q5_0"),
    "qwen3-q4_0": ("qwen3", "q4_0"),
    "gemma3-q8_0": ("gemma3", "q8_0"),
}


@pytest.fixture(autouse=True)
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUCHAT_KERNELS", "on")


def _ops(model: Model) -> Counter[str]:
    graph = onnx.load(str(model.graph_dir / "decoder.onnx"), load_external_data=False)
    return Counter(n.op_type for n in graph.graph.node)


def _steps(m: Model, ids: list[int]) -> list[np.ndarray]:
    """A chunked prefill, decode steps, a verify, and a two-row batched decode step."""
    m.exact_decode = False
    out = [m.prefill(ids[:21])] + [m.decode(t) for t in ids[21:24]]
    out += list(m.verify(ids[24:28]))
    m.rollback(0, row=1)
    m.prefill(ids[:9], row=1)
    out += list(m.decode_batch([ids[28], ids[9]], first_row=0))
    return out


@pytest.mark.parametrize(
    ("case", "kv_dtype"),
    [(c, "f32") for c in CASES] + [("qwen2-q4_k_m", "f16"), ("gemma3-q8_0", "f16")],
)
def test_the_fused_op_changes_no_bit(
    synthetic_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, kv_dtype: str
) -> None:
    """f16: the fused op rounds new rows as the graph's Cast does and widens them exactly."""
    arch, types = CASES[case]
    path = synthetic_gguf(arch, types)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 256, 30)]
    runs = {}
    cpu = GraphSpec.cpu
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(
                GraphSpec,
                "cpu",
                classmethod(lambda cls, *a, **k: replace(cpu(*a, **k), fused_attention=False)),
            )
        with Model.load(
            path,
            cache_dir=tmp_path / str(fused),
            prefill_chunk=8,
            verify_k=4,
            batch_max=2,
            kv_dtype=kv_dtype,
        ) as m:
            ops = _ops(m)
            n = m.config.n_layers
            name = "RopeAttentionF16" if kv_dtype == "f16" else "RopeAttention"
            assert ops[name] == (n if fused else 0) and ops["Attention"] == n - ops[name]
            assert ops["RotaryEmbedding"] == (0 if fused else 2 * n)
            assert ops["ScatterND"] == (0 if fused else 2 * n)
            runs[fused] = _steps(m, ids)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert np.array_equal(a, b)


def _session(half: bool = False) -> ort.InferenceSession:
    """The op alone: H 2, Hkv 1, dh 4, B 1, S 2, C 4; no row selection; `half`: an f16 cache."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = TensorProto.FLOAT16 if half else f32
    inputs = [
        helper.make_tensor_value_info("qkv", f32, [2, 16]),
        helper.make_tensor_value_info("cos", f32, [1, 2, 2]),
        helper.make_tensor_value_info("sin", f32, [1, 2, 2]),
        helper.make_tensor_value_info("slots", i64, [1, 1, 2, 3]),
        helper.make_tensor_value_info("past_k", kv, [1, 1, 4, 4]),
        helper.make_tensor_value_info("past_v", kv, [1, 1, 4, 4]),
        helper.make_tensor_value_info("mask", f32, [1, 1, 2, 4]),
    ]
    outputs = [
        helper.make_tensor_value_info(n, t, None) for n, t in (("y", f32), ("k", kv), ("v", kv))
    ]
    node = helper.make_node(
        "RopeAttentionF16" if half else "RopeAttention",
        [i.name for i in inputs],
        ["y", "k", "v"],
        domain=DOMAIN,
        num_heads=2,
        kv_heads=1,
    )
    graph = helper.make_graph([node], "op", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)]
    )
    so = ort.SessionOptions()
    register_kernels(so, kernels_for(4))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(slot: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    angles = np.array([[[0.0, 0.0], [0.5, 0.25]]], np.float32)
    mask = np.array([[[[0, -np.inf, -np.inf, -np.inf], [0, 0, -np.inf, -np.inf]]]], np.float32)
    return {
        "qkv": rng.standard_normal((2, 16)).astype(np.float32),
        "cos": np.cos(angles),
        "sin": np.sin(angles),
        "slots": np.array([[[[0, 0, 0], [0, 0, slot]]]], np.int64),
        "past_k": np.zeros((1, 1, 4, 4), np.float32),
        "past_v": np.zeros((1, 1, 4, 4), np.float32),
        "mask": mask,
    }


def _rope(row: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    a, b = row[:2], row[2:]
    return np.concatenate([a * c - b * s, a * s + b * c])


def _check_attention(y: np.ndarray, feeds: dict[str, np.ndarray], keys, values) -> None:
    """y's rows against numpy attention of the rotated queries over `keys` / `values`."""
    x, c, s = feeds["qkv"], feeds["cos"][0], feeds["sin"][0]
    for t in range(2):
        for head in range(2):
            q = _rope(x[t, 4 * head : 4 * head + 4], c[t], s[t])
            scores = keys[: t + 1] @ q
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ values[: t + 1]
            np.testing.assert_allclose(y[t, 4 * head : 4 * head + 4], want, rtol=1e-5)


def test_the_op_alone_against_numpy() -> None:
    feeds = _feeds(1)
    y, k, v = _session().run(None, feeds)
    x, c, s = feeds["qkv"], feeds["cos"][0], feeds["sin"][0]
    keys = np.stack([_rope(x[t, 8:12], c[t], s[t]) for t in range(2)])
    values = x[:, 12:16]
    np.testing.assert_allclose(k[0, 0, :2], keys, rtol=1e-6)
    np.testing.assert_array_equal(v[0, 0, :2], values)
    _check_attention(y, feeds, keys, values)


def test_the_f16_cache_holds_rows_rounded_as_numpy_rounds_them() -> None:
    """New V rows at every magnitude a half meets (subnormal, ties, overflow, -0) are stored as
    numpy's astype(float16) stores them, K rows as the f32 op's rounded, the other slots are
    kept, and attention reads the stored halves."""
    feeds = _feeds(1)
    x = feeds["qkv"]
    x[0, 12:16] = [3e-8, -6.1e-5, 65520.0, -0.0]  # subnormal, near 2^-14, a tie up to inf
    x[1, 12:16] = [1e5, 2.0**-25, 1.0 + 2.0**-11, -(2.0**-24) * 1.5]  # inf, ties to even
    x[1, 8:12] *= 1e-6  # a K row of subnormal halves once rotated
    old = np.random.default_rng(1).standard_normal((1, 1, 4, 4)).astype(np.float16)
    _, k16, v16 = _session(half=True).run(None, dict(feeds, past_k=old, past_v=old))
    assert k16.dtype == np.float16 and v16.dtype == np.float16
    want_v = old.copy()
    with np.errstate(over="ignore"):
        want_v[0, 0, :2] = x[:, 12:16].astype(np.float16)
    assert np.array_equal(v16.view(np.uint16), want_v.view(np.uint16))
    assert np.isinf(v16[0, 0, 0, 2]) and np.signbit(v16[0, 0, 0, 3]) and v16[0, 0, 1, 1] == 0
    _, k32, _ = _session().run(None, dict(feeds, past_k=old.astype(np.float32)))
    assert np.array_equal(k16.view(np.uint16), k32.astype(np.float16).view(np.uint16))
    assert np.any((k16[0, 0, 1] != 0) & (np.abs(k16[0, 0, 1]) < 2.0**-14)), "no subnormal K"

    finite = _feeds(1)  # attention over the halves: subnormal V rows, no inf
    finite["qkv"][:, 12:16] *= 1e-6
    y16, k16, v16 = _session(half=True).run(None, dict(finite, past_k=old, past_v=old))
    keys, values = k16[0, 0, :2].astype(np.float32), v16[0, 0, :2].astype(np.float32)
    assert not np.array_equal(values, finite["qkv"][:, 12:16]), "the rows were not rounded"
    _check_attention(y16, finite, keys, values)


def test_the_portable_kernels_round_and_widen_halves_the_same() -> None:
    """Without F16C (the scalar kernels) halves are widened in integers: the same checks hold."""
    script = (
        "import sys; sys.path.insert(0, 'tests'); import test_rope_attention as t;"
        "from npuchat.engine.custom_ops import kernel_library;"
        "assert kernel_library().isa == 'scalar';"
        "t.test_the_f16_cache_holds_rows_rounded_as_numpy_rounds_them(); print('checked')"
    )
    env = dict(os.environ, NPUCHAT_KERNEL_ISA="scalar")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "checked" in proc.stdout, proc.stderr[-2000:]


def test_a_slot_outside_the_cache_is_an_error_not_a_write() -> None:
    with pytest.raises(Exception, match="slot index lies outside the cache"):
        _session().run(None, _feeds(4))
