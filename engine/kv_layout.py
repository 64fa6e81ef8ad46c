"""How K/V rows are stored: the cache dtypes, and snapshots of rows in that storage.

`f32` keeps the rows as the graph computes them. `f16` halves them (a Cast on write and on
read). `int8` quarters them: each row of one head (head_dim values) is stored as int8 with its
own float32 scale, `absmax / 127`, quantized in the graph when the row is written and applied
inside attention; 4 bytes per (token, head) on top of head_dim bytes. Measured on 300 tokens of
real rows of qwen2.5-coder-0.5b (f32 cache), the relative error is 1.1e-2 for K and 7e-3 for
V; blocks of 32 values (llama.cpp's q8_0 layout) gave 9e-3 for K and no better perplexity, so
the simpler scale per head stays. One scale per channel gave 2.6e-3 for K (its outlier
channels are the same from token to token): the scheme to try next for K.

A snapshot is copied out and back in its cache's storage, never converted: its rows are only
meaningful in a cache of the same dtype, so a mismatch is an error, not a silent conversion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import NpuchatError

__all__ = ["KV_DTYPES", "KVSnapshot", "bytes_per_token", "check_kv_dtype", "kv_dtype_of"]

KV_DTYPES: dict[str, type[np.generic]] = {"f32": np.float32, "f16": np.float16, "int8": np.int8}
_SCALE_BYTES = 4  # one float32 per (token, head) for int8 rows


def check_kv_dtype(name: str) -> str:
    """`name` if it is a KV dtype; a one-line error that lists them otherwise."""
    if name not in KV_DTYPES:
        raise NpuchatError(f"unknown KV dtype {name!r}: use one of {', '.join(KV_DTYPES)}")
    return name


def kv_dtype_of(dtype: np.dtype) -> str | None:
    """The KV dtype name of arrays of `dtype`, None when it is none of them."""
    return next((name for name, t in KV_DTYPES.items() if np.dtype(t) == dtype), None)


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
    """

    start: int
    k: list[np.ndarray]
    v: list[np.ndarray]
    k_scale: list[np.ndarray] = field(default_factory=list)
    v_scale: list[np.ndarray] = field(default_factory=list)

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
        return KVSnapshot(start, k, v, *scales)

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
        return cls(parts[0].start, k, v, *scales)
