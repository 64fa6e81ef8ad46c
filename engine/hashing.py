"""sha256 of a file, read in chunks: model files are gigabytes, so never read whole."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

_CHUNK = 8 << 20


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """Hex digest of `path`; `progress` gets the size of each chunk as it is read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()
