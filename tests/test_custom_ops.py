"""The native `npuchat.QMatMul` kernels: numbers against numpy, rows independent of each other,
the portable kernels too, and clear errors for inputs that do not fit."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from gguf.quants import dequantize
from onnx import TensorProto, helper, numpy_helper
from qmatmul_check import (
    K,
    N,
    blocks,
    reference,
    relative_errors,
    session,
    swiglu_extremes,
    weights,
)
from regroup_reference import reference_regroup
from synthetic import ggml_type

from npuchat.engine.custom_ops import DOMAIN, kernel_library, register_kernels
from npuchat.engine.errors import NpuchatError
from npuchat.engine.graph_native import pair_halves, regroup_rows
from npuchat.engine.kernel_build import HEADERS, SOURCE_DIR, SOURCES, build_kernels

if shutil.which("g++") is None or shutil.which("npm") is None:
    pytest.skip("building the kernels needs g++ and npm", allow_module_level=True)

# Activations are quantized by the documented rule on both sides; what remains is float
# summation order (int32 block sums are exact), ~1e-7 of the largest output.
TOLERANCE = 2e-6


@pytest.fixture(autouse=True)
def built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUCHAT_KERNELS", "on")  # also for the subprocess
    lib = kernel_library()
    assert lib.available, lib.reason  # this machine has both tools: the build must work


def test_every_type_matches_numpy() -> None:
    errors = relative_errors()
    assert all(e < TOLERANCE for e in errors.values()), errors


# Each kernel table and the CPU flags it needs (/proc/cpuinfo's names): every one this CPU has is
# tested, whichever the default is.
ISA_FLAGS = {
    "scalar": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avxvnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx512vnni": {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"},
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}


@functools.cache
def _check(isa: str) -> dict:
    env = dict(os.environ, NPUCHAT_KERNEL_ISA=isa, NPUCHAT_KERNELS="on")
    script = Path(__file__).parent / "qmatmul_check.py"
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa", list(ISA_FLAGS))
def test_every_kernel_table_the_cpu_has_matches_numpy(isa: str) -> None:
    """Each table in a fresh process (NPUCHAT_KERNEL_ISA): numbers against numpy, a row alone
    equal to the row among others; the VNNI tables give the AVX2 table's bits."""
    if not ISA_FLAGS[isa] <= _cpu_flags():
        pytest.skip(f"this CPU lacks {isa}")
    result = _check(isa)
    assert result["isa"] == isa
    assert all(e < TOLERANCE for e in result["errors"].values()), result["errors"]
    assert result["mismatches"] == []
    if isa in ("avxvnni", "avx512vnni"):
        assert result["digests"] == _check("avx2")["digests"]
    if isa == "scalar" and ISA_FLAGS["avx2"] <= _cpu_flags():  # one SwiGLU in every table
        assert result["digests"]["swiglu"] == _check("avx2")["digests"]["swiglu"]


def test_kernels_stay_close_to_the_float_product() -> None:
    """int8 activations cost about 1% (llama.cpp's own scheme), not more."""
    x = np.random.default_rng(2).standard_normal((3, K)).astype(np.float32)
    for name in ("q4_k", "q8_0"):
        qtype = ggml_type(name)
        raw = blocks(weights(), qtype)
        exact = x.astype(np.float64) @ dequantize(raw, qtype).reshape(N, K).T.astype(np.float64)
        y = session(raw, qtype, K).run(None, {"x": x})[0]
        assert np.abs(y - exact).max() / np.abs(exact).max() < 0.02


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0", "q5_0", "q4_1", "q4_0"])
def test_a_row_is_the_same_alone_and_among_others(name: str) -> None:
    qtype = ggml_type(name)
    raw = blocks(weights(), qtype)
    x = np.random.default_rng(3).standard_normal((16, K)).astype(np.float32)
    two, one = session(raw, qtype, K, threads=2), session(raw, qtype, K, threads=1)
    alone = [two.run(None, {"x": x[i : i + 1]})[0][0] for i in range(16)]
    for rows in (2, 3, 4, 5, 16):
        together = two.run(None, {"x": x[:rows]})[0]
        for i in range(rows):
            assert np.array_equal(together[i], alone[i]), (rows, i)
    assert np.array_equal(one.run(None, {"x": x})[0], two.run(None, {"x": x})[0])


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q8_0"])
@pytest.mark.parametrize("k", [256, 1024])  # short rows go four at a time, long ones alone
def test_one_row_equals_a_row_among_others_at_any_width(name: str, k: int) -> None:
    """A decode step's single row takes the one-row kernels; its numbers are those of the same row
    in a many-row call, for every output feature (75 of them: not a multiple of four)."""
    qtype = ggml_type(name)
    raw = blocks(weights(75, k, seed=7), qtype)
    x = np.random.default_rng(8).standard_normal((9, k)).astype(np.float32)
    y = session(raw, qtype, k, threads=1).run(None, {"x": x})[0]
    assert np.abs(y - reference(x, raw, qtype)).max() / np.abs(y).max() < TOLERANCE
    two = session(raw, qtype, k, threads=2)
    for i in range(9):
        assert np.array_equal(two.run(None, {"x": x[i : i + 1]})[0][0], y[i]), i


