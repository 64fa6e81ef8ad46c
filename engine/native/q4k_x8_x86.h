// Q4_K on eight regrouped rows (Q4KX8, qblocks.h) for qdot_avx2.cc and its VNNI builds: one
// 32-byte load holds a four-element group of all eight rows (low nibbles: sub-block 2j, high:
// 2j + 1), four activations broadcast to every lane meet it in one NPQ_DOT_ADD, and each int32
// lane then sums that row only. A block's integers and float steps are q4_k_rows' (qblocks.h),
// so a regrouped row gives the bits of the same row unregrouped. Included after qdot_x86.h.
#pragma once

namespace npq {

namespace {

// The block's minima term M of the eight rows: minima . activation sums, sub-block pairs by madd.
NPQ_AVX2 inline __m256i x8_minima(const Q4KX8& q, const ActSuper& y) {
  __m256i m = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.mins[k])));
    int32_t pair;
    std::memcpy(&pair, &y.bsums32[2 * k], 4);
    m = _mm256_add_epi32(m, _mm256_madd_epi16(mins, _mm256_set1_epi32(pair)));
  }
  return m;
}

#if NPQ_INT16_SUMS
// AVX2: a sub-block's eight four-element groups summed as int16 lanes (each maddubs pair is at
// most 2 * 15 * 127 in magnitude, eight of them 30,480 < 2^15), then one madd with the rows'
// scales: the int32 sums of the VNNI path below, exactly, in about half the instructions.
#define NPQ_X8_BACC(acc, u, p) _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, bcast4(p)))

// sums += dots (int16 pairs) * the rows' scales of sub-block s (row i: int16 lanes 2i, 2i + 1).
NPQ_AVX2 inline __m256i x8_scaled(__m256i sums, __m256i dots, const Q4KX8& q, int s) {
  const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q.scales[s]));
  return _mm256_add_epi32(sums, _mm256_madd_epi16(dots, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc, sc))));
}
#else
#define NPQ_X8_BACC(acc, u, p) dot_bcast(acc, u, p)

// sums += dots * the rows' scales of sub-block s.
NPQ_AVX2 inline __m256i x8_scaled(__m256i sums, __m256i dots, const Q4KX8& q, int s) {
  const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q.scales[s])));
  return _mm256_add_epi32(sums, _mm256_mullo_epi32(dots, sc));
}
#endif

// The float steps of one block for the eight rows.
NPQ_AVX2 inline void x8_step(const Q4KX8& q, __m256i sumi, __m256i summ, float dx, __m256* acc,
                             __m256* accm) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.d)));
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.dmin)));
  const __m256 vx = _mm256_set1_ps(dx);
  *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, vx), *acc);
  *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, vx), *accm);
}

// One activation row (a decode step): all eight sub-blocks' sums side by side, so that eight
// independent chains hide the dot instructions' latency.
NPQ_AVX2 void q4_k_x8_one(const Q4KX8* w, const ActSuper* x, int nb, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    prefetch_ahead(w, b);
    const Q4KX8& q = w[b];
    const int8_t* y = x[b].qs;
    __m256i dots[8];
    for (int s = 0; s < 8; ++s) dots[s] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = load32(q.qs[j][g]);
        const __m256i lo = _mm256_and_si256(raw, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        dots[2 * j] = NPQ_X8_BACC(dots[2 * j], lo, y + 64 * j + 4 * g);
        dots[2 * j + 1] = NPQ_X8_BACC(dots[2 * j + 1], hi, y + 64 * j + 32 + 4 * g);
      }
    }
    __m256i sumi = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) sumi = x8_scaled(sumi, dots[s], q, s);
    x8_step(q, sumi, x8_minima(q, x[b]), x[b].d, &acc, &accm);
  }
  _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
}

#if !NPQ_INT16_SUMS
// Group g of chunk j for R rows: its low and high nibbles into each row's two chains.
template <int R>
NPQ_AVX2 inline __attribute__((always_inline)) void x8_group(const Q4KX8& q,
                                                            const uint8_t* const* x, int b, int j,
                                                            int g, __m256i m4, __m256i* lo_dots,
                                                            __m256i* hi_dots) {
  const __m256i raw = load32(q.qs[j][g]);
  const __m256i lo = _mm256_and_si256(raw, m4);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  for (int r = 0; r < R; ++r) {
    const int8_t* y = reinterpret_cast<const ActSuper*>(x[r])[b].qs + 64 * j + 4 * g;
    lo_dots[r] = NPQ_X8_BACC(lo_dots[r], lo, y);
    hi_dots[r] = NPQ_X8_BACC(hi_dots[r], hi, y + 32);
  }
}
#endif

