"""The NPU device on the QNN HTP simulator: placement, numerics, compile-once cache, devices.

Everything runs on the x86 wheel's HTP *simulator* (exact but ~50–100× slower than the CPU EP),
so the models are tiny (synthetic, 2–4 layers, d 64) and the runs short (prefill + 20 greedy
decode steps). The CPU EP with float activations (`accuracy_level=0`) is the reference: same
weights, float32 math; the graph builder itself is checked against the numpy reference
forward elsewhere (test_graphs.py), so a difference here is the NPU path's own.

Tolerance: the HTP computes the float graph in fp16 (`enable_htp_fp16_precision=1`; unit
roundoff u = 2⁻¹¹ ≈ 4.9e-4). A 2–4 layer decoder passes each activation through ~10 rounded
stages per layer (norm, matmuls, rotary, softmax, residual adds), so relative errors of a few
u per stage compound to ~1e-3 of the logit scale: measured 1.5e-3 to 4.3e-3 (max |Δ| / max
|logit|) across llama/qwen2/phi3 and q8_0/q4_0/q4_1/q4_k/f16. The bound is 1.5e-2 of the logit
scale — ~3× the worst measured, ~30 u — while a real defect (a wrong row, position or mask)
moves logits by O(10%) or more; `test_greedy_matches_cpu` checks that the bound does reject
the logits of a neighbouring step.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from synthetic import TENSOR_TYPES

from npuchat.engine import devices
from npuchat.engine.errors import NpuchatError
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.graph_builder import GraphSpec, build_graphs, rope_tables
from npuchat.engine.kvcache import KVCache
from npuchat.engine.model import Model
from npuchat.engine.npu_compile import (
    PLACEMENT_FILE,
    adapt_for_htp,
    compile_npu_graphs,
    explain_placement,
    npu_specs,
)
from npuchat.engine.npu_graphs import NpuGraphs
from npuchat.engine.npu_sizes import binary_sizes
from npuchat.engine.quant import dequantize_rows
from npuchat.engine.runtime import GraphCache, model_sha256

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not devices.npu_status().available, reason="no QNN HTP backend here"),
]

CAPACITY = 64
PREFILL = 16
VERIFY_K = 3
DECODE_STEPS = 20
REL_TOL = 1.5e-2
# One weight format per arch, each on a different MatMulNBits path: 8-bit symmetric (llama),
# 4-bit with block offsets and QKV bias (qwen2, the Gemm correction and the bias Add), 4-bit
# symmetric with fused qkv / gate_up (phi3, 4 layers); qwen3 adds the per-head Q/K norms, and
# gemma3 the post norms, GELU, the embedding scale and sliding layers with their own mask and
# rotary tables (window 8, crossed by the greedy run).
MODELS = {
    "llama": ("q8_0", {}),
    "qwen2": ("q4_1", {}),
    "phi3": ("q4_0", {"n_layers": 4}),
    "qwen3": ("q8_0", {}),
    "gemma3": ("q4_0", {}),
}


class NpuDriver:
    """Prefill and greedy decode over `NpuGraphs`, the way `Model` drives its graphs."""

    def __init__(
        self, path: Path, cache_dir: Path, verify_k: int = VERIFY_K, single_graph: bool = False
    ) -> None:
        self.gguf = GGUFFile(path)
        self.cfg = cfg = self.gguf.config
        self.cache = GraphCache(cache_dir)
        self.graphs = NpuGraphs.load(
            path,
            cfg,
            model_sha256(path, cache_dir),
            self.cache,
            prefill_chunk=PREFILL,
            verify_k=verify_k,
            capacity=CAPACITY,
            accuracy_level=0,
            single_graph=single_graph,
        )
        self.kv = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, [CAPACITY])
        self.cos, self.sin = rope_tables(cfg, np.arange(CAPACITY))
        self.cos_swa, self.sin_swa = rope_tables(cfg, np.arange(CAPACITY), local=True)
        self._emb: np.ndarray | None = self.gguf.raw("token_embd.weight")
        self._emb_type = self.gguf.tensors["token_embd.weight"].ggml_type

    def close(self) -> None:
        self._emb = None  # the view pins the mapping
        self.gguf.close()

    def step(self, ids: list[int], all_rows: bool = False) -> np.ndarray:
        assert self._emb is not None, "closed"
        n, s = self.kv.n, len(ids)
        emb = dequantize_rows(
            self._emb, self._emb_type, self.cfg.d_model, np.asarray(ids, dtype=np.int64)
        )
        rows = slice(n, n + s)
        local = (self.cos_swa[rows], self.sin_swa[rows])
        out = self.graphs.step(
            emb, self.cos[rows], self.sin[rows], self.kv, all_rows=all_rows, local=local
        )
        self.kv.n = n + s
        return out

    def prefill(self, ids: list[int]) -> np.ndarray:
        for start in range(0, len(ids), PREFILL):
            logits = self.step(ids[start : start + PREFILL])
        return logits[0]


def _prompt(vocab: int, n: int, seed: int = 5) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _greedy(
    prefill: Callable[[list[int]], np.ndarray],
    decode: Callable[[int], np.ndarray],
    prompt: list[int],
    steps: int,
) -> tuple[list[int], np.ndarray]:
    rows = [prefill(prompt)]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(decode(tokens[-1]))
    return tokens, np.stack(rows)


def _cpu_greedy(
    path: Path, cache: Path, prompt: list[int], steps: int = DECODE_STEPS
) -> tuple[list[int], np.ndarray]:
    with Model.load(
        path, cache_dir=cache, prefill_chunk=PREFILL, capacities=[CAPACITY], accuracy_level=0
    ) as m:
        return _greedy(m.prefill, m.decode, prompt, steps)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_matches_cpu(synthetic_gguf, tmp_path: Path, arch: str) -> None:
    """Every graph compiles with 100% placement; prefill (two chunks, the last padded) then 20
    greedy decode steps give the CPU's tokens; verify rows equal decode rows."""
    tensor_type, kw = MODELS[arch]
    path = synthetic_gguf(arch, tensor_type, **kw)
    npu = NpuDriver(path, tmp_path / "npu")
    try:
        placements = npu.graphs.compiled.placements
        assert set(placements) == {"prefill", "decode", "verify"}
        for p in placements.values():
            assert p.complete and not p.fallbacks and p.total_nodes > 50
        prompt = _prompt(npu.cfg.vocab_size, 21)  # 16 + 5: the second chunk is left-padded
        got_tokens, got = _greedy(npu.prefill, lambda t: npu.step([t])[0], prompt, DECODE_STEPS)
        want_tokens, want = _cpu_greedy(path, tmp_path / "cpu", prompt)
        assert got_tokens == want_tokens
        assert _rel_err(got, want) < REL_TOL
        # The bound discriminates: the neighbouring step's logits are far outside it.
        assert _rel_err(got[1:], want[:-1]) > 5 * REL_TOL

        # verify: the last 3 tokens again in one padded 4-row graph == their decode rows
        end = npu.kv.n
        npu.kv.rollback(end - 3)
        rows = npu.step(got_tokens[-3:], all_rows=True)
        assert rows.shape == (3, npu.cfg.vocab_size)
        assert _rel_err(rows, got[-3:]) < REL_TOL
        assert list(rows.argmax(-1)) == list(got[-3:].argmax(-1))
        assert npu.kv.n == end
    finally:
        npu.close()


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_second_load_uses_the_compiled_binaries(synthetic_gguf, tmp_path: Path) -> None:
    path = synthetic_gguf("llama", "q8_0")
    first = NpuDriver(path, tmp_path)
    folder = first.graphs.folder
    assert first.cache.builds == 1 and first.graphs.compiled.compiled
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(
        [f"{g}_ctx.onnx" for g in ("decode", "prefill", "verify")]
        + [f"{g}_ctx_qnn.bin" for g in ("decode", "prefill", "verify")]
        + ["manifest.json", PLACEMENT_FILE]
    )
    prompt = _prompt(first.cfg.vocab_size, 9)
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


