// What the two AVX2 + FMA attention paths share (attention_avx2.cc: eight rows in the lanes;
// attention_few_avx2.cc: slots or dims in the lanes for a few rows): the target attribute, the
// softmax's exp (exp_x86.h's) and the copying of cache rows into an L1 block. One definition
// each, so both paths compute the same bits.
#pragma once
#include <immintrin.h>

#include <cstring>

#include "attention.h"
#include "exp_x86.h"

#define NPA_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace npuchat_attention {
namespace {

using npuchat_exp::exp_neg;

// n float16 values widened into dst (a block of cache rows, kept in L1 for the block's tiles).
NPA_AVX2 inline void widen_rows(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// Slots [c0, c1) of one head's K or V rows into `buf` as floats (slot c at buf + (c - c0) dh):
// copied (f32) or widened (f16) in one sequential read, the tiles then broadcast from L1. The
// tiles reading a dozen rows side by side straight from the cache ran ~1.6x slower once the
// cache outgrew the caches (1.5B layer shapes, 28 layers at 4,000 slots: 29 vs 18 ms a step).
NPA_AVX2 inline const float* block_rows(const float* f32, const uint16_t* f16, int64_t c0,
                                        int64_t c1, int64_t dh, float* buf) {
  if (f16 == nullptr) {
    std::memcpy(buf, f32 + c0 * dh, static_cast<size_t>((c1 - c0) * dh) * sizeof(float));
  } else {
    widen_rows(f16 + c0 * dh, (c1 - c0) * dh, buf);
  }
  return buf;
}

// One (batch, KV head)'s K and V rows of the cache: float32 (k, v) or float16 (k16, v16), the
// other pair null.
struct HeadCache {
  const float *k, *v;
  const uint16_t *k16, *v16;
  HeadCache(const Job& j, const Rows& rows) {
    const int64_t head = rows.bh * j.c * j.dh;
    const bool half = j.k16 != nullptr;
    k = half ? nullptr : j.k + head;
    v = half ? nullptr : j.v + head;
    k16 = half ? j.k16 + head : nullptr;
    v16 = half ? j.v16 + head : nullptr;
  }
};

}  // namespace
}  // namespace npuchat_attention
