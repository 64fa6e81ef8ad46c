"""The KV cache moving between capacities: every row keeps its own slots, and room reserved for
a prompt read in parts keeps the cache where it was put."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from npuchat.engine.kv_pages import ReservedBuffer
from npuchat.engine.kvcache import KVCache


def _filled(lengths: list[int], kv_dtype: str = "f32") -> tuple[KVCache, list[np.ndarray]]:
    kv = KVCache(2, 2, 4, [4, 8, 16, 32], rows=len(lengths), kv_dtype=kv_dtype)
    kv.ensure(max(lengths))
    rng = np.random.default_rng(1)
    want = []
    for row, n in enumerate(lengths):
        for layer in range(2):
            for part in (kv.k, kv.v):
                vals = rng.integers(-100, 100, (2, n, 4)).astype(kv.dtype)
                part[layer][row, :, :n] = vals
                want.append(vals)
        kv.lengths[row] = n
    return kv, want


def _rows(kv: KVCache, lengths: list[int]) -> list[np.ndarray]:
    return [
        part[layer][row, :, :n].copy()
        for row, n in enumerate(lengths)
        for layer in range(2)
        for part in (kv.k, kv.v)
    ]


@pytest.mark.parametrize("kv_dtype", ["f32", "int8"])
def test_every_row_keeps_its_slots_through_growing_and_shrinking(kv_dtype: str) -> None:
    lengths = [7, 1, 0, 3]
    kv, want = _filled(lengths, kv_dtype)
    assert kv.capacity == 8
    for needed in (30, 12, 9, 7):  # up to 32, down to 16, then 8 (the longest row holds 7)
        kv.ensure(needed)
        got = _rows(kv, lengths)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), needed
    assert kv.capacity == 8


def test_held_room_stays_until_it_is_released() -> None:
    kv, want = _filled([3, 2])
    kv.hold(20)
    assert kv.capacity == 32
    kv.ensure(4)  # a step that needs little does not move the cache back down
    assert kv.capacity == 32
    kv.hold(0)
    kv.ensure(4)
    assert kv.capacity == 4
    assert all(np.array_equal(a, b) for a, b in zip(_rows(kv, [3, 2]), want, strict=True))


def test_prepare_faults_the_pages_in_before_saying_ready() -> None:
    kv, want = _filled([3, 2])
    assert kv.prepare(4)  # fits already
    deadline = time.monotonic() + 10
    while not kv.prepare(30):
        assert time.monotonic() < deadline, "the room for 30 slots never became ready"
        time.sleep(0.01)
    assert kv.capacity == 4  # ready, not moved: the caller moves once it is (`hold`)
    kv.hold(30)
    assert kv.capacity == 32
    assert all(np.array_equal(a, b) for a, b in zip(_rows(kv, [3, 2]), want, strict=True))


def test_pages_are_faulted_in_at_a_fraction_of_a_core() -> None:
    """The room for a long prompt is faulted in beside running steps: the prefault thread
    idles between chunks (`PREFAULT_IDLE`), so it takes a fraction of a core over its life
    (its own CPU clock against the wall clock), not a whole one the steps would miss."""
    buffer = ReservedBuffer(32 << 20, np.dtype(np.float32))  # 128 MiB
    buffer.release(0)  # none of it resident (the allocator may hand back a freed buffer's)
    before = set(threading.enumerate())
    buffer.prefault(0, buffer.flat.size)
    (thread,) = [t for t in threading.enumerate() if t.name == "kv-prefault" and t not in before]
    clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
    wall, cpu = time.perf_counter(), 0.0
    while thread.is_alive():  # not `join`: that hurries the rest
        try:
            cpu = time.clock_gettime(clock)
        except OSError:  # it ended meanwhile
            break
        time.sleep(0.002)
    wall = time.perf_counter() - wall
    assert buffer.ready(0, buffer.flat.size)
    assert cpu < 0.5 * wall, (cpu, wall)
