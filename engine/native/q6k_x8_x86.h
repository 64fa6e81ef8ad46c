// Q6_K on eight regrouped rows (Q6KX8, qblocks.h) for qdot_avx2.cc and its VNNI builds: per half
// and four-element group, three 32-byte loads (low nibbles of two element runs, and their high
// bit pairs) hold sixteen elements of all eight rows; four activations broadcast to every lane
// meet each quarter in one NPQ_DOT_ADD. The -32 offset comes off through the activations'
// per-16 sums, and a block's integer and float step are q6_k_rows' (qblocks.h), so a regrouped
// row gives the bits of the same row unregrouped. Included after qdot_x86.h.
#pragma once

namespace npq {

namespace {

// The rows' scales of sub-blocks 2k and 2k + 1 as int16 pairs (row r: lanes 2r, 2r + 1).
NPQ_AVX2 inline __m256i q6_pair_scales(const Q6KX8& q, int k) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.scales[k])));
}

// sums += dots * the rows' scales of sub-block 2k + e (e: 0 or 1), taken from the pair.
NPQ_AVX2 inline __m256i q6_scaled(__m256i sums, __m256i dots, __m256i pair, int e) {
  const __m256i sc = e == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16)
                            : _mm256_srai_epi32(pair, 16);
  return _mm256_add_epi32(sums, _mm256_mullo_epi32(dots, sc));
}

// 32 * sum over sub-blocks of scale * (the activations' sum over it): the -32 every weight carries.
NPQ_AVX2 inline __m256i q6_offset(const Q6KX8& q, const ActSuper& y) {
  __m256i m = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) {
    int32_t pair;
    std::memcpy(&pair, &y.bsums[2 * k], 4);
    m = _mm256_add_epi32(m, _mm256_madd_epi16(q6_pair_scales(q, k), _mm256_set1_epi32(pair)));
  }
  return _mm256_slli_epi32(m, 5);
}

// The four quarters' 6-bit values (0..63) of one group: low nibbles of runs a (quarters 0, 2)
// and b (1, 3), high bit pairs from h.
struct Q6Quarters {
  __m256i v[4];
};
NPQ_AVX2 inline Q6Quarters q6_unpack(const uint8_t* p) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m256i a = load32(p), b = load32(p + 32), h = load32(p + 64);
  Q6Quarters out;
  out.v[0] = _mm256_or_si256(_mm256_and_si256(a, m4),
                             _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(3)), 4));
  out.v[1] = _mm256_or_si256(_mm256_and_si256(b, m4),
                             _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(12)), 2));
  out.v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                             _mm256_and_si256(h, _mm256_set1_epi8(48)));
  out.v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                             _mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(-64)), 2));
  return out;
}

