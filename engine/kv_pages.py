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

import numpy as np

__all__ = ["ReservedBuffer"]

_MADV_DONTNEED = 4  # Linux


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class ReservedBuffer:
    """`flat`: the buffer; `release` and `prefault` manage which of its pages are resident."""

    def __init__(self, elements: int, dtype: np.dtype) -> None:
        self.flat = np.zeros(elements, dtype)
        self._prefaulting: threading.Thread | None = None
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
        live layout: no step reads them meanwhile)."""
        if end <= self._prefaulted or self._prefaulting is not None:
            return
        step = mmap.PAGESIZE // self.flat.itemsize

        def touch() -> None:
            self.flat[start:end:step] = 0

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
            self._prefaulting.join()
            self._prefaulting = None
