"""The NPU path gives the CPU's greedy tokens and fp16-level logits on the QNN HTP simulator.

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

Compiling, placement, the compile-once cache and device discovery are `test_npu_compile.py`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from npu_driver import (
    CAPACITY,
    DECODE_STEPS,
    MODELS,
    PREFILL,
    REL_TOL,
    VERIFY_K,
    NpuDriver,
    cpu_greedy,
    greedy,
    random_prompt,
    rel_err,
)

from npuchat.engine import devices
from npuchat.engine.model import Model

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not devices.npu_status().available, reason="no QNN HTP backend here"),
]


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_matches_cpu(synthetic_gguf, tmp_path: Path, arch: str) -> None:
    """The step graph compiles with 100% placement; prefill (two chunks, the last padded) then
    20 greedy decode steps (1 real row, 15 pad rows) give the CPU's tokens; verify rows (3 real
    rows in the same graph) equal decode rows."""
    tensor_type, kw = MODELS[arch]
    path = synthetic_gguf(arch, tensor_type, **kw)
    npu = NpuDriver(path, tmp_path / "npu")
    try:
        placements = npu.graphs.compiled.placements
        assert set(placements) == {"step"}
        for p in placements.values():
            assert p.complete and not p.fallbacks and p.total_nodes > 50
        prompt = random_prompt(npu.cfg.vocab_size, 21)  # 16 + 5: the second chunk is left-padded
        got_tokens, got = greedy(npu.prefill, lambda t: npu.step([t])[0], prompt, DECODE_STEPS)
        want_tokens, want = cpu_greedy(path, tmp_path / "cpu", prompt)
        assert got_tokens == want_tokens
        assert rel_err(got, want) < REL_TOL
        # The bound discriminates: the neighbouring step's logits are far outside it.
        assert rel_err(got[1:], want[:-1]) > 5 * REL_TOL

        # verify: the last 3 tokens again in one padded 4-row graph == their decode rows
        end = npu.kv.n
        npu.kv.rollback(end - 3)
        rows = npu.step(got_tokens[-3:], all_rows=True)
        assert rows.shape == (3, npu.cfg.vocab_size)
        assert rel_err(rows, got[-3:]) < REL_TOL
        assert list(rows.argmax(-1)) == list(got[-3:].argmax(-1))
        assert npu.kv.n == end
    finally:
        npu.close()


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.skipif(
    os.environ.get("NPUCHAT_NPU_SMOKE") != "1",
    reason="SmolLM2 on the HTP simulator takes many minutes; set NPUCHAT_NPU_SMOKE=1 to run",
)
def test_smollm2_smoke_npu_equals_cpu(real_gguf, tmp_path: Path) -> None:
    """The real 30-layer model on the app's NPU graph (one step graph: 16 rows for each of 2
    KV slots, verify k = 4; capacity 64 to keep the simulator's run short): 16 greedy tokens
    equal the CPU's, and the graph set is one binary within 1.15x the GGUF's tensor bytes.
    Prints the figures the README quotes (run with -s)."""
    from npuchat.engine.gguf_reader import GGUFFile
    from npuchat.engine.npu_sizes import binary_sizes, describe
    from npuchat.engine.tokenizer import Tokenizer

    path = real_gguf("smollm2-135m")
    with GGUFFile(path) as g:
        prompt = Tokenizer.from_gguf(g).encode("The three primary colors are")
    kw = {"verify_k": 4, "capacities": [CAPACITY], "accuracy_level": 0}
    t0 = time.perf_counter()
    with Model.load(path, cache_dir=tmp_path / "npu", device="npu", batch_max=2, **kw) as npu:
        assert npu._npu is not None
        compiled = npu._npu.compiled
        assert all(p.complete for p in compiled.placements.values())
        sizes = binary_sizes(npu.graph_dir, path)
        t1 = time.perf_counter()
        got = _greedy_tokens(npu, prompt, SMOKE_TOKENS)
        t2 = time.perf_counter()
    with Model.load(path, cache_dir=tmp_path / "cpu", **kw) as cpu:
        want = _greedy_tokens(cpu, prompt, SMOKE_TOKENS)
    print(
        f"\nsmollm2-135m on the HTP simulator: compile {compiled.seconds:.0f} s, load "
        f"{t1 - t0:.0f} s in all, {len(prompt)}-token prompt + {SMOKE_TOKENS} tokens in "
        f"{t2 - t1:.0f} s; {describe(len(sizes.binaries), sizes.binary_bytes, sizes.tensor_bytes)}"
    )
    assert got == want
    assert sizes.ratio <= 1.15


SMOKE_TOKENS = 16


def _greedy_tokens(model: Model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens: one from the prompt's logits, then one per decode step."""
    tokens = [int(np.argmax(model.prefill(prompt)))]
    while len(tokens) < n:
        tokens.append(int(np.argmax(model.decode(tokens[-1]))))
    return tokens


def test_model_on_npu_equals_cpu(synthetic_gguf, tmp_path: Path) -> None:
    """`Model.load(device="npu")`: chunked prefill, decode, verify and rollback give the CPU's
    greedy tokens and fp16-level logits; a second load does not recompile."""
    path = synthetic_gguf("qwen2", "q4_1")
    kw = {"prefill_chunk": PREFILL, "verify_k": VERIFY_K, "capacities": [32, CAPACITY]}
    prompt = random_prompt(403, 37)  # three chunks, the last one padded
    with Model.load(path, cache_dir=tmp_path, device="npu", accuracy_level=0, **kw) as npu:
        assert (npu.capacity, npu.max_capacity, npu.graph_builds) == (CAPACITY, CAPACITY, 1)
        got_tokens, got = greedy(npu.prefill, npu.decode, prompt, 16)
        end = npu.n_past
        npu.rollback(end - 4)
        rows = npu.verify(got_tokens[-4:])
        assert npu.n_past == end
    with Model.load(path, cache_dir=tmp_path, device="cpu", accuracy_level=0, **kw) as cpu:
        want_tokens, want = greedy(cpu.prefill, cpu.decode, prompt, 16)
    assert got_tokens == want_tokens
    assert rel_err(got, want) < REL_TOL and rel_err(rows, want[-4:]) < REL_TOL
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
    # one binary: the step graph serves prefill, decode, verify and the app's two KV slots
    assert [p.name for p in before] == ["step_ctx_qnn.bin"]
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
    assert len(list(graphs.rglob("*_qnn.bin"))) == 1  # the draft's step graph
