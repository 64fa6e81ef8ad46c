"""GGUF files: metadata, tensor directory and raw tensor bytes (`model_config` reads the config).

`gguf.GGUFReader` parses every array element into Python objects and takes ~14 s to open a
150k-token vocabulary; a chat app cannot wait that long to tokenize one line. This reader parses
the header itself (numeric arrays via numpy, strings in one pass) and maps tensor data lazily, so
opening any of our models takes well under a second. Tensor *decoding* is left to `gguf.quants`.
"""

from __future__ import annotations

import errno
import math
import mmap
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import NpuchatError
from .model_config import ModelConfig, RopeScaling

# ModelConfig and RopeScaling are defined in `model_config`; named here for the modules that
# take them together with the file.
__all__ = ["GGUFFile", "ModelConfig", "RopeScaling", "TensorInfo", "read_config"]
_MAGIC = b"GGUF"

# GGUF value types -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9

# Limits checked before anything is allocated. The largest real vocabularies hold ~262k tokens
# and ~500k merges; GGML tensors have at most 4 dimensions.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_ELEMENTS = 1 << 21
MAX_ARRAY_DEPTH = 2
MAX_DIMS = 4
MAX_ALIGNMENT = 1 << 20


class GGUFFormatError(NpuchatError):
    """The file is not a readable GGUF (truncated, wrong magic, unknown value type)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's directory entry. `shape` is in GGML order (ne0 = innermost, contiguous)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(
                f"{self.path} is truncated (header runs past the end of the file): "
                "download or import it again"
            )
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return self.take(n).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: `string` inlined, since a vocabulary and its merges are
        300k of them and this loop is most of a cached start's parse."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                break
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                break
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        else:
            self.pos = pos
            return out
        self.pos = end
        self.take(1)  # past the end: the truncation error
        return out

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1])
                raw = self.take(dtype.itemsize * count)  # bounded by the file's size
                return np.frombuffer(raw, dtype=dtype).copy()
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFFormatError(
                    f"{self.path}: arrays nested deeper than {MAX_ARRAY_DEPTH}; not a model file"
                )
            # Each element costs Python objects far larger than its bytes: bound the count
            # before the loop, so a sparse file of zeros cannot become gigabytes of strings.
            if count > MAX_ARRAY_ELEMENTS or count * 8 > len(self.buf) - self.pos:
                raise GGUFFormatError(
                    f"{self.path}: a metadata array claims {count} elements (at most"
                    f" {MAX_ARRAY_ELEMENTS} fit a model file); the file is damaged"
                )
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise GGUFFormatError(f"{self.path}: unknown GGUF value type {vtype}; is it a GGUF file?")

    def count(self, what: str, limit: int, min_bytes: int) -> int:
        """A count from the header, refused if it cannot fit the file or the limit."""
        n = self.scalar("<Q")
        if n > limit or n * min_bytes > len(self.buf) - self.pos:
            raise GGUFFormatError(
                f"{self.path}: the header claims {n} {what} (at most {limit}, and each needs"
                f" {min_bytes}+ bytes); the file is damaged or not a model"
            )
        return int(n)


class GGUFFile:
    """A GGUF file opened for reading: metadata dict, tensor directory, raw tensor bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_regular_file(self.path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # empty file
                raise GGUFFormatError(f"{self.path} is empty, not a GGUF model") from exc
        cur = _Cursor(self._map, self.path)
        if cur.take(4) != _MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (bad magic bytes)")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} is not supported")
        n_tensors = cur.count("tensors", MAX_TENSORS, 24)
        n_kv = cur.count("metadata entries", MAX_KV, 12)
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        self.metadata: Mapping[str, Any] = meta
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > MAX_DIMS:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name} has {n_dims} dimensions (GGUF allows"
                    f" {MAX_DIMS}); the file is damaged"
                )
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            ttype = cur.scalar("<I")
            offset = cur.scalar("<Q")
            raw_infos.append((name, dims, ttype, offset))
        align = meta.get("general.alignment", 32)
        if (
            not isinstance(align, int | np.integer)
            or isinstance(align, bool)
            or not 0 < int(align) <= MAX_ALIGNMENT
            or int(align) & (int(align) - 1)
        ):
            raise GGUFFormatError(
                f"{self.path}: general.alignment = {align!r} is not a power of two up to"
                f" {MAX_ALIGNMENT}; the file is damaged"
            )
        align = int(align)
        data_start = (cur.pos + align - 1) // align * align
        tensors: dict[str, TensorInfo] = {}
        for name, dims, ttype, offset in raw_infos:
            try:
                gtype = GGMLQuantizationType(ttype)
            except ValueError as exc:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name} has unknown type {ttype}"
                ) from exc
            block, type_size = GGML_QUANT_SIZES[gtype]
            n_el = math.prod(dims)
            if n_el * type_size // block > len(self._map) or (dims and dims[0] % block):
                raise GGUFFormatError(
                    f"{self.path}: tensor {name} has shape {list(dims)}, which is larger than"
                    f" the file or not whole {gtype.name} blocks; the file is damaged"
                )
            n_bytes = n_el // block * type_size
            start = data_start + offset
            if start + n_bytes > len(self._map):
                raise GGUFFormatError(
                    f"{self.path} is truncated (tensor {name} runs past the end): "
                    "download or import it again"
                )
            tensors[name] = TensorInfo(name, dims, gtype, start, n_bytes)
        self.tensors: Mapping[str, TensorInfo] = tensors

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def file_bytes(self) -> np.ndarray:
        """The whole file as a read-only uint8 view into the mapping (drop it before `close`)."""
        return np.frombuffer(self._map, dtype=np.uint8)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the mapped file (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self)


def check_regular_file(path: Path) -> None:
    """Refuse, by what it is, a path that cannot be a model file (a folder, a device, a
    symlink loop), instead of a misleading "no such file"."""
    try:
        st = path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NpuchatError(
                f"{path} is a symbolic link loop; give the path of a .gguf file"
            ) from exc
        raise NpuchatError(f"no such file: {path}; give the path of a .gguf file") from exc
    if stat.S_ISDIR(st.st_mode):
        raise NpuchatError(f"{path} is a directory; give the path of a .gguf file")
    if not stat.S_ISREG(st.st_mode):
        raise NpuchatError(f"{path} is not a regular file; give the path of a .gguf file")


def read_config(path: str | Path) -> ModelConfig:
    with GGUFFile(path) as g:
        return g.config
