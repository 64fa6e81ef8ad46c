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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort  # type: ignore[import-untyped]
from onnx import TensorProto

from .errors import NpuchatError

__all__ = ["GGUF_REF", "GgufInitializers", "gguf_initializers"]

GGUF_REF = "gguf-tensors"


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


def _external(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def gguf_initializers(onnx_path: Path, gguf_path: Path) -> GgufInitializers | None:
    """The initializers of `onnx_path` that live in the GGUF, mapped; None if it has none.

    Every range must lie inside the model file as it is now: a file shorter than the graph
    expects is a one-line error, never mapped.
    """
    if not (onnx_path.parent / GGUF_REF).exists():
        return None
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    refs = [t for t in graph.initializer if _external(t).get("location") == GGUF_REF]
    if not refs:
        return None
    try:
        mapping = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise NpuchatError(f"cannot map {gguf_path} for its graphs ({exc})") from exc
    values = {}
    for t in refs:
        ext = _external(t)
        offset, length = int(ext["offset"]), int(ext["length"])
        if offset + length > len(mapping):
            raise NpuchatError(
                f"{gguf_path} is shorter than its built graphs expect ({len(mapping)} bytes, "
                f"tensor {t.name} ends at {offset + length}): download or import it again"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        view = mapping[offset : offset + length].view(dtype).reshape(tuple(t.dims))
        values[t.name] = ort.OrtValue.ortvalue_from_numpy(view)
    return GgufInitializers(values, mapping)
