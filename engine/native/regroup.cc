// The graph build's eight-row layouts (qblocks.h: Q4KX8, Q6KX8, Q8X8, Q5X8, Q41X8) written from
// the GGUF's rows, for graph_native.regroup_rows. numpy took ~1.6 s for the 0.5B model's 393 MB of
// Q5_0 and Q8_0 rows and ~1.5 s for the 1.5B's 930 MB of Q4_K and Q6_K ones (strided copies of
// four-byte runs, the fifth bits through a table); here it is one pass over the bytes.
// tests/regroup_reference.py holds the same layouts in numpy, the reference these are checked
// against byte for byte.
#include <cstdint>
#include <cstring>
#include <vector>

#include "qblocks.h"

namespace {

using npq::Q41X8;
using npq::Q4KX8;
using npq::Q5X8;
using npq::Q6KX8;
using npq::Q8X8;

constexpr int ROWS = 8;

// Four bytes of each of the eight rows at `at` into dst[row * 4 .. row * 4 + 3].
inline void runs(const uint8_t* const* rows, int at, uint8_t* dst) {
  for (int r = 0; r < ROWS; ++r) std::memcpy(dst + 4 * r, rows[r] + at, 4);
}

void q4_k(const uint8_t* const* rows, Q4KX8* out) {
  for (int r = 0; r < ROWS; ++r) {
    std::memcpy(&out->d[r], rows[r], 2);
    std::memcpy(&out->dmin[r], rows[r] + 2, 2);
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      npq::q4k_scale_min(rows[r] + 4, s, &sc, &mn);
      out->scales[s][r] = static_cast<uint8_t>(sc);
      out->mins[s / 2][2 * r + s % 2] = static_cast<uint8_t>(mn);
    }
  }
  for (int j = 0; j < 4; ++j) {
    for (int g = 0; g < 8; ++g) runs(rows, 16 + 32 * j + 4 * g, out->qs[j][g]);
  }
}

void q6_k(const uint8_t* const* rows, Q6KX8* out) {
  for (int r = 0; r < ROWS; ++r) {
    std::memcpy(&out->d[r], rows[r] + 208, 2);
    for (int k = 0; k < 8; ++k) std::memcpy(&out->scales[k][2 * r], rows[r] + 192 + 2 * k, 2);
  }
  for (int half = 0; half < 2; ++half) {
    for (int g = 0; g < 8; ++g) {
      runs(rows, 64 * half + 4 * g, out->q[half][g][0]);       // low nibbles, run a
      runs(rows, 64 * half + 32 + 4 * g, out->q[half][g][1]);  // run b
      runs(rows, 128 + 32 * half + 4 * g, out->q[half][g][2]);  // high bit pairs
    }
  }
}

void q8_0(const uint8_t* const* rows, Q8X8* out) {
  for (int r = 0; r < ROWS; ++r) std::memcpy(&out->d[r], rows[r], 2);
  for (int g = 0; g < 8; ++g) {
    runs(rows, 2 + 4 * g, out->qs[g]);
    for (uint8_t& w : out->qs[g]) w ^= 0x80;  // int8 + 128
  }
}

// For 16 fifth bits v (one half h of a Q5_0 row's), the four bytes (t = 0..3, little-endian)
// whose byte t holds bit 4g + t of v at bit 2g: Q5X8.qh of that half, shifted left by h.
const std::vector<uint32_t>& fifth_bits_table() {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> out(1 << 16);
    for (uint32_t v = 0; v < out.size(); ++v) {
      for (int t = 0; t < 4; ++t) {
        for (int g = 0; g < 4; ++g) out[v] |= ((v >> (4 * g + t)) & 1u) << (8 * t + 2 * g);
      }
    }
    return out;
  }();
  return table;
}

void q5_0(const uint8_t* const* rows, Q5X8* out) {
  const std::vector<uint32_t>& table = fifth_bits_table();
  for (int r = 0; r < ROWS; ++r) {
    std::memcpy(&out->d[r], rows[r], 2);
    uint32_t qh;
    std::memcpy(&qh, rows[r] + 2, 4);
    const uint32_t bits = table[qh & 0xFFFF] | (table[qh >> 16] << 1);
    std::memcpy(&out->qh[4 * r], &bits, 4);  // little-endian: byte t is element t's
  }
  for (int g = 0; g < 4; ++g) runs(rows, 6 + 4 * g, out->qs[g]);
}

void q4_1(const uint8_t* const* rows, Q41X8* out) {
  for (int r = 0; r < ROWS; ++r) {
    std::memcpy(&out->d[r], rows[r], 2);
    std::memcpy(&out->m[r], rows[r] + 2, 2);
  }
  for (int g = 0; g < 4; ++g) runs(rows, 4 + 4 * g, out->qs[g]);
}

template <typename Block, void (*Group)(const uint8_t* const*, Block*)>
void regroup(const uint8_t* src, int64_t n, int64_t row_bytes, int block_bytes, uint8_t* dst) {
  const int64_t nb = row_bytes / block_bytes;
  Block* out = reinterpret_cast<Block*>(dst);
  for (int64_t g0 = 0; g0 < n; g0 += ROWS) {
    const uint8_t* rows[ROWS];
    for (int64_t b = 0; b < nb; ++b, ++out) {
      for (int r = 0; r < ROWS; ++r) rows[r] = src + (g0 + r) * row_bytes + b * block_bytes;
      Group(rows, out);
    }
  }
}

}  // namespace

extern "C" {

// src: n rows of `row_bytes` GGUF blocks of `type` (n a multiple of 8); dst: as many bytes in
// that type's eight-row layout (Q4_K: 1184 per eight rows' 1152). 0, or -1 for a type without
// one, a row count not a multiple of 8 or a row that is no whole number of blocks.
__attribute__((visibility("default"))) int npuchat_regroup(int type, const uint8_t* src,
                                                           int64_t n, int64_t row_bytes,
                                                           uint8_t* dst) {
  const int bytes = npq::block_bytes(type);
  if (bytes == 0 || n % ROWS != 0 || row_bytes % bytes != 0) return -1;
  switch (type) {
    case npq::Q4_K: regroup<Q4KX8, q4_k>(src, n, row_bytes, bytes, dst); return 0;
    case npq::Q6_K: regroup<Q6KX8, q6_k>(src, n, row_bytes, bytes, dst); return 0;
    case npq::Q8_0: regroup<Q8X8, q8_0>(src, n, row_bytes, bytes, dst); return 0;
    case npq::Q5_0: regroup<Q5X8, q5_0>(src, n, row_bytes, bytes, dst); return 0;
    case npq::Q4_1: regroup<Q41X8, q4_1>(src, n, row_bytes, bytes, dst); return 0;
    default: return -1;
  }
}

}  // extern "C"
