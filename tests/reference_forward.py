"""An independent, plain-numpy forward pass over a GGUF file: the numerics oracle for the engine.

Written from the math of the three supported architectures, not from any graph builder, so that
graphs built by the engine can be checked against it on synthetic models. It is in turn checked
against llama.cpp's own log-probabilities on the real models (tests/test_reference_forward.py).

Conventions taken from llama.cpp (verified in its source):
- `llama_model_rope_type`: LLAMA uses "normal" RoPE (rotate consecutive pairs x[2i], x[2i+1];
  convert_hf_to_gguf permutes q/k rows so this equals HF's rotate-half); QWEN2 and PHI3 use NEOX
  RoPE (rotate x[i] with x[i + n_rot/2]). Dims past `rope.dimension_count` are not rotated.
- GQA: query head h reads KV head h // (n_heads / n_kv_heads).
- Phi-3's fused `attn_qkv` rows are [q; k; v]; its fused `ffn_up` rows are [gate; up], and
  llama.cpp's swiglu computes silu(first half) * second half.
- GGUF stores a [out, in] matrix with GGML shape (in, out): numpy shape is the reverse.
- Llama 3 (`rope_freqs.weight`): ggml's rope divides frequency i's angle by factor i.
- QWEN3: RMSNorm of each Q and K head (`attn_q_norm`, `attn_k_norm`) before RoPE (NEOX).
- GEMMA3 (src/models/gemma3.cpp): embeddings × sqrt(d_model); Q/K head norms before RoPE (NEOX);
  Q × 1/sqrt(head_dim) (1/sqrt(d_model/n_heads) for the 62-layer 27B) and no further scale;
  `post_attention_norm` on the attention output and `post_ffw_norm` on the MLP output before
  each residual add; MLP gelu(gate, tanh form) · up. Layer i slides unless i % 6 == 5
  (`sliding_window_pattern`, when recorded, says otherwise); a sliding row at position p sees
  positions p-window+1..p and rotates with base `rope.freq_base_swa` (default 10000) unscaled.
  The converter already added Gemma's +1 to every norm weight: the GGUF norms are used as is.
- Sliding windows on llama files (Mistral-family) apply to every layer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf.quants import dequantize

from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.model_config import ModelConfig

__all__ = ["ROPE_NEOX_ARCHS", "ReferenceModel", "log_softmax"]

ROPE_NEOX_ARCHS = frozenset({"qwen2", "phi3", "qwen3", "gemma3"})


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


class ReferenceModel:
    """`ReferenceModel(path).logits(token_ids)` -> [len(token_ids), vocab] logits, all positions.

    `dtype` is the compute precision (float64 by default; float32 halves the memory for the real
    models). With `cache_weights=False` each forward dequantizes the tensors it needs again, which
    keeps a 0.5B model's memory at one layer's worth. `rope_neox` overrides the per-arch RoPE
    pairing (tests use it as a negative control: the wrong pairing must visibly fail).
    `kv_dtype` rounds every K (after RoPE) and V row as a cache of that storage would: "f16"
    to float16 and back; "int8" to `round(x / a)·a` with a = absmax/127 per (token, head)
    (llama.cpp's q8_0 is the same with blocks of 32 instead of a whole head), K divided by
    its per-channel smoothing first and multiplied back after (`k_smoothing`; off with
    `smooth_k=False`), the scheme written out here from its definition.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: type[np.floating] = np.float64,
        cache_weights: bool = True,
        rope_neox: bool | None = None,
        kv_dtype: str = "f32",
        smooth_k: bool = True,
    ) -> None:
        if kv_dtype not in ("f32", "f16", "int8"):
            raise ValueError(f"unknown kv_dtype {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        self.smooth_k = smooth_k
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._gguf = GGUFFile(self.path)
        self.config: ModelConfig = self._gguf.config
        if self.config.rope_scaling.type not in ("none", "linear"):
            raise NotImplementedError(
                f"reference RoPE has no {self.config.rope_scaling.type!r} scaling"
            )
        self._cache: dict[str, np.ndarray] | None = {} if cache_weights else None
        self.rope_neox = self.config.arch in ROPE_NEOX_ARCHS if rope_neox is None else rope_neox
        self._read_arch_features()

    def _read_arch_features(self) -> None:
        """The per-arch math, read from the metadata as llama.cpp's loaders read it."""
        c, m = self.config, self._gguf.metadata
        arch = c.arch
        self.gemma = arch == "gemma3"
        self.qk_norm = arch in ("qwen3", "gemma3")
        window = int(m.get(f"{arch}.attention.sliding_window", 0) or 0)
        self.window = window if arch in ("llama", "gemma3") else 0
        if self.gemma:
            pattern = m.get("gemma3.attention.sliding_window_pattern", 6)
            if isinstance(pattern, (list, np.ndarray)):
                self.sliding = [bool(x) for x in pattern]
            else:
                self.sliding = [i % int(pattern) < int(pattern) - 1 for i in range(c.n_layers)]
            self.swa_base = float(m.get("gemma3.rope.freq_base_swa", 10000.0))
            per_head = c.d_model / c.n_heads if c.n_layers == 62 else c.head_dim
            self.q_scale = 1.0 / np.sqrt(per_head)
        else:
            self.sliding = [self.window > 0] * c.n_layers
            self.swa_base = c.rope_theta
            self.q_scale = 1.0 / np.sqrt(c.head_dim)
        if not self.window:
            self.sliding = [False] * c.n_layers
        self.freq_factors = (
            self.tensor("rope_freqs.weight").astype(np.float64)
            if self.has("rope_freqs.weight")
            else None
        )

    def close(self) -> None:
        self._cache = {} if self._cache is not None else None
        self._gguf.close()

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized tensor in numpy order (reversed GGML dims), in the compute dtype."""
        if self._cache is not None and name in self._cache:
            return self._cache[name]
        info = self._gguf.tensors[name]
        flat = dequantize(self._gguf.raw(name), info.ggml_type)
        out = np.asarray(flat, dtype=self.dtype).reshape(tuple(reversed(info.shape)))
        if self._cache is not None:
            self._cache[name] = out
        return out

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Selected rows of a 2-D tensor, dequantizing only those rows (embedding lookup)."""
        if self._cache is not None and name in self._cache:
            return self._cache[name][ids]
        info = self._gguf.tensors[name]
        n_rows = info.shape[1]
        raw = self._gguf.raw(name).reshape(n_rows, -1)[ids]
        flat = dequantize(np.ascontiguousarray(raw), info.ggml_type)
        return np.asarray(flat, dtype=self.dtype).reshape(ids.size, info.shape[0])

    def has(self, name: str) -> bool:
        return name in self._gguf.tensors

    # ------------------------------------------------------------------ building blocks

    def _rms_norm(self, x: np.ndarray, weight_name: str) -> np.ndarray:
        """RMSNorm over the last axis (whole rows, or each head's head_dim values)."""
        eps = self.config.rms_eps
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * self.tensor(weight_name)

    def rope(self, x: np.ndarray, positions: np.ndarray, sliding: bool = False) -> np.ndarray:
        """Rotate x [heads, seq, head_dim] by position; first rope_dim dims only."""
        c = self.config
        n_rot = c.rope_dim
        pos = positions.astype(np.float64)
        base = self.swa_base if sliding and self.gemma else c.rope_theta
        inv_freq = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        if not (sliding and self.gemma):  # Gemma's sliding layers rotate unscaled
            if c.rope_scaling.type == "linear":
                pos = pos / c.rope_scaling.factor
            if self.freq_factors is not None:
                inv_freq = inv_freq / self.freq_factors
        angle = pos[:, None] * inv_freq[None, :]  # [seq, n_rot/2]
        cos = np.cos(angle).astype(self.dtype)
        sin = np.sin(angle).astype(self.dtype)
        out = x.copy()
        if self.rope_neox:
            a, b = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]
            out[..., : n_rot // 2] = a * cos - b * sin
            out[..., n_rot // 2 : n_rot] = a * sin + b * cos
        else:
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        return out

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.tensor(f"{name}.weight").T
        if self.has(f"{name}.bias"):
            y = y + self.tensor(f"{name}.bias")
        return y

    def _attention(self, x: np.ndarray, layer: int, positions: np.ndarray) -> np.ndarray:
        c = self.config
        p = f"blk.{layer}."
        seq, hd = x.shape[0], c.head_dim
        q_dim, kv_dim = c.n_heads * hd, c.n_kv_heads * hd
        if c.fused_qkv:
            qkv = self._linear(x, p + "attn_qkv")
            q, k, v = (
                qkv[:, :q_dim],
                qkv[:, q_dim : q_dim + kv_dim],
                qkv[:, q_dim + kv_dim : q_dim + 2 * kv_dim],
            )
        else:
            q = self._linear(x, p + "attn_q")
            k = self._linear(x, p + "attn_k")
            v = self._linear(x, p + "attn_v")
        q = q.reshape(seq, c.n_heads, hd).transpose(1, 0, 2)
        k = k.reshape(seq, c.n_kv_heads, hd).transpose(1, 0, 2)
        v = v.reshape(seq, c.n_kv_heads, hd).transpose(1, 0, 2)
        if self.qk_norm:
            q = self._rms_norm(q, p + "attn_q_norm.weight")
            k = self._rms_norm(k, p + "attn_k_norm.weight")
        sliding = self.sliding[layer]
        q = self.rope(q, positions, sliding)
        k = self._stored(self.rope(k, positions, sliding), layer, "k")
        v = self._stored(v, layer, "v")
        group = c.n_heads // c.n_kv_heads
        k = np.repeat(k, group, axis=0)  # head h -> kv head h // group
        v = np.repeat(v, group, axis=0)
        scores = (q @ k.transpose(0, 2, 1)) * self.q_scale
        distance = positions[:, None] - positions[None, :]
        hidden = distance < 0
        if sliding:
            hidden |= distance >= self.window
        scores = np.where(hidden[None], -np.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = (probs @ v).transpose(1, 0, 2).reshape(seq, q_dim)
        return self._linear(out, p + "attn_output")

    def _stored(self, x: np.ndarray, layer: int, kind: str) -> np.ndarray:
        """Rows [heads, seq, head_dim] of cache `kind` of `layer` as the cache gives them back."""
        if self.kv_dtype == "f16":
            return x.astype(np.float16).astype(self.dtype)
        if self.kv_dtype == "int8":
            s = self.k_smoothing(layer)[:, None, :] if kind == "k" and self.smooth_k else 1.0
            scale = np.maximum(np.abs(x / s).max(axis=-1, keepdims=True) / 127.0, 1e-30)
            return np.clip(np.round(x / s / scale), -127, 127) * scale * s
        return x

    def k_smoothing(self, layer: int) -> np.ndarray:
        """The int8 cache's K divisor per (KV head, channel) `[Hkv, head_dim]`: each channel's
        typical size from the weights (`sqrt(bias² + |W_k row · attn_norm|²)`, or |k_norm|
        for per-head-normed K), the larger of its rotary pair's two, over the head's median,
        rounded down to a power of two, from 1 to 2^12."""
        c, p = self.config, f"blk.{layer}."
        hd, q_dim, kv_dim = c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        if self.qk_norm:
            size = np.abs(self.tensor(p + "attn_k_norm.weight"))[None, :].repeat(c.n_kv_heads, 0)
        else:
            name = p + ("attn_qkv" if c.fused_qkv else "attn_k")
            rows = slice(q_dim, q_dim + kv_dim) if c.fused_qkv else slice(0, kv_dim)
            w = self.tensor(name + ".weight")[rows] * self.tensor(p + "attn_norm.weight")
            b = self.tensor(name + ".bias")[rows] if self.has(name + ".bias") else 0.0
            size = np.sqrt((w * w).sum(axis=1) + b * b).reshape(c.n_kv_heads, hd)
        i = np.arange(hd)
        partner = (i + hd // 2) % hd if self.rope_neox else i ^ 1
        size = np.maximum(size, size[:, partner])
        exp = np.floor(np.log2(size / np.median(size, axis=1, keepdims=True)))
        return 2.0 ** np.clip(exp, 0, 12)

    def _mlp(self, x: np.ndarray, layer: int) -> np.ndarray:
        p = f"blk.{layer}."
        if self.config.fused_gate_up:
            gate_up = self._linear(x, p + "ffn_up")
            half = gate_up.shape[-1] // 2
            gate, up = gate_up[:, :half], gate_up[:, half:]
        else:
            gate = self._linear(x, p + "ffn_gate")
            up = self._linear(x, p + "ffn_up")
        if self.gemma:  # GELU, tanh approximation
            act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            act = gate / (1.0 + np.exp(-gate))
        return self._linear(act * up, p + "ffn_down")

    # ------------------------------------------------------------------ the model

    def hidden_states(self, token_ids: np.ndarray | list[int]) -> np.ndarray:
        """Final-norm hidden states [seq, d_model] for the tokens at positions 0..seq-1."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError("token id out of the vocabulary")
        positions = np.arange(ids.size)
        x = self.rows("token_embd.weight", ids)
        if self.gemma:
            x = x * np.sqrt(self.config.d_model)
        for layer in range(self.config.n_layers):
            p = f"blk.{layer}."
            h = self._attention(self._rms_norm(x, p + "attn_norm.weight"), layer, positions)
            if self.gemma:
                h = self._rms_norm(h, p + "post_attention_norm.weight")
            x = x + h
            h = self._mlp(self._rms_norm(x, p + "ffn_norm.weight"), layer)
            if self.gemma:
                h = self._rms_norm(h, p + "post_ffw_norm.weight")
            x = x + h
        return self._rms_norm(x, "output_norm.weight")

    def logits(self, token_ids: np.ndarray | list[int]) -> np.ndarray:
        """Logits [seq, vocab] at every position (teacher-forced, causal)."""
        h = self.hidden_states(token_ids)
        head = "token_embd.weight" if self.config.tied_embeddings else "output.weight"
        return h @ self.tensor(head).T
