"""The hyperparameters of a model, read from its GGUF metadata and checked.

Apart from `gguf_reader` (the file format: header, metadata, tensor directory) because this is
what the rest of the engine consumes: the graph builder, the KV cache and the reference forward
pass take a `ModelConfig`, never the file, and every absurd or missing value is refused here
with a one-line error before anything is sized from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .arch_features import arch_traits, check_arch, check_config, check_features
from .errors import UnsupportedModelError

if TYPE_CHECKING:
    from .gguf_reader import GGUFFile


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling as GGUF records it; type "none" for plain RoPE."""

    type: str = "none"
    factor: float = 1.0
    original_context_length: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the graph builder and the reference forward pass need about a model."""

    arch: str
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rope_dim: int
    rope_scaling: RopeScaling
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    fused_qkv: bool
    fused_gate_up: bool
    # Features of the newer archs (`arch_features`); the defaults are plain Llama math.
    qk_norm: bool = False  # per-head RMSNorm of Q and K before rotary (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs (Gemma 3)
    activation: str = "silu"  # gated MLP activation: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(d_model))
    attention_scale: float = 0.0  # Q·K scale; 0 means 1/sqrt(head_dim)
    sliding_window: int = 0  # rows a sliding layer sees (itself included); 0: none
    swa_layers: tuple[bool, ...] = ()  # which layers slide (empty: none)
    rope_theta_swa: float = 0.0  # rope base of sliding layers; 0: rope_theta
    rope_freq_factors: tuple[float, ...] = ()  # Llama 3 per-frequency divisors of the angle

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_scale(self) -> float:
        """The factor on Q·Kᵀ before softmax."""
        return self.attention_scale or 1.0 / float(np.sqrt(self.head_dim))

    @property
    def mixed_windows(self) -> bool:
        """Some layers slide and some attend globally (two masks per step)."""
        return any(self.swa_layers) and not all(self.swa_layers)

    @property
    def local_rope(self) -> bool:
        """Sliding layers rotate with tables of their own (a second rope base)."""
        return self.mixed_windows and bool(self.rope_theta_swa)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        arch = g.architecture
        check_arch(g.path.name, arch)
        m = g.metadata

        def key(name: str, default: Any = None) -> Any:
            value = m.get(f"{arch}.{name}", default)
            if value is None:
                raise UnsupportedModelError(f"{g.path.name}: GGUF metadata lacks {arch}.{name}")
            return value

        def count(name: str, default: Any = None, low: int = 1) -> int:
            """A whole-number hyperparameter, refused (not crashed on) if absurd."""
            value = key(name, default)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise UnsupportedModelError(
                    f"{g.path.name}: {arch}.{name} = {_short(value)} is not a whole number"
                )
            if not low <= int(value) <= 1 << 40:
                raise UnsupportedModelError(
                    f"{g.path.name}: {arch}.{name} = {int(value)} is out of range; the file"
                    " is damaged"
                )
            return int(value)

        def real(name: str, default: Any = None) -> float:
            value = key(name, default)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise UnsupportedModelError(
                    f"{g.path.name}: {arch}.{name} = {_short(value)} is not a number"
                )
            if not math.isfinite(float(value)) or float(value) <= 0:
                raise UnsupportedModelError(
                    f"{g.path.name}: {arch}.{name} = {float(value)} must be a positive number"
                )
            return float(value)

        d_model = count("embedding_length")
        n_heads = count("attention.head_count")
        n_kv = count("attention.head_count_kv", n_heads)
        if n_heads % n_kv:
            raise UnsupportedModelError(
                f"{g.path.name}: {arch}.attention.head_count_kv = {n_kv} does not divide"
                f" head_count = {n_heads}; the file is damaged"
            )
        head_dim = count("attention.key_length", max(1, d_model // n_heads))
        t = g.tensors
        if "token_embd.weight" not in t:
            raise UnsupportedModelError(f"{g.path.name}: no token_embd.weight tensor")
        embd = t["token_embd.weight"].shape
        if len(embd) != 2:
            raise UnsupportedModelError(
                f"{g.path.name}: token_embd.weight has shape {list(embd)}, not a 2-D table"
            )
        vocab = count("vocab_size", embd[1])
        scaling = RopeScaling(
            type=str(m.get(f"{arch}.rope.scaling.type", "none")),
            factor=real("rope.scaling.factor", 1.0),
            original_context_length=count("rope.scaling.original_context_length", 0, low=0),
        )
        count("block_count")  # checked before the features read it
        check_features(g, g.path.name, arch)
        traits = arch_traits(g, g.path.name, arch, head_dim, d_model)
        cfg = cls(
            arch=arch,
            name=str(m.get("general.name", g.path.stem)),
            n_layers=count("block_count"),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=count("feed_forward_length"),
            vocab_size=vocab,
            context_length=count("context_length"),
            rope_theta=real("rope.freq_base", 10000.0),
            rope_dim=count("rope.dimension_count", head_dim),
            rope_scaling=scaling,
            rms_eps=real("attention.layer_norm_rms_epsilon"),
            tied_embeddings="output.weight" not in t,
            qkv_bias="blk.0.attn_q.bias" in t or "blk.0.attn_qkv.bias" in t,
            fused_qkv="blk.0.attn_qkv.weight" in t,
            fused_gate_up="blk.0.ffn_gate.weight" not in t,
            **vars(traits),
        )
        check_config(cfg)
        return cfg


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
