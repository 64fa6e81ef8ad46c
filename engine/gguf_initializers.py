"""Graph initializers that are byte ranges of the GGUF itself, handed to ONNX Runtime uncopied.

The native kernels (`npuchat.QMatMul`) read GGUF blocks as they are, so a copy of them in the
graph cache would only double the disk (1.1 GB more for the default model), the first start's
writes and the cache check's hashing. Instead such an initializer is stored as external data at
its offset in the model file, with `GGUF_REF` as its location: an empty file in the graph folder
that stands for the GGUF (ONNX Runtime only accepts external files inside the model's folder,
and refuses links out of it). Reading an empty file fails for any offset, so a graph opened
without its GGUF is an error, never garbage.

At session start the same ranges are mapped from the GGUF and given to ONNX Runtime as shared
initializers (`SessionOptions.add_initializer`): it uses that memory as it is (checked on ORT
1.32: a write into the mapping after the session starts is seen by the next run), where
`add_external_initializers` would copy every byte. The mapping must outlive the session, so the
session keeps it (`attach`).

Which initializers those are is written beside the graph when it is built (`<graph>.gguf.json`:
name, dtype, dims, offset, length), so that opening a built graph needs no protobuf parsing and
no `onnx` package (`graph_key` says why). The index is one of the folder's files, under its
manifest like the rest; an index that is missing or does not hold together is an error, never
mapped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]

from .errors import NpuchatError

if TYPE_CHECKING:
    import onnx

__all__ = ["GGUF_REF", "GgufInitializers", "gguf_initializers", "index_path", "write_index"]

GGUF_REF = "gguf-tensors"
_INDEX_FORMAT = 1
_DTYPES = frozenset({"uint8", "int8", "int32", "int64", "float16", "float32"})


@dataclass
class GgufInitializers:
    """OrtValues over one read-only mapping of the GGUF, by initializer name."""

    values: dict[str, ort.OrtValue]
    mapping: np.memmap

    def add_to(self, so: ort.SessionOptions, names: set[str] | None = None) -> None:
        """Share them with the session `so` opens (`names`: only these, for a sub-graph)."""
        for name, value in self.values.items():
            if names is None or name in names:
                so.add_initializer(name, value)

    def attach(self, session: ort.InferenceSession) -> ort.InferenceSession:
        session._npuchat_gguf_initializers = self  # the memory lives while the session does
        return session


@dataclass(frozen=True)
class _Ref:
    name: str
    dtype: str
    dims: tuple[int, ...]
    offset: int
    length: int


def index_path(onnx_path: Path) -> Path:
    return onnx_path.with_name(onnx_path.name + ".gguf.json")


def write_index(model: onnx.ModelProto, onnx_path: Path) -> None:
    """Beside a graph just saved, the index of its initializers that live in the GGUF (none:
    no index)."""
    from onnx import helper

    refs = []
    for t in model.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if ext.get("location") == GGUF_REF:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).name
            refs.append(
                {"name": t.name, "dtype": dtype, "dims": list(t.dims)}
                | {"offset": int(ext["offset"]), "length": int(ext["length"])}
            )
    if refs:
        text = json.dumps({"format": _INDEX_FORMAT, "tensors": refs})
        index_path(onnx_path).write_text(text)


def _ref(entry: Any) -> _Ref | None:
    """One index entry, if it holds together: a known dtype, dims whose bytes are its length."""
    try:
        ref = _Ref(
            entry["name"],
            entry["dtype"],
            tuple(entry["dims"]),
            entry["offset"],
            entry["length"],
        )
    except (KeyError, TypeError):
        return None
    ints = [*ref.dims, ref.offset, ref.length]
    if not isinstance(ref.name, str) or not isinstance(ref.dtype, str) or ref.dtype not in _DTYPES:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        return None
    if math.prod(ref.dims) * np.dtype(ref.dtype).itemsize != ref.length:
        return None
    return ref


def _damaged(onnx_path: Path) -> NpuchatError:
    """(Made here, not kept in a local of the raiser: an exception that its own frame holds is
    a cycle, and the frames behind it hold views of the model file until a collection.)"""
    return NpuchatError(
        f"the graph cache's index of GGUF tensors for {onnx_path.name} is missing or damaged; "
        "delete the cache folder and start again"
    )


def _read_index(onnx_path: Path) -> list[_Ref]:
    try:
        raw = json.loads(index_path(onnx_path).read_text())
        entries = raw["tensors"] if raw.get("format") == _INDEX_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise _damaged(onnx_path) from None
    refs = [_ref(e) for e in entries] if isinstance(entries, list) else [None]
    if not refs or None in refs:
        raise _damaged(onnx_path)
    return [r for r in refs if r is not None]


def gguf_initializers(onnx_path: Path, gguf_path: Path) -> GgufInitializers | None:
    """The initializers of `onnx_path` that live in the GGUF, mapped; None if it has none.

    Every range must lie inside the model file as it is now: a file shorter than the graph
    expects is a one-line error, never mapped.
    """
    if not (onnx_path.parent / GGUF_REF).exists():
        return None
    refs = _read_index(onnx_path)
    try:
        mapping = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise NpuchatError(f"cannot map {gguf_path} for its graphs ({exc})") from exc
    values = {}
    for t in refs:
        if t.offset + t.length > len(mapping):
            raise NpuchatError(
                f"{gguf_path} is shorter than its built graphs expect ({len(mapping)} bytes, "
                f"tensor {t.name} ends at {t.offset + t.length}): download or import it again"
            )
        view = mapping[t.offset : t.offset + t.length].view(t.dtype).reshape(t.dims)
        values[t.name] = ort.OrtValue.ortvalue_from_numpy(view)
    return GgufInitializers(values, mapping)
