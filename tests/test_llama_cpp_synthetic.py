"""The engine against llama.cpp on synthetic GGUFs of the newer archs (recorded data, no build).

`tests/data/llama-cpp-synthetic.json` holds llama.cpp's log-probabilities over a fixed token
sequence (every position, top 8) and its greedy continuation of a prompt, for each model in
`synthetic_cases` (recorded by benchmarks/llama_cpp_reference.py). The synthetic writer is
deterministic; a file whose sha256 no longer matches the recording means the writer changed and
the recording must be made again. The engine runs with its default int8 activations, llama.cpp
with its Q8 activations and fp16 KV cache, so log-probs differ by rounding: the bounds are stated
per test, and top-1 must agree wherever llama.cpp's top two are more than `NEAR_TIE` apart.

Measured (top-8 log-prob error against llama.cpp): the engine 0.026–0.087 mean, ≤ 0.45 max; the
exact numpy reference 0.022–0.070 mean, ≤ 0.29 max, with no drift past the sliding windows; top-1
flips only where llama.cpp's top two were 0.004–0.213 apart.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from real_models import REFERENCE_DIR
from reference_forward import ReferenceModel, log_softmax
from synthetic import write_synthetic_gguf
from synthetic_cases import LLAMA_CPP_CASES, case_tokens

from npuchat.engine.model import Model

DATA = REFERENCE_DIR / "llama-cpp-synthetic.json"
NEAR_TIE = 0.25


def _recorded() -> dict[str, Any]:
    return json.loads(DATA.read_text())["cases"]


@pytest.mark.parametrize("name", list(LLAMA_CPP_CASES))
def test_engine_matches_llama_cpp(name: str, tmp_path: Path) -> None:
    case = _recorded()[name]
    arch, tensor_type, kw = LLAMA_CPP_CASES[name]
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, tensor_type=tensor_type, **kw)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha == case["gguf_sha256"], (
        "the synthetic writer changed: rerun benchmarks/llama_cpp_reference.py"
    )
    with Model.load(path, cache_dir=tmp_path / "c", capacities=[64], prefill_chunk=16) as m:
        seq = case["tokens"]
        assert seq == case_tokens(m.config.vocab_size)
        rows = [m.decode(t) for t in seq]
        m.rollback(0)
        prompt = case["greedy_prompt"]
        logits = m.prefill(prompt)
        greedy, gaps = [], []
        for _ in case["greedy_ids"]:
            top2 = np.sort(logits)[-2:]
            gaps.append(float(top2[1] - top2[0]))
            greedy.append(int(np.argmax(logits)))
            logits = m.decode(greedy[-1])
    ours = log_softmax(np.stack(rows).astype(np.float64))
    ids, theirs = np.array(case["top_ids"]), np.array(case["top_logprobs"])
    errors = np.abs(np.take_along_axis(ours, ids, -1) - theirs)
    decided = theirs[:, 0] - theirs[:, 1] > NEAR_TIE
    assert decided.sum() >= len(seq) // 2  # not vacuous
    assert (ours.argmax(-1)[decided] == ids[decided, 0]).all()
    assert errors.mean() < 0.1 and errors.max() < 0.6, (errors.mean(), errors.max())
    # Greedy: the same tokens up to the first step where our own top two nearly tie.
    first_tie = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
    assert greedy[:first_tie] == case["greedy_ids"][:first_tie]
    assert first_tie >= 4


def _reference_errors(ref: ReferenceModel, case: dict[str, Any]) -> np.ndarray:
    ours = log_softmax(ref.logits(case["tokens"]))
    ids, theirs = np.array(case["top_ids"]), np.array(case["top_logprobs"])
    return np.abs(np.take_along_axis(ours, ids, -1) - theirs)


@pytest.mark.parametrize(
    ("name", "break_it"),
    [
        ("gemma3-q8_0", "window"),
        ("gemma3-pattern6-q4_k", "window"),
        ("llama3-rope-factors-q8_0", "factors"),
    ],
)
def test_reference_matches_llama_cpp_and_the_wrong_math_does_not(
    name: str, break_it: str, tmp_path: Path
) -> None:
    """The numpy reference reads each feature as llama.cpp does; without the sliding window (or
    the rope factors) it leaves llama.cpp's bounds by far, so the recording checks them."""
    case = _recorded()[name]
    arch, tensor_type, kw = LLAMA_CPP_CASES[name]
    ref = ReferenceModel(
        write_synthetic_gguf(tmp_path / "m.gguf", arch, tensor_type=tensor_type, **kw)
    )
    right = _reference_errors(ref, case)
    assert right.mean() < 0.1 and right.max() < 0.4
    if break_it == "window":
        ref.sliding = [False] * ref.config.n_layers
    else:
        ref.freq_factors = None
    wrong = _reference_errors(ref, case)
    assert wrong.mean() > 3 * right.mean() and wrong.max() > 1.0
