// exp(x) for x <= 0 in eight lanes (the attention softmax's shifted scores, SwiGLU's sigmoid),
// and SwiGLU itself, with a one-lane mirror of the same steps: the scalar kernel table computes
// silu(gate) * up by the same operations in the same order (fma where the lanes fuse, the build
// has -ffp-contract=off), so every table gives the same bits.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define NPX_AVX2 __attribute__((target("avx2,fma")))

namespace npuchat_exp {
namespace {

// 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], a degree-6 polynomial (relative error ~2e-7);
// below -87.3 (or -inf) exactly 0; NaN reads as -87.3 (max_ps takes the second operand).
constexpr float EXP_FLOOR = -87.3f, LOG2E = 1.44269504f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f,
                P3 = 4.1665795894e-2f, P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

NPX_AVX2 inline __m256 exp_neg(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i e = _mm256_slli_epi32(biased, 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// silu(g) * u = g * sigmoid(g) * u, with e = exp(-|g|) <= 1: sigmoid(g) is 1 / (1 + e) for
// g >= 0 and e / (1 + e) below (no overflow either side).
NPX_AVX2 inline __m256 swiglu8(__m256 g, __m256 u) {
  const __m256 e = exp_neg(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, neg);
  const __m256 s = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(_mm256_mul_ps(g, s), u);
}

// The same two in one lane (the scalar table's), step for step.
inline float exp_neg1(float x) {
  const bool tiny = x < EXP_FLOOR;
  x = x > EXP_FLOOR ? x : EXP_FLOOR;
  const float n = std::nearbyint(x * LOG2E);
  float r = std::fma(-n, LN2_HI, x);
  r = std::fma(-n, LN2_LO, r);
  float p = P0;
  p = std::fma(p, r, P1);
  p = std::fma(p, r, P2);
  p = std::fma(p, r, P3);
  p = std::fma(p, r, P4);
  p = std::fma(p, r, P5);
  p = std::fma(p, r * r, r + 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

inline float swiglu1(float g, float u) {
  const float e = exp_neg1(-std::fabs(g));
  const float s = (g < 0.0f ? e : 1.0f) / (1.0f + e);
  return g * s * u;
}

}  // namespace
}  // namespace npuchat_exp
