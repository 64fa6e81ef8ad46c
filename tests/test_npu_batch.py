"""Batched decode on the QNN HTP (simulator on x86), CPU fallback disabled: the step graph of
two KV slots compiles with every node on the NPU, and two sequences decoded together, or one
of them alone while the other waits, give each the greedy tokens the CPU gives it alone, for
every arch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from npu_driver import CAPACITY, MODELS, PREFILL, REL_TOL, random_prompt, rel_err
from synthetic import synthetic_gguf  # noqa: F401  (fixture)

from npuchat.engine import devices
from npuchat.engine.model import Model

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not devices.npu_status().available, reason="no QNN HTP backend here"),
]

STEPS = 8
ALONE = 3


@pytest.mark.parametrize("arch", list(MODELS))
def test_batched_npu_decode_equals_cpu_alone(synthetic_gguf, tmp_path: Path, arch: str) -> None:  # noqa: F811
    tensor_type, kw = MODELS[arch]
    path = synthetic_gguf(arch, tensor_type, **kw)
    opts = {"prefill_chunk": PREFILL, "verify_k": 0, "capacities": [CAPACITY], "accuracy_level": 0}
    prompts = [random_prompt(300, 9, seed=1), random_prompt(300, 20, seed=2)]
    with Model.load(path, cache_dir=tmp_path, device="npu", batch_max=2, **opts) as npu:
        assert npu._npu is not None
        placements = npu._npu.compiled.placements
        assert set(placements) == {"step"} and npu._npu.compiled.specs["step"].batch == 2
        assert all(p.complete and not p.fallbacks for p in placements.values())
        rows = [[npu.prefill(p, row=r)] for r, p in enumerate(prompts)]
        for _ in range(STEPS):
            out = npu.decode_batch([int(np.argmax(r[-1])) for r in rows])
            for r, logits in zip(rows, out, strict=True):
                r.append(logits)
        for _ in range(ALONE):  # row 1 alone: entry 0 of the graph is padding
            rows[1].append(npu.decode(int(np.argmax(rows[1][-1])), row=1))
    for p, got in zip(prompts, rows, strict=True):
        with Model.load(path, cache_dir=tmp_path / "cpu", **opts) as cpu:
            want = [cpu.prefill(p)]
            for _ in range(len(got) - 1):
                want.append(cpu.decode(int(np.argmax(want[-1]))))
        assert [int(np.argmax(x)) for x in got] == [int(np.argmax(x)) for x in want]
        assert rel_err(np.stack(got), np.stack(want)) < REL_TOL
