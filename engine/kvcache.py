"""The static KV cache: preallocated per-layer K/V buffers, fill levels, and the masks they imply.

The cache holds `rows` sequences (KV slots: rows of the batch dimension), each with its own fill
level. Graphs never see a growing tensor: they read whole `[B, Hkv, C, dh]` row ranges and an
additive mask that hides each row's slots at and beyond its fill level. Static (NPU) graphs
return only the new rows, which the host writes at slot `n` (DESIGN §3); the CPU graph scatters
them into the buffers itself. Rolling back (rejected draft tokens, an edited message) is moving
`n`; nothing is recomputed. Capacity variants keep attention cost proportional to what is used:
the cache lives in the smallest listed capacity that fits and moves up with one copy.
The buffers hold K/V in the cache's `kv_dtype` (`kv_layout`: f32, f16, or int8 with per-(token,
head) scales in an array of their own, moved, swapped and exported with their rows). Sliding-
window layers keep only a ring of rows (`kv_ring`), so rolling back is bounded by what it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import NpuchatError
from .kv_layout import KV_DTYPES, KVSnapshot, bytes_per_token, check_kv_dtype, quantize_rows
from .kv_pages import ReservedBuffer
from .kv_ring import RingFloors, RingShape
from .layer_inputs import MASK_NEG
from .model_config import ModelConfig


class KVCache:
    """Per-layer K and V buffers `[rows, Hkv, C, dh]` and each row's number of valid slots.

    All rows share one capacity (the smallest variant that holds the longest row), so any
    contiguous range of rows is one `[B, Hkv, C, dh]` view a batched graph can bind as is.
    `n` is row 0's fill level (the single-sequence API).

    With a `window` and `sliding` layers, those layers keep `[rows, Hkv, Rc, dh]`: a ring of
    `window + step_rows` slots (`kv_ring`), or C slots while C is smaller. Each row's
    `floors` (`kv_ring.RingFloors`) says from which lengths its rings can continue.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacities: Sequence[int],
        rows: int = 1,
        kv_dtype: str = "f32",
        *,
        window: int = 0,
        sliding: Sequence[bool] = (),
        step_rows: int = 0,
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
        self.sliding = tuple(bool(x) for x in sliding) if window > 0 else ()
        if self.sliding and len(self.sliding) != n_layers:
            raise NpuchatError("the sliding-layer flags must name every layer")
        self.ring = RingShape(window, step_rows) if any(self.sliding) else None
        self._ring_layers = sum(self.sliding) if self.ring else 0
        self.floors = RingFloors(self.ring, self.rows)  # first positions the rings hold
        self.capacity = 0
        self.data: np.ndarray = np.zeros(0, self.dtype)  # every buffer, flat
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.k_scale: list[np.ndarray] = []  # int8: per-layer `[rows, Hkv, C, 1]` float32
        self.v_scale: list[np.ndarray] = []
        self.generation = 0  # bumped whenever the layout changes (rebind OrtValues)
        self.held = 0  # slots the capacity keeps room for whatever the rows hold (`hold`)
        elements = self._data_bytes(self.max_capacity) // self.dtype.itemsize
        self._pages = ReservedBuffer(elements, self.dtype)
        self._flat = self._pages.flat
        self._allocate(self.capacities[0])

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, caps: Sequence[int], rows: int, kv_dtype: str, step_rows: int
    ) -> KVCache:
        """The cache of `cfg`'s layers, its sliding layers in rings (`step_rows`: the most
        rows one graph run writes)."""
        dims = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        window, sliding = cfg.sliding_window, cfg.swa_layers
        return cls(*dims, caps, rows, kv_dtype, window=window, sliding=sliding, step_rows=step_rows)

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
    def ring_slots(self) -> int:
        """Slots of a ring layer now; 0 without rings."""
        return self.ring.rows(self.capacity) if self.ring else 0

    def is_ring(self, layer: int) -> bool:
        return self.ring is not None and self.sliding[layer]

    def layer_rows(self, layer: int, capacity: int) -> int:
        """Slots layer `layer` holds at `capacity`."""
        return self.ring.rows(capacity) if self.ring and self.is_ring(layer) else capacity

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes of one token in every layer (int8: with its scales), rings left aside."""
        return bytes_per_token(self.kv_dtype, self.n_layers, self.n_kv_heads, self.head_dim)

    def bytes_for(self, capacity: int) -> int:
        """Bytes of all rows at `capacity` (int8: with their scales; ring layers: their ring)."""
        return self.bytes_per_token // self.n_layers * self._slots(capacity) * self.rows

    def _slots(self, capacity: int) -> int:  # of one row in all layers (O(1): every step asks)
        ring = self.ring.rows(capacity) * self._ring_layers if self.ring else 0
        return ring + (self.n_layers - self._ring_layers) * capacity

    def _data_bytes(self, capacity: int) -> int:
        """Bytes of the K/V values alone (the reserved buffer) at `capacity`."""
        per_slot = 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return per_slot * self._slots(capacity) * self.rows

    def parts(self) -> list[list[np.ndarray]]:
        """The per-layer buffer lists, in `KVSnapshot.parts` order: K, V, then (int8) scales."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.k_scale else [])

    def _blocks(self, capacity: int) -> list[tuple[int, int, bool]]:
        """(offset, slots, ring) of every `[slots, dh]` block, in buffer order: K then V,
        layer, row, head; a part's layer is one contiguous `[rows, Hkv, slots, dh]` run."""
        out, offset = [], 0
        for _part in range(2):
            for i in range(self.n_layers):
                c, ring = self.layer_rows(i, capacity), self.is_ring(i)
                for _ in range(self.rows * self.n_kv_heads):
                    out.append((offset, c, ring))
                    offset += c * self.head_dim
        return out

    def _allocate(self, capacity: int) -> None:
        """The per-layer layouts over the one reserved buffer; `k[i]`/`v[i]` are contiguous
        views into it, so the graph binds per-layer buffers (any range of rows) and a
        write-back is one copy.

        Every capacity's layout starts at the buffer's first byte, so moving to another one
        moves each `[C, dh]` block within the buffer (backwards when growing, forwards when
        shrinking: every block's offset moves the same way) instead of copying into fresh
        memory: fresh pages cost a page fault each, and faults in this process measured
        ~40 µs a page (0.9 s for 90 MB moved at a step). The pages a larger capacity will touch
        are faulted in ahead, off the step path (`_prefault`); a smaller capacity hands the
        tail's pages back to the OS. A ring's slots move whole (they are not in position order);
        other blocks move the slots their own row holds (a long row does not make every row's
        blocks copy its length).
        """
        self._pages.join()
        old, used = self.capacity, max(self.lengths)
        dh, flat = self.head_dim, self._flat
        src, dst = self._blocks(old), self._blocks(capacity)
        order = range(len(dst) - 1, -1, -1) if capacity > old else range(len(dst))
        if old:
            for j in order:  # numpy copies overlapping ranges correctly
                (a, ca, ring), (b, cb, _) = src[j], dst[j]
                mine = self.lengths[j // self.n_kv_heads % self.rows]  # the block's row holds
                n = min(ca, cb) if ring else min(mine, ca, cb)
                if n and a != b:
                    flat[b : b + n * dh] = flat[a : a + n * dh]
        size = self._data_bytes(capacity) // self.dtype.itemsize
        if capacity < old:
            self._pages.release(size)
        self.data = flat[:size]
        views: list[np.ndarray] = []
        for j in range(0, len(dst), self.rows * self.n_kv_heads):
            b, c, _ = dst[j]
            n = self.rows * self.n_kv_heads * c * dh
            views.append(flat[b : b + n].reshape(self.rows, self.n_kv_heads, c, dh))
        self.k, self.v = views[: self.n_layers], views[self.n_layers :]
        if self.kv_dtype == "int8":  # scales: 1/dh of the values in float32, plainly copied
            olds: list[np.ndarray | None] = [*self.k_scale, *self.v_scale]
            olds = olds or [None] * (2 * self.n_layers)
            new = [self._moved_scales(a, i % self.n_layers, used) for i, a in enumerate(olds)]
            self.k_scale, self.v_scale = new[: self.n_layers], new[self.n_layers :]
        self.capacity = capacity
        self.generation += 1

    def _moved_scales(self, old: np.ndarray | None, layer: int, used: int) -> np.ndarray:
        fresh = np.zeros((*self.k[layer].shape[:-1], 1), np.float32)
        if old is not None:
            n = min(old.shape[2], fresh.shape[2])
            n = n if self.is_ring(layer) else min(n, used)
            fresh[:, :, :n] = old[:, :, :n]
        return fresh

    def _prefault(self, capacity: int) -> None:
        """Fault in, off the step path, the pages the layout for `capacity` adds."""
        size = self.dtype.itemsize
        self._pages.prefault(
            self._data_bytes(self.capacity) // size, self._data_bytes(capacity) // size
        )

    def prepare(self, needed: int) -> bool:
        """Whether the capacity for `needed` slots can be moved to without faulting its pages
        in at a step; when not yet, they are faulted in off the step path (a long prompt read
        beside streaming replies waits for that, then the cache moves once: `hold`)."""
        best = next((c for c in self.capacities if c >= needed), self.max_capacity)
        start, end = (self._data_bytes(c) // self.dtype.itemsize for c in (self.capacity, best))
        return best <= self.capacity or self._pages.ready(start, end)

    def hold(self, slots: int) -> None:
        """Keep room for `slots` (0: none) whatever the rows hold, so a prompt read in parts
        does not move the cache at every capacity it passes."""
        self.held = min(int(slots), self.max_capacity)
        if self.held > self.capacity:
            self.ensure(self.held)

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
        best = next(c for c in self.capacities if c >= max(needed, self.held, *self.lengths))
        if best != self.capacity:
            self._allocate(best)
        bigger = [c for c in self.capacities if c > self.capacity]
        if bigger and needed * 2 > self.capacity:  # past half full: get the next one ready
            self._prefault(bigger[0])

    def usable(self, n: int, row: int = 0) -> int:
        """The longest length ≤ n row `row` can continue from: n itself, or 0 when n is past
        what its sliding layers' rings still hold (`kv_ring`)."""
        return self.floors.usable(min(n, self.lengths[row]), row)

    def rollback(self, n: int, row: int = 0) -> None:
        if not 0 <= n <= self.lengths[row]:
            raise NpuchatError(
                f"cannot roll back to {n}: the cache holds {self.lengths[row]} slots"
            )
        if self.usable(n, row) != n:
            raise NpuchatError(
                f"cannot roll back to {n}: the sliding-window layers no longer hold the rows "
                f"before it (they keep the last {self.ring_slots}); prefill instead"
            )
        self.lengths[row] = n
        if n == 0:
            self.floors.floor[row] = 0

    def note_written(self, row: int, end: int) -> None:
        self.floors.written(row, end)

    def swap(self, a: int, b: int) -> None:
        """Exchange the contents of rows `a` and `b` (so a batch's rows can be contiguous)."""
        if a == b:
            return
        used = max(self.lengths[a], self.lengths[b])
        for layers in self.parts():
            for i, buf in enumerate(layers):
                n = buf.shape[2] if self.is_ring(i) else used
                if n:
                    tmp = buf[a, :, :n].copy()
                    buf[a, :, :n] = buf[b, :, :n]
                    buf[b, :, :n] = tmp
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]
        self.floors.swap(a, b)

    def slots(self, layer: int, at: int, count: int) -> slice | np.ndarray:
        """The slots of positions `at..at+count` in layer `layer` (a ring's wrap around)."""
        if self.ring is not None and self.sliding[layer]:
            return self.ring.slots(np.arange(at, at + count))
        return slice(at, at + count)

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
        into cache row `row` at the slots of positions from `at` (the static graphs' float
        rows: f32 caches, or int8 ones, quantized here as the CPU graph does)."""
        if self.kv_dtype == "f16":
            raise NpuchatError("float K/V rows cannot be written into a f16 cache")
        count = len(range(*rows.indices(new_k[0].shape[2])))
        self._check_room(at, count)
        for i in range(self.n_layers):
            slots = self.slots(i, at, count)
            k, v = new_k[i][batch_index, :, rows], new_v[i][batch_index, :, rows]
            if self.kv_dtype == "int8":
                (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
                self.k_scale[i][row][:, slots], self.v_scale[i][row][:, slots] = k_scale, v_scale
            self.k[i][row][:, slots] = k
            self.v[i][row][:, slots] = v
        self.note_written(row, at + count)

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

    def fill_ring_mask(
        self, out: np.ndarray, pad: int = 0, row: int = 0, batch_index: int = 0
    ) -> None:
        """`fill_mask` for the ring layers (`[B, 1, S, Rc + S]`: the ring, then the new rows)."""
        assert self.ring is not None
        n = self.lengths[row]
        self.ring.fill_split_mask(out[batch_index], n - pad, n, pad)

    def fill_causal_mask(self, out: np.ndarray, positions: np.ndarray) -> None:
        """The mask `[B, 1, S, C]` of rows already scattered into the cache at `positions`
        (`[S]` for one sequence, `[B, S]` for a batch): row i attends slots
        `[0, positions[i]]` (itself included), nothing beyond."""
        pos = positions.reshape(out.shape[0], out.shape[2])
        cols = np.arange(out.shape[3])
        np.multiply(cols[None, None, :] > pos[:, :, None], MASK_NEG, out=out[:, 0])

    def export(self, start: int, end: int, row: int = 0) -> KVSnapshot:
        """Copies of rows `[start, end)` in position order. A ring layer no longer holds its
        rows below the row's floor: they are zeros, and the snapshot's `ring_from` says so."""
        if not 0 <= start <= end <= self.lengths[row]:
            raise NpuchatError(
                f"cannot export KV rows {start}..{end}: the cache holds {self.lengths[row]}"
            )
        floor = self.floors.floor[row]
        out: list[list[np.ndarray]] = []
        for layers in self.parts():
            out.append([])
            for i, a in enumerate(layers):
                part = a[row : row + 1, :, self.slots(i, start, end - start)].copy()
                if self.is_ring(i) and floor > start:
                    part[:, :, : min(floor, end) - start] = 0
                out[-1].append(part)
        k, v, *scales = out
        return KVSnapshot(start, k, v, *scales, ring_from=max(floor, start) if self.ring else 0)

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
        end = at + snap.length
        floor = self.floors.for_import(row, at, end, snap.ring_from)
        self.ensure(end)
        for dsts, srcs in zip(self.parts(), snap.parts(), strict=True):
            for i, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
                if self.is_ring(i):  # only the rows the ring can hold, at their slots
                    first = max(at, end - self.ring_slots)
                    dst[row][:, self.slots(i, first, end - first)] = src[0, :, first - at :]
                else:
                    dst[row, :, at:end] = src[0]
        self.lengths[row] = end
        self.floors.floor[row] = floor