// R activation rows (2..NPQ_X8_PASS) at once: chunk by chunk, 2R chains, the weights unpacked once.
template <int R>
NPQ_AVX2 void q4_k_x8_rows(const Q4KX8* w, const uint8_t* const* x, int nb, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    if (ahead_for<R>) prefetch_ahead(w, b);
    const Q4KX8& q = w[b];
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
#if NPQ_INT16_SUMS
      // AVX2's 16 registers: the low nibbles' sums, then the high ones' (R accumulators live,
      // not 2R: at four rows those spilled; a harness of 8-row prefill passes over an L2 tile
      // ran 1.1-1.3x faster this way, streaming 4-row passes the same). Unrolled by four, not
      // eight: fully unrolled, GCC loaded all eight groups' nibbles ahead and spilled them (39
      // stack stores a block at four rows)
      for (int h = 0; h < 2; ++h) {
        __m256i dots[R];
        for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int g = 0; g < 8; ++g) {
          const __m256i raw = load32(q.qs[j][g]);
          const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m4);
          for (int r = 0; r < R; ++r) {
            const int8_t* y = reinterpret_cast<const ActSuper*>(x[r])[b].qs + 64 * j + 32 * h;
            dots[r] = NPQ_X8_BACC(dots[r], nib, y + 4 * g);
          }
        }
        for (int r = 0; r < R; ++r) sumi[r] = x8_scaled(sumi[r], dots[r], q, 2 * j + h);
      }
#else
      __m256i lo_dots[R], hi_dots[R];
      for (int r = 0; r < R; ++r) lo_dots[r] = hi_dots[r] = _mm256_setzero_si256();
      if constexpr (R >= 5 && R < 8) {
        // five to seven rows (verify and mixed steps, streaming): unrolled by two, 2-20% faster
        // in a kernel harness (five rows the most); eight rows (prefill, an L2 tile) ran 10%
        // slower that way and keep the full unroll
#pragma GCC unroll 2
        for (int g = 0; g < 8; ++g) x8_group<R>(q, x, b, j, g, m4, lo_dots, hi_dots);
      } else {
        for (int g = 0; g < 8; ++g) x8_group<R>(q, x, b, j, g, m4, lo_dots, hi_dots);
      }
      for (int r = 0; r < R; ++r) {
        sumi[r] = x8_scaled(x8_scaled(sumi[r], lo_dots[r], q, 2 * j), hi_dots[r], q, 2 * j + 1);
      }
#endif
    }
    for (int r = 0; r < R; ++r) {
      const ActSuper& y = reinterpret_cast<const ActSuper*>(x[r])[b];
      x8_step(q, sumi[r], x8_minima(q, y), y.d, &acc[r], &accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, _mm256_sub_ps(acc[r], accm[r]));
}

// rows (1..MAX_ROWS) activation rows, NPQ_X8_PASS at a time.
NPQ_AVX2 void q4_k_x8(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) {
  const Q4KX8* q = reinterpret_cast<const Q4KX8*>(w);
  for (; rows > 0; x += NPQ_X8_PASS, out += 8 * NPQ_X8_PASS, rows -= NPQ_X8_PASS) {
    switch (rows) {
      case 1: q4_k_x8_one(q, reinterpret_cast<const ActSuper*>(x[0]), nb, out); break;
      case 2: q4_k_x8_rows<2>(q, x, nb, out); break;
      case 3: q4_k_x8_rows<3>(q, x, nb, out); break;
#if NPQ_X8_PASS == 8
      case 4: q4_k_x8_rows<4>(q, x, nb, out); break;
      case 5: q4_k_x8_rows<5>(q, x, nb, out); break;
      case 6: q4_k_x8_rows<6>(q, x, nb, out); break;
      case 7: q4_k_x8_rows<7>(q, x, nb, out); break;
      default: q4_k_x8_rows<8>(q, x, nb, out); break;
#else
      default: q4_k_x8_rows<4>(q, x, nb, out); break;
#endif
    }
  }
}

#undef NPQ_X8_BACC

}  // namespace

}  // namespace npq
