"""CPU graphs on the native kernels (`NPUCHAT_KERNELS=on`): the GGUF's blocks reach QMatMul
unchanged, the logits agree with the numpy reference forward pass, and exactness comes for free
(verify rows equal decode steps bit for bit; a row batched equals it alone)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from reference_forward import ReferenceModel

from npuchat.engine.model import Model

if shutil.which("g++") is None or shutil.which("npm") is None:
    pytest.skip("building the kernels needs g++ and npm", allow_module_level=True)

# Mixed types in one layer (as Q4_K_M files have: Q6_K V/down/head beside Q4_K), llama's permuted
ISAS = ("avx512vnni", "avxvnni", "avx2", "scalar")  # the kernel tables (npuchat_kernel_isa)

# Q/K rows with a tied Q8_0 head, a fused Q|K|V (phi3), and an F16 matrix the kernels do not cover.
CASES = {
    "qwen2-q4_k_m": (
        "qwen2",
        {"default": "q4_k", "attn_v": "q6_k", "ffn_down": "q6_k", "output": "q6_k"},
    ),
    "llama-q4_1": ("llama", {"default": "q4_1", "token_embd": "q8_0"}),
    "phi3-q5_0": ("phi3", {"default": "q5_0", "ffn_down": "f16"}),
    "qwen3-q4_0": ("qwen3", "q4_0"),
    "gemma3-q8_0": ("gemma3", "q8_0"),  # sliding-window layers on rings of their own size
}


def _ids(vocab: int, n: int, seed: int = 5) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _ops(model: Model) -> Counter[str]:
    graph = onnx.load(str(model.graph_dir / "decoder.onnx"), load_external_data=False)
    return Counter(n.op_type for n in graph.graph.node)


def _regrouped(model: Model) -> int:
    """QMatMul nodes that read rows regrouped in eights (`layout` 1)."""
    graph = onnx.load(str(model.graph_dir / "decoder.onnx"), load_external_data=False)
    return sum(
        1
        for n in graph.graph.node
        if n.op_type == "QMatMul" and any(a.name == "layout" and a.i in (1, 2) for a in n.attribute)
    )


@pytest.fixture(autouse=True)
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUCHAT_KERNELS", "on")


@pytest.mark.parametrize("case", list(CASES))
def test_native_graph_matches_the_reference(synthetic_gguf, tmp_path: Path, case: str) -> None:
    arch, types = CASES[case]
    path = synthetic_gguf(arch, types)
    ref = ReferenceModel(path)
    ids = _ids(ref.config.vocab_size, 40)
    expect = ref.logits(ids)
    with Model.load(path, cache_dir=tmp_path, prefill_chunk=16, capacities=[64]) as m:
        ops = _ops(m)
        assert ops["QMatMul"] > 0 and any(f"({isa})" in m.kernels for isa in ISAS)
        assert ops["Sigmoid"] == 0  # gate|up share a block type: the op computes SwiGLU
        # attention reads the float32 cache in place (no Softmax, no attention MatMuls), fused
        # with its rotary, head norms and cache writes (`npuchat.RopeAttention`)
        assert ops["RopeAttention"] == m.config.n_layers and ops["Softmax"] == 0
        assert ops["RotaryEmbedding"] == ops["Attention"] == 0
        # rows are regrouped eight at a time for the eight-row kernels (numbers checked
        # against the reference below); Q4_0 rows stay as in the GGUF
        assert (_regrouped(m) > 0) == (case != "qwen3-q4_0")
        if case == "phi3-q5_0":
            assert ops["MatMulNBits"] == 0 and ops["MatMul"] == m.config.n_layers  # f16 down
        else:
            assert ops["MatMulNBits"] == 0 and ops["Gemm"] == 0  # no offset Gemms either
        last = m.prefill(ids[:32])
        rows = [last] + [m.decode(t) for t in ids[32:40]]
    for got, want in zip(rows, expect[31:40], strict=True):
        # int8 activations (per 32 or 256 values) against float math: the int8 path's bound
        assert np.abs(got - want).max() <= 4e-2 * np.abs(want).max()
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > 4e-2 * np.abs(want).max():  # not a near tie
            assert int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize("case", ["qwen2-q4_k_m", "llama-q4_1", "phi3-q5_0", "gemma3-q8_0"])
def test_verify_equals_decode_and_batched_equals_alone_bit_for_bit(
    synthetic_gguf, tmp_path: Path, case: str
) -> None:
    arch, types = CASES[case]
    path = synthetic_gguf(arch, types)
    with Model.load(
        path, cache_dir=tmp_path, prefill_chunk=16, verify_k=4, capacities=[64], batch_max=2
    ) as m:
        m.exact_decode = False  # no row padding: the kernels need none
        ids = _ids(m.config.vocab_size, 30)
        m.prefill(ids[:20])
        rows = m.verify(ids[20:25])
        m.rollback(20)
        for j, t in enumerate(ids[20:25]):
            assert np.array_equal(m.decode(t), rows[j]), j
        alone = m.decode(ids[25])
        m.rollback(0, row=1)
        m.prefill(ids[:25], row=1)  # the same sequence in the second slot
        m.rollback(25, row=0)
        both = m.decode_batch([ids[25], ids[25]], first_row=0)
        assert np.array_equal(both[0], alone) and np.array_equal(both[1], alone)


@pytest.mark.parametrize("case", ["qwen2-q4_k_m", "llama-q4_1"])
def test_norms_fused_into_the_matmuls_change_no_bit(
    synthetic_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """QMatMul applies each residual add + RMSNorm itself (the norm ops leave the graph) with
    the bits of ONNX Runtime's SkipSimplifiedLayerNormalization: the logits of a prefill and of
    decode steps equal those of the graph that keeps the norm ops (qwen2: Q|K and V are two
    groups, the second reading the first one's sum)."""
    from npuchat.engine import graph_builder

    arch, types = CASES[case]
    path = synthetic_gguf(arch, types)
    ids = _ids(256, 24)
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(graph_builder, "fuses_norm", lambda lins: False)
            monkeypatch.setattr(graph_builder, "glu_fuses", lambda gate_up, act: False)
        with Model.load(path, cache_dir=tmp_path / str(fused), prefill_chunk=16) as m:
            norms = _ops(m)["SkipSimplifiedLayerNormalization"]
            assert norms == (0 if fused else 2 * m.config.n_layers)
            runs[fused] = [m.prefill(ids[:20])] + [m.decode(t) for t in ids[20:]]
    for a, b in zip(runs[True], runs[False], strict=True):
        assert np.array_equal(a, b)


def test_off_keeps_matmulnbits(synthetic_gguf, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NPUCHAT_KERNELS", "off")
    path = synthetic_gguf("qwen2", "q4_k")
    with Model.load(path, cache_dir=tmp_path, prefill_chunk=16, capacities=[64]) as m:
        assert _ops(m)["QMatMul"] == _ops(m)["Attention"] == 0 and _ops(m)["MatMulNBits"] > 0
        assert "MatMulNBits" in m.kernels and "NPUCHAT_KERNELS=off" in m.kernels


def test_doctor_says_which_kernels_a_cpu_model_runs(
    synthetic_gguf, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from npuchat.app.cli import main

    path = synthetic_gguf("llama", "q4_0", context_length=256)
    assert main(["import", str(path), "--name", "syn-native"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--model", "syn-native", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machine"]["cpu_kernels"].startswith("npuchat GGUF-block kernels")
    assert report["machine"]["cpu_kv_cache"] == "f16 (kv_dtype = auto)"  # the default
    (graph,) = report["model"]["graphs"]
    assert graph["ops"]["QMatMul"] >= 7 and "MatMulNBits" not in graph["ops"]
    monkeypatch.setenv("NPUCHAT_KERNELS", "off")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "MatMulNBits (NPUCHAT_KERNELS=off" in out and "f32 (kv_dtype = auto)" in out