def test_leading_dimensions_and_the_scaled_rows() -> None:
    qtype = ggml_type("q4_k")
    raw = blocks(weights(), qtype)
    x = np.random.default_rng(4).standard_normal((2, 3, K)).astype(np.float32)
    y = session(raw, qtype, K, scale=0.125, scaled_rows=24).run(None, {"x": x})[0]
    assert y.shape == (2, 3, N)
    ref = reference(x.reshape(6, K), raw, qtype)
    ref[:, :24] *= 0.125
    assert np.abs(y.reshape(6, N) - ref).max() / np.abs(ref).max() < TOLERANCE


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q4_1"])
def test_a_matrix_split_into_many_tasks_gives_every_output(name: str) -> None:
    """A matrix big enough to be split into several tasks, their last one short: decode steps
    (up to eight rows) share it out in runs of an eighth of the matrix, prefill chunks in ~32 KiB
    tiles crossed by each group of eight rows (`run_tile`). Every output of the regrouped and of
    the regrouped, paired gate|up layout against numpy, at every row count, on two threads."""
    qtype = ggml_type(name)
    n, k = 528, 1024  # 528 rows (264 outputs with glu): no task size divides them
    raw = blocks(weights(n, k, seed=21), qtype)
    x = np.random.default_rng(22).standard_normal((19, k)).astype(np.float32)
    ref = reference(x, raw, qtype)
    grouped = session(regroup_rows(raw, qtype), qtype, k, threads=2, layout=1)
    glu = session(regroup_rows(pair_halves(raw), qtype), qtype, k, glu=1, layout=1, paired=1)
    gate, up = ref[:, : n // 2], ref[:, n // 2 :]
    swiglu = gate / (1 + np.exp(-gate)) * up
    for rows in (1, 3, 8, 9, 19):  # one decode row, a batch, a pass, two passes, a chunk
        y = grouped.run(None, {"x": x[:rows]})[0]
        assert np.abs(y - ref[:rows]).max() / np.abs(ref).max() < TOLERANCE, rows
        y = glu.run(None, {"x": x[:rows]})[0]
        assert np.abs(y - swiglu[:rows]).max() / np.abs(swiglu).max() < TOLERANCE, rows


@pytest.mark.parametrize("name", ["q4_k", "q5_0"])
def test_the_bias_and_the_fused_swiglu(name: str) -> None:
    """The op adds the bias and, with glu, gives silu(gate) * up of its gate|up rows: the
    numbers of the separate Add / Split / Sigmoid / Mul ops, a row alone as among others."""
    qtype = ggml_type(name)
    raw = blocks(weights(), qtype)
    bias = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    x = np.random.default_rng(6).standard_normal((9, K)).astype(np.float32)
    ref = reference(x, raw, qtype) + bias
    y = session(raw, qtype, K, bias=bias).run(None, {"x": x})[0]
    assert np.abs(y - ref).max() / np.abs(ref).max() < TOLERANCE
    glu = session(raw, qtype, K, bias=bias, glu=1)
    y = glu.run(None, {"x": x})[0]
    gate, up = ref[:, : N // 2], ref[:, N // 2 :]
    expected = gate / (1 + np.exp(-gate)) * up
    assert y.shape == (9, N // 2)
    assert np.abs(y - expected).max() / np.abs(expected).max() < TOLERANCE
    for i in range(9):
        assert np.array_equal(glu.run(None, {"x": x[i : i + 1]})[0][0], y[i])


def test_the_swiglu_at_extreme_gates() -> None:
    """silu(gate) * up where exp underflows, at zero and far past it: float64's numbers to
    ~1e-6 of each value (exactly 0 below exp's floor, where the true value is under 1e-36)."""
    y, expected = swiglu_extremes()
    assert np.all(np.isfinite(y))
    assert np.all(np.abs(y - expected) <= 2e-6 * np.abs(expected) + 1e-36), y - expected


def _normed_session(raw: np.ndarray, qtype: int, norm: np.ndarray, outputs: int = 2):
    """QMatMul reading RMSNorm(x + skip) * norm, with the sum as a second output."""
    node = helper.make_node(
        "QMatMul", ["x", "w", "", "skip", "norm"], ["y", "sum"][:outputs], domain=DOMAIN,
        ggml_type=int(qtype), N=raw.shape[0], K=K, scale=1.0, scaled_rows=0, epsilon=1e-5,
    )  # fmt: skip
    values = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "skip")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "sum")]
    inits = [numpy_helper.from_array(raw, "w"), numpy_helper.from_array(norm, "norm")]
    graph = helper.make_graph([node], "normed", values, outs[:outputs], inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    register_kernels(so, kernel_library())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", ["q4_1", "q6_k"])
def test_the_fused_residual_add_and_rms_norm(name: str) -> None:
    """With skip and norm inputs the op reads RMSNorm(x + skip) * norm and gives x + skip as
    its second output: numpy's numbers (the norm in float64), a row alone as among others."""
    qtype = ggml_type(name)
    raw = blocks(weights(), qtype)
    rng = np.random.default_rng(8)
    x, skip = (rng.standard_normal((9, K)).astype(np.float32) for _ in range(2))
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
    s = _normed_session(raw, qtype, norm)
    y, summed = s.run(None, {"x": x, "skip": skip})
    assert np.array_equal(summed, x + skip)
    h = (x + skip).astype(np.float64)
    normed = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * norm
    ref = reference(normed.astype(np.float32), raw, qtype)
    # a value a float ulp from a rounding edge may quantize one step apart: ~1e-4 of the output
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-3
    for i in range(9):
        alone = s.run(None, {"x": x[i : i + 1], "skip": skip[i : i + 1]})
        assert np.array_equal(alone[0][0], y[i]) and np.array_equal(alone[1][0], summed[i])
    with pytest.raises(Exception, match="norm must hold K = 512"):
        _normed_session(raw, qtype, norm[:-1]).run(None, {"x": x, "skip": skip})
    with pytest.raises(Exception, match="skip must have x's shape"):
        s.run(None, {"x": x, "skip": skip[:2]})


def test_inputs_that_do_not_fit_are_refused_with_a_reason() -> None:
    qtype = ggml_type("q8_0")
    raw = blocks(weights(), qtype)
    s = session(raw, qtype, K)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="last dimension"):
        s.run(None, {"x": np.zeros((1, K - 32), np.float32)})
    with pytest.raises(Exception, match="unsupported ggml_type 99"):
        session(raw, qtype, K, ggml_type=99)
    with pytest.raises(Exception, match="W must hold N rows"):
        session(raw[:, :-2].copy(), qtype, K).run(None, {"x": np.zeros((1, K), np.float32)})
    with pytest.raises(Exception, match="bias must hold N = 80"):
        short = np.zeros(N - 1, np.float32)
        session(raw, qtype, K, bias=short).run(None, {"x": np.zeros((1, K), np.float32)})
    with pytest.raises(Exception, match="glu needs an even N"):
        session(raw[:-1].copy(), qtype, K, N=N - 1, glu=1)
    with pytest.raises(Exception, match="glu must be 0 or 1"):
        session(raw, qtype, K, glu=2)
    q40 = ggml_type("q4_0")
    with pytest.raises(Exception, match=r"layout 1 .* needs Q4_K, Q6_K, Q8_0, Q5_0 or Q4_1"):
        session(blocks(weights(), q40), q40, K, layout=1)  # Q4_0 rows are never regrouped
    q4k = ggml_type("q4_k")
    grouped = regroup_rows(blocks(weights(), q4k), q4k)
    with pytest.raises(Exception, match=r"layout 1 .* needs Q4_K, Q6_K, Q8_0, Q5_0 or Q4_1 and N"):
        session(grouped, q4k, K, layout=1, N=N - 4)
    with pytest.raises(Exception, match="paired gate/up rows need glu"):
        session(raw, qtype, K, paired=1)
    with pytest.raises(Exception, match="W must hold N / 8 groups"):
        session(grouped[:-1].copy(), q4k, K, layout=1, N=N).run(
            None, {"x": np.zeros((1, K), np.float32)}
        )


