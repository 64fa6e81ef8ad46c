"""An int8 KV cache on the QNN HTP (simulator on x86), CPU fallback disabled: the step graph
reads the int8 rows and their scales, the host quantizes the new rows the way the CPU graph
does, and greedy tokens equal the CPU's int8 path, for every arch, alone and batched.

The CPU int8 graph (float activations) is the reference. The NPU graph attends a step's own
new rows rounded as their int8 storage reads back, as the CPU graph does (it reads them from
its cache), so the two differ by the HTP's fp16 (`test_npu.py` bounds it at `REL_TOL`), through
which a few values land on the neighbouring integer. Measured on these models with K outlier
channels (x4): 0.16-1.4e-2 of the logit scale against the CPU's int8 path, 0.28-2.4e-2
against its f32 cache; the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from npu_driver import CAPACITY, MODELS, PREFILL, REL_TOL, VERIFY_K, greedy, random_prompt, rel_err

from npuchat.engine import devices
from npuchat.engine.graph_builder import GraphSpec, build_graphs
from npuchat.engine.model import Model
from npuchat.engine.npu_adapt import adapt_for_htp
from npuchat.engine.npu_compile import CompiledGraphs

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not devices.npu_status().available, reason="no QNN HTP backend here"),
]

STEPS = 16
KW = {
    "prefill_chunk": PREFILL,
    "verify_k": VERIFY_K,
    "capacities": [CAPACITY],
    "accuracy_level": 0,
    "kv_dtype": "int8",
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_int8_cache_on_npu_equals_cpu_int8(synthetic_gguf, tmp_path: Path, arch: str) -> None:
    """Prefill (two chunks, the last padded), 16 greedy decode steps and a verify after a
    rollback: the CPU int8 path's tokens and logits within `REL_TOL`, nearer to them than to
    the CPU's f32 cache (the int8 rounding is the NPU's too). K has outlier channels (x4), so
    the K smoothing is at work (`kv_smoothing`)."""
    tensor_type, kw = MODELS[arch]
    path = synthetic_gguf(arch, tensor_type, k_outliers=4.0, **kw)
    with Model.load(path, cache_dir=tmp_path, device="npu", **KW) as npu:  # type: ignore[arg-type]
        assert npu._npu is not None and npu.kv_dtype == "int8"
        assert npu._kv.k[0].dtype == np.int8
        assert all(p.complete for p in npu._npu.compiled.placements.values())
        prompt = random_prompt(npu.config.vocab_size, 21)
        got_tokens, got = greedy(npu.prefill, npu.decode, prompt, STEPS)
        npu.rollback(npu.n_past - 3)
        rows = npu.verify(got_tokens[-3:])
    with Model.load(path, cache_dir=tmp_path / "cpu", **KW) as cpu:  # type: ignore[arg-type]
        want_tokens, want = greedy(cpu.prefill, cpu.decode, prompt, STEPS)
    f32 = {**KW, "kv_dtype": "f32"}
    with Model.load(path, cache_dir=tmp_path / "cpu", **f32) as cpu:  # type: ignore[arg-type]
        _, want_f32 = greedy(cpu.prefill, cpu.decode, prompt, STEPS)
    assert got_tokens == want_tokens
    assert rel_err(got, want) < min(REL_TOL, rel_err(got, want_f32))
    assert rel_err(got[1:], want[:-1]) > 5 * REL_TOL  # the bound tells steps apart
    assert rel_err(rows, want[-3:]) < REL_TOL


def test_int8_cache_batched_on_npu_equals_cpu_int8_alone(synthetic_gguf, tmp_path: Path) -> None:
    """Two sequences in the two KV slots of one int8 cache, decoded together: each gets the
    tokens the CPU int8 path gives it alone (ring layers: gemma3)."""
    tensor_type, kw = MODELS["gemma3"]
    path = synthetic_gguf("gemma3", tensor_type, **kw)
    prompts = [random_prompt(300, 9, seed=1), random_prompt(300, 20, seed=2)]
    with Model.load(path, cache_dir=tmp_path, device="npu", batch_max=2, **KW) as npu:  # type: ignore[arg-type]
        rows = [[npu.prefill(p, row=r)] for r, p in enumerate(prompts)]
        for _ in range(8):
            out = npu.decode_batch([int(np.argmax(r[-1])) for r in rows])
            for r, logits in zip(rows, out, strict=True):
                r.append(logits)
    for p, got in zip(prompts, rows, strict=True):
        with Model.load(path, cache_dir=tmp_path / "cpu", **KW) as cpu:  # type: ignore[arg-type]
            want = [cpu.prefill(p)]
            for _ in range(len(got) - 1):
                want.append(cpu.decode(int(np.argmax(want[-1]))))
        assert [int(np.argmax(x)) for x in got] == [int(np.argmax(x)) for x in want]
        assert rel_err(np.stack(got), np.stack(want)) < REL_TOL


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_step_graph_computes_the_cpu_int8_graphs_numbers(
    synthetic_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """The NPU's int8 step graph, run uncompiled on the CPU EP in float32, gives the CPU int8
    graph's logits (1e-4 of the scale) over prefill chunks and decode: its new rows are
    rounded as the cache stores them, and the host quantizes them as the CPU graph does. What
    remains between the NPU and the CPU's int8 path is then the HTP's fp16 alone."""
    from npuchat.engine import npu_graphs

    def uncompiled(
        gguf_path: Path, sha: str, specs: dict[str, GraphSpec], *_: object
    ) -> CompiledGraphs:
        folder = tmp_path / "uncompiled"
        src = build_graphs(gguf_path, specs, folder)["step"]
        graph = adapt_for_htp(onnx.load(str(src), load_external_data=False))
        onnx.save_model(graph, str(folder / "step_ctx.onnx"))
        return CompiledGraphs(folder, dict(specs), {}, True, 0.0)

    def on_cpu(path: Path, opts: object) -> ort.InferenceSession:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    monkeypatch.setattr(npu_graphs, "compile_npu_graphs", uncompiled)
    monkeypatch.setattr(npu_graphs, "load_compiled_session", on_cpu)
    tensor_type, kw = MODELS[arch]
    path = synthetic_gguf(arch, tensor_type, k_outliers=4.0, **kw)
    runs = []
    for device in ("npu", "cpu"):
        with Model.load(path, cache_dir=tmp_path / device, device=device, **KW) as m:  # type: ignore[arg-type]
            prompt = random_prompt(m.config.vocab_size, 21)
            runs.append(greedy(m.prefill, m.decode, prompt, STEPS))
    (got_tokens, got), (want_tokens, want) = runs
    assert got_tokens == want_tokens
    assert rel_err(got, want) < 1e-4
