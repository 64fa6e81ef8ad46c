"""GGUF matrices kept as their own blocks, for the `npuchat.QMatMul` kernels (`custom_ops`).

A matrix of a type the kernels cover is written as its rows of GGUF blocks, byte for byte: no
requantization, llama.cpp's bytes per weight (Q4_K 4.5 bits, Q6_K 6.56), nothing for ONNX Runtime
to prepack at load. Row operations the graph needs stay exact on blocks: a row permutation
(llama's rotary layout) or a split (fused Q|K|V) moves whole rows; attention's 1/sqrt(dh) on Q
becomes the op's `scale` over the first `scaled_rows` outputs instead of new block scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .custom_ops import COVERED_TYPES
from .gguf_reader import GGUFFile

__all__ = ["RawRows", "native_rows", "stack_native"]


@dataclass(frozen=True)
class RawRows:
    """`W[n, k]` as GGUF blocks: `data[n, row_bytes]`, every output row times `scale`."""

    ggml_type: GGMLQuantizationType
    k: int
    data: np.ndarray
    scale: float = 1.0

    @property
    def n(self) -> int:
        return int(self.data.shape[0])

    @property
    def kind(self) -> tuple[str, int]:
        return ("blocks", int(self.ggml_type))

    def rows(self, index: np.ndarray | slice) -> RawRows:
        return replace(self, data=np.ascontiguousarray(self.data[index]))

    def scaled(self, factor: float) -> RawRows:
        return replace(self, scale=self.scale * float(factor))


def native_rows(g: GGUFFile, name: str) -> RawRows | None:
    """The tensor as block rows, or None when the kernels do not cover its type."""
    info = g.tensors[name]
    if info.ggml_type not in COVERED_TYPES:
        return None
    k, n = info.shape[0], int(np.prod(info.shape[1:]))
    block, size = GGML_QUANT_SIZES[info.ggml_type]
    return RawRows(info.ggml_type, k, g.raw(name).reshape(n, k // block * size))


def stack_native(parts: Sequence[RawRows], joined: np.ndarray | None = None) -> tuple[RawRows, int]:
    """Fuse parts of one type by rows; the scaled parts must lead and share one scale (the Q of
    Q|K|V). Returns the fused rows (with that scale) and how many leading rows take it.
    `joined`: the parts' rows already as one array (the file's own bytes when the tensors lie
    back to back in it), used instead of a concatenated copy."""
    scales = [p.scale for p in parts]
    scale = scales[0]
    lead = 0
    while lead < len(parts) and scales[lead] == scale:
        lead += 1
    if any(s != 1.0 for s in scales[lead:]):
        raise ValueError("only a leading run of parts can be scaled")
    if joined is not None:
        data = joined
    else:
        data = np.concatenate([p.data for p in parts]) if len(parts) > 1 else parts[0].data
    scaled_rows = 0 if scale == 1.0 else sum(p.n for p in parts[:lead])
    return RawRows(parts[0].ggml_type, parts[0].k, data, scale), scaled_rows
