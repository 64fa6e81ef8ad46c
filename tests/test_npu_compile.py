"""Compiling for the QNN HTP (simulator on x86): every graph and weight type placed wholly on
the NPU, a rejected op named in a one-line error, the HTP rewrite keeping the math, the
compile-once cache (reused, and rebuilt when damaged), binaries at their quantized size, doctor's
report, and device discovery.

Placement and the cache are checked here by what a user sees (files, errors, doctor's JSON);
whether the compiled graphs compute the CPU's numbers is `test_npu.py`.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from npu_driver import CAPACITY, MODELS, PREFILL, VERIFY_K, NpuDriver, random_prompt
from synthetic import TENSOR_TYPES

from npuchat.engine import devices
from npuchat.engine.errors import NpuchatError
from npuchat.engine.graph_builder import GraphSpec, build_graphs
from npuchat.engine.npu_adapt import adapt_for_htp
from npuchat.engine.npu_compile import (
    NPU_STEP_ROWS,
    PLACEMENT_FILE,
    compile_npu_graphs,
    explain_placement,
    npu_specs,
)
from npuchat.engine.npu_sizes import binary_sizes
from npuchat.engine.runtime import GraphCache, model_sha256

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not devices.npu_status().available, reason="no QNN HTP backend here"),
]


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_second_load_uses_the_compiled_binaries(synthetic_gguf, tmp_path: Path) -> None:
    path = synthetic_gguf("llama", "q8_0")
    first = NpuDriver(path, tmp_path)
    folder = first.graphs.folder
    assert first.cache.builds == 1 and first.graphs.compiled.compiled
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["step_ctx.onnx", "step_ctx_qnn.bin", "manifest.json", PLACEMENT_FILE])
    prompt = random_prompt(first.cfg.vocab_size, 9)
    expect = first.prefill(prompt)
    first.close()
    before = _mtimes(folder)

    second = NpuDriver(path, tmp_path)
    try:
        assert second.cache.builds == 0 and not second.graphs.compiled.compiled
        assert second.graphs.folder == folder and _mtimes(folder) == before
        np.testing.assert_array_equal(second.prefill(prompt), expect)  # same binary, same bits
    finally:
        second.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_binary_is_rebuilt(synthetic_gguf, tmp_path: Path, damage: str) -> None:
    """A flipped byte or a truncated binary is caught by the manifest."""
    path = synthetic_gguf("phi3", "q4_0")
    first = NpuDriver(path, tmp_path)
    folder = first.graphs.folder
    prompt = random_prompt(first.cfg.vocab_size, 7)
    expect = first.prefill(prompt)
    first.close()
    victim = folder / "step_ctx_qnn.bin"
    if damage == "flip":
        with open(victim, "r+b") as f:
            f.seek(victim.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert not GraphCache(tmp_path).verify(folder.name)

    second = NpuDriver(path, tmp_path)
    try:
        assert second.cache.builds == 1 and second.graphs.compiled.compiled
        assert GraphCache(tmp_path).verify(folder.name)
        np.testing.assert_allclose(second.prefill(prompt), expect, rtol=0, atol=1e-3)
    finally:
        second.close()


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_every_weight_type_compiles_fully(
    synthetic_gguf,
    tmp_path: Path,
    tensor_type: str,
) -> None:
    """Every GGUF weight type the engine reads lands on the HTP (qwen2: with QKV bias)."""
    path = synthetic_gguf("qwen2", tensor_type, n_layers=1)
    compiled = compile_npu_graphs(
        path,
        model_sha256(path, tmp_path),
        npu_specs(1, 0, 32, 0),  # a one-row graph
        GraphCache(tmp_path),
        devices.QnnOptions(),
    )
    assert list(compiled.placements) == ["step"]
    assert compiled.placements["step"].complete


def test_rejected_op_is_an_error_naming_the_node(synthetic_gguf, tmp_path: Path) -> None:
    """With CPU fallback disabled an op the HTP rejects fails the compile, by name and reason,
    and leaves nothing in the cache; the doctor's explanation lists every such node.

    The CPU graph's fused `SkipSimplifiedLayerNormalization` is such an op (QNN rejects it).
    """
    path = synthetic_gguf("llama", "q8_0")
    specs = {"step": GraphSpec(1, CAPACITY, 1, 0, fused_norms=True)}
    opts = devices.QnnOptions()
    cache = GraphCache(tmp_path)
    pattern = r"cannot run on the NPU: SkipSimplifiedLayerNormalization_\d+ \(SkipSimpl.*not supp"
    with pytest.raises(NpuchatError, match=pattern):
        compile_npu_graphs(path, model_sha256(path, tmp_path), specs, cache, opts)
    assert cache.builds == 0 and not any(cache.root.iterdir())
    placement = explain_placement(path, specs, opts)["step"]
    assert not placement.complete
    assert {f.op_type for f in placement.fallbacks} == {"SkipSimplifiedLayerNormalization"}
    assert len(placement.fallbacks) == 4  # 2 layers x 2 residual adds
    assert all("not supported by QNN EP" in f.reason for f in placement.fallbacks)
    assert placement.npu_nodes + len(placement.fallbacks) == placement.total_nodes


def test_htp_rewrite_keeps_the_math(synthetic_gguf, tmp_path: Path) -> None:
    """`adapt_for_htp` (3-D MatMulNBits, bias as Add) computes the same thing on the CPU EP."""
    path = synthetic_gguf("qwen2", "q4_1")  # bias and block offsets: every rewritten form
    spec = npu_specs(PREFILL, VERIFY_K, CAPACITY, 0)["step"]
    src = build_graphs(path, {"g": spec}, tmp_path)["g"]
    model = onnx.load(str(src), load_external_data=False)
    adapted = adapt_for_htp(onnx.load(str(src), load_external_data=False))
    for node in adapted.graph.node:
        if node.op_type == "MatMulNBits":
            assert len(node.input) <= 5, "bias must have moved to an Add"
    assert sum(n.op_type == "MatMulNBits" for n in adapted.graph.node) == sum(
        n.op_type == "MatMulNBits" for n in model.graph.node
    )
    out = tmp_path / "adapted.onnx"
    onnx.save_model(adapted, str(out))
    rng = np.random.default_rng(0)
    sess = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (src, out)]
    feeds = {}
    for i in sess[0].get_inputs():
        if i.name == "logit_rows":
            feeds[i.name] = np.arange(PREFILL - VERIFY_K - 1, PREFILL, dtype=np.int64)
        elif i.name == "mask":
            feeds[i.name] = np.zeros(i.shape, np.float32)
        else:
            feeds[i.name] = rng.standard_normal(i.shape).astype(np.float32)
    a, b = (s.run(None, feeds) for s in sess)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_device_discovery_and_auto() -> None:
    status = devices.npu_status()
    eps = {d.ep_name for d in devices.list_ep_devices()}
    assert {"CPUExecutionProvider", devices.QNN_EP} <= eps
    pkg, qairt = devices.qnn_versions()
    assert pkg and qairt.count(".") >= 1
    assert devices.resolve_device("cpu")[0] == "cpu"
    assert devices.resolve_device("npu")[0] == "npu"
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert status.simulated
        device, note = devices.resolve_device("auto")
        assert device == "cpu" and "simulator" in note
    with pytest.raises(NpuchatError, match="unknown device"):
        devices.resolve_device("gpu")
    opts = devices.QnnOptions(soc_model=0, htp_arch=75).provider_options()
    assert "soc_model" not in opts and opts["htp_arch"] == "75"


def test_placement_file_is_json(synthetic_gguf, tmp_path: Path) -> None:
    npu = NpuDriver(synthetic_gguf("qwen2", "q4_1"), tmp_path, verify_k=0)
    try:
        record = json.loads((npu.graphs.folder / PLACEMENT_FILE).read_text())
        assert set(record) == {"step"}
        assert all(r["npu_nodes"] == r["total_nodes"] for r in record.values())
    finally:
        npu.close()


def test_doctor_reports_full_npu_placement_for_every_arch(
    synthetic_gguf,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`npuchat doctor --model X --device npu`: the app's step graph (2 KV slots, 16 rows) of
    every arch 100% on the NPU, compiled on the first call and loaded from the cache on the
    second; the byte counts it prints are the binary on disk and gguf's own tensor table."""
    from npuchat.app.cli import main

    paths = {}
    for arch, (tensor_type, kw) in MODELS.items():
        paths[arch] = synthetic_gguf(arch, tensor_type, context_length=256, **kw)
        assert main(["import", str(paths[arch]), "--name", f"syn-{arch}"]) == 0
    capsys.readouterr()
    for arch in MODELS:
        for expected in ("compiled now", "from the cache"):
            assert main(["doctor", "--model", f"syn-{arch}", "--device", "npu", "--json"]) == 0
            report = json.loads(capsys.readouterr().out)
            model = report["model"]
            assert model["arch"] == arch and model["ok"] and model["binaries"] == expected
            assert [g["graph"] for g in model["graphs"]] == ["step"]
            assert [(g["batch"], g["seq_len"]) for g in model["graphs"]] == [(2, 16)]
            for g in model["graphs"]:
                assert g["npu_percent"] == 100.0 and g["nodes"] == g["npu_nodes"] > 50
                assert g["capacity"] == 256 and not g["fallbacks"]
            _check_sizes(model, paths[arch])
    machine = report["machine"]
    assert machine["versions"]["qairt"] == devices.qnn_versions()[1]
    assert {d["ep_name"] for d in machine["devices"]} >= {devices.QNN_EP}


