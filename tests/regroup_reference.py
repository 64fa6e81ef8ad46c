"""The eight-row layouts of `native/qblocks.h` (Q4KX8, Q6KX8, Q8X8, Q5X8, Q41X8) written with numpy,
independently of the library's `npuchat_regroup` (`native/regroup.cc`, what the graph build
uses): the reference its bytes are checked against (`tests/test_custom_ops.py`). The engine
used these until they cost 1.5-1.6 s of a first start (strided copies of four-byte runs)."""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType

GROUP = 8  # rows per group
_Q4K_BYTES = 144  # a Q4_K block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/minima, 128 nibbles
_X8_BYTES = 1184  # a regrouped block of eight rows (sizeof(Q4KX8))
_Q6K_BYTES = 210  # a Q6_K block: 128 low-nibble bytes, 64 of high bit pairs, 16 scales, fp16 d
_Q6X8_BYTES = 1680  # a regrouped Q6_K block of eight rows (sizeof(Q6KX8)): 8 x 210
_Q8_0_BYTES = 34  # fp16 d, 32 int8
_Q5_0_BYTES = 22  # fp16 d, 4 bytes of fifth bits, 16 nibble bytes
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 nibble bytes
_CHUNK_GROUPS = 4096  # groups regrouped at a time where numpy needs temporaries per element


def _runs(data: np.ndarray, nb: int, block: int, first: int, last: int) -> np.ndarray:
    """Bytes [first, last) of every block of each group's eight rows as 4-byte words,
    `[groups, row, block, words]`: the regrouped layouts move whole runs of four bytes, and
    moving them as words is ~4x faster than as bytes (the first start of a 1.5B model regroups
    ~930 MB)."""
    groups = data.shape[0] // GROUP
    blocks = data.reshape(groups, GROUP, nb, block)[..., first:last]
    return np.ascontiguousarray(blocks).view(np.uint32)