@pytest.mark.parametrize("damage", ["flip", "swap"])
def test_damaged_binary_is_rebuilt(synthetic_gguf, tmp_path: Path, damage: str) -> None:
    """A flipped byte or another graph's binary in its place is caught by the manifest."""
    path = synthetic_gguf("phi3", "q4_0")
    first = NpuDriver(path, tmp_path)
    folder = first.graphs.folder
    prompt = _prompt(first.cfg.vocab_size, 7)
    expect = first.prefill(prompt)
    first.close()
    victim = folder / "decode_ctx_qnn.bin"
    if damage == "flip":
        with open(victim, "r+b") as f:
            f.seek(victim.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        victim.write_bytes((folder / "prefill_ctx_qnn.bin").read_bytes())
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
        npu_specs(1, 0, 32, 0),  # the decode graph alone
        GraphCache(tmp_path),
        devices.QnnOptions(),
    )
    assert list(compiled.placements) == ["decode"]
    assert compiled.placements["decode"].complete


def test_rejected_op_is_an_error_naming_the_node(synthetic_gguf, tmp_path: Path) -> None:
    """With CPU fallback disabled an op the HTP rejects fails the compile, by name and reason,
    and leaves nothing in the cache; the doctor's explanation lists every such node.

    The CPU graph's fused `SkipSimplifiedLayerNormalization` is such an op (QNN rejects it).
    """
    path = synthetic_gguf("llama", "q8_0")
    specs = {"decode": GraphSpec(1, CAPACITY, 1, 0, fused_norms=True)}
    opts = devices.QnnOptions()
    cache = GraphCache(tmp_path)
    pattern = r"cannot run on the NPU: SkipSimplifiedLayerNormalization_\d+ \(SkipSimpl.*not supp"
    with pytest.raises(NpuchatError, match=pattern):
        compile_npu_graphs(path, model_sha256(path, tmp_path), specs, cache, opts)
    assert cache.builds == 0 and not any(cache.root.iterdir())
    placement = explain_placement(path, specs, opts)["decode"]
    assert not placement.complete
    assert {f.op_type for f in placement.fallbacks} == {"SkipSimplifiedLayerNormalization"}
    assert len(placement.fallbacks) == 4  # 2 layers x 2 residual adds
    assert all("not supported by QNN EP" in f.reason for f in placement.fallbacks)
    assert placement.npu_nodes + len(placement.fallbacks) == placement.total_nodes