def _check_sizes(model: dict[str, Any], gguf_path: Path) -> None:
    """Doctor's byte counts are the context binaries on disk and gguf's own tensor table."""
    import gguf

    on_disk = {p.name: p.stat().st_size for p in Path(model["folder"]).glob("*.bin")}
    tensors = sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors)
    sizes = model["sizes"]
    assert sizes["binaries"] == on_disk and sizes["binary_bytes"] == sum(on_disk.values())
    assert len(on_disk) == len(model["graphs"]) and sizes["tensor_bytes"] == tensors
    assert sizes["ratio"] == round(sum(on_disk.values()) / tensors, 3)


def test_doctor_without_a_model_lists_the_machine(capsys: pytest.CaptureFixture[str]) -> None:
    from npuchat.app.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for text in ("onnxruntime-qnn", "qairt", devices.QNN_EP, "--device auto"):
        assert text in out
    assert devices.npu_status().kind in out


def test_whole_graph_set_is_one_copy_of_the_quantized_weights(
    synthetic_gguf, tmp_path: Path
) -> None:
    """The graph set the app compiles (16 rows, 2 KV slots, verify k = 4) is one context binary
    holding the GGUF's matrices at ~their quantized size (an fp16 expansion would be 3.6x for
    q4_0), so the whole set is within 1.15x the GGUF's tensor bytes (a binary per step shape
    was ~3x). The model is large enough (d 512, ffn 1,536) that the matrices, not the graph's
    fixed ~150 KB, dominate. The token embedding is not in the binary: the host gathers
    embedding rows (the head is untied)."""
    import gguf

    path = synthetic_gguf(
        "llama", "q4_0", n_layers=2, d_model=512, ffn_dim=1536, tied_embeddings=False
    )
    cache = GraphCache(tmp_path)
    specs = npu_specs(NPU_STEP_ROWS, 4, CAPACITY, 0, batch_max=2)
    compiled = compile_npu_graphs(
        path, model_sha256(path, tmp_path), specs, cache, devices.QnnOptions()
    )
    assert compiled.placements["step"].complete
    reader = gguf.GGUFReader(path)
    matrices = sum(
        int(t.n_bytes)
        for t in reader.tensors
        if len(t.shape) == 2 and t.name != "token_embd.weight"
    )
    sizes = binary_sizes(compiled.folder, path)
    assert list(sizes.binaries) == ["step_ctx_qnn.bin"]
    assert 0.95 < sizes.binary_bytes / matrices < 1.25, (sizes, matrices)
    assert sizes.tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert sizes.ratio <= 1.15, sizes
