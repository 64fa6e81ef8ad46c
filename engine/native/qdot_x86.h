// The AVX2 building blocks of qdot_avx2.cc (and of its VNNI builds, qdot_vnni.cc): horizontal
// sums, halves, loads and broadcasts, the integer dots over NPQ_DOT_ADD / NPQ_PAIRS_ADD, nibble
// and bit unpacking. Included after NPQ_AVX2 (the target attribute) and those two are defined.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace npq {

namespace {

// Block b's bytes of an eight-row kernel's weights (blocks of 176-1,680 bytes) 2 KB further on,
// asked for now. Several activation rows make a block's work long enough that the hardware
// streamer alone leaves the next lines late: 4-row decode steps took 0.86-0.96x (1.5B) and
// 0.90-0.96x (0.5B) of their time without it, one-row steps 0.98-1.01x (seven A/B runs; 1 and
// 4 KB ahead did less). Past the end of the weights it is a hint to an address no one reads.
// Eight rows are a prefill chunk's (run_tile: the tile's weights are in L2 for all but its first
// group of rows), where the hints only take load slots: `ahead_for` leaves them out there (a
// kernel harness, eight-row passes over a 32 KiB tile: Q4_K 5-7% faster without them, Q8_0 and
// Q5_0 4-6%, Q6_K 4%, Q4_1 the same; Q4_K streaming from memory, 15-25% slower without).
template <int R>
constexpr bool ahead_for = R < 8;

template <typename T>
inline void prefetch_ahead(const T* w, int b) {
  constexpr uintptr_t AHEAD = 2048;
  const uintptr_t at = reinterpret_cast<uintptr_t>(w + b) + AHEAD;
  for (uintptr_t l = 0; l < sizeof(T); l += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(at + l), _MM_HINT_T0);
  }
}

NPQ_AVX2 inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// The exact sum of 4 or 8 int32 lanes (the sums here stay far inside int32).
NPQ_AVX2 inline int hsum_i32(__m128i r) {
  r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 1));
  return _mm_cvtsi128_si32(r);
}
NPQ_AVX2 inline int hsum_i32(__m256i v) {
  return hsum_i32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// fma(a, b, c) rounded once, as the vector fmadds do.
NPQ_AVX2 inline float fma_ss(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

NPQ_AVX2 inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

NPQ_AVX2 inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// The four bytes at p in every 32-bit lane.
NPQ_AVX2 inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + u . bcast4(p) (unsigned . signed bytes, as NPQ_DOT_ADD). With AVX-512 (NPQ_EVEX_BCAST)
// one vpdpbusd reads the four bytes itself (an embedded {1to8} broadcast) and adds in place:
// GCC 12 gave the eight-row kernels a vpbroadcastd per dot and two register copies around
// each vpdpbusd: an eight-row Q4_K pass took 1.7-2x as long (README, "Latest figures").
NPQ_AVX2 inline __m256i dot_bcast(__m256i acc, __m256i u, const int8_t* p) {
#if NPQ_EVEX_BCAST
  struct Four {
    int8_t b[4];
  };
  __asm__("vpdpbusd %2%{1to8%}, %1, %0"
          : "+v"(acc)
          : "v"(u), "m"(*reinterpret_cast<const Four*>(p)));
  return acc;
#else
  return NPQ_DOT_ADD(acc, u, bcast4(p));
#endif
}

// Signed int8 . signed int8 over 32 lanes -> 8 int32 partial sums.
NPQ_AVX2 inline __m256i dot_i8(__m256i a, __m256i b) {
  return NPQ_DOT_ADD(_mm256_setzero_si256(), _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

// Unsigned (< 128) . signed int8 over 32 lanes -> 8 int32.
NPQ_AVX2 inline __m256i dot_u8(__m256i u, __m256i s) {
  return NPQ_DOT_ADD(_mm256_setzero_si256(), u, s);
}

// Unsigned (< 64) . signed int8 over 32 lanes, times one int16 scale per 16 lanes -> 8 int32.
NPQ_AVX2 inline __m256i dot_u8_scaled(__m256i u, __m256i s, __m256i scales) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scales);
}

// acc + dot_u8_scaled(u, s, scales).
NPQ_AVX2 inline __m256i dot_u8_scaled_add(__m256i acc, __m256i u, __m256i s, __m256i scales) {
  return NPQ_PAIRS_ADD(acc, _mm256_maddubs_epi16(u, s), scales);
}

// 16 bytes of nibbles -> 32 bytes: element j (low nibble of byte j) then element 16 + j.
NPQ_AVX2 inline __m256i nibbles16(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(both, _mm256_set1_epi8(0xF));
}

// 32 bits -> 32 bytes, 0xFF where the bit is set.
NPQ_AVX2 inline __m256i bits_to_bytes(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(v)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

}  // namespace

}  // namespace npq
