"""What each architecture's GGUF may ask for, and the refusal of anything the graphs do not do.

A GGUF records its model's math in two places: metadata keys (`{arch}.rope.scaling.type`,
`{arch}.final_logit_softcapping`, ...) and the tensors it carries (`rope_freqs.weight`,
`blk.N.ffn_gate_exps.weight`, ...). A feature the engine silently ignored would give a model that
runs and answers subtly wrong at every position, so `check_features` refuses, with one line naming
the feature, every key whose value asks for math we do not implement and every tensor name outside
the arch's known set (which catches mixture-of-experts, biases we do not add, extra heads...).
`arch_traits` turns the implemented features into the fields of `ModelConfig`.

Conventions follow llama.cpp's loaders (`src/models/<arch>.cpp`): Gemma 3 marks every sixth
layer global (`set_swa_pattern(6)`: layer i is sliding unless i % 6 == 5) unless the file records
`attention.sliding_window_pattern`, and its sliding layers use rope base 10000 with no scaling
unless `rope.freq_base_swa` says otherwise; llama.cpp's converter already adds Gemma's "+1" to
every norm weight, so the GGUF norms are plain RMSNorm weights. Phi-3's window is not applied by
llama.cpp (it warns and disables it); the engine keeps Phi-3 within its window instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import UnsupportedModelError

__all__ = [
    "SUPPORTED_ARCHS",
    "ArchTraits",
    "arch_traits",
    "check_arch",
    "check_config",
    "check_features",
]

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3")

_GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight"}
_LAYER_COMMON = {"attn_norm", "attn_output", "ffn_norm", "ffn_up", "ffn_down"}
_SPLIT_QKV = {"attn_q", "attn_k", "attn_v"}
# Per arch: the `blk.N.<name>.weight` names and the `blk.N.<name>.bias` names it may carry.
_LAYER_WEIGHTS: dict[str, set[str]] = {
    "llama": _LAYER_COMMON | _SPLIT_QKV | {"ffn_gate"},
    "qwen2": _LAYER_COMMON | _SPLIT_QKV | {"ffn_gate"},
    "qwen3": _LAYER_COMMON | _SPLIT_QKV | {"ffn_gate", "attn_q_norm", "attn_k_norm"},
    "phi3": _LAYER_COMMON | {"attn_qkv"},
    "gemma3": _LAYER_COMMON
    | _SPLIT_QKV
    | {"ffn_gate", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"},
}
_LAYER_BIASES: dict[str, set[str]] = {
    "llama": _SPLIT_QKV,
    "qwen2": _SPLIT_QKV,
    "qwen3": set(),
    "phi3": {"attn_qkv"},
    "gemma3": set(),
}
_EXTRA_GLOBALS: dict[str, set[str]] = {"llama": {"rope_freqs.weight"}}

# Tensor name fragments that say which feature an unknown tensor belongs to.
_TENSOR_FEATURES = (
    ("_exps", "mixture-of-experts expert tensors"),
    ("_shexp", "mixture-of-experts shared experts"),
    ("ffn_gate_inp", "a mixture-of-experts router"),
    ("rope_factors", "per-frequency rope factors (longrope)"),
    ("rope_freqs", "per-frequency rope factors"),
    ("_norm", "a norm the graphs do not apply"),
    (".bias", "a bias the graphs do not add"),
    ("nextn", "multi-token prediction layers"),
    ("dense_", "extra dense projections (an embedding model)"),
    ("cls", "a classifier head"),
)

_RE_LAYER = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


class _GGUFLike(Protocol):
    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    def raw(self, name: str) -> np.ndarray: ...


@dataclass(frozen=True)
class ArchTraits:
    """The `ModelConfig` fields an architecture's features set (see `ModelConfig`)."""

    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    attention_scale: float = 0.0  # 0: 1/√head_dim
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_theta_swa: float = 0.0  # 0: the global base
    rope_freq_factors: tuple[float, ...] = ()


