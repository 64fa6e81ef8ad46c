"""KV prefixes kept for reuse: in RAM under a byte budget (LRU), and system prompts on disk.

Entries form chains: an entry stores only the K/V rows past its parent, the longest entry that
is a prefix of it, so a system prompt shared by many conversations is held once (prefix sharing).
A lookup may use any entry partially: row i of a causal model's cache depends only on tokens
0..i, so the first `lcp` rows of an entry are valid for every sequence sharing those tokens,
as far as a cache can continue from them: an entry taken after a sliding-window layer's ring
wrapped lacks that layer's older rows (`KVSnapshot.ring_from`, kept in the header on disk), and
a prefix that needs them is not used (`kv_ring`).

On disk, each persisted prefix is an `.npz` of its rows plus a JSON header with the tokens, the
layout key (model, graphs, numerics: the graph cache key) and the sha256 of the `.npz` bytes. A
file whose hash does not match, or whose header or arrays do not have the shape a snapshot has
(any program can write a file with a matching hash), is never loaded: it is reported once and
rebuilt by the next prefill.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .kv_layout import KVSnapshot, kv_dtype_of

if TYPE_CHECKING:
    from .sequence import Sequence as KVHolder

Exporter = Callable[[int, int], KVSnapshot]
Usable = Callable[[int, int], int]  # (rows, ring_from) -> the rows an import can continue from
PeerLookup = Callable[[int, int], "PrefixHit | None"]  # (limit, rows to beat) -> another row's
_FORMAT = 1
_MAX_LAYERS = 1024
_PARTS = ("k", "v", "k_scale", "v_scale")  # array names in the `.npz`, per layer: k0, k1, ...


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n


def token_key(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    parent: str | None  # key of the entry holding rows [0, start)
    start: int
    rows: KVSnapshot  # rows [start, len(tokens))
    pinned: bool = False  # system prefixes survive eviction while others can go


@dataclass(frozen=True)
class PrefixHit:
    length: int
    snapshot: KVSnapshot  # rows [0, length)
    source: str  # "memory", "disk" or "row" (another row of the cache: `peer_prefix`)


class PrefixStore:
    def __init__(
        self, layout_key: str, *, budget_bytes: int = 512 << 20, disk_dir: Path | None = None
    ) -> None:
        self.layout_key = layout_key
        self.budget_bytes = budget_bytes
        self.disk_dir = disk_dir / layout_key[:32] if disk_dir else None
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.warnings: list[str] = []
        self._reported: set[str] = set()

    # ------------------------------------------------------------------ memory

    @property
    def nbytes(self) -> int:
        return sum(e.rows.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def _best(self, tokens: Sequence[int], limit: int, usable: Usable) -> tuple[str | None, int]:
        best_key, best_len = None, 0
        for key, e in self._entries.items():
            n = min(common_prefix_len(e.tokens, tokens), limit)
            n = usable(n, self._ring_from(key, n)) if n > best_len else 0
            if n > best_len:
                best_key, best_len = key, n
        return best_key, best_len

    def _ring_from(self, key: str, end: int) -> int:
        """`ring_from` of rows [0, end) along the chain of `key` (`KVSnapshot.concat`'s rule)."""
        cur: str | None = key
        while cur is not None:
            e = self._entries[cur]
            if e.start < end and e.rows.ring_from > e.start:
                return e.rows.ring_from
            cur = e.parent
        return 0

    def _rows(self, key: str, end: int) -> KVSnapshot:
        """Rows [0, end) assembled along the chain of `key`."""
        parts: list[KVSnapshot] = []
        cur: str | None = key
        while cur is not None:
            e = self._entries[cur]
            if e.start < end:
                parts.append(e.rows.rows(0, min(end, len(e.tokens)) - e.start))
            cur = e.parent
        parts.reverse()
        return KVSnapshot.concat(parts)

    def put(self, tokens: Sequence[int], export: Exporter, *, pinned: bool = False) -> None:
        """Keep the KV of `tokens` (currently rows [0, len) of the cache, read via `export`)."""
        tokens = tuple(int(t) for t in tokens)
        key = token_key(tokens)
        if not tokens:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            self._entries[key].pinned |= pinned
            return
        parent, start = None, 0
        for k, e in self._entries.items():  # longest full entry that is our prefix
            if len(e.tokens) > start and tokens[: len(e.tokens)] == e.tokens:
                parent, start = k, len(e.tokens)
        if start == len(tokens):
            return
        self._entries[key] = _Entry(tokens, parent, start, export(start, len(tokens)), pinned)
        self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self._entries:
            parents = {e.parent for e in self._entries.values()}
            victim = next(
                (k for k, e in self._entries.items() if k not in parents and not e.pinned),
                None,
            ) or next((k for k in self._entries if k not in parents), None)
            if victim is None:
                return
            del self._entries[victim]

    def lookup(
        self, tokens: Sequence[int], limit: int, usable: Usable | None = None
    ) -> PrefixHit | None:
        """The longest stored prefix of `tokens` (at most `limit` rows), from RAM or disk.
        `usable` cuts an entry to the rows a cache can continue from (a ring layer's rows
        below a snapshot's `ring_from` are not held: `kv_ring`)."""
        usable = usable or (lambda n, _ring_from: n)
        key, n = self._best(tokens, limit, usable)
        disk = self._disk_best(tokens, limit, n, usable)
        if disk is not None:
            return disk
        if key is None or n == 0:
            return None
        self._entries.move_to_end(key)
        return PrefixHit(n, self._rows(key, n), "memory")

    # ------------------------------------------------------------------ disk

    def _paths(self, key: str) -> tuple[Path, Path]:
        assert self.disk_dir is not None
        return self.disk_dir / f"{key}.json", self.disk_dir / f"{key}.npz"

    def persist(self, tokens: Sequence[int], export: Exporter) -> None:
        """Write the prefix to disk (atomically) unless an intact copy is already there."""
        if self.disk_dir is None or not tokens:
            return
        key = token_key(tokens)
        head, body = self._paths(key)
        if head.exists() and self._read(head, body) is not None:
            return
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        snap = export(0, len(tokens))
        buf = io.BytesIO()
        arrays: dict[str, Any] = {
            f"{name}{i}": a
            for name, part in zip(_PARTS, snap.parts(), strict=False)
            for i, a in enumerate(part)
        }
        np.savez(buf, **arrays)
        data = buf.getvalue()
        header = {
            "format": _FORMAT,
            "layout": self.layout_key,
            "tokens": [int(t) for t in tokens],
            "layers": len(snap.k),
            "ring_from": snap.ring_from,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
        }
        for path, content in ((body, data), (head, json.dumps(header).encode())):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)

    def _warn(self, path: Path, why: str) -> None:
        if path.name not in self._reported:
            self._reported.add(path.name)
            self.warnings.append(f"prefix cache {path.name} {why}; it will be rebuilt")

    def _header(self, head: Path) -> dict[str, Any] | None:
        """The header if it has the shape `persist` writes; None (reported) otherwise."""
        try:
            header = json.loads(head.read_text())
        except (OSError, ValueError):
            self._warn(head, "is unreadable")
            return None
        tokens = header.get("tokens") if isinstance(header, dict) else None
        layers = header.get("layers") if isinstance(header, dict) else None
        if not (
            isinstance(header, dict)
            and isinstance(tokens, list)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
            and isinstance(layers, int)
            and not isinstance(layers, bool)
            and 0 < layers <= _MAX_LAYERS
            and isinstance(header.get("sha256"), str)
        ):
            self._warn(head, "has a header of the wrong shape")
            return None
        return header

    def _read(self, head: Path, body: Path) -> tuple[list[int], KVSnapshot] | None:
        header = self._header(head)
        if header is None:
            return None
        if header.get("format") != _FORMAT or header.get("layout") != self.layout_key:
            return None  # another model or graph version: not ours to judge
        try:
            data = body.read_bytes()
        except OSError:
            self._warn(body, "is unreadable")
            return None
        if hashlib.sha256(data).hexdigest() != header["sha256"]:
            self._warn(body, "does not match its hash (corrupt)")
            return None
        tokens: list[int] = header["tokens"]
        ring_from = header.get("ring_from", 0)
        snap = _snapshot(data, header["layers"], len(tokens))
        if snap is None or not isinstance(ring_from, int) or isinstance(ring_from, bool):
            self._warn(body, "does not hold K/V rows of the shape its header says")
            return None
        snap.ring_from = max(0, ring_from)
        return tokens, snap

    def restore(
        self, seq: KVHolder, ids: Sequence[int], peer: PeerLookup | None = None
    ) -> tuple[int, str]:
        """Put the longest available prefix of `ids` in `seq` (its own tokens, a stored entry,
        or, given `peer`, another row's: `peer_prefix`); (reused tokens, where from). The last
        id is never reused: its logits start the reply. A longer state `seq` is leaving is
        kept here first, for coming back to it."""
        limit = len(ids) - 1
        seq.resync()
        shared = min(common_prefix_len(seq.tokens, ids), limit)
        if shared < len(seq.tokens) and len(seq.tokens) > shared + 16:
            self.put(seq.tokens, seq.kv_export)
        lcp = seq.usable(shared)  # a sliding layer's ring may no longer hold that far back
        hit = self.lookup(ids, limit, lambda n, ring_from: seq.model.usable(n, 0, ring_from))
        if peer is not None:
            hit = peer(limit, max(lcp, hit.length if hit else 0)) or hit
        if hit is not None and hit.length > lcp:
            seq.adopt(hit.snapshot, ids)
            return hit.length, hit.source
        seq.rollback(lcp)
        return lcp, "cache"

    def _disk_best(
        self, tokens: Sequence[int], limit: int, beat: int, usable: Usable
    ) -> PrefixHit | None:
        """The persisted entry sharing the longest prefix (more than `beat` rows) with `tokens`.

        Like a RAM entry, a stored one may be used partially (rows `[0, lcp)`): a conversation
        paged out with its last reply's tokens shares with its next turn's prompt everything
        up to where the re-rendered reply differs."""
        if self.disk_dir is None or not self.disk_dir.is_dir():
            return None
        best: tuple[int, Path] | None = None
        for head in self.disk_dir.glob("*.json"):
            header = self._header(head)
            if header is None:
                continue
            stored, ring_from = header["tokens"], header.get("ring_from", 0)
            n = min(common_prefix_len(stored, tokens), limit)
            n = usable(n, ring_from if isinstance(ring_from, int) else len(stored))
            if n > beat and (best is None or n > best[0]):
                best = (n, head)
        if best is None:
            return None
        n, head = best
        read = self._read(head, head.with_suffix(".npz"))
        if read is None:
            return None
        stored, snap = read
        self.put(stored, snap.rows, pinned=True)
        return PrefixHit(n, snap.rows(0, n), "disk")