def test_htp_rewrite_keeps_the_math(synthetic_gguf, tmp_path: Path) -> None:
    """`adapt_for_htp` (3-D MatMulNBits, bias as Add) computes the same thing on the CPU EP."""
    path = synthetic_gguf("qwen2", "q4_1")  # bias and block offsets: every rewritten form
    spec = npu_specs(PREFILL, VERIFY_K, CAPACITY, 0)["prefill"]
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
            feeds[i.name] = np.array([PREFILL - 1], np.int64)
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
        assert set(record) == {"prefill", "decode"}
        assert all(r["npu_nodes"] == r["total_nodes"] for r in record.values())
    finally:
        npu.close()


def test_doctor_reports_full_npu_placement_for_every_arch(
    synthetic_gguf,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`npuchat doctor --model X --device npu`: every graph of every arch 100% on the NPU,
    compiled on the first call and loaded from the cache on the second."""
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
            assert [g["graph"] for g in model["graphs"]] == ["decode", "prefill", "verify"]
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


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.skipif(
    os.environ.get("NPUCHAT_NPU_SMOKE") != "1",
    reason="SmolLM2 on the HTP simulator takes many minutes; set NPUCHAT_NPU_SMOKE=1 to run",
)
def test_smollm2_smoke_npu_equals_cpu(real_gguf, tmp_path: Path) -> None:
    """The real 30-layer model: prefill + 4 greedy decode tokens on the NPU equal the CPU's."""
    path = real_gguf("smollm2-135m")
    npu = NpuDriver(path, tmp_path / "npu", verify_k=0)
    try:
        assert all(p.complete for p in npu.graphs.compiled.placements.values())
        prompt = _prompt(npu.cfg.vocab_size, 12)
        got_tokens, got = _greedy(npu.prefill, lambda t: npu.step([t])[0], prompt, 4)
    finally:
        npu.close()
    want_tokens, want = _cpu_greedy(path, tmp_path / "cpu", prompt, 4)
    assert got_tokens == want_tokens
    assert _rel_err(got, want) < 3 * REL_TOL  # 30 layers of fp16 rounding, not 2-4


def test_model_on_npu_equals_cpu(synthetic_gguf, tmp_path: Path) -> None:
    """`Model.load(device="npu")`: chunked prefill, decode, verify and rollback give the CPU's
    greedy tokens and fp16-level logits; a second load does not recompile."""
    path = synthetic_gguf("qwen2", "q4_1")
    kw = {"prefill_chunk": PREFILL, "verify_k": VERIFY_K, "capacities": [32, CAPACITY]}
    prompt = _prompt(403, 37)  # three chunks, the last one padded
    with Model.load(path, cache_dir=tmp_path, device="npu", accuracy_level=0, **kw) as npu:
        assert (npu.capacity, npu.max_capacity, npu.graph_builds) == (CAPACITY, CAPACITY, 1)
        got_tokens, got = _greedy(npu.prefill, npu.decode, prompt, 16)
        end = npu.n_past
        npu.rollback(end - 4)
        rows = npu.verify(got_tokens[-4:])
        assert npu.n_past == end
    with Model.load(path, cache_dir=tmp_path, device="cpu", accuracy_level=0, **kw) as cpu:
        want_tokens, want = _greedy(cpu.prefill, cpu.decode, prompt, 16)
    assert got_tokens == want_tokens
    assert _rel_err(got, want) < REL_TOL and _rel_err(rows, want[-4:]) < REL_TOL
    with Model.load(path, cache_dir=tmp_path, device="npu", accuracy_level=0, **kw) as again:
        assert again.graph_builds == 0 and again.graph_dir == npu.graph_dir
        np.testing.assert_array_equal(again.prefill(prompt), got[0])


def test_run_command_npu_equals_cpu(
    synthetic_gguf,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`npuchat run --device npu` streams the same greedy tokens as `--device cpu`, and the
    second run loads the compiled binaries instead of compiling."""
    from npuchat.app.cli import main
    from npuchat.app.context import AppContext

    path = synthetic_gguf("llama", "q8_0", context_length=256)
    assert main(["import", str(path), "--name", "syn"]) == 0
    capsys.readouterr()
    args = ["--model", "syn", "--raw", "-p", "Hello world! How are you", "-n", "16", "--json"]
    args += ["--draft", "none"]

    def run(device: str) -> list[int]:
        assert main(["run", *args, "--device", device]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert lines[-1]["metrics"]["device"] == device
        return [x["id"] for x in lines[:-1]]

    cpu = run("cpu")
    assert len(cpu) == 16
    assert run("npu") == cpu
    graphs = AppContext.load().paths.cache_dir / "graphs"
    before = {p: p.stat().st_mtime_ns for p in graphs.rglob("*_qnn.bin")}
    # decode, prefill, verify, and the batched decode of the app's two KV slots on the NPU
    assert sorted(p.name for p in before) == sorted(
        f"{g}_ctx_qnn.bin" for g in ("decode", "decode_b2", "prefill", "verify")
    )
    assert run("npu") == cpu
    assert {p: p.stat().st_mtime_ns for p in graphs.rglob("*_qnn.bin")} == before


def test_draft_on_npu_target_on_cpu(
    synthetic_gguf,
    isolated_home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Heterogeneous split (`draft_device = "npu"`): the draft model's graphs are compiled for
    the HTP while the target runs on the CPU, and greedy output stays the target's own."""
    from npuchat.app.cli import main
    from npuchat.app.context import AppContext

    target = synthetic_gguf("llama", "q8_0", context_length=256, n_layers=2)
    draft = synthetic_gguf("llama", "q8_0", context_length=256, n_layers=1)
    assert main(["import", str(target), "--name", "syn-target"]) == 0
    assert main(["import", str(draft), "--name", "syn-draft"]) == 0
    cfg = isolated_home / "config" / "config.toml"
    cfg.write_text('draft_device = "npu"\n' + cfg.read_text())
    capsys.readouterr()
    args = ["run", "--model", "syn-target", "--device", "cpu", "--raw", "-n", "12", "--json"]
    args += ["-p", "Hello world! Hello world! Hello"]

    def tokens(draft_arg: str) -> list[int]:
        assert main([*args, "--draft", draft_arg]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        return [x["id"] for x in lines[:-1]]

    plain = tokens("none")
    assert tokens("syn-draft") == plain
    graphs = AppContext.load().paths.cache_dir / "graphs"
    assert len(list(graphs.rglob("*_qnn.bin"))) == 3  # the draft's decode/prefill/verify


def test_quantized_weights_stay_quantized_in_each_binary(synthetic_gguf, tmp_path: Path) -> None:
    """Each graph's context binary holds the GGUF's matrices at ~their quantized size (an fp16
    expansion would be 1.8x for q8_0 and 3.6x for q4_0). The model is large enough (d 512,
    ffn 1,536) that the matrices, not the graph's fixed ~150 KB, dominate a binary. The token
    embedding is not in the binaries: the host gathers embedding rows (the head is untied)."""
    import gguf

    path = synthetic_gguf(
        "llama", "q4_0", n_layers=2, d_model=512, ffn_dim=1536, tied_embeddings=False
    )
    cache = GraphCache(tmp_path)
    specs = npu_specs(PREFILL, 0, CAPACITY, 0)
    compiled = compile_npu_graphs(
        path, model_sha256(path, tmp_path), specs, cache, devices.QnnOptions()
    )
    matrices = sum(
        int(t.n_bytes)
        for t in gguf.GGUFReader(path).tensors
        if len(t.shape) == 2 and t.name != "token_embd.weight"
    )
    sizes = binary_sizes(compiled.folder, path)
    assert set(sizes.binaries) == {f"{name}_ctx_qnn.bin" for name in specs}
    for name, size in sizes.binaries.items():
        assert 0.95 < size / matrices < 1.25, (name, size, matrices)


def test_one_step_graph_serves_every_step_with_one_weight_copy(
    synthetic_gguf, tmp_path: Path
) -> None:
    """`single_graph`: one 16-row graph with every row's logits runs prefill chunks, decode
    (1 real row, 15 pad rows) and verify, with the CPU's greedy tokens; the whole set is one
    binary within 1.15x the GGUF's tensor bytes (the three-graph set of the same model: ~3x).
    The size is measured on a model whose matrices dominate (d 512), the tokens on a tiny one."""
    path = synthetic_gguf("llama", "q8_0")
    npu = NpuDriver(path, tmp_path / "npu", single_graph=True)
    try:
        assert set(npu.graphs.compiled.placements) == {"step"}
        assert npu.graphs.compiled.placements["step"].complete
        prompt = _prompt(npu.cfg.vocab_size, 21)
        got_tokens, got = _greedy(npu.prefill, lambda t: npu.step([t])[0], prompt, DECODE_STEPS)
        want_tokens, want = _cpu_greedy(path, tmp_path / "cpu", prompt)
        assert got_tokens == want_tokens
        assert _rel_err(got, want) < REL_TOL
        end = npu.kv.n
        npu.kv.rollback(end - 3)
        rows = npu.step(got_tokens[-3:], all_rows=True)
        assert rows.shape == (3, npu.cfg.vocab_size) and _rel_err(rows, got[-3:]) < REL_TOL
    finally:
        npu.close()

    big = synthetic_gguf(
        "llama", "q4_0", n_layers=2, d_model=512, ffn_dim=1536, tied_embeddings=False
    )
    cache = GraphCache(tmp_path / "big")
    specs = npu_specs(PREFILL, VERIFY_K, CAPACITY, 0, single=True)
    sha = model_sha256(big, tmp_path / "big")
    compiled = compile_npu_graphs(big, sha, specs, cache, devices.QnnOptions())
    sizes = binary_sizes(compiled.folder, big)
    assert list(sizes.binaries) == ["step_ctx_qnn.bin"] and sizes.ratio <= 1.15, sizes