def test_the_build_is_reused_and_a_machine_without_tools_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = kernel_library().path
    assert built is not None and build_kernels() == built  # same sources: no second build
    monkeypatch.setenv("NPUCHAT_KERNELS", "auto")
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler, no npm
    monkeypatch.delenv("CXX", raising=False)
    fallback = kernel_library(tmp_path / "fresh")
    assert not fallback.available and "no C++ compiler" in fallback.reason
    assert "MatMulNBits" in fallback.describe()
    monkeypatch.setenv("NPUCHAT_KERNELS", "on")
    with pytest.raises(NpuchatError, match="NPUCHAT_KERNELS=on but the kernels cannot be built"):
        kernel_library(tmp_path / "fresh")
    monkeypatch.setenv("NPUCHAT_KERNELS", "off")
    assert kernel_library().reason.startswith("NPUCHAT_KERNELS=off")
    monkeypatch.setenv("NPUCHAT_KERNELS", "fast")
    with pytest.raises(NpuchatError, match="is not one of: auto, off, on"):
        kernel_library()


def test_every_native_source_keys_the_build() -> None:
    """A file the build reads but does not hash would leave an old library in use after an
    edit (an edited header once did): every source and header in the folder is keyed."""
    on_disk = {p.name for p in SOURCE_DIR.iterdir() if p.suffix in (".cc", ".h")}
    assert on_disk == set(SOURCES) | set(HEADERS)


