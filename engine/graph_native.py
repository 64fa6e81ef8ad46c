"""GGUF matrices kept as their own blocks, for the `npuchat.QMatMul` kernels (`custom_ops`).

A matrix of a type the kernels cover is written as its rows of GGUF blocks, byte for byte: no
requantization, llama.cpp's bytes per weight (Q4_K 4.5 bits, Q6_K 6.56), nothing for ONNX Runtime
to prepack at load. Row operations the graph needs stay exact on blocks: a row permutation
(llama's rotary layout) or a split (fused Q|K|V) moves whole rows; attention's 1/sqrt(dh) on Q
becomes the op's `scale` over the first `scaled_rows` outputs instead of new block scales.

Q4_K, Q6_K, Q8_0 and Q5_0 matrices are the exception (`regroup_rows`): their rows are regrouped
eight at a time into the layouts of the kernels' eight-row dot products (`Q4KX8`, `Q6KX8`,
`Q8X8`, `Q5X8` in `native/qblocks.h`), which read each weight byte once for eight rows' sums:
~1.7-2x the prefill and less CPU per decode step than the GGUF's rows, for a copy in the graph
cache (Q4_K 2.8% larger than its blocks, the others the same size). A SwiGLU's gate|up rows of
any type are paired in eights (`pair_halves`) so that the fused op reads an output's two rows
from one stream.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .custom_ops import COVERED_TYPES
from .gguf_reader import GGUFFile

__all__ = [
    "Q4K_GROUP",
    "RawRows",
    "native_rows",
    "pair_halves",
    "regroup_q4_k",
    "regroup_q5_0",
    "regroup_q6_k",
    "regroup_q8_0",
    "regroup_rows",
    "stack_native",
]

Q4K_GROUP = 8  # rows per group of the regrouped layout
_Q4K_BYTES = 144  # a Q4_K block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/minima, 128 nibbles
_X8_BYTES = 1184  # a regrouped block of eight rows (sizeof(Q4KX8))
_Q6K_BYTES = 210  # a Q6_K block: 128 low-nibble bytes, 64 of high bit pairs, 16 scales, fp16 d
_Q6X8_BYTES = 1680  # a regrouped Q6_K block of eight rows (sizeof(Q6KX8)): 8 x 210
_Q8_0_BYTES = 34  # fp16 d, 32 int8
_Q5_0_BYTES = 22  # fp16 d, 4 bytes of fifth bits, 16 nibble bytes
_CHUNK_GROUPS = 4096  # groups regrouped at a time where numpy needs temporaries per element


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


def _runs(data: np.ndarray, nb: int, block: int, first: int, last: int) -> np.ndarray:
    """Bytes [first, last) of every block of each group's eight rows as 4-byte words,
    `[groups, row, block, words]`: the regrouped layouts move whole runs of four bytes, and
    moving them as words is ~4x faster than as bytes (the first start of a 1.5B model regroups
    ~930 MB)."""
    groups = data.shape[0] // Q4K_GROUP
    blocks = data.reshape(groups, Q4K_GROUP, nb, block)[..., first:last]
    return np.ascontiguousarray(blocks).view(np.uint32)


def _by_row(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[..., r] = src[:, r]` for a group's eight rows: eight strided copies with long inner
    loops (one transpose that puts the rows innermost ran ~4x slower)."""
    for r in range(Q4K_GROUP):
        dst[..., r] = src[:, r]


