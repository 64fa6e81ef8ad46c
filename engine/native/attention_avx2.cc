// The AVX2 + FMA rows of `npuchat.Attention` (attention_op.cc says what the op computes and
// why each row's result is the same at any row count, batch or window).
#include <immintrin.h>

#include <array>
#include <utility>

#include "attention.h"
#include "attention_x86.h"

namespace npuchat_attention {
namespace {

// ---- AVX2 + FMA: eight query rows in the eight lanes of a vector ----
// Every lane's arithmetic is its own row's, the same in any lane, beside any rows and over any
// span that covers its slots: a score is q . k summed in order over dh (one FMA per d), the
// softmax's max and sum run over the slots in order, P.V adds each slot's p * v in slot order.
// Slots a lane does not see add exact zeros there (exp(-inf) = 0; p = 0 in an FMA leaves an
// accumulator that is never -0 unchanged), so a row's result is bit for bit what it gets alone.

// scores[v][c][lane] = qT[v][.][lane] . k[c] for NC slots: each K element one broadcast for NV
// vectors of rows (NV * NC accumulators, NV + 1 more registers).
template <int NV, int NC>
NPA_AVX2 void dots_tile(const float* qt, int64_t qstride, const float* k, int64_t dh, float* s,
                        int64_t sstride) {
  __m256 acc[NV * NC];
#pragma GCC unroll 16
  for (int x = 0; x < NV * NC; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dh; ++d) {
    __m256 qd[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) qd[v] = _mm256_loadu_ps(qt + v * qstride + d * LANES);
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m256 kc = _mm256_broadcast_ss(k + c * dh + d);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[v * NC + c] = _mm256_fmadd_ps(qd[v], kc, acc[v * NC + c]);
    }
  }
#pragma GCC unroll 2
  for (int v = 0; v < NV; ++v) {
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(s + v * sstride + c * LANES, acc[v * NC + c]);
  }
}

// accT[v][d][lane] += p[v][c][lane] * v[c][d] over the slots in order for ND dims of dh; a slot
// no lane weighs is not read.
template <int NV, int ND>
NPA_AVX2 void pv_tile(const float* p, int64_t pstride, const float* vals, int64_t cols, int64_t dh,
                      float* acc, int64_t astride) {
  __m256 a[NV * ND];
#pragma GCC unroll 2
  for (int v = 0; v < NV; ++v) {
#pragma GCC unroll 16
    for (int d = 0; d < ND; ++d) a[v * ND + d] = _mm256_loadu_ps(acc + v * astride + d * LANES);
  }
  for (int64_t c = 0; c < cols; ++c) {
    __m256 pc[NV];
    __m256 any = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      pc[v] = _mm256_loadu_ps(p + v * pstride + c * LANES);
      any = _mm256_or_ps(any, pc[v]);
    }
    const __m256i bits = _mm256_castps_si256(any);
    if (_mm256_testz_si256(bits, bits)) continue;
    const float* vc = vals + c * dh;
#pragma GCC unroll 16
    for (int d = 0; d < ND; ++d) {
      const __m256 vd = _mm256_broadcast_ss(vc + d);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) a[v * ND + d] = _mm256_fmadd_ps(pc[v], vd, a[v * ND + d]);
    }
  }
#pragma GCC unroll 2
  for (int v = 0; v < NV; ++v) {
#pragma GCC unroll 16
    for (int d = 0; d < ND; ++d) _mm256_storeu_ps(acc + v * astride + d * LANES, a[v * ND + d]);
  }
}

using DotsTile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
using PvTile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);

template <int NV, int... I>
constexpr std::array<DotsTile, sizeof...(I)> dots_tiles(std::integer_sequence<int, I...>) {
  return {dots_tile<NV, I + 1>...};
}
template <int NV, int... I>
constexpr std::array<PvTile, sizeof...(I)> pv_tiles(std::integer_sequence<int, I...>) {
  return {pv_tile<NV, I + 1>...};
}

// one vector of rows: 12 slots (dims) per pass; two vectors: 6
constexpr int WIDE[3] = {0, 12, 6};
constexpr auto DOTS1 = dots_tiles<1>(std::make_integer_sequence<int, 12>{});
constexpr auto DOTS2 = dots_tiles<2>(std::make_integer_sequence<int, 6>{});
constexpr auto PV1 = pv_tiles<1>(std::make_integer_sequence<int, 12>{});
constexpr auto PV2 = pv_tiles<2>(std::make_integer_sequence<int, 6>{});

// Rows in groups of up to two vectors (16 rows) sharing a span of slots: scores block by block
// of BLOCK_COLS slots (the block's K rows in L1 for every group), the mask and softmax per
// vector, P.V block by block, then each lane's row divided by its sum.
}  // namespace