def _snapshot(data: bytes, layers: int, length: int) -> KVSnapshot | None:
    """The K/V rows in an `.npz`, if it holds exactly `layers` arrays per part, each
    `[1, heads, length, dim]` and alike across layers, K and V of one KV dtype, and scales
    (`[1, heads, length, 1]` float32) exactly when that dtype is int8; None for anything else."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            n_parts = 4 if "k_scale0" in z.files else 2
            names = {f"{part}{i}" for part in _PARTS[:n_parts] for i in range(layers)}
            if set(z.files) != names:
                return None
            parts = [[z[f"{part}{i}"] for i in range(layers)] for part in _PARTS[:n_parts]]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None
    k, v = parts[0], parts[1]
    kv_dtype = kv_dtype_of(k[0].dtype)
    if kv_dtype is None or (kv_dtype == "int8") != (n_parts == 4):
        return None
    heads, dim = k[0].shape[1::2] if k[0].ndim == 4 else (0, 0)
    for j, arrays in enumerate(parts):
        shape = (1, heads, length, dim if j < 2 else 1)
        dtype = k[0].dtype if j < 2 else np.dtype(np.float32)
        if any(a.shape != shape or a.dtype != dtype for a in arrays):
            return None
    return KVSnapshot(0, k, v, *parts[2:])
