// Q8_0, Q5_0 and Q4_1 on eight regrouped rows (Q8X8, Q5X8, Q41X8; qblocks.h) for qdot_avx2.cc
// and its VNNI builds: one 32-byte load holds a four-element group of all eight rows, four
// activations broadcast to every lane meet it in one NPQ_DOT_ADD, each int32 lane sums one row's
// block exactly, and the float step is the plain rows' (qblocks.h), so a regrouped row gives the
// bits of the same row unregrouped. Included after qdot_x86.h.
#pragma once

namespace npq {

namespace {

// acc = fma(float(S), d * d_x, acc) for the eight rows of one block.
NPQ_AVX2 inline __m256 x8_block_step(const uint16_t* d, __m256i s, float dx, __m256 acc) {
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
}

template <int C>
NPQ_AVX2 inline __m256i chains_sum(const __m256i* sumi) {
  __m256i s = sumi[0];
  for (int c = 1; c < C; ++c) s = _mm256_add_epi32(s, sumi[c]);
  return s;
}

// R activation rows (1..NPQ_X8_PASS), C independent integer chains per row (a decode step has one row:
// more chains hide the dot instructions' latency there).
template <int R, int C>
NPQ_AVX2 void q8_0_x8_rows(const Q8X8* w, const uint8_t* const* x, int nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const Q8X8& q = w[b];
    if (ahead_for<R>) prefetch_ahead(w, b);
    __m256i sumi[R][C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) sumi[r][c] = _mm256_setzero_si256();
    }
    for (int g = 0; g < 8; ++g) {
#if NPQ_INT16_SUMS
      // AVX2's maddubs would saturate on w + 128: back to int8, then dot_i8's sign trick
      const __m256i v = _mm256_xor_si256(load32(q.qs[g]), _mm256_set1_epi8(-128));
      const __m256i u = _mm256_sign_epi8(v, v);
#else
      const __m256i u = load32(q.qs[g]);  // w + 128, straight into vpdpbusd
#endif
      for (int r = 0; r < R; ++r) {
        const int8_t* y = reinterpret_cast<const ActBlock*>(x[r])[b].qs + 4 * g;
#if NPQ_INT16_SUMS
        sumi[r][g % C] = NPQ_DOT_ADD(sumi[r][g % C], u, _mm256_sign_epi8(bcast4(y), v));
#else
        sumi[r][g % C] = dot_bcast(sumi[r][g % C], u, y);
#endif
      }
    }
    for (int r = 0; r < R; ++r) {
      const ActBlock& y = reinterpret_cast<const ActBlock*>(x[r])[b];
      __m256i s = chains_sum<C>(sumi[r]);
      if (!NPQ_INT16_SUMS) s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * y.isum));
      acc[r] = x8_block_step(q.d, s, y.d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Bit s of every byte of qh moved to bit 4: set s's fifth bits beside its nibbles.
NPQ_AVX2 inline __m256i fifth_bits(__m256i qh, int s) {
  const __m256i moved = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}

// One row's dots of a nibble type's group g (lo: elements 4g + t, hi: 16 + 4g + t) with its
// activations y = qs + 4g, into its chains; AVX2: [0] and [1] the int16 sums of the low and the
// high sets (four groups' maddubs pairs, each |.| <= 2 * 31 * 127, fit int16).
template <int C>
NPQ_AVX2 inline void nibble_dots(__m256i* sumi, __m256i lo, __m256i hi, const int8_t* y, int g) {
#if NPQ_INT16_SUMS
  (void)g;  // two int16 sets, whatever the group
  sumi[0] = _mm256_add_epi16(sumi[0], _mm256_maddubs_epi16(lo, bcast4(y)));
  sumi[1] = _mm256_add_epi16(sumi[1], _mm256_maddubs_epi16(hi, bcast4(y + 16)));
#else
  sumi[(2 * g) % C] = dot_bcast(sumi[(2 * g) % C], lo, y);
  sumi[(2 * g + 1) % C] = dot_bcast(sumi[(2 * g + 1) % C], hi, y + 16);
#endif
}

// The eight rows' int32 block sums from one activation row's nibble_dots chains.
template <int C>
NPQ_AVX2 inline __m256i nibble_sums(const __m256i* sumi) {
#if NPQ_INT16_SUMS
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_madd_epi16(sumi[0], ones), _mm256_madd_epi16(sumi[1], ones));
#else
  return chains_sum<C>(sumi);
#endif
}

// Q5_0's weights unsigned (nibble | 16 * bit, 0..31) straight into NPQ_DOT_ADD; each row's block
// then takes off 16 * the activations' sum (exact), which is the signed weights' integer.
template <int R, int C>
NPQ_AVX2 void q5_0_x8_rows(const Q5X8* w, const uint8_t* const* x, int nb, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const Q5X8& q = w[b];
    if (ahead_for<R>) prefetch_ahead(w, b);
    const __m256i qh = load32(q.qh);
    __m256i sumi[R][C];  // nibble_dots' chains
    __m256i bias[R];
    for (int r = 0; r < R; ++r) {
      const ActBlock& y = reinterpret_cast<const ActBlock*>(x[r])[b];
      bias[r] = _mm256_set1_epi32(-16 * y.isum);
      for (int c = 0; c < C; ++c) sumi[r][c] = _mm256_setzero_si256();
    }
    for (int g = 0; g < 4; ++g) {
      const __m256i raw = load32(q.qs[g]);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, m4), fifth_bits(qh, 2 * g));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                                         fifth_bits(qh, 2 * g + 1));
      for (int r = 0; r < R; ++r) {
        nibble_dots<C>(sumi[r], lo, hi, reinterpret_cast<const ActBlock*>(x[r])[b].qs + 4 * g, g);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = reinterpret_cast<const ActBlock*>(x[r])[b].d;
      const __m256i s = nibble_sums<C>(sumi[r]);
      acc[r] = x8_block_step(q.d, _mm256_add_epi32(s, bias[r]), dx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Q4_1's nibbles (0..15) straight into NPQ_DOT_ADD: each row's block integer exactly. The
// minima's chain (qblocks.h) is a second pass over the blocks' m once the dots are done, so the
// pass over the nibbles holds no more registers than Q5_0's.
template <int R, int C>
NPQ_AVX2 void q4_1_x8_rows(const Q41X8* w, const uint8_t* const* x, int nb, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const Q41X8& q = w[b];
    if (ahead_for<R>) prefetch_ahead(w, b);
    __m256i sumi[R][C];  // nibble_dots' chains
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) sumi[r][c] = _mm256_setzero_si256();
    }
    for (int g = 0; g < 4; ++g) {
      const __m256i raw = load32(q.qs[g]);
      const __m256i lo = _mm256_and_si256(raw, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      for (int r = 0; r < R; ++r) {
        nibble_dots<C>(sumi[r], lo, hi, reinterpret_cast<const ActBlock*>(x[r])[b].qs + 4 * g, g);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = reinterpret_cast<const ActBlock*>(x[r])[b].d;
      const __m256i s = nibble_sums<C>(sumi[r]);
      acc[r] = x8_block_step(q.d, s, dx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const ActBlock* y = reinterpret_cast<const ActBlock*>(x[r]);
    __m256 off = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].m)));
      off = _mm256_fmadd_ps(m, _mm256_set1_ps(y[b].sum), off);
    }
    _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], off));
  }
}

