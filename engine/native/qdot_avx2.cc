// AVX2 + FMA kernels (compiled for that target per function; used only where the CPU has it).
// The scheme is llama.cpp's (ggml-cpu/arch/x86/quants.c, MIT licence): int8 activations,
// integer dot products per block (maddubs/madd), one float multiply-add per block into an
// 8-lane accumulator, a horizontal sum at the end; the bit-spreading constants of
// bits_to_bytes and the Q4_K scale unpacking follow its bytes_from_bits_32 and
// ggml_vec_dot_q4_K_q8_K.
// qdot_vnni.cc and qdot_avx512.cc compile this file again for the VNNI targets, with NPQ_DOT_ADD / NPQ_PAIRS_ADD
// as vpdpbusd / vpdpwssd: the same int32 sums (maddubs never saturates on these operands), the
// same float steps, so those kernels give these kernels' bits.
#include <immintrin.h>

#include "qblocks.h"

#ifndef NPQ_TARGET
#define NPQ_TARGET "avx2,fma,f16c"
#define NPQ_ENTRY avx2_kernels
#define NPQ_ISA "avx2"
#define NPQ_CPU_HAS true
// acc + u . s (unsigned x signed bytes, four lanes a sum); acc + pairs . scales (int16 pairs)
#define NPQ_DOT_ADD(acc, u, s) \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define NPQ_PAIRS_ADD(acc, pairs, scales) _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales))
// Without VNNI the eight-row kernels sum short runs of maddubs pairs as int16 before one madd
// (q4k_x8_x86.h, blocks_x8_x86.h): the same int32 sums in fewer instructions.
#define NPQ_INT16_SUMS 1
#endif
#ifndef NPQ_INT16_SUMS
#define NPQ_INT16_SUMS 0
#endif
#ifndef NPQ_EVEX_BCAST
#define NPQ_EVEX_BCAST 0
#endif
// Activation rows the eight-row kernels take in one pass over a group's weights: four where the
// target has 16 vector registers; qdot_avx512.cc (32 of them) takes eight.
#ifndef NPQ_X8_PASS
#define NPQ_X8_PASS 4
#endif
#define NPQ_AVX2 __attribute__((target(NPQ_TARGET)))
#include "qdot_x86.h"
#include "q4k_x8_x86.h"
#include "q6k_x8_x86.h"
#include "blocks_x8_x86.h"
#include "exp_x86.h"

