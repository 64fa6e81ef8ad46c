// What the two halves of `npuchat.Attention` share (attention_op.cc: the op, its checks and
// the portable rows; attention_avx2.cc: the AVX2 rows): one task's job and its rows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace npuchat_attention {

constexpr int64_t LANES = 8;
constexpr int64_t ROWS_PER_TASK = 32;  // query rows of one KV head per task (K/V read once each)
constexpr int64_t BLOCK_COLS = 48;     // cache slots whose K or V rows stay in L1 for the task

inline const float NEG_INF = -std::numeric_limits<float>::infinity();

struct Job {
  const float *q, *k, *v, *mask;
  float* y;
  float hidden;
  int64_t hkv, rows, s, c, a, dh, row_tasks;
  // a float16 cache instead (k and v then null): IEEE half bits, widened to float exactly as
  // they are read, so a row's arithmetic is the f32 cache's over the same values
  const uint16_t *k16 = nullptr, *v16 = nullptr;
};

// IEEE half <-> float in integers only (no dependence on the FPU's flush-to-zero modes):
// widening is exact; narrowing rounds to nearest even, overflow to infinity, NaN stays NaN
// (quiet), as numpy's astype(float16) and F16C's vcvtps2ph do.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {  // subnormal: m * 2^-24, the top bit p of m gives 2^(p - 24)
    const uint32_t p = 31 - static_cast<uint32_t>(__builtin_clz(m));
    bits = sign | ((p + 103) << 23) | ((m << (23 - p)) & 0x7fffffu);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 2^16: infinity
  uint32_t r, rem, tie;
  if (ax < 0x38800000u) {                                    // below 2^-14: subnormal or zero
    if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // at most 2^-25: zero
    const uint32_t shift = 126 - (ax >> 23), m = (ax & 0x7fffffu) | 0x800000u;
    r = m >> shift;
    rem = m & ((1u << shift) - 1);
    tie = 1u << (shift - 1);
  } else {
    r = (ax >> 13) - (112u << 10);
    rem = ax & 0x1fffu;
    tie = 0x1000u;
  }
  if (rem > tie || (rem == tie && (r & 1u))) ++r;  // a carry rounds up the exponent (to inf)
  return static_cast<uint16_t>(sign | r);
}

// The first and one past the last slot a mask row shows ([0, 0) when it shows none).
inline std::pair<int64_t, int64_t> visible_span(const float* mask, int64_t a, float hidden) {
  int64_t lo = 0, hi = a;
  while (lo < a && mask[lo] <= hidden) ++lo;
  while (hi > lo && mask[hi - 1] <= hidden) --hi;
  return lo < hi ? std::make_pair(lo, hi) : std::make_pair(int64_t{0}, int64_t{0});
}

// Rows [r0, r0 + n) of one (batch, KV head) in token-major order (x = s * G + g: the G query
// heads of a token, which share its mask row, side by side), where each sits in q and y
// (g * S + s) and the slots each shows.
struct Rows {
  int64_t bh, b, r0, n;
  std::vector<int64_t> at, token, lo, hi;

  Rows(const Job& j, size_t t)
      : bh(static_cast<int64_t>(t) / j.row_tasks),
        b(bh / j.hkv),
        r0((static_cast<int64_t>(t) % j.row_tasks) * ROWS_PER_TASK),
        n(std::min(j.rows, r0 + ROWS_PER_TASK) - r0),
        at(n),
        token(n),
        lo(n),
        hi(n) {
    const int64_t g = j.rows / j.s;
    std::pair<int64_t, int64_t> span{0, 0};
    for (int64_t i = 0; i < n; ++i) {
      token[i] = (r0 + i) / g;
      at[i] = (r0 + i) % g * j.s + token[i];
      if (i == 0 || token[i] != token[i - 1]) span = visible_span(mask_row(j, i), j.a, j.hidden);
      lo[i] = span.first;
      hi[i] = span.second;
    }
  }
  const float* mask_row(const Job& j, int64_t i) const {
    return j.mask + (b * j.s + token[i]) * j.a;
  }
  const float* q(const Job& j, int64_t i) const { return j.q + (bh * j.rows + at[i]) * j.dh; }
  float* y(const Job& j, int64_t i) const { return j.y + (bh * j.rows + at[i]) * j.dh; }
  // the union of the spans of rows [i0, i1) ([a, a) when none shows a slot)
  std::pair<int64_t, int64_t> span(int64_t i0, int64_t i1, int64_t a) const {
    int64_t l = a, h = 0;
    for (int64_t i = i0; i < std::min(i1, n); ++i) {
      if (lo[i] >= hi[i]) continue;
      l = std::min(l, lo[i]);
      h = std::max(h, hi[i]);
    }
    return l < h ? std::make_pair(l, h) : std::make_pair(a, a);
  }
};

// One task's rows on AVX2 + FMA (attention_avx2.cc), and on any CPU (attention_op.cc).
void run_task_avx2(void* data, size_t t);
void run_task_scalar(void* data, size_t t);

// The one of them this process runs (NPUCHAT_KERNEL_ISA=scalar forces the portable rows).
using TaskFn = void (*)(void*, size_t);
TaskFn attention_task();

}  // namespace npuchat_attention
