"""The memory under the KV cache: one zeroed buffer for the largest capacity, whose pages are
faulted in ahead of use and handed back to the OS when the cache shrinks.

numpy's zeroed allocation of a buffer this size is a fresh mapping from the C library, so pages
become resident only when touched; ONNX Runtime binds views of it like any numpy memory.

The buffer is kept on 4 KiB pages (`MADV_NOHUGEPAGE`; numpy asks for huge pages): a fault is
then a 4 KiB page rather than a 2 MiB one, so faulting the room for a long prompt in beside
running steps can be cut into slices of about a millisecond (`prefault`). On a VM whose guest
memory is backed on first use (2-3 ms a MiB measured, against ~0.1 once backed), one huge page
is ~6 ms that nothing can split. Decode at 3,500 cached tokens measured the same on either
(0.5B, f16 K/V, 2 threads: 52.9 / 53.6 tok/s on 4 KiB pages, 50.1 / 48.3 on huge pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import threading
import time

import numpy as np

__all__ = ["ReservedBuffer"]

_MADV_DONTNEED = 4  # Linux
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in, writable, without touching them
PREFAULT_PIECE = 64 * 4096  # bytes faulted in per call: ~0.2 ms where memory is first backed
PREFAULT_SLICE = 1e-3  # seconds of faulting between pauses
PREFAULT_IDLE = 2.0  # then idle twice as long as that took: a third of a core


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class ReservedBuffer:
    """`flat`: the buffer; `release` and `prefault` manage which of its pages are resident."""

    def __init__(self, elements: int, dtype: np.dtype) -> None:
        self.flat = np.zeros(elements, dtype)
        self._madvise(0, elements, _MADV_NOHUGEPAGE)  # module doc; advice only: may fail
        self._prefaulting: threading.Thread | None = None
        self._hurry = threading.Event()  # a step waits for the pages: no more pauses
        self._prefaulted = 0  # elements of the buffer known to be resident
        self._populate = True  # MADV_POPULATE_WRITE works here (else pages are touched)

    def _madvise(self, start: int, end: int, advice: int, whole: bool = True) -> bool:
        """`advice` on the pages of elements `[start, end)`, those wholly inside it or (`whole`
        False) every page it touches; whether the kernel took it. A ctypes call releases the
        GIL, so a slow fault holds up no other Python thread."""
        page, size = mmap.PAGESIZE, self.flat.itemsize
        lo, hi = self.flat.ctypes.data + start * size, self.flat.ctypes.data + end * size
        first = -(-lo // page) * page if whole else lo // page * page
        last = hi // page * page if whole else -(-hi // page) * page
        if last <= first:
            return True
        return _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice) == 0

    def release(self, keep: int) -> None:
        """Hand the pages past the first `keep` elements back to the OS (they read as zeros)."""
        self._madvise(keep, self.flat.size, _MADV_DONTNEED)
        self._prefaulted = min(self._prefaulted, keep)

    def _fault(self, start: int, end: int) -> None:
        """Fault in the pages of elements `[start, end)`: by the kernel where it can (the GIL
        released meanwhile), else by writing a zero into each page."""
        if self._populate and self._madvise(start, end, _MADV_POPULATE_WRITE, whole=False):
            return  # (contents untouched: a page shared with live data may be populated)
        self._populate = False  # an older kernel: EINVAL
        self.flat[start : end : mmap.PAGESIZE // self.flat.itemsize] = 0

    def prefault(self, start: int, end: int) -> None:
        """Fault in, in a background thread, the pages of elements `[start, end)` (beyond the
        live layout: no step reads them meanwhile), in slices of `PREFAULT_SLICE` with pauses
        between: faulting in a large cache at full speed took a core from the steps running
        meanwhile (a stream's decode steps 2-3.5x dearer, by process CPU time, while 400 MB
        of pages came in for a paste's room); at a third of one they pay much less, and a
        slice of a millisecond holds a step up by at most about that (4 MiB at a time, ~10 ms
        on first-backed memory, made single steps 1.5-2.3x dearer). A step that needs the
        pages (`join`) has the rest faulted in without pauses."""
        if end <= self._prefaulted or self._prefaulting is not None:
            return
        piece = max(1, PREFAULT_PIECE // self.flat.itemsize)

        def fault_in() -> None:
            at = start
            while at < end:
                t0 = time.perf_counter()
                while at < end and time.perf_counter() - t0 < PREFAULT_SLICE:
                    self._fault(at, min(end, at + piece))
                    at += piece
                self._hurry.wait(PREFAULT_IDLE * (time.perf_counter() - t0))

        self._prefaulting = threading.Thread(target=fault_in, name="kv-prefault", daemon=True)
        self._prefaulting.start()
        self._prefaulted = end

    def ready(self, start: int, end: int) -> bool:
        """Whether the pages up to element `end` are resident; when not, those of `[start,
        end)` are faulted in (background; asked again while a smaller range is running)."""
        if self._prefaulting is not None and not self._prefaulting.is_alive():
            self.join()
        if end > self._prefaulted:
            self.prefault(max(start, self._prefaulted), end)
            return False
        return self._prefaulting is None

    def join(self) -> None:
        if self._prefaulting is not None:
            self._hurry.set()
            self._prefaulting.join()
            self._prefaulting = None
            self._hurry.clear()
