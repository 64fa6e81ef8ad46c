"""The parts of the synthetic GGUFs that belong to the newer architectures (used by synthetic.py).

Gemma 3's sliding layers are written with llama.cpp's keys (its vocabulary is in
`synthetic_vocab`). Llama 3's per-frequency rope factors follow
Meta's llama3 scaling rule (factor 8, low/high frequency factors 1 and 4, original context 8192),
the rule llama.cpp's converter uses to write `rope_freqs.weight`, with the original context
scaled down to 32 positions so that the factors change the logits within a test's few tokens.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter

__all__ = ["WIDE_HEAD_ARCHS", "add_window_metadata", "llama3_freq_factors"]

WIDE_HEAD_ARCHS = frozenset({"qwen3", "gemma3"})  # head_dim > d_model / n_heads, like the real ones


def add_window_metadata(w: GGUFWriter, arch: str, window: int | None, pattern: int | None) -> None:
    """Sliding-window keys: Gemma 3 slides by default (window 8, every other layer)."""
    if arch == "gemma3":
        w.add_sliding_window(8 if window is None else window)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2 if pattern is None else pattern)
    elif window:
        w.add_sliding_window(window)


def llama3_freq_factors(head_dim: int, theta: float = 100000.0, old_ctx: int = 32) -> np.ndarray:
    """`rope_freqs.weight` by Meta's llama3 rule (as convert_hf_to_gguf computes it)."""
    factor, low, high = 8.0, 1.0, 4.0
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0, factor)
    mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    out = np.where(mid, 1.0 / ((1 - smooth) / factor + smooth), out)
    return out.astype(np.float32)