namespace npq {

namespace {

template <typename Act>
NPQ_AVX2 inline const Act* act(const uint8_t* const* x, int r) {
  return reinterpret_cast<const Act*>(x[r]);
}

// The 32-element types: `Unpack(w)` gives the block's 32 weights as bytes; `Signed` says whether
// they are signed (multiplied with dot_i8) or unsigned (maddubs directly); `Offset` adds the
// block minimum times the activation sum in a chain of its own (Q4_1); `Exact`: the block's
// integer summed exactly and one scalar fma per block (Q8_0, Q5_0, Q4_1: the regrouped rows'
// steps, qblocks.h), else llama.cpp's eight float lanes (Q4_0).
template <int R, int Bytes, __m256i (*Unpack)(const uint8_t*), bool Signed, bool Offset,
          bool Exact>
NPQ_AVX2 void blocks_rows(const uint8_t* w, const uint8_t* const* x, int nb, float* out) {
  static_assert(Exact || !Offset, "the offset chain is one of the exact steps");
  __m256 acc[R];
  float offsets[R], exact[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offsets[r] = exact[r] = 0.0f;
  }
  for (int b = 0; b < nb; ++b, w += Bytes) {
    const __m256i q = Unpack(w);
    const float d = half(w);
    for (int r = 0; r < R; ++r) {
      const ActBlock& y = act<ActBlock>(x, r)[b];
      const __m256i s = Signed ? dot_i8(q, load32(y.qs)) : dot_u8(q, load32(y.qs));
      if (Exact) {
        exact[r] = fma_ss(static_cast<float>(hsum_i32(s)), d * y.d, exact[r]);
        if (Offset) offsets[r] = fma_ss(half(w + 2), y.sum, offsets[r]);
        continue;
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(s), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = !Exact ? hsum(acc[r]) : Offset ? exact[r] + offsets[r] : exact[r];
  }
}

NPQ_AVX2 inline __m256i unpack_q8_0(const uint8_t* w) { return load32(w + 2); }
NPQ_AVX2 inline __m256i unpack_q4_0(const uint8_t* w) {
  return _mm256_sub_epi8(nibbles16(w + 2), _mm256_set1_epi8(8));
}
NPQ_AVX2 inline __m256i unpack_q4_1(const uint8_t* w) { return nibbles16(w + 4); }
NPQ_AVX2 inline __m256i unpack_q5_0(const uint8_t* w) {
  // nibble | 16 * bit, minus 16: where the bit is clear the byte becomes 0xF0 | nibble.
  const __m256i high = _mm256_andnot_si256(bits_to_bytes(w + 2), _mm256_set1_epi8(-16));
  return _mm256_or_si256(nibbles16(w + 6), high);
}

// Q4_K one row at a time (tail rows and matrices not regrouped; q4k_x8_x86.h has the eight-row
// layout): the block's integers summed in 8 int32 lanes, then the float steps of qblocks.h.
template <int R>
NPQ_AVX2 void q4_k_rows(const uint8_t* w, const uint8_t* const* x, int nb, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  float acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = 0.0f;
  for (int b = 0; b < nb; ++b, w += 144) {
    // The 8 6-bit scales, then the 8 minima, one byte each (branch-free unpacking).
    uint32_t u[4];
    std::memcpy(u, w + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3f;
    // The scales as int16 in both 128-bit lanes; a byte shuffle broadcasts sub-block i's.
    const __m256i scales = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(u[1]), static_cast<int>(u[0]))));
    const __m128i mins16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(u[3]), static_cast<int>(u[2])));
    const uint8_t* qs = w + 16;
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q = load32(qs + 32 * j);
      const __m256i lo = _mm256_and_si256(q, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      const __m256i s0 = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(((4 * j + 1) << 8) | (4 * j))));
      const __m256i s1 = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(((4 * j + 3) << 8) | (4 * j + 2))));
      for (int r = 0; r < R; ++r) {
        const int8_t* y = act<ActSuper>(x, r)[b].qs + 64 * j;
        const __m256i both = dot_u8_scaled_add(dot_u8_scaled(lo, load32(y), s0), hi, load32(y + 32), s1);
        sumi[r] = _mm256_add_epi32(sumi[r], both);
      }
    }
    const float d = half(w), dmin = half(w + 2);
    for (int r = 0; r < R; ++r) {
      const ActSuper& y = act<ActSuper>(x, r)[b];
      const __m128i pairs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(y.bsums32));
      const __m128i m = _mm_madd_epi16(mins16, pairs);
      const int summ = hsum_i32(m);
      acc[r] = fma_ss(static_cast<float>(hsum_i32(sumi[r])), d * y.d, acc[r]);
      accm[r] = fma_ss(static_cast<float>(summ), dmin * y.d, accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r] - accm[r];
}

// Scales of groups g and g + 1 (int16 lanes of `both`, one 128-bit lane holding 8 scales) as
// 16 int16 lanes for madd: a byte shuffle per pair instead of two broadcasts and an insert.
template <int G>
NPQ_AVX2 inline __m256i two_scales(__m256i both) {
  constexpr char lo0 = 2 * G, lo1 = 2 * G + 1, hi0 = 2 * G + 2, hi1 = 2 * G + 3;
  return _mm256_shuffle_epi8(both, _mm256_setr_epi8(
      lo0, lo1, lo0, lo1, lo0, lo1, lo0, lo1, lo0, lo1, lo0, lo1, lo0, lo1, lo0, lo1,
      hi0, hi1, hi0, hi1, hi0, hi1, hi0, hi1, hi0, hi1, hi0, hi1, hi0, hi1, hi0, hi1));
}

