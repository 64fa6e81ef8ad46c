"""How K/V rows are stored: the cache dtypes, and snapshots of rows in that storage.

`f32` keeps the rows as the graph computes them. `f16` halves them (a Cast on write and on
read). `int8` quarters them: each row of one head (head_dim values) is stored as int8 with its
own float32 scale, `absmax / 127`, quantized in the graph when the row is written and applied
inside attention; 4 bytes per (token, head) on top of head_dim bytes. K is divided first by a
per-channel power of two taken from the weights (`kv_smoothing`: its outlier channels are the
same from token to token), and Q multiplied by it, which leaves q·k unchanged.

Why this scheme (`python benchmarks/kv_schemes.py MODEL --tokens 768`: the numpy reference,
perplexity over 768 tokens of Python's argparse.py against f32 K/V, mean relative row errors;
each scheme quantizes every row on its own, as decode == verify needs):

| scheme (K; V per token-head unless said) | qwen2.5-coder-0.5b Δppl | errK | smollm2-135m Δppl |
|---|---|---|---|
| one scale per (token, head) | +2.30% | 9.5e-3 | +0.06% |
| blocks of 32 (llama.cpp's q8_0 layout) | +1.65% | 7.9e-3 | +0.28% |
| K smoothed, powers from a calibration pass (K absmax) | +0.17% | 5.4e-3 | +0.22% |
| K smoothed, powers from a calibration pass (K RMS) | -0.02% | 6.9e-3 | +0.15% |
| K smoothed, powers from the weights (nearest power) | -0.10% | 7.0e-3 | -0.43% |
| K and V smoothed (calibration RMS) | +0.01% | 6.9e-3 | +0.08% |
| K smoothed, from the weights, rounded down, at least 1 (used) | see below | | +0.08% |

The weights give what a calibration pass gives, with no forward pass at build time, and
smoothing V adds nothing. Rounding the powers to the nearest one scaled random channels by 2x
on models without outliers and made them slightly worse; rounded down and at least 1 (the
scheme used), only channels at 2x their head's median or more move. On qwen2.5-coder-0.5b the
graphs then give +0.02% perplexity over 1,024 tokens and mean KL 1.2e-3 against f32, where one
scale per (token, head) gave +2.04% and 5.1e-3; smollm2-135m +0.06% over 4,096 tokens
(`benchmarks/kv_quality.py`; README). Cost: two Muls per layer on [Hkv, dh]-broadcast tensors.

A snapshot is copied out and back in its cache's storage, never converted: its rows are only
meaningful in a cache of the same dtype, so a mismatch is an error, not a silent conversion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import NpuchatError

__all__ = [
    "DEFAULT_CONTEXT",
    "KV_AUTO",
    "KV_CHOICES",
    "KV_DTYPES",
    "MAX_CONTEXT",
    "MIN_CONTEXT",
    "KVSnapshot",
    "attention_window",
    "bytes_per_token",
    "check_context",
    "check_kv_dtype",
    "default_capacities",
    "kv_dtype_of",
    "quantize_rows",
    "resolve_kv_dtype",
]

KV_DTYPES: dict[str, type[np.generic]] = {"f32": np.float32, "f16": np.float16, "int8": np.int8}
_SCALE_BYTES = 4  # one float32 per (token, head) for int8 rows


KV_AUTO = "auto"  # f16 where the native attention reads it in place (the CPU's), else f32
KV_CHOICES = (KV_AUTO, *KV_DTYPES)  # what a user may ask for


def resolve_kv_dtype(name: str, device: str, native_attention: bool) -> str:
    """The dtype `name` stands for on `device`: "auto" is f16 where the native attention runs
    (`native_attention`: the CPU with the kernels; it widens half rows in L1: half the memory
    and the bytes a long context's step reads, as llama.cpp's default cache) and f32 elsewhere
    (ONNX Runtime's own ops would convert the whole cache every step). Others are checked as
    given; the NPU's graphs keep f32 or int8, so f16 there is a one-line error."""
    dtype = ("f16" if native_attention else "f32") if name == KV_AUTO else check_kv_dtype(name)
    if device == "npu" and dtype == "f16":
        raise NpuchatError("the NPU graph keeps f32 or int8 K/V; use one of them")
    return dtype


def check_kv_dtype(name: str) -> str:
    """`name` if it is a KV dtype; a one-line error that lists them otherwise."""
    if name not in KV_DTYPES:
        raise NpuchatError(f"unknown KV dtype {name!r}: use one of {', '.join(KV_DTYPES)}")
    return name


def kv_dtype_of(dtype: np.dtype) -> str | None:
    """The KV dtype name of arrays of `dtype`, None when it is none of them."""
    return next((name for name, t in KV_DTYPES.items() if np.dtype(t) == dtype), None)


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 rows and their scales `[..., 1]` for float rows `[..., dh]`, as the CPU graph
    quantizes them (`graph_attention._store_rows`): scale `max(absmax / 127, tiny)`, values
    rounded half to even. The NPU's static graphs return float rows; the host stores them so."""
    x = np.asarray(rows, np.float32)
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    scale = np.maximum(absmax / np.float32(127.0), np.float32(1e-30))
    return np.clip(np.rint(x / scale), -128, 127).astype(np.int8), scale


def bytes_per_token(kv_dtype: str, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """K and V bytes one token takes in every layer (int8: with its scales)."""
    per_head = head_dim * np.dtype(KV_DTYPES[kv_dtype]).itemsize
    if kv_dtype == "int8":
        per_head += _SCALE_BYTES
    return 2 * n_layers * n_kv_heads * per_head


@dataclass
class KVSnapshot:
    """Copies of K/V rows `[start, start+length)`, per layer `[1, Hkv, length, dh]`, in the
    cache's storage; for int8, `k_scale`/`v_scale` per layer `[1, Hkv, length, 1]` float32.

    K rows carry rotary encoding for their absolute positions, so a snapshot is only valid when
    imported at the slot it was exported from (the prefix store keeps prefixes at slot 0).
    `ring_from`: the sliding-window layers' rows below this position were no longer in their
    ring when the rows were taken (zeros here); a prefix that needs them is not usable
    (`kv_ring`). At or below `start`: every row is held.
    """

    start: int
    k: list[np.ndarray]
    v: list[np.ndarray]
    k_scale: list[np.ndarray] = field(default_factory=list)
    v_scale: list[np.ndarray] = field(default_factory=list)
    ring_from: int = field(default=0, kw_only=True)

    @property
    def length(self) -> int:
        return int(self.k[0].shape[2]) if self.k else 0

    @property
    def kv_dtype(self) -> str | None:
        return kv_dtype_of(self.k[0].dtype) if self.k else None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for part in self.parts() for a in part)

    def parts(self) -> list[list[np.ndarray]]:
        """The per-layer array lists: K, V, then (int8) their scales."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.k_scale else [])

    def _map(self, start: int, f: Callable[[np.ndarray], np.ndarray]) -> KVSnapshot:
        k, v, *scales = [[f(a) for a in part] for part in self.parts()]
        return KVSnapshot(start, k, v, *scales, ring_from=self.ring_from)

    def rows(self, start: int, end: int) -> KVSnapshot:
        """Rows `[start, end)` counted from this snapshot's first row (views, not copies)."""
        return self._map(self.start + start, lambda a: a[:, :, start:end])

    @classmethod
    def concat(cls, parts: Sequence[KVSnapshot]) -> KVSnapshot:
        """Consecutive snapshots joined into one starting at the first's slot."""
        lists = [p.parts() for p in parts]
        k, v, *scales = [
            [np.concatenate([p[j][i] for p in lists], axis=2) for i in range(len(lists[0][j]))]
            for j in range(len(lists[0]))
        ]
        # the last part missing ring rows decides (the ones after it hold all theirs)
        missing = [p.ring_from for p in parts if p.ring_from > p.start]
        return cls(parts[0].start, k, v, *scales, ring_from=max(missing, default=0))


DEFAULT_CONTEXT = 8192
"""The largest KV capacity when the user asks for none: a model's trained context (32,768 for
Qwen2.5) costs memory as the cache fills; `--context` / the `context` setting raise it."""
MIN_CONTEXT = 256  # the smallest capacity variant
MAX_CONTEXT = 1 << 20  # beyond any model here; a bound on what a config file can ask for


def check_context(asked: int | None, trained: int, name: str) -> None:
    """Refuse a context (`--context`; None: the default, `DEFAULT_CONTEXT` at most) that the
    model cannot hold, in one line that gives the range it can."""
    if asked is not None and not MIN_CONTEXT <= asked <= trained:
        raise NpuchatError(
            f"a context of {asked} tokens: {name} holds {MIN_CONTEXT} to {trained}; "
            "give a number in that range"
        )


def default_capacities(context_length: int, limit: int | None = None) -> list[int]:
    """KV capacity variants up to the model's context (at most `limit`, default
    `DEFAULT_CONTEXT`).

    Every decode step reads the whole `[C]` cache (masked), so the waste is the gap between the
    fill level and C: steps of 256 up to 2048 and of 1024 beyond keep it ≤ 25%. On the CPU a
    variant costs nothing but the one copy when the cache moves to it (one symbolic graph).
    """
    top = max(1, min(context_length, DEFAULT_CONTEXT if limit is None else limit))
    steps = [*range(256, 2048, 256), *range(2048, top, 1024)]
    return [*(c for c in steps if c < top), top]


def attention_window(capacities: Sequence[int], capacity: int, needed: int) -> int:
    """The cache slots a CPU step attends (`GraphSpec.attn_window`): the smallest capacity
    variant that holds `needed` slots, at most the cache's capacity. Variants, not the exact
    length: every width is a shape ONNX Runtime sizes its buffers for on its first run, and
    the variants keep the slots attended past the rows' ends to at most about 25%."""
    return next((c for c in capacities if needed <= c <= capacity), capacity)
