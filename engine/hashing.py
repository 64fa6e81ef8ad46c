"""sha256 of a file, read in chunks: model files are gigabytes, so never read whole; and a
model file's digest remembered beside the cache, so a start does not hash it again."""

from __future__ import annotations

import hashlib
import json
import os
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


def _sidecar(path: Path, cache_dir: Path) -> Path:
    return cache_dir / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")


def _stamp(path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {
        "path": str(path),
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def remember_sha256(path: Path, cache_dir: Path, digest: str) -> None:
    """Record `digest` as the sha256 of `path` as it is now (a pull hashed it while fetching)."""
    path = Path(path).resolve()
    sidecar = _sidecar(path, cache_dir)
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    tmp = sidecar.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**_stamp(path), "sha256": digest}))
    tmp.replace(sidecar)


def model_sha256(
    path: Path, cache_dir: Path, hash_file: Callable[[Path], str] | None = None
) -> str:
    """The model file's sha256, cached in a sidecar keyed by path, inode, size, mtime and ctime.

    Hashing a 1 GB file costs ~1 s per start; the sidecar makes it a stat() call. A file that was
    replaced or written since (another inode, size, mtime or ctime) is hashed again. The ctime
    matters because the CPU graphs read the model's blocks where they lie in the file: a write
    that kept the size and set the mtime back (`touch -r`) still moves the ctime, which no
    user call can set.
    """
    path = Path(path).resolve()
    stamp = _stamp(path)
    try:
        saved = json.loads(_sidecar(path, cache_dir).read_text())
        if {k: saved.get(k) for k in stamp} == stamp and len(saved.get("sha256", "")) == 64:
            return str(saved["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    digest = (hash_file or sha256_file)(path)
    remember_sha256(path, cache_dir, digest)
    return digest
