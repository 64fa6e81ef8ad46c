"""The synthetic models and token sequences llama.cpp ran on (data/llama-cpp-synthetic.json).

Shared by the recording script (benchmarks/llama_cpp_reference.py) and the test that compares
the engine with the recording (tests/test_llama_cpp_synthetic.py), so both build the same files.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LLAMA_CPP_CASES", "SEQ_LEN", "case_tokens"]

SEQ_LEN = 40  # past every window below, so sliding layers hide part of the past

# name -> (arch, tensor type, write_synthetic_gguf options)
LLAMA_CPP_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-q8_0": ("qwen3", "q8_0", {}),
    "qwen3-q4_k": ("qwen3", "q4_k", {}),
    "gemma3-q8_0": ("gemma3", "q8_0", {}),  # window 8 on every other layer
    "gemma3-pattern6-q4_k": (
        "gemma3",
        "q4_k",
        {"n_layers": 6, "swa_pattern": 6, "sliding_window": 12},
    ),
    "llama3-rope-factors-q8_0": ("llama", "q8_0", {"rope_freq_factors": True}),
}


def case_tokens(vocab_size: int) -> list[int]:
    """A fixed sequence of ordinary (non-special) token ids."""
    return [int(t) for t in np.random.default_rng(21).integers(10, vocab_size, SEQ_LEN)]
