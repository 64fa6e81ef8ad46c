"""The KV cache moving between capacities: every row keeps its own slots, and room reserved for
a prompt read in parts keeps the cache where it was put."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
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


def _resident_pages(buffer: ReservedBuffer) -> tuple[int, int]:
    """(resident, all) whole pages of the buffer, by `mincore`."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    lo = -(-buffer.flat.ctypes.data // page) * page
    hi = (buffer.flat.ctypes.data + buffer.flat.nbytes) // page * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0
    return sum(b & 1 for b in vec), len(vec)


@pytest.mark.parametrize("populate", [True, False])
def test_prefault_makes_every_page_of_the_range_resident_and_release_drops_them(
    populate: bool,
) -> None:
    """Faulted in piece by piece (`PREFAULT_PIECE`) from an offset inside a page, no page of
    the range is skipped; released, none stays (the buffer's 4 KiB pages: each goes alone).
    `populate` False: a kernel without `MADV_POPULATE_WRITE`, where the pages are touched."""
    buffer = ReservedBuffer((8 << 20) + 123, np.dtype(np.float32))  # 32 MiB and a bit
    buffer._populate = populate
    buffer.release(0)
    assert _resident_pages(buffer)[0] == 0
    buffer.flat[:777] = 1.0  # live data below the range, on its first page, keeps its values
    buffer.prefault(777, buffer.flat.size)
    buffer.join()
    resident, pages = _resident_pages(buffer)
    assert resident == pages
    assert np.all(buffer.flat[:777] == 1.0)
    buffer.release(1 << 20)  # keeps the first 4 MiB
    resident, _ = _resident_pages(buffer)
    assert resident == (4 << 20) // mmap.PAGESIZE
    assert np.all(buffer.flat[:777] == 1.0)


def test_the_buffer_is_not_backed_by_huge_pages() -> None:
    """A huge page is a 2 MiB fault that the prefault cannot cut into slices (`kv_pages`)."""
    buffer = ReservedBuffer(16 << 20, np.dtype(np.float32))  # 64 MiB: huge-page sized
    buffer.prefault(0, buffer.flat.size)
    buffer.join()
    lo, hi = buffer.flat.ctypes.data, buffer.flat.ctypes.data + buffer.flat.nbytes
    huge_kb, seen = 0, 0  # over the mappings the buffer lies in (advice splits them)
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and lo < end
                seen += (min(hi, end) - max(lo, start)) if inside else 0
            elif inside and head == "AnonHugePages:":
                huge_kb += int(line.split()[1])
    assert seen == buffer.flat.nbytes
    assert huge_kb == 0