def _feature(name: str, feature: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{name}: {feature} is not implemented; npuchat cannot run it")


def _num(m: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    value = m.get(key, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _int(m: Mapping[str, Any], key: str, default: int = 0) -> int:
    """A whole-number key (`default` when absent); a value that is no number is refused."""
    value = _num(m, key, default)
    if not math.isfinite(value):
        shown = repr(m.get(key))[:40]
        raise UnsupportedModelError(f"{key} = {shown} is not a number; the file is damaged")
    return int(value)


def check_arch(name: str, arch: str) -> None:
    """Refuse an architecture the engine has no graphs for (before reading its keys)."""
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{name}: architecture {arch or '(none)'!r} is not supported; "
            f"npuchat runs {', '.join(SUPPORTED_ARCHS)} models"
        )


def check_features(g: _GGUFLike, name: str, arch: str) -> None:
    """Raise `UnsupportedModelError` naming the first feature of `g` the engine does not do.

    Call it once the hyperparameters themselves were read and checked (`ModelConfig`)."""
    check_arch(name, arch)
    m = g.metadata
    a = f"{arch}."
    if _int(m, a + "expert_count") > 0 or _int(m, a + "expert_used_count") > 0:
        n = _int(m, a + "expert_count")
        raise _feature(name, f"mixture-of-experts ({n} experts)")
    scaling = str(m.get(a + "rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise _feature(name, f"rope scaling {scaling!r}")
    if any(k.startswith(a + "rope.scaling.yarn") for k in m):
        raise _feature(name, "YaRN rope scaling")
    if _num(m, a + "rope.scaling.attn_factor", 1.0) != 1.0:
        raise _feature(name, "rope attention factor")
    if m.get(a + "rope.dimension_sections") is not None:
        raise _feature(name, "multi-section rope (M-RoPE)")
    for key, feature in (
        ("attn_logit_softcapping", "attention logit soft-capping"),
        ("final_logit_softcapping", "final logit soft-capping"),
        ("attention.max_alibi_bias", "ALiBi position bias"),
        ("attention.clamp_kqv", "Q/K/V clamping"),
        ("logit_scale", "logit scaling"),
        ("residual_scale", "residual scaling"),
        ("embedding_scale", "embedding scaling"),
        ("attention.scale", "a custom attention scale"),
        ("expert_shared_count", "mixture-of-experts shared experts"),
        ("nextn_predict_layers", "multi-token prediction layers"),
    ):
        if _num(m, a + key) != 0.0:
            raise _feature(name, feature)
    if m.get(a + "attention.causal", True) is False:
        raise _feature(name, "non-causal attention")
    if a + "attention.layer_norm_epsilon" in m and a + "attention.layer_norm_rms_epsilon" not in m:
        raise _feature(name, "LayerNorm (only RMSNorm is)")
    n_heads = max(1, _int(m, a + "attention.head_count", 1))
    per_head = _int(m, a + "embedding_length") // n_heads
    k_len = _int(m, a + "attention.key_length", per_head)
    v_len = _int(m, a + "attention.value_length", k_len)
    if k_len != v_len:
        raise _feature(name, f"different K and V head sizes ({k_len} vs {v_len})")
    window = _int(m, a + "attention.sliding_window")
    if window > 0 and arch in ("qwen2", "qwen3"):
        raise _feature(name, f"sliding-window attention on {arch}")
    if arch != "gemma3":
        for key in ("attention.sliding_window_pattern", "rope.freq_base_swa"):
            if a + key in m:
                raise _feature(name, f"interleaved sliding-window layers ({arch}.{key})")
    _check_tensors(g, name, arch)


def _check_tensors(g: _GGUFLike, name: str, arch: str) -> None:
    weights, biases = _LAYER_WEIGHTS[arch], _LAYER_BIASES[arch]
    globals_ = _GLOBAL_TENSORS | _EXTRA_GLOBALS.get(arch, set())
    n_layers = _int(g.metadata, f"{arch}.block_count")
    for tensor in g.tensors:
        hit = _RE_LAYER.match(tensor)
        if hit is None:
            known = tensor in globals_
        else:
            layer, part, kind = int(hit.group(1)), hit.group(2), hit.group(3)
            known = layer < n_layers and part in (weights if kind == "weight" else biases)
        if not known:
            feature = next((f for frag, f in _TENSOR_FEATURES if frag in tensor), "")
            what = f"tensor {tensor}" + (f" ({feature})" if feature else "")
            raise _feature(name, what)


def _swa_layers(m: Mapping[str, Any], arch: str, n_layers: int, window: int) -> tuple[bool, ...]:
    if window <= 0 or arch == "phi3":
        return ()
    if arch != "gemma3":  # Mistral-family llama files: one window for every layer
        return (True,) * n_layers
    pattern = m.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, np.ndarray)):
        flags = tuple(bool(x) for x in pattern)
        if len(flags) != n_layers:
            raise UnsupportedModelError(
                f"gemma3.attention.sliding_window_pattern has {len(flags)} entries "
                f"for {n_layers} layers"
            )
        return flags
    if isinstance(pattern, bool) or not isinstance(pattern, int | np.integer) or pattern < 0:
        raise UnsupportedModelError(
            f"gemma3.attention.sliding_window_pattern = {pattern!r} is not a layer count"
        )
    n = int(pattern)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layers))


