"""GGUF weight blocks → the integer form ONNX Runtime's `MatMulNBits` runs fast.

`MatMulNBits` (com.microsoft) computes `y = x @ Wᵀ` with `W[n, k] = scale[n, b] · (q[n, k] − zp)`
per block `b` of 32 along K. Its fast int8-activation kernels (`accuracy_level=4`) need integer
zero points or none: float zero points are exact but ~100× slower (measured on ORT 1.32). So every
GGUF type is mapped, exactly, to `w = scale · (q − 2^(bits−1)) + offset` with the default
(midpoint) zero point and no zero-point input:

* symmetric types have no offset: Q4_0, Q8_0 directly, Q5_0 as 8-bit (5-bit values fit int8);
* asymmetric types (`w = d·q + m`: Q4_1, Q4_K as 4-bit, Q5_1, Q5_K as 8-bit) are re-centred,
  `w = d·(q − mid) + (m + mid·d)`, and the graph adds the per-block offsets as
  `(per-block sums of x) @ offsetsᵀ` (ReduceSum, then a Gemm that adds the matmul's output).
  Re-centring rather than zero point 0 keeps the int8-quantized activations multiplied by
  values of |w|'s size instead of `d·q`'s, which halves the activation-rounding error
  (measured on the synthetic models).

Q6_K has 16-element sub-blocks with separate scales, which block-32 `MatMulNBits` cannot express
exactly; it is requantized to symmetric 8-bit blocks of 32 (error ≤ max|w|/254 per block, well
under Q6_K's own rounding). Any other quantized type is dequantized with `gguf.quants` and
requantized the same way. F32/F16/BF16 matrices stay dense float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from .errors import UnsupportedModelError

BLOCK = 32
Q = GGMLQuantizationType
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


@dataclass
class QuantMatrix:
    """A weight `W[n, k]` (rows = output features) in `MatMulNBits` form, or dense float.

    `q` holds one unpacked integer per weight (uint8 `[n, k]`); `scales` and `mins` hold one value
    per block of 32 (`[n, k/32]`): `w = scale·(q − 2^(bits−1)) + min`, with `mins is None` for
    symmetric types. `bits == 0` means dense: `dense` is float32 `[n, k]`.
    """

    n: int
    k: int
    bits: int
    q: np.ndarray | None = None
    scales: np.ndarray | None = None
    mins: np.ndarray | None = None
    dense: np.ndarray | None = None

    @property
    def kind(self) -> tuple[int, bool]:
        """Matrices of the same kind can be concatenated by rows into one matmul."""
        return (self.bits, self.mins is not None)

    def dequantize(self) -> np.ndarray:
        """The float32 `[n, k]` matrix this form represents (tests and the host embedding)."""
        if self.bits == 0:
            assert self.dense is not None
            return self.dense
        assert self.q is not None and self.scales is not None
        nb = self.k // BLOCK
        q = self.q.reshape(self.n, nb, BLOCK).astype(np.float32) - float(1 << (self.bits - 1))
        w = q * self.scales[:, :, None]
        if self.mins is not None:
            w += self.mins[:, :, None]
        return w.reshape(self.n, self.k)

    def scaled(self, factor: float) -> QuantMatrix:
        """The matrix times `factor` (folds attention's 1/√dh into the Q rows; exact for 2^-k)."""
        f = np.float32(factor)

        def mul(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else (a * f).astype(np.float32)

        return QuantMatrix(
            self.n, self.k, self.bits, self.q, mul(self.scales), mul(self.mins), mul(self.dense)
        )

    def rows(self, index: np.ndarray | slice) -> QuantMatrix:
        """A new matrix holding the selected rows (a permutation or a split of fused weights)."""

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.ascontiguousarray(a[index])

        dense = pick(self.dense)
        q = pick(self.q)
        n = (dense if dense is not None else q).shape[0]  # type: ignore[union-attr]
        return QuantMatrix(n, self.k, self.bits, q, pick(self.scales), pick(self.mins), dense)


def concat_rows(mats: Sequence[QuantMatrix]) -> QuantMatrix:
    """Stack matrices of one kind by rows (fused Q|K|V or gate|up: one matmul instead of three)."""
    first = mats[0]
    if any(m.kind != first.kind or m.k != first.k for m in mats):
        raise ValueError("concat_rows needs matrices of one kind and one K")

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(m, name) for m in mats]
        return None if parts[0] is None else np.concatenate(parts, axis=0)

    n = sum(m.n for m in mats)
    return QuantMatrix(n, first.k, first.bits, cat("q"), cat("scales"), cat("mins"), cat("dense"))


# --------------------------------------------------------------------------- GGUF block decoders


def _f16(b: np.ndarray) -> np.ndarray:
    """Two uint8 columns → float32 (GGUF stores block scales as little-endian fp16)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(b.shape[0])


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 layout: byte j holds element j (low nibble) and element j+16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """The 5th bit of each of 32 elements from a little-endian uint32 per block."""
    bits = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed 6-bit scales and mins of the 8 sub-blocks (llama.cpp get_scale_min_k4)."""
    s = sc.astype(np.uint8)
    scales = np.empty((s.shape[0], 8), np.uint8)
    mins = np.empty((s.shape[0], 8), np.uint8)
    scales[:, :4] = s[:, 0:4] & 63
    mins[:, :4] = s[:, 4:8] & 63
    scales[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mins[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return scales.astype(np.float32), mins.astype(np.float32)


def _requantize8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float `[n, k]` → symmetric 8-bit blocks of 32: (uint8 q `[n, k]`, scales `[n, k/32]`)."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    scales = (amax / 127.0).astype(np.float32)
    safe = np.where(scales == 0, 1.0, scales)
    q = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int16) + 128
    return q.astype(np.uint8).reshape(n, k), scales


def _recentred(
    n: int, k: int, bits: int, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, mid: int
) -> QuantMatrix:
    """`w = scale·q + offset` (q ≥ 0) as `scale·(q' − 2^(bits−1)) + (offset + mid·scale)`."""
    nb = k // BLOCK
    shift = (1 << (bits - 1)) - mid  # q' = q − mid + 2^(bits−1)
    q2 = (q.astype(np.int16) + shift).astype(np.uint8).reshape(n, k)
    scale = scale.astype(np.float32)
    mins = (offset.astype(np.float32) + np.float32(mid) * scale).astype(np.float32)
    return QuantMatrix(n, k, bits, q2, scale.reshape(n, nb), mins.reshape(n, nb))


def decode_tensor(raw: np.ndarray, ggml_type: GGMLQuantizationType, n: int, k: int) -> QuantMatrix:
    """Turn a GGUF tensor's raw bytes (`n` rows of `k` values) into a `QuantMatrix`."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if ggml_type in FLOAT_TYPES:
        dense = gguf_dequantize(np.asarray(raw).reshape(n, -1), ggml_type)
        return QuantMatrix(n, k, 0, dense=np.ascontiguousarray(dense, dtype=np.float32))
    if k % BLOCK:
        raise UnsupportedModelError(
            f"a {ggml_type.name} weight has rows of {k} values, not a multiple of {BLOCK}"
        )
    nb = k // BLOCK
    b = np.asarray(raw).reshape(n * k // block, type_size)

    if ggml_type == Q.Q8_0:
        d = _f16(b[:, 0:2])
        q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QuantMatrix(n, k, 8, q.reshape(n, k), d.reshape(n, nb))
    if ggml_type == Q.Q4_0:
        d = _f16(b[:, 0:2])
        q = _nibbles_split(b[:, 2:18])
        return QuantMatrix(n, k, 4, q.reshape(n, k), d.reshape(n, nb))
    if ggml_type == Q.Q4_1:
        d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        q = _nibbles_split(b[:, 4:20])
        return _recentred(n, k, 4, q, d, m, 8)
    if ggml_type == Q.Q5_0:
        d = _f16(b[:, 0:2])
        q5 = _nibbles_split(b[:, 6:22]) | (_q5_high(b[:, 2:6]) << 4)
        # w = d·(q5 − 16); as symmetric 8-bit (zero point 128): q8 = q5 − 16 + 128
        return QuantMatrix(n, k, 8, (q5 + 112).reshape(n, k), d.reshape(n, nb))
    if ggml_type == Q.Q5_1:
        d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        q5 = _nibbles_split(b[:, 8:24]) | (_q5_high(b[:, 4:8]) << 4)
        return _recentred(n, k, 8, q5, d, m, 16)
    if ggml_type in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        if ggml_type == Q.Q4_K:
            qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 values: low nibbles, high
            q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
            bits, mid = 4, 8
        else:
            qh = b[:, 16:48]
            qs = b[:, 48:176].reshape(-1, 4, 32)
            shifts = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
            high = ((qh[:, None, None, :] >> shifts) & 1) << 4  # [blocks, 4 chunks, 2, 32]
            q = (np.stack([qs & 0x0F, qs >> 4], axis=2) | high).reshape(-1, 256)
            bits, mid = 8, 16
        scales = d[:, None] * sc  # [superblocks, 8]: w = scale·q − dmin·m per sub-block
        mins = -(dmin[:, None] * mn)
        return _recentred(n, k, bits, q, scales.reshape(-1), mins.reshape(-1), mid)
    if ggml_type == Q.Q6_K:
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 16)
        d = _f16(b[:, 208:210])
        lo = np.stack(
            [ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4],
            axis=2,
        )  # [blocks, half, 4 quarters, 32]
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = (lo | (hi << 4)).astype(np.float32).reshape(-1, 256) - 32.0
        w = q.reshape(-1, 16, 16) * (d[:, None] * sc)[:, :, None]
        q8, scales = _requantize8(w.reshape(n, k))
        return QuantMatrix(n, k, 8, q8, scales)
    # Any other block type (Q2_K, Q3_K, IQ*): exact dequantization, then 8-bit blocks of 32.
    w = gguf_dequantize(np.asarray(raw).reshape(n, -1), ggml_type).astype(np.float32)
    q8, scales = _requantize8(w)
    return QuantMatrix(n, k, 8, q8, scales)


def dequantize_rows(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, k: int, ids: np.ndarray
) -> np.ndarray:
    """Rows `ids` of a GGUF matrix as float32 `[len(ids), k]` (the host-side embedding lookup)."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    block, _ = GGML_QUANT_SIZES[ggml_type]
    row_bytes = k // block * type_size
    table = np.asarray(raw).reshape(-1, row_bytes)
    return gguf_dequantize(table[np.asarray(ids, dtype=np.int64)], ggml_type).astype(np.float32)


# --------------------------------------------------------------------------- MatMulNBits tensors


@dataclass
class NBitsTensors:
    """The initializers of one `MatMulNBits` node (plus the mins of the block-sum correction)."""

    b: np.ndarray  # uint8 [n, k/32, 32·bits/8]
    scales: np.ndarray  # float32 [n, k/32]
    mins: np.ndarray | None  # float32 [n, k/32]: correction = blocksum(x) @ minsᵀ


def pack_nbits(m: QuantMatrix) -> NBitsTensors:
    """Pack a quantized `QuantMatrix` into `MatMulNBits` layout (element 2i in the low nibble)."""
    assert m.q is not None and m.scales is not None and m.bits in (4, 8)
    nb = m.k // BLOCK
    if m.bits == 4:
        pairs = m.q.reshape(m.n, nb, BLOCK // 2, 2)
        b = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    else:
        b = m.q.reshape(m.n, nb, BLOCK)
    mins = None if m.mins is None else np.ascontiguousarray(m.mins, dtype=np.float32)
    return NBitsTensors(np.ascontiguousarray(b), m.scales.astype(np.float32), mins)
