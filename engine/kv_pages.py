"""The memory under the KV cache: one zeroed buffer for the largest capacity, whose pages are
faulted in ahead of use and handed back to the OS when the cache shrinks.

numpy's zeroed allocation of a buffer this size is a fresh mapping from the C library, so pages
become resident only when touched; ONNX Runtime binds views of it like any numpy memory.
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
PREFAULT_CHUNK = 4 << 20  # bytes faulted in at a time
PREFAULT_IDLE = 2.0  # then idle twice as long as that took: a third of a core


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class ReservedBuffer:
    """`flat`: the buffer; `release` and `prefault` manage which of its pages are resident."""

    def __init__(self, elements: int, dtype: np.dtype) -> None:
        self.flat = np.zeros(elements, dtype)
        self._prefaulting: threading.Thread | None = None
        self._hurry = threading.Event()  # a step waits for the pages: no more pauses
        self._prefaulted = 0  # elements of the buffer known to be resident

    def release(self, keep: int) -> None:
        """Hand the pages past the first `keep` elements back to the OS (they read as zeros)."""
        page = mmap.PAGESIZE
        base = self.flat.ctypes.data
        start = -(-(base + keep * self.flat.itemsize) // page) * page
        end = (base + self.flat.nbytes) // page * page
        if end > start:
            _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
        self._prefaulted = min(self._prefaulted, keep)

    def prefault(self, start: int, end: int) -> None:
        """Touch, in a background thread, the pages of elements `[start, end)` (beyond the
        live layout: no step reads them meanwhile), `PREFAULT_CHUNK` bytes at a time with
        pauses between: faulting in a large cache at full speed took a core from the steps
        running meanwhile (a stream's decode steps 2-3.5x dearer, by process CPU time, while
        400 MB of pages came in for a paste's room); at a third of one they pay much less.
        A step that needs the pages (`join`) has the rest faulted in without pauses."""
        if end <= self._prefaulted or self._prefaulting is not None:
            return
        step = mmap.PAGESIZE // self.flat.itemsize
        chunk = max(step, PREFAULT_CHUNK // self.flat.itemsize // step * step)

        def touch() -> None:
            for at in range(start, end, chunk):
                t0 = time.perf_counter()
                self.flat[at : min(end, at + chunk) : step] = 0
                self._hurry.wait(PREFAULT_IDLE * (time.perf_counter() - t0))

        self._prefaulting = threading.Thread(target=touch, name="kv-prefault", daemon=True)
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