def test_a_damaged_library_in_the_cache_is_refused_not_loaded_or_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = kernel_library().path
    assert built is not None
    copy = tmp_path / "cache" / built.parent.name
    shutil.copytree(built.parent, copy)
    damaged = copy / built.name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    monkeypatch.setenv("NPUCHAT_KERNELS", "on")
    with pytest.raises(NpuchatError, match="is damaged"):
        kernel_library(tmp_path / "cache")
    monkeypatch.setenv("NPUCHAT_KERNELS", "auto")  # falls back, saying why
    lib = kernel_library(tmp_path / "cache")
    assert not lib.available and "is damaged" in lib.reason and str(copy) in lib.reason
    assert damaged.read_bytes() == bytes(data)  # left for the user to look at


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0", "q5_0", "q4_1"])
def test_the_library_regroups_rows_as_the_numpy_reference_does(name: str) -> None:
    """`npuchat_regroup` (what the graph build writes) against the layouts written with numpy:
    any bytes (random blocks, not just quantized ones), several groups and blocks."""
    qtype = ggml_type(name)
    row_bytes = blocks(weights(8, 512), qtype).shape[1]
    raw = np.random.default_rng(3).integers(0, 256, (40, row_bytes), dtype=np.uint8)
    assert np.array_equal(regroup_rows(raw, qtype), reference_regroup(raw, qtype))
    with pytest.raises(ValueError, match="cannot be regrouped in eights"):
        regroup_rows(raw[:12], qtype)
