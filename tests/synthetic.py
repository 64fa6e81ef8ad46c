"""Tiny synthetic GGUF models, written with `gguf.GGUFWriter`, for tests that need no download.

Each file is a complete model in llama.cpp's own layout (metadata keys, tensor names, GGML dim
order, tokenizer arrays), so every part of the engine — the GGUF reader, the tokenizer, the graph
builder — reads it exactly as it reads a real file. Weights are random but scaled like a trained
network (std ~ 1/sqrt(fan_in), norm weights ~ 1) so logits are well-conditioned: distinct, not
flat, not exploding. The vocabulary is real: a byte-level BPE (or a SentencePiece-style vocab for
Phi-3 and Gemma) trained deterministically on a fixed text, plus each family's chat specials
(`synthetic_vocab`); the newer archs' metadata comes from `synthetic_archs`.

`gguf.quants.quantize` has no K-quant encoders, so Q4_K and Q6_K blocks are packed here (simple
per-block min/max quantizers that invert gguf-py's dequantizers); the round trip is tested.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from synthetic_archs import WIDE_HEAD_ARCHS, add_window_metadata, llama3_freq_factors
from synthetic_vocab import add_bpe_vocab, add_spm_vocab

__all__ = [
    "ARCHS",
    "K_QUANT_TYPES",
    "TENSOR_TYPES",
    "ggml_type",
    "quantize_tensor",
    "synthetic_gguf",
    "write_synthetic_gguf",
]

ARCHS = ("llama", "qwen2", "phi3", "qwen3", "gemma3")
TENSOR_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k")
K_QUANT_TYPES = ("q4_k", "q6_k")
QK_K = 256

# Per-arch hyperparameters in the spirit of the real models (SmolLM2, Qwen2.5, Phi-3).
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 100000.0, "rms_eps": 1e-5, "tied": True, "vocab": "bpe"},
    "qwen2": {"rope_theta": 1000000.0, "rms_eps": 1e-6, "tied": False, "vocab": "bpe"},
    "phi3": {"rope_theta": 10000.0, "rms_eps": 1e-5, "tied": False, "vocab": "spm"},
    "qwen3": {"rope_theta": 1000000.0, "rms_eps": 1e-6, "tied": True, "vocab": "bpe"},
    "gemma3": {"rope_theta": 1000000.0, "rms_eps": 1e-6, "tied": True, "vocab": "gemma"},
}


# --------------------------------------------------------------------------- quantization


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks: x ≈ d·sc·q − dmin·m per 32-value sub-block (6-bit sc, m; 4-bit q)."""
    x = rows.reshape(-1, 8, 32).astype(np.float32)
    n = x.shape[0]
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    sub_scale = np.maximum(hi - lo, 1e-8) / 15.0
    sub_min = -lo
    d = _f16(np.maximum(sub_scale.max(axis=-1), 1e-8) / 63.0)
    dmin = _f16(np.maximum(sub_min.max(axis=-1), 1e-8) / 63.0)
    sc = np.clip(np.rint(sub_scale / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(sub_min / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint((x + offset) / step), 0, 15).astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128)
    head = np.stack([d, dmin], axis=-1).astype(np.float16).view(np.uint8).reshape(n, 4)
    return np.concatenate([head, scales, qs], axis=-1)


def _quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K blocks: x ≈ d·sc·(q − 32) per 16-value sub-block (int8 sc, 6-bit q)."""
    x = rows.reshape(-1, 16, 16).astype(np.float32)
    n = x.shape[0]
    sub_scale = np.maximum(np.abs(x).max(axis=-1), 1e-8) / 31.0
    d = _f16(sub_scale.max(axis=-1) / 127.0)
    sc = np.clip(np.rint(sub_scale / d[:, None]), 1, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(x / step), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(n, 128)
    high = q >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    qh = qh.reshape(n, 64)
    return np.concatenate(
        [ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=-1
    )


_K_ENCODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q4_K: _quantize_q4_k,
    GGMLQuantizationType.Q6_K: _quantize_q6_k,
}


def ggml_type(name: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError as exc:
        raise ValueError(f"unknown tensor type {name!r}; use one of {TENSOR_TYPES}") from exc


def quantize_tensor(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Encode a [rows, cols] float matrix as GGUF stores it (bytes per row for block types)."""
    if qtype in _K_ENCODERS:
        if w.shape[-1] % QK_K:
            raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values")
        blocks = _K_ENCODERS[qtype](np.ascontiguousarray(w, dtype=np.float32))
        return blocks.reshape(*w.shape[:-1], -1)
    return quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)