// Q6_K one row at a time (tail rows and matrices not regrouped; q6k_x8_x86.h has the eight-row
// layout): the block's integers in 8 int32 lanes, then the float step of qblocks.h.
template <int R>
NPQ_AVX2 void q6_k_rows(const uint8_t* w, const uint8_t* const* x, int nb, float* out) {
  const __m256i m15 = _mm256_set1_epi8(15);
  const __m256i m3 = _mm256_set1_epi8(3);
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int b = 0; b < nb; ++b, w += 210) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    __m256i sumi[R];
    // Every weight carries -32: start from -32 * (scale . per-16 activation sums), exact in int32.
    for (int r = 0; r < R; ++r) {
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act<ActSuper>(x, r)[b].bsums));
      sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5));
    }
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    for (int h = 0; h < 2; ++h, ql += 64, qh += 32) {
      // This half's 8 scales (int16) in both 128-bit lanes.
      const __m256i both = h == 0 ? _mm256_permute4x64_epi64(scales16, 0x44)
                                  : _mm256_permute4x64_epi64(scales16, 0xEE);
      const __m256i l1 = load32(ql), l2 = load32(ql + 32), hb = load32(qh);
      const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l1, m15),
                                         _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
      const __m256i q1 = _mm256_or_si256(
          _mm256_and_si256(l2, m15),
          _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2));
      const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                                         _mm256_and_si256(hb, _mm256_set1_epi8(48)));
      const __m256i q3 = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(l2, 4), m15),
          _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(-64)), 2));
      const __m256i s0 = two_scales<0>(both), s1 = two_scales<2>(both);
      const __m256i s2 = two_scales<4>(both), s3 = two_scales<6>(both);
      for (int r = 0; r < R; ++r) {
        const int8_t* y = act<ActSuper>(x, r)[b].qs + 128 * h;
        const __m256i a = dot_u8_scaled_add(dot_u8_scaled(q0, load32(y), s0), q1, load32(y + 32), s1);
        const __m256i c = dot_u8_scaled_add(dot_u8_scaled(q2, load32(y + 64), s2), q3, load32(y + 96), s3);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(a, c));
      }
    }
    const float d = half(w + 208);
    for (int r = 0; r < R; ++r) {
      const float dx = act<ActSuper>(x, r)[b].d;
      acc[r] = fma_ss(static_cast<float>(hsum_i32(sumi[r])), d * dx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// rows (1..MAX_ROWS) -> the instance of `Kern` for that many rows.
template <template <int> class Kern>
NPQ_AVX2 void by_rows(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) {
  switch (rows) {
    case 1: Kern<1>::run(w, x, nb, out); break;
    case 2: Kern<2>::run(w, x, nb, out); break;
    case 3: Kern<3>::run(w, x, nb, out); break;
    case 4: Kern<4>::run(w, x, nb, out); break;
    case 5: Kern<5>::run(w, x, nb, out); break;
    case 6: Kern<6>::run(w, x, nb, out); break;
    case 7: Kern<7>::run(w, x, nb, out); break;
    default: Kern<8>::run(w, x, nb, out); break;
  }
}

// One struct per type whose run<R> is the R-row kernel (what by_rows dispatches on).
#define NPQ_ROWS(Name, ...)                                                               \
  template <int R>                                                                        \
  struct Name {                                                                           \
    NPQ_AVX2 static void run(const uint8_t* w, const uint8_t* const* x, int nb, float* o) { \
      __VA_ARGS__(w, x, nb, o);                                                           \
    }                                                                                     \
  };
NPQ_ROWS(Q8_0K, blocks_rows<R, 34, unpack_q8_0, true, false, true>)
NPQ_ROWS(Q4_0K, blocks_rows<R, 18, unpack_q4_0, true, false, false>)
NPQ_ROWS(Q4_1K, blocks_rows<R, 20, unpack_q4_1, false, true, true>)
NPQ_ROWS(Q5_0K, blocks_rows<R, 22, unpack_q5_0, true, false, true>)
NPQ_ROWS(Q4_KK, q4_k_rows<R>)
NPQ_ROWS(Q6_KK, q6_k_rows<R>)
#undef NPQ_ROWS

// One activation row . C weight rows of a 32-element type: for each weight row the float steps of
// blocks_rows (the same products, the same fma per block, the same offset chain and final sum),
// the C rows' chains side by side so that one block's fma need not wait on the last one's, and
// the activation block loaded once for all C. `Shift` 0: signed weights (dot_i8); otherwise
// `Unpack` gives them unsigned, plus 1 << Shift (Q4_0's 8, Q5_0's 16), maddubs multiplies them
// directly and (1 << Shift) times the activations' sums per four lanes (once per block for all
// C rows) is taken off: dot_i8's int32 lanes exactly, in fewer instructions per row. `Exact`:
// blocks_rows' exact steps (Q8_0, Q5_0, Q4_1).
template <int C, int Bytes, __m256i (*Unpack)(const uint8_t*), int Shift, bool Offset, bool Exact>
NPQ_AVX2 void blocks_cols(const uint8_t* w, size_t stride, const uint8_t* x, int nb, float* out) {
  static_assert(Exact || !Offset, "the offset chain is one of the exact steps");
  const ActBlock* y = reinterpret_cast<const ActBlock*>(x);
  __m256 acc[C];
  float exact[C], offsets[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_setzero_ps();
    exact[c] = offsets[c] = 0.0f;
  }
  for (int b = 0; b < nb; ++b) {
    const __m256i yq = load32(y[b].qs);
    __m256i ybias = _mm256_setzero_si256();  // -(1 << Shift) * the activations' four-lane sums
    if (Shift != 0) {
      ybias = _mm256_sub_epi32(ybias, _mm256_slli_epi32(dot_u8(_mm256_set1_epi8(1), yq), Shift));
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* wb = w + c * stride + static_cast<size_t>(b) * Bytes;
      const __m256i q = Unpack(wb);
      const __m256i s = Shift == 0 ? (Offset ? dot_u8(q, yq) : dot_i8(q, yq))
                                   : NPQ_DOT_ADD(ybias, q, yq);
      if (Exact) {
        exact[c] = fma_ss(static_cast<float>(hsum_i32(s)), half(wb) * y[b].d, exact[c]);
        if (Offset) offsets[c] = fma_ss(half(wb + 2), y[b].sum, offsets[c]);
      } else {
        const __m256 d = _mm256_set1_ps(half(wb) * y[b].d);
        acc[c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    out[c] = !Exact ? hsum(acc[c]) : Offset ? exact[c] + offsets[c] : exact[c];
  }
}

// The K types one weight row at a time (their R-row kernels at R = 1).
template <template <int> class Kern>
NPQ_AVX2 void rows_one(const uint8_t* w, size_t stride, const uint8_t* x, int n, int nb, float* out) {
  const uint8_t* rows[1] = {x};
  for (int i = 0; i < n; ++i) Kern<1>::run(w + i * stride, rows, nb, out + i);
}

// n weight rows: four at a time where rows are short (the weights of four rows lie together and
// the chains overlap: ~18% less time on SmolLM2's 576-wide Q4_1 rows, before they were
// regrouped), one at a time where they are long (four streams of weights ran 5-25% slower than
// one on the 612-byte Q8_0 and 960-byte Q4_1 rows). Now these serve Q4_0 and the matrices whose
// rows do not come in sixteens.
constexpr size_t SHORT_ROW_BYTES = 512;
#define NPQ_COLS(Name, ...)                                                                     \
  template <int C>                                                                              \
  NPQ_AVX2 void Name##_c(const uint8_t* w, size_t stride, const uint8_t* x, int nb, float* o) { \
    __VA_ARGS__(w, stride, x, nb, o);                                                           \
  }                                                                                             \
  NPQ_AVX2 void Name(const uint8_t* w, size_t stride, const uint8_t* x, int n, int nb, float* o) { \
    int i = 0;                                                                                  \
    if (stride <= SHORT_ROW_BYTES) {                                                            \
      for (; i + 4 <= n; i += 4) Name##_c<4>(w + i * stride, stride, x, nb, o + i);             \
    }                                                                                           \
    for (; i < n; ++i) Name##_c<1>(w + i * stride, stride, x, nb, o + i);                       \
  }
NPQ_AVX2 inline __m256i unpack_q4_0_plus8(const uint8_t* w) { return nibbles16(w + 2); }
NPQ_AVX2 inline __m256i unpack_q5_0_plus16(const uint8_t* w) {
  return _mm256_or_si256(nibbles16(w + 6),
                         _mm256_and_si256(bits_to_bytes(w + 2), _mm256_set1_epi8(16)));
}
NPQ_COLS(q8_0_cols, blocks_cols<C, 34, unpack_q8_0, 0, false, true>)
NPQ_COLS(q4_0_cols, blocks_cols<C, 18, unpack_q4_0_plus8, 3, false, false>)
NPQ_COLS(q4_1_cols, blocks_cols<C, 20, unpack_q4_1, 0, true, true>)
NPQ_COLS(q5_0_cols, blocks_cols<C, 22, unpack_q5_0_plus16, 4, false, true>)
#undef NPQ_COLS

// The portable rule of quantize_run (qdot_scalar.cc) 8 lanes at a time: the same max, the same
// two divisions, _mm256_cvtps_epi32 rounds half to even as lrintf does in the default mode.
NPQ_AVX2 float quantize_run(const float* x, int8_t* q, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float amax = _mm_cvtss_f32(m);
  if (amax == 0.0f) {
    std::memset(q, 0, static_cast<size_t>(n));
    return 0.0f;
  }
  const __m256 id = _mm256_set1_ps(127.0f / amax);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lanes
  for (int i = 0; i < n; i += 32) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), id));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), id));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), id));
    const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), id));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_max_epi8(ordered, _mm256_set1_epi8(-127)));
  }
  return amax / 127.0f;
}