def regroup_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K rows `[n, nb * 144]` (n a multiple of 8) as `[n / 8, nb * 1184]` bytes: per group of
    eight rows and per super-block, the rows' d, then dmin, the 6-bit scales and minima unpacked to
    bytes (`scales[sub-block][row]`, `mins[pair][row][2]`), then the nibble bytes in runs of four
    per row (`qs[64-element chunk][four-element group][row][4]`), as `Q4KX8` declares them."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q4K_BYTES
    groups = n // Q4K_GROUP
    b = data.reshape(groups, Q4K_GROUP, nb, _Q4K_BYTES).transpose(0, 2, 1, 3)  # [g, blk, row, byte]
    out = np.empty((groups, nb, _X8_BYTES), np.uint8)
    out[..., 0:16] = b[..., 0:2].reshape(groups, nb, 16)
    out[..., 16:32] = b[..., 2:4].reshape(groups, nb, 16)
    u = b[..., 4:16]  # q4k_scale_min's bytes: scales 0-3, minima 0-3, then the high pairs
    scales = np.concatenate([u[..., 0:4] & 63, (u[..., 8:12] & 15) | ((u[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([u[..., 4:8] & 63, (u[..., 8:12] >> 4) | ((u[..., 4:8] >> 6) << 4)], -1)
    out[..., 32:96] = scales.transpose(0, 1, 3, 2).reshape(groups, nb, 64)
    pairs = mins.reshape(groups, nb, Q4K_GROUP, 4, 2).transpose(0, 1, 3, 2, 4)
    out[..., 96:160] = pairs.reshape(groups, nb, 64)
    qs = _runs(data, nb, _Q4K_BYTES, 16, 144).reshape(groups, Q4K_GROUP, nb, 4, 8)
    words = out[..., 160:].view(np.uint32)  # [group, block, 256]: chunk, group of four, row
    _by_row(words.reshape(groups, nb, 4, 8, Q4K_GROUP), qs)
    return out.reshape(groups, nb * _X8_BYTES)


def regroup_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K rows `[n, nb * 210]` (n a multiple of 8) as `[n / 8, nb * 1680]` bytes, `Q6KX8`'s
    layout: per group of eight rows and per super-block, the rows' d, their 16 int8 scales as
    pairs (`scales[pair][row][2]`), then per half (128 elements) and four-element group g three
    32-byte runs of four bytes per row: low-nibble bytes 4g.. (elements l and l + 64), bytes
    32 + 4g.. (l + 32, l + 96), and the high-bit bytes 4g.. (two bits of each of the four)."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q6K_BYTES
    groups = n // Q4K_GROUP
    b = data.reshape(groups, Q4K_GROUP, nb, _Q6K_BYTES).transpose(0, 2, 1, 3)  # [g, blk, row, byte]
    out = np.empty((groups, nb, _Q6X8_BYTES), np.uint8)
    out[..., 0:16] = b[..., 208:210].reshape(groups, nb, 16)
    scales = b[..., 192:208].reshape(groups, nb, Q4K_GROUP, 8, 2).transpose(0, 1, 3, 2, 4)
    out[..., 16:144] = scales.reshape(groups, nb, 128)
    body = _runs(data, nb, _Q6K_BYTES, 0, 192)  # 32 words of low nibbles, 16 of high bits
    low = body[..., :32].reshape(groups, Q4K_GROUP, nb, 2, 2, 8)  # row, block, half, run, g
    high = body[..., 32:].reshape(groups, Q4K_GROUP, nb, 2, 1, 8)
    words = out[..., 144:].view(np.uint32).reshape(groups, nb, 2, 8, 3, Q4K_GROUP)
    _by_row(words[..., 0:2, :], low.transpose(0, 1, 2, 3, 5, 4))  # [.., half, g, run, row]
    _by_row(words[..., 2:3, :], high.transpose(0, 1, 2, 3, 5, 4))
    return out.reshape(groups, nb * _Q6X8_BYTES)


def _rows_d(data: np.ndarray, nb: int, block: int) -> np.ndarray:
    """Each group's eight rows' fp16 d per block as `[group, block, 16 bytes]`."""
    groups = data.shape[0] // Q4K_GROUP
    b = data.reshape(groups, Q4K_GROUP, nb, block)[..., 0:2]
    return b.transpose(0, 2, 1, 3).reshape(groups, nb, 16)


def regroup_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 rows `[n, nb * 34]` (n a multiple of 8) as `[n / 8, nb * 272]` bytes, `Q8X8`'s
    layout: per group of eight rows and per block, the rows' d, then per four-element group a
    run of four int8 weights per row (`qs[group of four][row][4]`)."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q8_0_BYTES
    groups = n // Q4K_GROUP
    out = np.empty((groups, nb, 8 * _Q8_0_BYTES), np.uint8)
    out[..., 0:16] = _rows_d(data, nb, _Q8_0_BYTES)
    qs = _runs(data, nb, _Q8_0_BYTES, 2, 34)  # [group, row, block, 8 words]
    _by_row(out[..., 16:].view(np.uint32).reshape(groups, nb, 8, Q4K_GROUP), qs)
    return out.reshape(groups, nb * 8 * _Q8_0_BYTES)


@functools.cache
def _fifth_bits_table() -> np.ndarray:
    """For each 16 bits v of a Q5_0 row's fifth bits, the 4 bytes (little-endian in a uint32)
    whose byte t holds bit 4g + t of v at bit 2g: `Q5X8.qh` for half h is the table of that
    half's 16 bits shifted left by h."""
    v = np.arange(1 << 16, dtype=np.uint32)
    out = np.zeros(1 << 16, np.uint32)
    for t in range(4):
        for g in range(4):
            out |= ((v >> (4 * g + t)) & 1) << (8 * t + 2 * g)
    return out


def regroup_q5_0(data: np.ndarray) -> np.ndarray:
    """Q5_0 rows `[n, nb * 22]` (n a multiple of 8) as `[n / 8, nb * 176]` bytes, `Q5X8`'s
    layout: per group of eight rows and per block, the rows' d, their fifth bits (bit 2g + h of
    byte 4 * row + t: element 16h + 4g + t), then the nibble bytes in runs of four per row
    (`qs[g][row][4]`: bytes 4g..4g+3, elements 4g + t low and 16 + 4g + t high)."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q5_0_BYTES
    out = np.empty((n // Q4K_GROUP, nb, 8 * _Q5_0_BYTES), np.uint8)
    for g0 in range(0, n // Q4K_GROUP, _CHUNK_GROUPS):
        part = data[g0 * Q4K_GROUP : (g0 + _CHUNK_GROUPS) * Q4K_GROUP]
        groups = part.shape[0] // Q4K_GROUP
        dst = out[g0 : g0 + groups]
        dst[..., 0:16] = _rows_d(part, nb, _Q5_0_BYTES)
        qh = _runs(part, nb, _Q5_0_BYTES, 2, 6)[..., 0]  # [group, row, block] bit e = element e
        table = _fifth_bits_table()
        bits = table[qh & 0xFFFF] | (table[qh >> 16] << 1)  # [group, row, block] as 4 bytes
        _by_row(dst[..., 16:48].view(np.uint32), bits)
        qs = _runs(part, nb, _Q5_0_BYTES, 6, 22)  # [group, row, block, 4 words]
        _by_row(dst[..., 48:].view(np.uint32).reshape(groups, nb, 4, Q4K_GROUP), qs)
    return out.reshape(n // Q4K_GROUP, nb * 8 * _Q5_0_BYTES)


def regroup_rows(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray | None:
    """The eight-row layout of Q4_K, Q6_K, Q8_0 or Q5_0 rows (`regroup_q4_k`, ...); None for
    the types the kernels read as the GGUF's rows (Q4_0, Q4_1)."""
    regroup = {
        GGMLQuantizationType.Q4_K: regroup_q4_k,
        GGMLQuantizationType.Q6_K: regroup_q6_k,
        GGMLQuantizationType.Q8_0: regroup_q8_0,
        GGMLQuantizationType.Q5_0: regroup_q5_0,
    }.get(ggml_type)
    return None if regroup is None else regroup(data)