// R activation rows (1..4): per half and run of four groups (gh), the four sub-blocks' sums
// side by side for each row (5R integer registers live).
template <int R>
NPQ_AVX2 void q6_k_x8_rows(const Q6KX8* w, const uint8_t* const* x, int nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    prefetch_ahead(w, b);
    const Q6KX8& q = w[b];
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      for (int gh = 0; gh < 2; ++gh) {
        __m256i dots[R][4];  // [row][quarter]: sub-block 8 * half + 2 * quarter + gh
        for (int r = 0; r < R; ++r) {
          for (int qq = 0; qq < 4; ++qq) dots[r][qq] = _mm256_setzero_si256();
        }
        for (int g = 4 * gh; g < 4 * gh + 4; ++g) {
          const Q6Quarters v = q6_unpack(q.q[half][g][0]);
          for (int r = 0; r < R; ++r) {
            const int8_t* y = reinterpret_cast<const ActSuper*>(x[r])[b].qs + 128 * half + 4 * g;
            for (int qq = 0; qq < 4; ++qq) {
              dots[r][qq] = dot_bcast(dots[r][qq], v.v[qq], y + 32 * qq);
            }
          }
        }
        for (int k = 0; k < 4; ++k) {
          const __m256i pair = q6_pair_scales(q, 4 * half + k);
          for (int r = 0; r < R; ++r) sumi[r] = q6_scaled(sumi[r], dots[r][k], pair, gh);
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.d)));
    for (int r = 0; r < R; ++r) {
      const ActSuper& y = reinterpret_cast<const ActSuper*>(x[r])[b];
      const __m256i total = _mm256_sub_epi32(sumi[r], q6_offset(q, y));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(y.d)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// R activation rows (5..8) in one pass: per half and run of four groups (gh), the sixteen
// unpacked quarters stay in registers while each row's four sub-block sums run over them, so
// a block is unpacked once for all the rows (q6_k_x8_rows unpacks it once per pass).
template <int R>
NPQ_AVX2 void q6_k_x8_wide(const Q6KX8* w, const uint8_t* const* x, int nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    if (ahead_for<R>) prefetch_ahead(w, b);
    const Q6KX8& q = w[b];
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      for (int gh = 0; gh < 2; ++gh) {
        Q6Quarters v[4];  // groups 4 gh .. 4 gh + 3
        for (int t = 0; t < 4; ++t) v[t] = q6_unpack(q.q[half][4 * gh + t][0]);
        for (int r = 0; r < R; ++r) {
          const int8_t* y = reinterpret_cast<const ActSuper*>(x[r])[b].qs + 128 * half + 16 * gh;
          __m256i dots[4];  // [quarter]: sub-block 8 * half + 2 * quarter + gh
          for (int qq = 0; qq < 4; ++qq) dots[qq] = _mm256_setzero_si256();
          for (int t = 0; t < 4; ++t) {
            for (int qq = 0; qq < 4; ++qq) {
              dots[qq] = dot_bcast(dots[qq], v[t].v[qq], y + 4 * t + 32 * qq);
            }
          }
          for (int k = 0; k < 4; ++k) {
            sumi[r] = q6_scaled(sumi[r], dots[k], q6_pair_scales(q, 4 * half + k), gh);
          }
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.d)));
    for (int r = 0; r < R; ++r) {
      const ActSuper& y = reinterpret_cast<const ActSuper*>(x[r])[b];
      const __m256i total = _mm256_sub_epi32(sumi[r], q6_offset(q, y));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(y.d)),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// rows (1..MAX_ROWS) activation rows. With 32 vector registers (AVX-512) in one pass: up to
// four by q6_k_x8_rows (at four it spills, and still beats three plus one: a kernel harness
// streaming 128 MB of blocks on one thread, 8.0-8.5 ms against 12.8-12.9), five to eight by
// q6_k_x8_wide (5: 10.8-11.1 ms against 15.3-16.8 for three plus two; 8: 15.8-19.7 against
// 17.9-21.0 for 3 + 3 + 2). With 16 (AVX2), two at a time.
NPQ_AVX2 void q6_k_x8(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) {
  const Q6KX8* q = reinterpret_cast<const Q6KX8*>(w);
#if NPQ_X8_PASS == 8
  switch (rows) {
    case 1: q6_k_x8_rows<1>(q, x, nb, out); break;
    case 2: q6_k_x8_rows<2>(q, x, nb, out); break;
    case 3: q6_k_x8_rows<3>(q, x, nb, out); break;
    case 4: q6_k_x8_rows<4>(q, x, nb, out); break;
    case 5: q6_k_x8_wide<5>(q, x, nb, out); break;
    case 6: q6_k_x8_wide<6>(q, x, nb, out); break;
    case 7: q6_k_x8_wide<7>(q, x, nb, out); break;
    default: q6_k_x8_wide<8>(q, x, nb, out); break;
  }
#else
  for (; rows > 0; x += 2, out += 16, rows -= 2) {
    if (rows == 1) {
      q6_k_x8_rows<1>(q, x, nb, out);
    } else {
      q6_k_x8_rows<2>(q, x, nb, out);
    }
  }
#endif
}

}  // namespace

}  // namespace npq
