"""GGUF matrices kept as their own blocks, for the `npuchat.QMatMul` kernels (`custom_ops`).

A matrix of a type the kernels cover is written as its rows of GGUF blocks, byte for byte: no
requantization, llama.cpp's bytes per weight (Q4_K 4.5 bits, Q6_K 6.56), nothing for ONNX Runtime
to prepack at load. Row operations the graph needs stay exact on blocks: a row permutation
(llama's rotary layout) or a split (fused Q|K|V) moves whole rows; attention's 1/sqrt(dh) on Q
becomes the op's `scale` over the first `scaled_rows` outputs instead of new block scales.

Q4_K, Q6_K, Q8_0, Q5_0 and Q4_1 matrices are the exception (`regroup_rows`): their rows are
regrouped eight at a time into the layouts of the kernels' eight-row dot products (`Q4KX8`,
`Q6KX8`, `Q8X8`, `Q5X8`, `Q41X8` in `native/qblocks.h`), which read each weight byte once for
eight rows' sums: ~1.7-2x the prefill and less CPU per decode step than the GGUF's rows (Q4_1,
SmolLM2's type: decode ~1.4x, prefill ~1.9x), for a copy in the graph cache (Q4_K 2.8%
larger than its blocks, the others the same size). A SwiGLU's gate|up rows of
any type are paired in eights (`pair_halves`) so that the fused op reads an output's two rows
from one stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .custom_ops import COVERED_TYPES, native_regroup
from .gguf_reader import GGUFFile

__all__ = [
    "Q4K_GROUP",
    "RawRows",
    "native_rows",
    "pair_halves",
    "regroup_rows",
    "stack_native",
]

Q4K_GROUP = 8  # rows per group of the regrouped layout
# Bytes of an eight-row group's block in each regrouped layout (sizeof(Q4KX8), ... in qblocks.h)
_X8_BYTES = {
    GGMLQuantizationType.Q4_K: 1184,  # 8 x 144 + the scales and minima unpacked to bytes
    GGMLQuantizationType.Q6_K: 1680,  # 8 x 210
    GGMLQuantizationType.Q8_0: 272,  # 8 x 34
    GGMLQuantizationType.Q5_0: 176,  # 8 x 22
    GGMLQuantizationType.Q4_1: 160,  # 8 x 20
}


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


def pair_halves(data: np.ndarray) -> np.ndarray:
    """Rows gate|up of a SwiGLU MLP (`[n, row_bytes]`, n / 2 a multiple of 8) reordered as gate
    rows 0-7, up rows 0-7, gate rows 8-15, ...: the fused op reads an output's two rows from one
    stream (QMatMul `paired`). Read as two streams, gate|up ran at 15-19 GB/s in a 1.5B decode
    step and 15 GB/s in a 0.5B one, against 21-30 GB/s for the single-stream matrices beside it."""
    n, row_bytes = data.shape
    halves = data.reshape(2, n // (2 * Q4K_GROUP), Q4K_GROUP, row_bytes)
    return np.ascontiguousarray(halves.transpose(1, 0, 2, 3)).reshape(n, row_bytes)


def regroup_rows(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray | None:
    """Rows `[n, row_bytes]` (n a multiple of 8) of Q4_K, Q6_K, Q8_0, Q5_0 or Q4_1 as
    `[n / 8, ...]` bytes in the eight-row layout of their type (`Q4KX8`, ... in
    `native/qblocks.h`), written by the kernel library (`native/regroup.cc`; numpy took ~1.5 s
    of a first start for it); None for the type the kernels read as the GGUF's rows (Q4_0)."""
    group_bytes = _X8_BYTES.get(ggml_type)
    if group_bytes is None:
        return None
    src = np.ascontiguousarray(data)
    n, row_bytes = src.shape
    nb = row_bytes // GGML_QUANT_SIZES[ggml_type][1]
    out = np.empty((n // Q4K_GROUP, nb * group_bytes), np.uint8)
    if native_regroup()(int(ggml_type), src.ctypes.data, n, row_bytes, out.ctypes.data) != 0:
        raise ValueError(f"{ggml_type.name} rows [{n}, {row_bytes}] cannot be regrouped in eights")
    return out