# --------------------------------------------------------------------------- the writer


def _tensor_type_for(tensor_type: str | Mapping[str, str], role: str) -> str:
    """`tensor_type` is one name for all matrices, or {role or "default": name}."""
    if isinstance(tensor_type, str):
        return tensor_type
    return tensor_type.get(role, tensor_type.get("default", "q8_0"))


def write_synthetic_gguf(
    path: str | Path,
    arch: str,
    *,
    tensor_type: str | Mapping[str, str] = "q8_0",
    n_layers: int = 2,
    d_model: int | None = None,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int | None = None,
    context_length: int = 512,
    seed: int = 0,
    tied_embeddings: bool | None = None,
    vocab: str | None = None,
    chat_template: str | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    swa_pattern: int | None = None,
    rope_freq_factors: bool = False,
    k_outliers: float = 1.0,
    extra: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    """Write a tiny `arch` model to `path` and return the path.

    `tensor_type` applies to every 2-D weight (token_embd, output, attention and FFN
    matrices); norms and biases stay F32 as in llama.cpp's files. A mapping selects per role
    (`token_embd`, `output`, `attn_q`, `attn_k`, `attn_v`, `attn_qkv`, `attn_output`,
    `ffn_gate`, `ffn_up`, `ffn_down`, or `default`). `d_model` and `ffn_dim` default to 64/128,
    or 256/512 when any K-quant is involved (K-quant rows hold multiples of 256 values).
    `chat_template` replaces the ChatML template of a BPE vocabulary (`QWEN25_TOOL_TEMPLATE`).
    Qwen3 and Gemma 3 heads default to twice d_model / n_heads (their real models' Q is wider
    than d_model); Gemma 3 slides every other layer over a window of 8 unless told otherwise.
    `sliding_window` on llama writes a Mistral-style window, `rope_freq_factors` a Llama 3
    `rope_freqs.weight`. `k_outliers` multiplies K channels 1 and 5 of every head by that gain
    (their K weight rows, bias and K norm), as real models' K has a few channels far above the
    rest. `extra(writer)` runs last, to add keys or tensors a test needs.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; use one of {ARCHS}")
    defaults = _ARCH_DEFAULTS[arch]
    types = {tensor_type} if isinstance(tensor_type, str) else set(tensor_type.values())
    uses_k = any(t.lower() in K_QUANT_TYPES for t in types)
    d_model = d_model or (256 if uses_k else 64)
    ffn_dim = ffn_dim or 2 * d_model
    tied = defaults["tied"] if tied_embeddings is None else tied_embeddings
    vocab = vocab or defaults["vocab"]
    if d_model % n_heads or n_heads % n_kv_heads:
        raise ValueError("d_model must divide by n_heads and n_heads by n_kv_heads")
    head_dim = head_dim or (2 if arch in WIDE_HEAD_ARCHS else 1) * d_model // n_heads
    kv_dim = n_kv_heads * head_dim
    q_dim = n_heads * head_dim

    path = Path(path)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(defaults["rope_theta"])
    w.add_layer_norm_rms_eps(defaults["rms_eps"])
    if arch != "qwen2":  # Qwen2.5's GGUFs omit it (the reader falls back to head_dim)
        w.add_rope_dimension_count(head_dim)
    if head_dim != d_model // n_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    add_window_metadata(w, arch, sliding_window, swa_pattern)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(context_length)
    if vocab == "bpe":
        n_vocab = add_bpe_vocab(w, arch, chat_template)
    elif vocab in ("spm", "gemma"):
        n_vocab = add_spm_vocab(w, "gemma" if vocab == "gemma" else "phi3")
    else:
        raise ValueError(f"unknown vocab {vocab!r}; use 'bpe', 'spm' or 'gemma'")
    if arch == "llama":  # SmolLM2's GGUF records it; the others leave it to token_embd's shape
        w.add_vocab_size(n_vocab)

    k_gain = np.ones(head_dim, np.float32)
    k_gain[[1, 5]] = k_outliers

    def matrix(name: str, role: str, rows: int, cols: int, gain: float | np.ndarray = 1.0) -> None:
        """A [rows, cols] weight (numpy order = GGML [cols, rows]), std gain/sqrt(cols)."""
        qtype = ggml_type(_tensor_type_for(tensor_type, role))
        gain = np.reshape(gain, (-1, 1)) if np.ndim(gain) else gain
        data = rng.standard_normal((rows, cols)).astype(np.float32) * (gain / np.sqrt(cols))
        enc = quantize_tensor(data, qtype)
        w.add_tensor(name, enc, raw_dtype=qtype if qtype.name not in ("F32", "F16") else None)

    def vector(name: str, n: int, mean: float, std: float, gain: float | np.ndarray = 1) -> None:
        w.add_tensor(name, ((mean + std * rng.standard_normal(n)) * gain).astype(np.float32))

    k_rows = np.tile(k_gain, n_kv_heads)

    # gain 3: tied or not, the LM head gives logits ~ N(0, 3²) for a normalized hidden state.
    matrix("token_embd.weight", "token_embd", n_vocab, d_model, gain=3.0)
    if rope_freq_factors:
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(head_dim))
    for i in range(n_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", d_model, 1.0, 0.1)
        if arch == "phi3":
            qkv_gain = np.concatenate([np.ones(d_model), k_rows, np.ones(kv_dim)])
            matrix(p + "attn_qkv.weight", "attn_qkv", d_model + 2 * kv_dim, d_model, qkv_gain)
        else:
            matrix(p + "attn_q.weight", "attn_q", q_dim, d_model)
            matrix(p + "attn_k.weight", "attn_k", kv_dim, d_model, k_rows)
            matrix(p + "attn_v.weight", "attn_v", kv_dim, d_model)
        if arch in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", head_dim, 1.0, 0.1)
            vector(p + "attn_k_norm.weight", head_dim, 1.0, 0.1, k_gain)
        if arch == "qwen2":
            vector(p + "attn_q.bias", d_model, 0.0, 0.5)
            vector(p + "attn_k.bias", kv_dim, 0.0, 0.5, k_rows)
            vector(p + "attn_v.bias", kv_dim, 0.0, 0.5)
        matrix(p + "attn_output.weight", "attn_output", d_model, q_dim)
        if arch == "gemma3":
            vector(p + "post_attention_norm.weight", d_model, 1.0, 0.1)
        vector(p + "ffn_norm.weight", d_model, 1.0, 0.1)
        if arch == "phi3":  # fused [gate; up]: llama.cpp's swiglu takes silu(first half)
            matrix(p + "ffn_up.weight", "ffn_up", 2 * ffn_dim, d_model)
        else:
            matrix(p + "ffn_gate.weight", "ffn_gate", ffn_dim, d_model)
            matrix(p + "ffn_up.weight", "ffn_up", ffn_dim, d_model)
        matrix(p + "ffn_down.weight", "ffn_down", d_model, ffn_dim)
        if arch == "gemma3":
            vector(p + "post_ffw_norm.weight", d_model, 1.0, 0.1)
    vector("output_norm.weight", d_model, 1.0, 0.1)
    if not tied:
        matrix("output.weight", "output", n_vocab, d_model, gain=3.0)
    if extra is not None:
        extra(w)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------- pytest fixture


def _cache_key(arch: str, tensor_type: Any, kw: Mapping[str, Any]) -> str:
    blob = json.dumps([arch, tensor_type, sorted(kw.items())], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def synthetic_gguf(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., Path]]:
    """Factory: `synthetic_gguf(arch, tensor_type="q8_0", **kw) -> Path`, one file per arguments."""
    folder = tmp_path_factory.mktemp("synthetic-gguf")
    made: dict[str, Path] = {}

    def make(arch: str, tensor_type: str | Mapping[str, str] = "q8_0", **kw: Any) -> Path:
        key = _cache_key(arch, tensor_type, kw)
        if key not in made:
            tag = tensor_type if isinstance(tensor_type, str) else "mixed"
            made[key] = write_synthetic_gguf(
                folder / f"{arch}-{tag}-{key}.gguf", arch, tensor_type=tensor_type, **kw
            )
        return made[key]

    yield make
