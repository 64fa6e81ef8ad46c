"""The static KV cache: preallocated per-layer K/V buffers, a fill level, and the masks it implies.

Graphs never see a growing tensor: they read the whole `[1, Hkv, C, dh]` buffers and an additive
mask that hides the slots at and beyond `n`. Static (NPU) graphs return only the new rows, which
the host writes at slot `n`; the CPU graph scatters them into the buffers itself.
Rolling back (rejected draft tokens, an edited message) is moving `n`; nothing is recomputed.
Capacity variants keep attention cost proportional to what is used: the cache lives in the
smallest listed capacity that fits and moves up with one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import NpuchatError
from .graph_builder import MASK_NEG


@dataclass
class KVSnapshot:
    """Copies of K/V rows `[start, start+length)`, per layer `[1, Hkv, length, dh]`.

    K rows carry rotary encoding for their absolute positions, so a snapshot is only valid when
    imported at the slot it was exported from (the prefix store keeps prefixes at slot 0).
    """

    start: int
    k: list[np.ndarray]
    v: list[np.ndarray]

    @property
    def length(self) -> int:
        return int(self.k[0].shape[2]) if self.k else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


class KVCache:
    """Per-layer K and V buffers `[1, Hkv, C, dh]` and the number of valid slots `n`."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacities: Sequence[int],
        dtype: type[np.floating] = np.float32,
    ) -> None:
        if not capacities or min(capacities) < 1:
            raise NpuchatError("KV capacities must be positive integers")
        self.capacities = sorted(set(int(c) for c in capacities))
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype = np.dtype(dtype)
        self.n = 0
        self.capacity = 0
        self.data: np.ndarray = np.zeros(0, self.dtype)
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.generation = 0  # bumped whenever the buffers are replaced (rebind OrtValues)
        self._allocate(self.capacities[0])

    @property
    def max_capacity(self) -> int:
        return self.capacities[-1]

    def bytes_for(self, capacity: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * capacity * self.head_dim * self.dtype.itemsize

    def _allocate(self, capacity: int) -> None:
        """One array `[2, layers, 1, Hkv, C, dh]`; `k[i]`/`v[i]` are contiguous views into it,
        so the graph binds per-layer buffers and the write-back is a single slice copy."""
        data = np.zeros((2, self.n_layers, 1, self.n_kv_heads, capacity, self.head_dim), self.dtype)
        if self.capacity:
            data[..., : self.n, :] = self.data[..., : self.n, :]
        self.k, self.v = [], []  # drop the old buffers before the new views exist
        self.data = data
        self.k = [data[0, i] for i in range(self.n_layers)]
        self.v = [data[1, i] for i in range(self.n_layers)]
        self.capacity = capacity
        self.generation += 1

    def ensure(self, needed: int) -> None:
        """Move to the smallest capacity that holds `needed` slots (one copy of the `n` rows).

        It moves down as well as up: after a rollback (a new conversation, an edit) attention
        should not keep paying for a large buffer that only a past request needed.
        """
        if needed > self.max_capacity:
            raise NpuchatError(
                f"the context is full ({needed} tokens needed, {self.max_capacity} fit); "
                "start a new conversation or load the model with a larger capacity"
            )
        best = next(c for c in self.capacities if c >= max(needed, self.n))
        if best != self.capacity:
            self._allocate(best)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.n:
            raise NpuchatError(f"cannot roll back to {n}: the cache holds {self.n} slots")
        self.n = n

    def write(
        self, new_k: Sequence[np.ndarray], new_v: Sequence[np.ndarray], rows: slice, at: int
    ) -> None:
        """Copy rows `rows` of per-layer new K/V arrays `[1, Hkv, S, dh]` into slots at `at`."""
        count = len(range(*rows.indices(new_k[0].shape[2])))
        self._check_room(at, count)
        for dst, src in zip(self.k, new_k, strict=True):
            dst[:, :, at : at + count] = src[:, :, rows]
        for dst, src in zip(self.v, new_v, strict=True):
            dst[:, :, at : at + count] = src[:, :, rows]

    def _check_room(self, at: int, count: int) -> None:
        if at + count > self.capacity:
            raise NpuchatError(f"KV write past the capacity ({at}+{count} > {self.capacity})")

    def mask(self, seq_len: int, pad: int = 0) -> np.ndarray:
        """Additive mask `[1, 1, S, C+S]` for S new rows, the first `pad` of them padding."""
        out = np.empty((1, 1, seq_len, self.capacity + seq_len), np.float32)
        self.fill_mask(out, pad)
        return out

    def fill_mask(self, out: np.ndarray, pad: int = 0) -> None:
        """Write the mask for `out.shape[2]` new rows into `out` (a bound graph input buffer).

        Real row i attends the valid slots `[0, n)` and the real new rows up to itself; a padding
        row attends only itself (so its softmax stays finite) and is never written back.
        """
        c, s = self.capacity, out.shape[2]
        m = out[0, 0]
        m.fill(MASK_NEG)
        m[pad:, : self.n] = 0.0
        if s == 1:
            m[0, c] = 0.0
            return
        i = np.arange(s)
        new = (i[None, :] <= i[:, None]) & ((i[None, :] >= pad) | (i[None, :] == i[:, None]))
        m[:, c:][new] = 0.0

    def fill_causal_mask(self, out: np.ndarray, positions: np.ndarray) -> None:
        """The mask `[1, 1, S, C]` of rows already scattered into the cache at `positions`:
        row i attends slots `[0, positions[i]]` (itself included), nothing beyond."""
        cols = np.arange(out.shape[3])
        np.multiply(cols[None, :] > positions[:, None], MASK_NEG, out=out[0, 0])

    def export(self, start: int, end: int) -> KVSnapshot:
        if not 0 <= start <= end <= self.n:
            raise NpuchatError(f"cannot export KV rows {start}..{end}: the cache holds {self.n}")
        return KVSnapshot(
            start,
            [a[:, :, start:end].copy() for a in self.k],
            [a[:, :, start:end].copy() for a in self.v],
        )

    def import_(self, snap: KVSnapshot, at: int) -> None:
        if len(snap.k) != self.n_layers or (
            snap.k and snap.k[0].shape[1::2] != (self.n_kv_heads, self.head_dim)
        ):
            raise NpuchatError("the KV snapshot belongs to a different model; prefill instead")
        if not 0 <= at <= self.n:
            raise NpuchatError(f"cannot import KV at slot {at}: the cache holds {self.n}")
        self.ensure(at + snap.length)
        self.write(snap.k, snap.v, slice(None), at)
        self.n = at + snap.length