// rows (1..MAX_ROWS) activation rows, NPQ_X8_PASS at a time.
#if NPQ_X8_PASS == 8
#define NPQ_X8_WIDE_CASES(Kernel)                  \
  case 4: Kernel<4, 2>(q, x, nb, out); break;      \
  case 5: Kernel<5, 2>(q, x, nb, out); break;      \
  case 6: Kernel<6, 2>(q, x, nb, out); break;      \
  case 7: Kernel<7, 2>(q, x, nb, out); break;      \
  default: Kernel<8, 2>(q, x, nb, out); break;
#else
#define NPQ_X8_WIDE_CASES(Kernel) \
  default: Kernel<4, 2>(q, x, nb, out); break;
#endif
#define NPQ_X8_ROWS(Name, Block, Kernel)                                                      \
  NPQ_AVX2 void Name(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) { \
    const Block* q = reinterpret_cast<const Block*>(w);                                        \
    for (; rows > 0; x += NPQ_X8_PASS, out += 8 * NPQ_X8_PASS, rows -= NPQ_X8_PASS) {          \
      switch (rows) {                                                                          \
        case 1: Kernel<1, 4>(q, x, nb, out); break;                                            \
        case 2: Kernel<2, 2>(q, x, nb, out); break;                                            \
        case 3: Kernel<3, 2>(q, x, nb, out); break;                                            \
        NPQ_X8_WIDE_CASES(Kernel)                                                              \
      }                                                                                        \
    }                                                                                          \
  }
NPQ_X8_ROWS(q8_0_x8, Q8X8, q8_0_x8_rows)
NPQ_X8_ROWS(q5_0_x8, Q5X8, q5_0_x8_rows)
NPQ_X8_ROWS(q4_1_x8, Q41X8, q4_1_x8_rows)
#undef NPQ_X8_ROWS
#undef NPQ_X8_WIDE_CASES

}  // namespace

}  // namespace npq