def arch_traits(g: _GGUFLike, name: str, arch: str, head_dim: int, d_model: int) -> ArchTraits:
    """The implemented features `g` uses (call `check_features` first)."""
    m = g.metadata
    n_layers = _int(m, f"{arch}.block_count")
    window = _int(m, f"{arch}.attention.sliding_window")
    swa = _swa_layers(m, arch, n_layers, window)
    factors: tuple[float, ...] = ()
    if "rope_freqs.weight" in g.tensors:
        info = g.tensors["rope_freqs.weight"]
        if info.ggml_type.name != "F32" or info.n_elements != head_dim // 2:
            raise _feature(name, f"rope_freqs.weight of {info.n_elements} {info.ggml_type.name}")
        values = np.frombuffer(g.raw("rope_freqs.weight"), dtype="<f4")
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise UnsupportedModelError(f"{name}: rope_freqs.weight holds non-positive factors")
        factors = tuple(float(v) for v in values)
    if arch == "gemma3":
        # llama.cpp: 1/sqrt(d_model / n_heads) for the 62-layer 27B, else 1/sqrt(head_dim).
        n_heads = _int(m, "gemma3.attention.head_count")
        per_head = d_model / n_heads if n_layers == 62 else head_dim
        return ArchTraits(
            qk_norm=True,
            post_norms=True,
            activation="gelu_tanh",
            embed_scale=math.sqrt(d_model),
            attention_scale=1.0 / math.sqrt(per_head),
            sliding_window=window if any(swa) else 0,
            swa_layers=swa if any(swa) else (),
            rope_theta_swa=_num(m, "gemma3.rope.freq_base_swa", 10000.0) if any(swa) else 0.0,
        )
    return ArchTraits(
        qk_norm=arch == "qwen3",
        sliding_window=window if swa else 0,
        swa_layers=swa,
        rope_freq_factors=factors,
    )


def check_config(cfg: Any) -> None:
    """Refuse shapes the graphs do not implement (a `ModelConfig`, read from the GGUF)."""
    if cfg.rope_dim != cfg.head_dim:
        rot = f"partial rotary (rope dim {cfg.rope_dim} of head dim {cfg.head_dim})"
        raise _feature(cfg.name, rot)
    if cfg.n_kv_heads <= 0 or cfg.n_heads % cfg.n_kv_heads:
        raise _feature(cfg.name, f"{cfg.n_heads} heads over {cfg.n_kv_heads} KV heads")
    if cfg.rope_freq_factors and len(cfg.rope_freq_factors) != cfg.rope_dim // 2:
        raise _feature(cfg.name, "rope frequency factors of another rope size")
