"""Host-side per-step tables the graphs take: rotary cos/sin and sliding-window masks.

Both are computed on the host because they depend only on positions: the graph stays free of
position arithmetic (an NPU compiles it once), and a model whose layers differ (Gemma 3's sliding
layers rotate with their own base and see only the last `window` positions) simply gets a second
table and a second mask (`cos_swa`/`sin_swa`, `mask_swa`; `ModelConfig.local_rope`,
`ModelConfig.mixed_windows`). When every layer slides (Mistral-family files) the window goes into
the one `mask`.

In a cache that holds every position in order (slot = position), a sliding layer's mask is the
causal mask with every column at distance ≥ `window` from the query row hidden, as llama.cpp's
`is_masked_swa` (STANDARD) hides it: row p sees p-window+1..p (`apply_window`). A cache whose
sliding layers keep rings (`kv_ring`, what `Model` builds) masks their slots by the position
each one holds instead.
"""

from __future__ import annotations

import numpy as np

from .model_config import ModelConfig

__all__ = ["apply_window", "llama_rope_permutation", "rope_tables"]

MASK_NEG = -30000.0  # finite (fp16-safe) and far below any real score


def rope_tables(
    cfg: ModelConfig, positions: np.ndarray, *, local: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Rotary tables `[len(positions), dh/2]` (cos, sin) for ONNX `RotaryEmbedding`.

    The angle of frequency i at position p is `p·s·θ^(-2i/d) / f_i`: s the linear scaling
    (1/factor), f the per-frequency factors of Llama 3 files (`rope_freqs.weight`), as ggml's
    `rope_ext` computes it. `local` gives the sliding layers' tables (their own base, no
    scaling), for models with `cfg.local_rope`.
    """
    half = cfg.rope_dim // 2
    theta = cfg.rope_theta_swa if local and cfg.rope_theta_swa else cfg.rope_theta
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    pos = positions.astype(np.float64)
    if not local:
        if cfg.rope_scaling.type == "linear" and cfg.rope_scaling.factor:
            pos = pos / cfg.rope_scaling.factor
        if cfg.rope_freq_factors:
            inv_freq = inv_freq / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
    ang = pos[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_window(
    out: np.ndarray, rows: np.ndarray, cols: np.ndarray, window: int, base: np.ndarray
) -> None:
    """`out[0, 0] = base[0, 0]` with the columns `window` or more positions behind a row hidden.

    `rows` are the S query positions, `cols` the position each mask column stands for; `out`
    may be `base` itself (every layer slides).
    """
    far = (rows[:, None] - cols[None, :]) >= window
    np.copyto(out[0, 0], base[0, 0])
    out[0, 0][far] = MASK_NEG


def llama_rope_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns llama.cpp's adjacent-pair rotary layout into the NEOX half layout."""
    per_head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + per_head[None, :]).reshape(-1)