// Eight lanes at a time; a tail of fewer goes through the lanes padded with zeros (same bits).
NPQ_AVX2 void swiglu(const float* gate, const float* up, float* out, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
    _mm256_storeu_ps(out + i, npuchat_exp::swiglu8(g, u));
  }
  if (i == n) return;
  float g[8] = {}, u[8] = {}, o[8];
  std::memcpy(g, gate + i, sizeof(float) * (n - i));
  std::memcpy(u, up + i, sizeof(float) * (n - i));
  _mm256_storeu_ps(o, npuchat_exp::swiglu8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
  std::memcpy(out + i, o, sizeof(float) * (n - i));
}

NPQ_AVX2 void quantize_blocks(const float* x, ActBlock* y, int k) {
  for (int b = 0; b < k / QK; ++b) {
    y[b].d = quantize_run(x + b * QK, y[b].qs, QK);
    block_sum(&y[b]);
  }
}

NPQ_AVX2 void quantize_supers(const float* x, ActSuper* y, int k) {
  for (int b = 0; b < k / QK_K; ++b) {
    y[b].d = quantize_run(x + b * QK_K, y[b].qs, QK_K);
    super_sums(&y[b]);
  }
}

}  // namespace

const Kernels* NPQ_ENTRY() {
  static const Kernels k{NPQ_ISA,          by_rows<Q4_0K>, by_rows<Q4_1K>,  by_rows<Q5_0K>,
                         by_rows<Q8_0K>,  by_rows<Q4_KK>, by_rows<Q6_KK>,  quantize_blocks,
                         quantize_supers, q4_0_cols,      q4_1_cols,       q5_0_cols,
                         q8_0_cols,       rows_one<Q4_KK>, rows_one<Q6_KK>, q4_k_x8,
                         q6_k_x8,         q8_0_x8,         q5_0_x8,         q4_1_x8,
                         swiglu};
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("f16c") && NPQ_CPU_HAS;
  return ok ? &k : nullptr;
}

}  // namespace npq
