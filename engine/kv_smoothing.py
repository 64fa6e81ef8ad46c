"""Per-channel K smoothing for the int8 cache: powers of two that even out K's outlier channels.

A K row quantized with one scale per (token, head) loses its small channels to the few large
ones, and those large channels are the same from token to token (on qwen2.5-coder-0.5b the K
bias puts some channels ~10-50x above the median). So the int8 cache stores `k / s` and
attention uses `q · s`, with one `s` per (layer, KV head, channel): `q·k` is unchanged in real
arithmetic, and each row is still quantized on its own when written (decode == verify, batched ==
alone). `s` is a power of two, so both scalings are exact in floating point, and equal within
each rotary pair, so it commutes with RoPE (a rotation mixes only the two channels of a pair).

`s` comes from the weights, once per model: the typical size of K channel c is
`sqrt(b_c² + ‖W_k[c] ⊙ g‖²)` (bias b, attention-norm weight g; the normed input has unit mean
square), or `|k_norm[c]|` where a per-head norm follows the K projection; the larger of a
pair's two values over the head's median, rounded down to a power of two, at least 1: only
channels at 2x the median or more are scaled (on weights without outliers, rounding to the
nearest power moved random channels by 2x and made the error slightly worse). A short
calibration pass measuring K itself did no better (`kv_layout` has the figures), and the
weights need no forward pass at build time.
"""

from __future__ import annotations

import numpy as np

from .gguf_reader import GGUFFile, ModelConfig
from .layer_inputs import llama_rope_permutation
from .quant import dequantize_rows

__all__ = ["K_SMOOTHING", "graph_layout", "k_smoothing"]

K_SMOOTHING = "weights-pow2"  # the scheme, in the int8 graphs' cache key
_MAX_EXP = 12  # log2 s bound


def _tensor(g: GGUFFile, name: str) -> np.ndarray:
    """A 1-D or 2-D tensor as float32 in numpy order ([rows, k])."""
    info = g.tensors[name]
    k, n = info.shape[0], int(np.prod(info.shape[1:]))
    return dequantize_rows(g.raw(name), info.ggml_type, k, np.arange(n)).reshape(n, k)


def _channel_sizes(g: GGUFFile, cfg: ModelConfig, layer: int) -> np.ndarray:
    """The typical |K| of each channel of layer `layer`, `[Hkv, dh]` in the file's row order."""
    p, dh, hkv = f"blk.{layer}.", cfg.head_dim, cfg.n_kv_heads
    if cfg.qk_norm:
        return np.tile(np.abs(_tensor(g, p + "attn_k_norm.weight").reshape(-1)), (hkv, 1))
    q_dim, kv_dim = cfg.n_heads * dh, hkv * dh
    if cfg.fused_qkv:
        rows, bias = slice(q_dim, q_dim + kv_dim), p + "attn_qkv.bias"
        w = _tensor(g, p + "attn_qkv.weight")[rows]
        b = _tensor(g, bias).reshape(-1)[rows] if bias in g.tensors else 0.0
    else:
        w, bias = _tensor(g, p + "attn_k.weight"), p + "attn_k.bias"
        b = _tensor(g, bias).reshape(-1) if bias in g.tensors else 0.0
    gain = _tensor(g, p + "attn_norm.weight").reshape(-1)
    size = np.sqrt(((w * gain) ** 2).sum(axis=1) + np.square(b))
    return size.reshape(hkv, dh)


def _pair_max(m: np.ndarray, neox: bool) -> np.ndarray:
    """`m` with both channels of each rotary pair set to the pair's larger value."""
    dh = m.shape[-1]
    if neox:  # pairs (i, i + dh/2)
        top = np.maximum(m[:, : dh // 2], m[:, dh // 2 :])
        return np.concatenate([top, top], axis=1)
    top = np.maximum(m[:, 0::2], m[:, 1::2])  # llama's file order: pairs (2i, 2i+1)
    return np.repeat(top, 2, axis=1)


def k_smoothing(g: GGUFFile) -> list[np.ndarray]:
    """`s` for every layer, float32 `[Hkv, dh]` in the file's row order (module doc)."""
    cfg = g.config
    out = []
    for layer in range(cfg.n_layers):
        m = _pair_max(_channel_sizes(g, cfg, layer), neox=cfg.arch != "llama")
        ratio = m / np.maximum(np.median(m, axis=1, keepdims=True), 1e-30)
        exp = np.clip(np.floor(np.log2(np.maximum(ratio, 1.0))), 0, _MAX_EXP)
        out.append(np.exp2(exp).astype(np.float32))
    return out


def graph_layout(s: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`s` `[Hkv, dh]` in the graph's channel order (llama K rows are permuted to NEOX)."""
    if cfg.arch != "llama":
        return s
    return s[:, llama_rope_permutation(1, cfg.head_dim)]
