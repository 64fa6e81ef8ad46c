"""Prefix store: hits and misses, partial reuse, sharing, byte budget, persistence, corruption."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from npuchat.engine.kvcache import KVSnapshot
from npuchat.engine.prefix_store import PrefixStore, common_prefix_len

LAYERS, HEADS, DIM = 2, 2, 4


class FakeCache:
    """Rows whose values encode (token, position), so any mix-up of rows is visible."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def rows(self, start: int, end: int) -> KVSnapshot:
        def layer(i: int, kind: int) -> np.ndarray:
            t = np.array(self.tokens[start:end], dtype=np.float32)
            pos = np.arange(start, end, dtype=np.float32)
            base = (t * 1000 + pos + i * 0.1 + kind * 0.01)[None, None, :, None]
            return np.broadcast_to(base, (1, HEADS, end - start, DIM)).copy()

        return KVSnapshot(
            start, [layer(i, 0) for i in range(LAYERS)], [layer(i, 1) for i in range(LAYERS)]
        )


def _expected(tokens: list[int], n: int) -> KVSnapshot:
    return FakeCache(tokens).rows(0, n)


def _same(a: KVSnapshot, b: KVSnapshot) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v, strict=True))


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0


def test_miss_hit_and_partial_use() -> None:
    store = PrefixStore("layout")
    conv = [1, 2, 3, 4, 5, 6]
    assert store.lookup(conv, 10) is None
    store.put(conv, FakeCache(conv).rows)
    hit = store.lookup([1, 2, 3, 9, 9], 10)
    assert hit is not None and hit.length == 3 and hit.source == "memory"
    assert _same(hit.snapshot, _expected(conv, 3))
    limited = store.lookup(conv, 4)
    assert limited is not None and limited.length == 4
    assert store.lookup([7, 1, 2], 10) is None


def test_shared_prefix_is_stored_once() -> None:
    system = list(range(100, 140))
    a = [*system, 1, 2, 3]
    b = [*system, 7, 8]
    store = PrefixStore("layout")
    store.put(system, FakeCache(system).rows, pinned=True)
    store.put(a, FakeCache(a).rows)
    store.put(b, FakeCache(b).rows)
    row_bytes = 2 * LAYERS * HEADS * DIM * 4
    assert store.nbytes == row_bytes * (len(system) + 3 + 2)
    hit = store.lookup([*b, 5], 100)
    assert hit is not None and hit.length == len(b)
    assert _same(hit.snapshot, _expected(b, len(b)))


def test_budget_evicts_least_recent_unpinned() -> None:
    row_bytes = 2 * LAYERS * HEADS * DIM * 4
    store = PrefixStore("layout", budget_bytes=row_bytes * 25)
    system = [9] * 10
    store.put(system, FakeCache(system).rows, pinned=True)
    convs = [[*system, i, i, i, i, i, i] for i in range(1, 4)]
    for c in convs:
        store.put(c, FakeCache(c).rows)
    assert store.nbytes <= row_bytes * 25
    assert store.lookup(convs[0], 100).length == len(system)  # oldest conversation evicted
    assert store.lookup(convs[2], 100).length == len(convs[2])  # newest kept
    assert store.lookup(system, 100).length == len(system)  # pinned system prefix kept


def test_persisted_prefix_survives_a_new_process(tmp_path: Path) -> None:
    tokens = list(range(1, 30))
    store = PrefixStore("layout-a", disk_dir=tmp_path)
    store.persist(tokens, FakeCache(tokens).rows)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_prefix_store import FakeCache, _same, _expected
        from npuchat.engine.prefix_store import PrefixStore
        tokens = list(range(1, 30))
        store = PrefixStore("layout-a", disk_dir=Path({str(tmp_path)!r}))
        hit = store.lookup(tokens + [99], 100)
        assert hit is not None and hit.source == "disk" and hit.length == len(tokens)
        assert _same(hit.snapshot, _expected(tokens, len(tokens)))
        assert PrefixStore("layout-b", disk_dir=Path({str(tmp_path)!r})).lookup(tokens, 99) is None
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_snapshot_is_detected_ignored_and_rebuilt(tmp_path: Path, damage: str) -> None:
    tokens = list(range(1, 30))
    PrefixStore("layout", disk_dir=tmp_path).persist(tokens, FakeCache(tokens).rows)
    (body,) = tmp_path.rglob("*.npz")
    data = bytearray(body.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    body.write_bytes(bytes(data))

    store = PrefixStore("layout", disk_dir=tmp_path)
    assert store.lookup(tokens, 100) is None
    assert any("corrupt" in w for w in store.warnings)
    assert body.exists()  # reported, not deleted
    store.persist(tokens, FakeCache(tokens).rows)  # the next prefill rebuilds it
    fresh = PrefixStore("layout", disk_dir=tmp_path)
    hit = fresh.lookup(tokens, 100)
    assert hit is not None and _same(hit.snapshot, _expected(tokens, len(tokens)))