NPA_AVX2 void run_task_avx2(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  const Rows rows(j, t);
  const int64_t dh = j.dh, n = rows.n, nv = (n + LANES - 1) / LANES;
  const HeadCache cache(j, rows);
  const float *kh = cache.k, *vh = cache.v;
  const uint16_t *kh16 = cache.k16, *vh16 = cache.v16;
  const auto [tlo, thi] = rows.span(0, n, j.a);
  if (tlo >= thi) {  // nothing shown: zero rows
    for (int64_t i = 0; i < n; ++i) std::fill(rows.y(j, i), rows.y(j, i) + dh, 0.0f);
    return;
  }
  if (run_few_rows_avx2(j, rows, tlo, thi)) return;  // a decode step's few rows
  std::vector<float> block(static_cast<size_t>(BLOCK_COLS * dh));
  const int64_t width = thi - tlo, vq = dh * LANES, vs = width * LANES;
  std::vector<float> qt(static_cast<size_t>(nv * vq), 0.0f), acc(qt.size(), 0.0f);
  std::vector<float> scores(static_cast<size_t>(nv * vs));
  for (int64_t i = 0; i < n; ++i) {
    const float* q = rows.q(j, i);
    for (int64_t d = 0; d < dh; ++d) qt[(i / LANES) * vq + d * LANES + i % LANES] = q[d];
  }
  struct Group {
    int64_t v0, nvec, lo, hi;
  };
  std::vector<Group> groups;
  for (int64_t v0 = 0; v0 < nv; v0 += 2) {
    const int64_t nvec = std::min<int64_t>(2, nv - v0);
    const auto [lo, hi] = rows.span(v0 * LANES, (v0 + nvec) * LANES, j.a);
    if (lo < hi) groups.push_back({v0, nvec, lo, hi});
  }

  for (int64_t c0 = tlo; c0 < thi; c0 += BLOCK_COLS) {
    const int64_t c1 = std::min(thi, c0 + BLOCK_COLS);
    const float* kb = block_rows(kh, kh16, c0, c1, dh, block.data());
    for (const Group& g : groups) {
      const int64_t lo = std::max(c0, g.lo), hi = std::min(c1, g.hi), wide = WIDE[g.nvec];
      for (int64_t c = lo; c < hi; c += wide) {
        const int64_t nc = std::min(wide, hi - c);
        const auto& tiles = g.nvec == 2 ? DOTS2.data() : DOTS1.data();
        tiles[nc - 1](qt.data() + g.v0 * vq, vq, kb + (c - c0) * dh, dh,
                      scores.data() + g.v0 * vs + (c - tlo) * LANES, vs);
      }
    }
  }

  std::vector<float> sums(static_cast<size_t>(nv * LANES), 0.0f);
  const __m256 hidden = _mm256_set1_ps(j.hidden), neg_inf = _mm256_set1_ps(NEG_INF);
  for (const Group& g : groups) {
    for (int64_t v = g.v0; v < g.v0 + g.nvec; ++v) {
      // the lanes' mask rows: up to four runs of lanes sharing one (broadcasts and blends),
      // else a gather
      const int64_t first = v * LANES, last = std::min(n, first + LANES) - 1;
      const float* run_row[LANES];
      __m256 run_lanes[LANES];
      int32_t offset[LANES];
      int runs = 0;
      for (int64_t l = 0; l < LANES; ++l) {
        const int64_t i = std::min(first + l, last);  // lanes past the rows: unused copies
        const float* row = rows.mask_row(j, i);
        offset[l] = static_cast<int32_t>(row - rows.mask_row(j, first));
        if (runs == 0 || row != run_row[runs - 1]) {
          run_row[runs] = row;
          run_lanes[runs] = _mm256_setzero_ps();
          ++runs;
        }
        float bits[LANES];
        _mm256_storeu_ps(bits, run_lanes[runs - 1]);
        bits[l] = -0.0f;  // the sign bit selects the lane in a blend
        run_lanes[runs - 1] = _mm256_loadu_ps(bits);
      }
      const __m256i offsets = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset));
      const float* mask = rows.mask_row(j, first);
      float* s = scores.data() + v * vs - tlo * LANES;
      __m256 max = neg_inf;
      for (int64_t c = g.lo; c < g.hi; ++c) {
        __m256 m;
        if (runs <= 4) {
          m = _mm256_broadcast_ss(run_row[0] + c);
          for (int r = 1; r < runs; ++r) {
            m = _mm256_blendv_ps(m, _mm256_broadcast_ss(run_row[r] + c), run_lanes[r]);
          }
        } else {
          m = _mm256_i32gather_ps(mask + c, offsets, 4);
        }
        const __m256 x = _mm256_blendv_ps(_mm256_add_ps(_mm256_loadu_ps(s + c * LANES), m),
                                          neg_inf, _mm256_cmp_ps(m, hidden, _CMP_LE_OQ));
        _mm256_storeu_ps(s + c * LANES, x);
        max = _mm256_max_ps(max, x);
      }
      // a lane whose every slot is hidden gets no weights (zeros, sum 0) instead of NaNs
      max = _mm256_blendv_ps(max, _mm256_setzero_ps(), _mm256_cmp_ps(max, neg_inf, _CMP_EQ_OQ));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = g.lo; c < g.hi; ++c) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + c * LANES), max));
        _mm256_storeu_ps(s + c * LANES, e);
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_storeu_ps(sums.data() + v * LANES, sum);
    }
  }

  for (int64_t c0 = tlo; c0 < thi; c0 += BLOCK_COLS) {
    const int64_t c1 = std::min(thi, c0 + BLOCK_COLS);
    const float* vb = nullptr;
    for (const Group& g : groups) {
      const int64_t lo = std::max(c0, g.lo), hi = std::min(c1, g.hi), wide = WIDE[g.nvec];
      if (lo >= hi) continue;
      if (vb == nullptr) vb = block_rows(vh, vh16, c0, c1, dh, block.data());
      const float* p = scores.data() + g.v0 * vs + (lo - tlo) * LANES;
      for (int64_t d = 0; d < dh; d += wide) {
        const int64_t nd = std::min(wide, dh - d);
        const auto& tiles = g.nvec == 2 ? PV2.data() : PV1.data();
        tiles[nd - 1](p, vs, vb + (lo - c0) * dh + d, hi - lo, dh,
                      acc.data() + g.v0 * vq + d * LANES, vq);
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const float si = sums[i];
    const float* a = acc.data() + (i / LANES) * vq + i % LANES;
    float* out = rows.y(j, i);
    for (int64_t d = 0; d < dh; ++d) out[d] = si == 0.0f ? 0.0f : a[d * LANES] / si;
  }
}

}  // namespace npuchat_attention
