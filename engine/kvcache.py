"""The static KV cache: preallocated per-layer K/V buffers, fill levels, and the masks they imply.

The cache holds `rows` sequences (KV slots: rows of the batch dimension), each with its own fill
level. Graphs never see a growing tensor: they read whole `[B, Hkv, C, dh]` row ranges and an
additive mask that hides each row's slots at and beyond its fill level. Static (NPU) graphs
return only the new rows, which the host writes at slot `n` (DESIGN §3); the CPU graph scatters
them into the buffers itself. Rolling back (rejected draft tokens, an edited message) is moving
`n`; nothing is recomputed. Capacity variants keep attention cost proportional to what is used:
the cache lives in the smallest listed capacity that fits and moves up with one copy.
The buffers hold K/V in the cache's `kv_dtype` (`kv_layout`: f32, f16, or int8 with per-(token,
head) scales in an array of their own, moved, swapped and exported with their rows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import threading
from collections.abc import Sequence

import numpy as np

from .errors import NpuchatError
from .graph_builder import MASK_NEG
from .kv_layout import KV_DTYPES, KVSnapshot, bytes_per_token, check_kv_dtype


def default_capacities(context_length: int, limit: int = 8192) -> list[int]:
    """KV capacity variants up to the model's context (at most `limit`).

    Every decode step reads the whole `[C]` cache (masked), so the waste is the gap between the
    fill level and C: steps of 256 up to 2048 and of 1024 beyond keep it ≤ 25%. On the CPU a
    variant costs nothing but the one copy when the cache moves to it (one symbolic graph).
    """
    top = max(1, min(context_length, limit))
    steps = [*range(256, 2048, 256), *range(2048, top, 1024)]
    return [*(c for c in steps if c < top), top]


_MADV_DONTNEED = 4  # Linux


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class KVCache:
    """Per-layer K and V buffers `[rows, Hkv, C, dh]` and each row's number of valid slots.

    All rows share one capacity (the smallest variant that holds the longest row), so any
    contiguous range of rows is one `[B, Hkv, C, dh]` view a batched graph can bind as is.
    `n` is row 0's fill level (the single-sequence API).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacities: Sequence[int],
        rows: int = 1,
        kv_dtype: str = "f32",
    ) -> None:
        if not capacities or min(capacities) < 1:
            raise NpuchatError("KV capacities must be positive integers")
        if rows < 1:
            raise NpuchatError("the KV cache needs at least one row")
        self.capacities = sorted(set(int(c) for c in capacities))
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.rows = int(rows)
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.dtype = np.dtype(KV_DTYPES[kv_dtype])
        self.lengths = [0] * self.rows
        self.capacity = 0
        self.data: np.ndarray = np.zeros(0, self.dtype)
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.scales: np.ndarray | None = None  # int8: `[2, layers, rows, Hkv, C, 1]` float32
        self.k_scale: list[np.ndarray] = []  # int8: per-layer views of `scales`
        self.v_scale: list[np.ndarray] = []
        self.generation = 0  # bumped whenever the layout changes (rebind OrtValues)
        self._reserve()
        self._allocate(self.capacities[0])

    @property
    def n(self) -> int:
        return self.lengths[0]

    @n.setter
    def n(self, value: int) -> None:
        self.lengths[0] = value

    @property
    def max_capacity(self) -> int:
        return self.capacities[-1]

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes of one token in every layer (int8: with its scales)."""
        return bytes_per_token(self.kv_dtype, self.n_layers, self.n_kv_heads, self.head_dim)

    def bytes_for(self, capacity: int) -> int:
        """Bytes of all rows at `capacity` (int8: with their scales)."""
        return self.bytes_per_token * capacity * self.rows

    def _data_bytes(self, capacity: int) -> int:
        """Bytes of the K/V values alone (the reserved buffer) at `capacity`."""
        per_row = 2 * self.n_layers * self.n_kv_heads * capacity * self.head_dim
        return per_row * self.rows * self.dtype.itemsize

    def parts(self) -> list[list[np.ndarray]]:
        """The per-layer buffer lists, in `KVSnapshot.parts` order: K, V, then (int8) scales."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.scales is not None else [])

    def _allocate(self, capacity: int) -> None:
        """The layout `[2, layers, rows, Hkv, C, dh]` over the one reserved buffer; `k[i]`/`v[i]`
        are contiguous views into it, so the graph binds per-layer buffers (any range of rows)
        and a write-back is one copy.

        Every capacity's layout starts at the buffer's first byte, so moving to another one
        moves each `[C, dh]` block within the buffer (backwards when growing, forwards when
        shrinking) instead of copying into fresh memory: fresh pages cost a page fault each,
        and faults in this process measured ~40 µs a page (0.9 s for 90 MB moved at a step).
        The pages a larger capacity will touch are faulted in ahead, off the step path
        (`_prefault`); a smaller capacity hands the tail's pages back to the OS.
        """
        self._join_prefault()
        old, used = self.capacity, max(self.lengths)
        shape = (2, self.n_layers, self.rows, self.n_kv_heads, capacity, self.head_dim)
        size = int(np.prod(shape))
        blocks = 2 * self.n_layers * self.rows * self.n_kv_heads
        self.k, self.v = [], []
        src = self._flat[: blocks * old * self.head_dim].reshape(blocks, old * self.head_dim)
        dst = self._flat[:size].reshape(blocks, capacity * self.head_dim)
        n = min(used, old, capacity) * self.head_dim
        order = range(blocks - 1, -1, -1) if capacity > old else range(blocks)
        if n and old:
            for j in order:  # numpy copies overlapping ranges correctly
                dst[j, :n] = src[j, :n]
        if capacity < old:
            self._release(size)
        self.data = self._flat[:size].reshape(shape)
        self.k = [self.data[0, i] for i in range(self.n_layers)]
        self.v = [self.data[1, i] for i in range(self.n_layers)]
        if self.kv_dtype == "int8":  # scales: 1/dh of the values in float32, plainly copied
            scales = np.zeros((*shape[:-1], 1), np.float32)
            if self.scales is not None and n:
                keep = min(used, old, capacity)
                scales[..., :keep, :] = self.scales[..., :keep, :]
            self.scales = scales
            self.k_scale = [scales[0, i] for i in range(self.n_layers)]
            self.v_scale = [scales[1, i] for i in range(self.n_layers)]
        self.capacity = capacity
        self.generation += 1

    def _reserve(self) -> None:
        """Memory for the largest capacity: numpy's zeroed allocation, which the C library maps
        fresh for a buffer this size, so pages become resident only when touched."""
        nbytes = self._data_bytes(self.max_capacity)
        self._flat = np.zeros(nbytes // self.dtype.itemsize, self.dtype)
        self._prefaulting: threading.Thread | None = None
        self._prefaulted = 0  # elements of the buffer known to be resident

    def _release(self, keep: int) -> None:
        """Hand the pages past the first `keep` elements back to the OS (they read as zeros)."""
        page = mmap.PAGESIZE
        base = self._flat.ctypes.data
        start = -(-(base + keep * self.dtype.itemsize) // page) * page
        end = (base + self._flat.nbytes) // page * page
        if end > start:
            _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
        self._prefaulted = min(self._prefaulted, keep)

    def _prefault(self, capacity: int) -> None:
        """Touch, in a background thread, the pages the layout for `capacity` adds."""
        end = self._data_bytes(capacity) // self.dtype.itemsize
        if end <= self._prefaulted or self._prefaulting is not None:
            return
        start = self._data_bytes(self.capacity) // self.dtype.itemsize
        step = mmap.PAGESIZE // self.dtype.itemsize

        def touch() -> None:
            self._flat[start:end:step] = 0  # beyond the live layout: no step reads it

        self._prefaulting = threading.Thread(target=touch, name="kv-prefault", daemon=True)
        self._prefaulting.start()
        self._prefaulted = end

    def _join_prefault(self) -> None:
        if self._prefaulting is not None:
            self._prefaulting.join()
            self._prefaulting = None

    def ensure(self, needed: int) -> None:
        """Move to the smallest capacity that holds `needed` slots and every row (one copy).

        It moves down as well as up: after a rollback (a new conversation, an edit) attention
        should not keep paying for a large buffer that only a past request needed.
        """
        if needed > self.max_capacity:
            raise NpuchatError(
                f"the context is full ({needed} tokens needed, {self.max_capacity} fit); "
                "start a new conversation or load the model with a larger capacity"
            )
        best = next(c for c in self.capacities if c >= max(needed, *self.lengths))
        if best != self.capacity:
            self._allocate(best)
        bigger = [c for c in self.capacities if c > self.capacity]
        if bigger and needed * 2 > self.capacity:  # past half full: get the next one ready
            self._prefault(bigger[0])

    def rollback(self, n: int, row: int = 0) -> None:
        if not 0 <= n <= self.lengths[row]:
            raise NpuchatError(
                f"cannot roll back to {n}: the cache holds {self.lengths[row]} slots"
            )
        self.lengths[row] = n

    def swap(self, a: int, b: int) -> None:
        """Exchange the contents of rows `a` and `b` (so a batch's rows can be contiguous)."""
        if a == b:
            return
        used = max(self.lengths[a], self.lengths[b])
        for buf in (self.data, self.scales):
            if used and buf is not None:
                tmp = buf[:, :, a, :, :used].copy()
                buf[:, :, a, :, :used] = buf[:, :, b, :, :used]
                buf[:, :, b, :, :used] = tmp
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def write(
        self,
        new_k: Sequence[np.ndarray],
        new_v: Sequence[np.ndarray],
        rows: slice,
        at: int,
        row: int = 0,
        batch_index: int = 0,
    ) -> None:
        """Copy rows `rows` of batch entry `batch_index` of per-layer new K/V `[B, Hkv, S, dh]`
        into cache row `row` at slots from `at` (the static graphs' float rows: f32 caches)."""
        if self.kv_dtype != "f32":
            raise NpuchatError(f"float K/V rows cannot be written into a {self.kv_dtype} cache")
        count = len(range(*rows.indices(new_k[0].shape[2])))
        self._check_room(at, count)
        for dst, src in zip(self.k, new_k, strict=True):
            dst[row, :, at : at + count] = src[batch_index, :, rows]
        for dst, src in zip(self.v, new_v, strict=True):
            dst[row, :, at : at + count] = src[batch_index, :, rows]

    def _check_room(self, at: int, count: int) -> None:
        if at + count > self.capacity:
            raise NpuchatError(f"KV write past the capacity ({at}+{count} > {self.capacity})")

    def mask(self, seq_len: int, pad: int = 0) -> np.ndarray:
        """Additive mask `[1, 1, S, C+S]` for S new rows of row 0, the first `pad` padding."""
        out = np.empty((1, 1, seq_len, self.capacity + seq_len), np.float32)
        self.fill_mask(out, pad)
        return out

    def fill_mask(self, out: np.ndarray, pad: int = 0, row: int = 0, batch_index: int = 0) -> None:
        """Write cache row `row`'s mask for `out.shape[2]` new rows into `out[batch_index]`.

        Real row i attends the valid slots `[0, n)` and the real new rows up to itself; a padding
        row attends only itself (so its softmax stays finite) and is never written back.
        """
        c, s = self.capacity, out.shape[2]
        m = out[batch_index, 0]
        m.fill(MASK_NEG)
        m[pad:, : self.lengths[row]] = 0.0
        if s == 1:
            m[0, c] = 0.0
            return
        i = np.arange(s)
        new = (i[None, :] <= i[:, None]) & ((i[None, :] >= pad) | (i[None, :] == i[:, None]))
        m[:, c:][new] = 0.0

    def fill_causal_mask(self, out: np.ndarray, positions: np.ndarray) -> None:
        """The mask `[B, 1, S, C]` of rows already scattered into the cache at `positions`
        (`[S]` for one sequence, `[B, S]` for a batch): row i attends slots
        `[0, positions[i]]` (itself included), nothing beyond."""
        pos = positions.reshape(out.shape[0], out.shape[2])
        cols = np.arange(out.shape[3])
        np.multiply(cols[None, None, :] > pos[:, :, None], MASK_NEG, out=out[:, 0])

    def export(self, start: int, end: int, row: int = 0) -> KVSnapshot:
        if not 0 <= start <= end <= self.lengths[row]:
            raise NpuchatError(
                f"cannot export KV rows {start}..{end}: the cache holds {self.lengths[row]}"
            )
        k, v, *scales = [[a[row : row + 1, :, start:end].copy() for a in p] for p in self.parts()]
        return KVSnapshot(start, k, v, *scales)

    def import_(self, snap: KVSnapshot, at: int, row: int = 0) -> None:
        if len(snap.k) != self.n_layers or (
            snap.k and snap.k[0].shape[1::2] != (self.n_kv_heads, self.head_dim)
        ):
            raise NpuchatError("the KV snapshot belongs to a different model; prefill instead")
        if snap.kv_dtype != self.kv_dtype or len(snap.parts()) != len(self.parts()):
            raise NpuchatError(
                f"the KV snapshot holds {snap.kv_dtype} rows but this cache stores "
                f"{self.kv_dtype}; prefill instead"
            )
        if not 0 <= at <= self.lengths[row]:
            raise NpuchatError(
                f"cannot import KV at slot {at}: the cache holds {self.lengths[row]}"
            )
        self.ensure(at + snap.length)
        count = snap.length
        for dsts, srcs in zip(self.parts(), snap.parts(), strict=True):
            for dst, src in zip(dsts, srcs, strict=True):
                dst[row, :, at : at + count] = src[0]
        self.lengths[row] = at + count