def _by_row(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[..., r] = src[:, r]` for a group's eight rows: eight strided copies with long inner
    loops (one transpose that puts the rows innermost ran ~4x slower)."""
    for r in range(GROUP):
        dst[..., r] = src[:, r]


def regroup_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K rows `[n, nb * 144]` (n a multiple of 8) as `[n / 8, nb * 1184]` bytes: per group of
    eight rows and per super-block, the rows' d, then dmin, the 6-bit scales and minima unpacked to
    bytes (`scales[sub-block][row]`, `mins[pair][row][2]`), then the nibble bytes in runs of four
    per row (`qs[64-element chunk][four-element group][row][4]`), as `Q4KX8` declares them."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q4K_BYTES
    groups = n // GROUP
    b = data.reshape(groups, GROUP, nb, _Q4K_BYTES).transpose(0, 2, 1, 3)  # [g, blk, row, byte]
    out = np.empty((groups, nb, _X8_BYTES), np.uint8)
    out[..., 0:16] = b[..., 0:2].reshape(groups, nb, 16)
    out[..., 16:32] = b[..., 2:4].reshape(groups, nb, 16)
    u = b[..., 4:16]  # q4k_scale_min's bytes: scales 0-3, minima 0-3, then the high pairs
    scales = np.concatenate([u[..., 0:4] & 63, (u[..., 8:12] & 15) | ((u[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([u[..., 4:8] & 63, (u[..., 8:12] >> 4) | ((u[..., 4:8] >> 6) << 4)], -1)
    out[..., 32:96] = scales.transpose(0, 1, 3, 2).reshape(groups, nb, 64)
    pairs = mins.reshape(groups, nb, GROUP, 4, 2).transpose(0, 1, 3, 2, 4)
    out[..., 96:160] = pairs.reshape(groups, nb, 64)
    qs = _runs(data, nb, _Q4K_BYTES, 16, 144).reshape(groups, GROUP, nb, 4, 8)
    words = out[..., 160:].view(np.uint32)  # [group, block, 256]: chunk, group of four, row
    _by_row(words.reshape(groups, nb, 4, 8, GROUP), qs)
    return out.reshape(groups, nb * _X8_BYTES)


def regroup_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K rows `[n, nb * 210]` (n a multiple of 8) as `[n / 8, nb * 1680]` bytes, `Q6KX8`'s
    layout: per group of eight rows and per super-block, the rows' d, their 16 int8 scales as
    pairs (`scales[pair][row][2]`), then per half (128 elements) and four-element group g three
    32-byte runs of four bytes per row: low-nibble bytes 4g.. (elements l and l + 64), bytes
    32 + 4g.. (l + 32, l + 96), and the high-bit bytes 4g.. (two bits of each of the four)."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q6K_BYTES
    groups = n // GROUP
    b = data.reshape(groups, GROUP, nb, _Q6K_BYTES).transpose(0, 2, 1, 3)  # [g, blk, row, byte]
    out = np.empty((groups, nb, _Q6X8_BYTES), np.uint8)
    out[..., 0:16] = b[..., 208:210].reshape(groups, nb, 16)
    scales = b[..., 192:208].reshape(groups, nb, GROUP, 8, 2).transpose(0, 1, 3, 2, 4)
    out[..., 16:144] = scales.reshape(groups, nb, 128)
    body = _runs(data, nb, _Q6K_BYTES, 0, 192)  # 32 words of low nibbles, 16 of high bits
    low = body[..., :32].reshape(groups, GROUP, nb, 2, 2, 8)  # row, block, half, run, g
    high = body[..., 32:].reshape(groups, GROUP, nb, 2, 1, 8)
    words = out[..., 144:].view(np.uint32).reshape(groups, nb, 2, 8, 3, GROUP)
    _by_row(words[..., 0:2, :], low.transpose(0, 1, 2, 3, 5, 4))  # [.., half, g, run, row]
    _by_row(words[..., 2:3, :], high.transpose(0, 1, 2, 3, 5, 4))
    return out.reshape(groups, nb * _Q6X8_BYTES)


def _rows_d(data: np.ndarray, nb: int, block: int) -> np.ndarray:
    """Each group's eight rows' fp16 d per block as `[group, block, 16 bytes]`."""
    groups = data.shape[0] // GROUP
    b = data.reshape(groups, GROUP, nb, block)[..., 0:2]
    return b.transpose(0, 2, 1, 3).reshape(groups, nb, 16)


def regroup_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 rows `[n, nb * 34]` (n a multiple of 8) as `[n / 8, nb * 272]` bytes, `Q8X8`'s
    layout: per group of eight rows and per block, the rows' d, then per four-element group a
    run of four weights per row (`qs[group of four][row][4]`), each int8 plus 128."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q8_0_BYTES
    groups = n // GROUP
    out = np.empty((groups, nb, 8 * _Q8_0_BYTES), np.uint8)
    out[..., 0:16] = _rows_d(data, nb, _Q8_0_BYTES)
    qs = _runs(data, nb, _Q8_0_BYTES, 2, 34)  # [group, row, block, 8 words]
    _by_row(out[..., 16:].view(np.uint32).reshape(groups, nb, 8, GROUP), qs)
    out[..., 16:] ^= 0x80  # int8 + 128
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
    out = np.empty((n // GROUP, nb, 8 * _Q5_0_BYTES), np.uint8)
    for g0 in range(0, n // GROUP, _CHUNK_GROUPS):
        part = data[g0 * GROUP : (g0 + _CHUNK_GROUPS) * GROUP]
        groups = part.shape[0] // GROUP
        dst = out[g0 : g0 + groups]
        dst[..., 0:16] = _rows_d(part, nb, _Q5_0_BYTES)
        qh = _runs(part, nb, _Q5_0_BYTES, 2, 6)[..., 0]  # [group, row, block] bit e = element e
        table = _fifth_bits_table()
        bits = table[qh & 0xFFFF] | (table[qh >> 16] << 1)  # [group, row, block] as 4 bytes
        _by_row(dst[..., 16:48].view(np.uint32), bits)
        qs = _runs(part, nb, _Q5_0_BYTES, 6, 22)  # [group, row, block, 4 words]
        _by_row(dst[..., 48:].view(np.uint32).reshape(groups, nb, 4, GROUP), qs)
    return out.reshape(n // GROUP, nb * 8 * _Q5_0_BYTES)


def regroup_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_1 rows `[n, nb * 20]` (n a multiple of 8) as `[n / 8, nb * 160]` bytes, `Q41X8`'s
    layout: per group of eight rows and per block, the rows' d, their minima m, then the nibble
    bytes in runs of four per row (`qs[g][row][4]`: bytes 4g..4g+3 of the row's nibbles)."""
    n, row_bytes = data.shape
    nb = row_bytes // _Q4_1_BYTES
    groups = n // GROUP
    b = data.reshape(groups, GROUP, nb, _Q4_1_BYTES).transpose(0, 2, 1, 3)  # [g, blk, row, byte]
    out = np.empty((groups, nb, 8 * _Q4_1_BYTES), np.uint8)
    out[..., 0:16] = b[..., 0:2].reshape(groups, nb, 16)
    out[..., 16:32] = b[..., 2:4].reshape(groups, nb, 16)
    runs = b[..., 4:20].reshape(groups, nb, GROUP, 4, 4).transpose(0, 1, 3, 2, 4)
    out[..., 32:] = runs.reshape(groups, nb, 128)
    return out.reshape(groups, nb * 8 * _Q4_1_BYTES)


def reference_regroup(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """`data`'s rows in the eight-row layout of their type."""
    return {
        GGMLQuantizationType.Q4_K: regroup_q4_k,
        GGMLQuantizationType.Q6_K: regroup_q6_k,
        GGMLQuantizationType.Q8_0: regroup_q8_0,
        GGMLQuantizationType.Q5_0: regroup_q5_0,
        GGMLQuantizationType.Q4_1: regroup_q4_1,
    }[ggml_type](data)
