// What the two halves of `npuchat.Attention` share (attention_op.cc: the op, its checks and
// the portable rows; attention_avx2.cc: the AVX2 rows): one task's job and its rows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "half.h"

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

using npuchat_half::float_to_half;
using npuchat_half::half_to_float;

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
// A task's 1-4 rows over slots [tlo, thi) with the slots or head dims in the lanes, the bits of
// run_task_avx2's (attention_few_avx2.cc); false (nothing done) where it does not apply.
bool run_few_rows_avx2(const Job& j, const Rows& rows, int64_t tlo, int64_t thi);
void run_task_scalar(void* data, size_t t);

// The one of them this process runs (NPUCHAT_KERNEL_ISA=scalar forces the portable rows).
using TaskFn = void (*)(void*, size_t);
TaskFn attention_task();

}  // namespace npuchat_attention
