// GGUF weight blocks as llama.cpp lays them out, the int8 activation blocks they are multiplied
// with, and the tables of dot-product kernels (VNNI, AVX2+FMA or portable, chosen at load time).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "half.h"

namespace npq {

// ggml type ids (gguf GGMLQuantizationType) of the weight blocks the kernels read.
enum GgmlType : int {
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q8_0 = 8,
  Q4_K = 12,
  Q6_K = 14,
};

constexpr int QK = 32;    // elements per block of the 32-element types
constexpr int QK_K = 256; // elements per super-block of the K types

// Bytes per block of each weight type, and how many elements a block holds.
inline int block_bytes(int type) {
  switch (type) {
    case Q4_0: return 18;   // fp16 d, 16 bytes of nibbles
    case Q4_1: return 20;   // fp16 d, fp16 m, 16 bytes of nibbles
    case Q5_0: return 22;   // fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles
    case Q8_0: return 34;   // fp16 d, 32 int8
    case Q4_K: return 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 nibble bytes
    case Q6_K: return 210;  // 128 low-nibble bytes, 64 bytes of high bits, 16 int8 scales, fp16 d
    default: return 0;
  }
}

inline int block_elems(int type) { return (type == Q4_K || type == Q6_K) ? QK_K : QK; }

// Activations of one row quantized to int8 per 32 elements (for the 32-element weight types):
// x ~= d * qs; `sum` = d * sum(qs), which the offset types (Q4_1) multiply by their minimum;
// `isum` = sum(qs) exactly, which the eight-row kernels' unsigned weights (Q5_0 plus 16, Q8_0
// plus 128) take off once per block and row instead of summing qs again for every group.
struct ActBlock {
  float d;
  float sum;
  int8_t qs[QK];
  int32_t isum;
};

// Activations per 256 elements (for the K types), with the sums of qs per 16 elements that the
// -32 offset (Q6_K) is multiplied by, and per 32 (pairs of those) for the minima (Q4_K): kept
// here so that a matmul does not re-add them for every weight row.
struct ActSuper {
  float d;
  int16_t bsums[QK_K / 16];
  int16_t bsums32[QK_K / 32];
  int8_t qs[QK_K];
};

// The block sums of a quantized super-block (exact: at most 32 * 127 in magnitude).
inline void super_sums(ActSuper* y) {
  for (int g = 0; g < QK_K / 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += y->qs[16 * g + i];
    y->bsums[g] = static_cast<int16_t>(s);
  }
  for (int g = 0; g < QK_K / 32; ++g) {
    y->bsums32[g] = static_cast<int16_t>(y->bsums[2 * g] + y->bsums[2 * g + 1]);
  }
}

// sum(qs) and d * sum(qs) of a quantized 32-element block (what Q4_1's minimum is multiplied
// by).
inline void block_sum(ActBlock* y) {
  int s = 0;
  for (int i = 0; i < QK; ++i) s += y->qs[i];
  y->isum = s;
  y->sum = y->d * static_cast<float>(s);
}

using npuchat_half::half_to_float;

inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

// The 6-bit scale and minimum of sub-block j (0..7) of a Q4_K super-block.
inline void q4k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A Q4_K row's result, on every table and in both layouts: per super-block the exact integers
// S = sum over sub-blocks of scale * (nibbles . activations) and M = sum of minimum * (sum of the
// sub-block's activations), then acc = fma(float(S), d * d_x, acc) and
// accm = fma(float(M), dmin * d_x, accm) block by block, and acc - accm (llama.cpp's float steps
// for its repacked Q4_K): no step depends on how the integers were summed.
//
// Q4_K rows regrouped eight at a time (the graph builder writes them: graph_native.regroup_q4_k):
// per super-block, the eight rows' d and dmin, their 6-bit scales and minima as bytes, and their
// nibble bytes in runs of four per row, so that one 32-byte load holds the same four-element
// group of all eight rows and one broadcast of four activations feeds eight dot products
// (llama.cpp's q4_K_8x8 idea; this layout keeps each row's sums in one int32 lane).
struct Q4KX8 {
  uint16_t d[8], dmin[8];
  uint8_t scales[8][8];  // [sub-block][row]
  uint8_t mins[4][16];   // [sub-block pair][row][2]: int16 pairs for a madd with bsums32 pairs
  uint8_t qs[4][8][32];  // [64-element chunk][four-element group][row][4 nibble bytes]
};
static_assert(sizeof(Q4KX8) == 1184, "Q4KX8 must stay packed");

// A Q6_K row's result, on every table and in both layouts: per super-block the exact integer
// S = sum over sub-blocks of scale * ((6-bit values - 32) . activations), then
// acc = fma(float(S), d * d_x, acc) block by block.
//
// Q6_K rows regrouped eight at a time (graph_native.regroup_q6_k): per super-block the rows' d,
// their scales as int16-ready pairs, and per half and four-element group three 32-byte runs
// (low nibble bytes of elements l and l + 64, of l + 32 and l + 96, and the high bit pairs of
// all four), four bytes per row each: the GGUF's 210 bytes a row, rearranged.
struct Q6KX8 {
  uint16_t d[8];
  int8_t scales[8][16];     // [sub-block pair][row][2]
  uint8_t q[2][8][3][32];   // [half][four-element group][low run a, low run b, high bits][row][4]
};
static_assert(sizeof(Q6KX8) == 1680, "Q6KX8 must stay packed");

// A Q8_0 or Q5_0 row's result, on every table and in both layouts: per block the exact integer
// S = (signed weights) . activations, then acc = fma(float(S), d * d_x, acc) block by block.
// Q4_1's the same over its unsigned nibbles, plus its minimum m times the activations' block sum
// in a second chain, off = fma(m, d_x * sum(qs), off), and acc + off at the end. (Q4_0, never
// regrouped, keeps llama.cpp's eight float lanes per block.)
//
// Q8_0 rows regrouped eight at a time (regroup.cc): per block the rows' d, then per
// four-element group one 32-byte run of four weights per row, each stored plus 128 (w ^ 0x80):
// unsigned, they go straight into vpdpbusd, 128 * the activations' sum taken off per block.
struct Q8X8 {
  uint16_t d[8];
  uint8_t qs[8][32];  // [four-element group][row][4], w + 128
};
static_assert(sizeof(Q8X8) == 272, "Q8X8 must stay packed");

// Q5_0 rows regrouped eight at a time (regroup.cc): per block the rows' d, their
// fifth bits, then the nibble bytes in runs of four per row (run g: bytes 4g..4g+3, whose low
// nibbles are elements 4g + t and high nibbles 16 + 4g + t). Bit s = 2g + h of qh[4 * row + t]
// is the fifth bit of element 16h + 4g + t: two shifts put one set's bits beside its nibbles.
struct Q5X8 {
  uint16_t d[8];
  uint8_t qh[32];     // [row][t], bit 2g + h
  uint8_t qs[4][32];  // [four-element group][row][4 nibble bytes]
};
static_assert(sizeof(Q5X8) == 176, "Q5X8 must stay packed");

// Q4_1 rows regrouped eight at a time (regroup.cc): per block the rows' d, their minima m, then
// the nibble bytes in runs of four per row as Q5X8's (run g: elements 4g + t low, 16 + 4g + t
// high): the GGUF's 20 bytes a row, rearranged.
struct Q41X8 {
  uint16_t d[8], m[8];
  uint8_t qs[4][32];  // [four-element group][row][4 nibble bytes]
};
static_assert(sizeof(Q41X8) == 160, "Q41X8 must stay packed");

// Eight regrouped rows (nb Q4KX8, Q6KX8, Q8X8, Q5X8 or Q41X8 blocks) . `rows` activation rows
// (1..MAX_ROWS): out[8 * r + i] = row i . x[r], by the steps above.
using DotX8 = void (*)(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out);

// One weight row (nb blocks) . `rows` activation rows (1..MAX_ROWS): out[r] = w . x[r].
// A row's result is computed by the same instructions in the same order whatever `rows` is, so it
// never depends on the rows beside it; taking several rows only shares the weights' unpacking.
constexpr int MAX_ROWS = 8;  // eight, not four: the K types ran ~10-20% faster per row at eight
using DotRows = void (*)(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out);

// One activation row x . `n` weight rows, `stride` bytes apart from w: out[i] = w_i . x, each by
// the float steps DotRows takes for that pair (bit for bit), the rows' chains interleaved (a
// decode step has one activation row: a block's multiply-add would otherwise wait on the last).
using DotCols = void (*)(const uint8_t* w, size_t stride, const uint8_t* x, int n, int nb,
                         float* out);

// Row quantizers: k floats (a multiple of the block) -> k / block activation blocks. Every path
// applies the same rule (d = max|x| / 127, q = x * (127 / max|x|) rounded half to even), so
// activations are the same bytes on every machine; the AVX2 ones only do it 8 lanes at a time.
using QuantizeBlocks = void (*)(const float* x, ActBlock* y, int k);
using QuantizeSupers = void (*)(const float* x, ActSuper* y, int k);

// out[i] = silu(gate[i]) * up[i], i < n (out may be gate): a SwiGLU MLP's product, the same
// bits in every table (exp_x86.h).
using Swiglu = void (*)(const float* gate, const float* up, float* out, int n);

struct Kernels {
  const char* isa;
  DotRows q4_0, q4_1, q5_0, q8_0, q4_k, q6_k;
  QuantizeBlocks quantize_blocks;
  QuantizeSupers quantize_supers;
  DotCols q4_0_cols, q4_1_cols, q5_0_cols, q8_0_cols, q4_k_cols, q6_k_cols;
  DotX8 q4_k_x8, q6_k_x8, q8_0_x8, q5_0_x8, q4_1_x8;
  Swiglu swiglu;
};

const Kernels& scalar_kernels();
const Kernels* avx2_kernels();  // nullptr when the CPU lacks AVX2/FMA/F16C
const Kernels* avxvnni_kernels();     // the AVX2 kernels on AVX-VNNI (qdot_vnni.cc), or nullptr
const Kernels* avx512vnni_kernels();  // the same on AVX-512 VNNI (qdot_avx512.cc), or nullptr
const Kernels& chosen_kernels();      // what this process uses (qdot_scalar.cc)

}  // namespace npq
