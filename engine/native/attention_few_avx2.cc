// The AVX2 + FMA rows of `npuchat.Attention` for a task of few query rows (a decode step's G
// query heads of one KV head, G <= 4: SmolLM2's 3, Gemma 3's 4), where run_task_avx2's eight
// lanes of rows would leave most lanes idle (3 of 8 for SmolLM2: its attention was a fifth of
// a decode step). Here the lanes hold slots for Q.K (each block of K rows transposed as it
// is widened into L1) and head dims for P.V (V rows are read as they lie), so every lane works.
//
// Each number is computed by the same operations in the same order as run_task_avx2 computes
// it (attention_avx2.cc): a score is fma(q[d], k[d], acc) over d in order from 0; the mask is
// added, or the slot hidden, per score; the softmax's max over the row's span, exp_neg of each
// score minus it, the sum added in slot order from 0; P.V is fma(p, v, acc) over the slots in
// order; each output divided by the sum. So a row's bits are the same whichever path runs it
// (decode steps equal verify steps; tests/test_attention_op.py holds the two to each other).
#include <immintrin.h>

#include "attention.h"
#include "attention_x86.h"

namespace npuchat_attention {
namespace {

constexpr int SLOT_VECS = BLOCK_COLS / LANES;  // slot vectors per block of K rows
static_assert(BLOCK_COLS % LANES == 0, "a block of K rows is whole vectors of slots");

// Eight dims of eight slots' rows (f32 or f16, `stride` elements apart; past `rows`: zeros) as
// floats, transposed: out[d] holds dim d of the eight slots.
NPA_AVX2 void load_transposed(const float* f32, const uint16_t* f16, int64_t stride, int rows,
                              __m256 out[LANES]) {
  __m256 r[LANES];
  for (int i = 0; i < LANES; ++i) {
    if (i >= rows) {
      r[i] = _mm256_setzero_ps();
    } else if (f16 != nullptr) {
      r[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f16 + i * stride)));
    } else {
      r[i] = _mm256_loadu_ps(f32 + i * stride);
    }
  }
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  out[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  out[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  out[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  out[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  out[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  out[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  out[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  out[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Slots [c0, c1) of one head's K rows (c1 - c0 <= BLOCK_COLS) into kt[d * BLOCK_COLS + slot]:
// dim-major, zeros past c1.
NPA_AVX2 void transposed_block(const float* f32, const uint16_t* f16, int64_t c0, int64_t c1,
                               int64_t dh, float* kt) {
  for (int64_t s0 = 0; s0 < BLOCK_COLS; s0 += LANES) {
    const int rows = static_cast<int>(std::clamp<int64_t>(c1 - c0 - s0, 0, LANES));
    const int64_t at = (c0 + s0) * dh;
    for (int64_t d0 = 0; d0 < dh; d0 += LANES) {
      __m256 t[LANES];
      load_transposed(f32 != nullptr ? f32 + at + d0 : nullptr,
                      f16 != nullptr ? f16 + at + d0 : nullptr, dh, rows, t);
      for (int i = 0; i < LANES; ++i) _mm256_storeu_ps(kt + (d0 + i) * BLOCK_COLS + s0, t[i]);
    }
  }
}

// scores[i][s] = q_i . k_s for NR rows and NS vectors of slots of a transposed block (from
// slot vector s0): fma over d in order, each q element broadcast once for NS vectors.
template <int NR, int NS>
NPA_AVX2 void few_dots(const float* const* q, const float* kt, int64_t dh, int s0, float* out,
                       int64_t ostride) {
  __m256 acc[NR * NS];
  for (int x = 0; x < NR * NS; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dh; ++d) {
    const float* row = kt + d * BLOCK_COLS + s0 * LANES;
    for (int r = 0; r < NR; ++r) {
      const __m256 qd = _mm256_broadcast_ss(q[r] + d);
      for (int s = 0; s < NS; ++s) {
        acc[r * NS + s] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(row + s * LANES), acc[r * NS + s]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int s = 0; s < NS; ++s) _mm256_storeu_ps(out + r * ostride + s * LANES, acc[r * NS + s]);
  }
}

// acc[i][d0 .. d0 + 8 ND) += p_i[c] * v_c over slots [0, cols) in order, for NR rows, the V
// rows read where they lie (f32, or f16 widened as they are loaded: exactly); a slot no row
// weighs is skipped, as pv_tile skips a slot no lane weighs (so a hidden slot's values, NaN
// too, never reach the output).
template <int NR, int ND>
NPA_AVX2 void few_pv(const float* const* p, const float* v32, const uint16_t* v16, int64_t cols,
                     int64_t dh, int64_t d0, float* const* acc) {
  __m256 a[NR * ND];
  for (int r = 0; r < NR; ++r) {
    for (int d = 0; d < ND; ++d) a[r * ND + d] = _mm256_loadu_ps(acc[r] + d0 + d * LANES);
  }
  for (int64_t c = 0; c < cols; ++c) {
    bool any = false;  // pv_tile's test
    for (int r = 0; r < NR; ++r) any = any || p[r][c] != 0.0f;
    if (!any) continue;
    __m256 pc[NR];
    for (int r = 0; r < NR; ++r) pc[r] = _mm256_broadcast_ss(p[r] + c);
    for (int d = 0; d < ND; ++d) {  // one V vector live at a time: NR * ND + NR + 1 registers
      const int64_t at = c * dh + d0 + d * LANES;
      const __m256 vd =
          v16 != nullptr
              ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v16 + at)))
              : _mm256_loadu_ps(v32 + at);
      for (int r = 0; r < NR; ++r) a[r * ND + d] = _mm256_fmadd_ps(pc[r], vd, a[r * ND + d]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int d = 0; d < ND; ++d) _mm256_storeu_ps(acc[r] + d0 + d * LANES, a[r * ND + d]);
  }
}

// The slot vectors of a Q.K pass and the dim vectors of a P.V pass for NR rows: NR of them
// times these accumulators, plus the NR broadcasts, fit AVX2's 16 registers.
template <int NR>
struct Tiles {
  static constexpr int SLOTS = NR <= 2 ? 6 : NR == 3 ? 3 : 2;  // divides SLOT_VECS
  static constexpr int DIMS = NR == 1 ? 8 : NR == 4 ? 2 : 4;   // divides dh / 8 (dh % 64 == 0)
};

template <int NR>
NPA_AVX2 void few_rows(const Job& j, const Rows& rows, int64_t tlo, int64_t thi) {
  const int64_t dh = j.dh, width = thi - tlo;
  const HeadCache cache(j, rows);
  const float *kh = cache.k, *vh = cache.v;
  const uint16_t *kh16 = cache.k16, *vh16 = cache.v16;
  // scores, then weights, per row over the span, padded to whole blocks of slots
  const int64_t padded = (width + BLOCK_COLS - 1) / BLOCK_COLS * BLOCK_COLS;
  std::vector<float> scores(static_cast<size_t>(NR * padded));
  std::vector<float> block(static_cast<size_t>(BLOCK_COLS * dh));
  std::vector<float> acc(static_cast<size_t>(NR * dh), 0.0f);
  const float* q[NR];
  float* s[NR];
  float* a[NR];
  for (int r = 0; r < NR; ++r) {
    q[r] = rows.q(j, r);
    s[r] = scores.data() + r * padded;
    a[r] = acc.data() + r * dh;
  }
  constexpr int NS = Tiles<NR>::SLOTS, ND = Tiles<NR>::DIMS;
  for (int64_t c0 = tlo; c0 < thi; c0 += BLOCK_COLS) {
    transposed_block(kh, kh16, c0, std::min(thi, c0 + BLOCK_COLS), dh, block.data());
    for (int v = 0; v < SLOT_VECS; v += NS) {
      few_dots<NR, NS>(q, block.data(), dh, v, scores.data() + (c0 - tlo) + v * LANES, padded);
    }
  }
  // mask, max, exp and sum per row, as run_task_avx2's lanes do them
  const __m256 hidden = _mm256_set1_ps(j.hidden), neg_inf = _mm256_set1_ps(NEG_INF);
  float sums[NR];
  for (int r = 0; r < NR; ++r) {
    const float* mask = rows.mask_row(j, r) + tlo;
    float* x = s[r];
    __m256 max8 = neg_inf;
    int64_t c = 0;
    for (; c + LANES <= width; c += LANES) {
      const __m256 m = _mm256_loadu_ps(mask + c);
      const __m256 v = _mm256_blendv_ps(_mm256_add_ps(_mm256_loadu_ps(x + c), m), neg_inf,
                                        _mm256_cmp_ps(m, hidden, _CMP_LE_OQ));
      _mm256_storeu_ps(x + c, v);
      max8 = _mm256_max_ps(max8, v);
    }
    float lanes[LANES];
    _mm256_storeu_ps(lanes, max8);
    float max = NEG_INF;
    for (float l : lanes) max = std::max(max, l);
    for (; c < width; ++c) {  // the same add, or -inf, one slot at a time
      x[c] = mask[c] <= j.hidden ? NEG_INF : x[c] + mask[c];
      max = std::max(max, x[c]);
    }
    if (max == NEG_INF) max = 0.0f;  // every slot hidden: weights 0, sum 0
    const __m256 m8 = _mm256_set1_ps(max);
    for (c = 0; c < width; c += LANES) {  // the padding past the span is computed, not used
      _mm256_storeu_ps(x + c, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + c), m8)));
    }
    float sum = 0.0f;
    for (c = 0; c < width; ++c) sum += x[c];
    sums[r] = sum;
  }
  const float* p[NR];
  for (int r = 0; r < NR; ++r) p[r] = s[r];
  const float* v32 = vh != nullptr ? vh + tlo * dh : nullptr;
  const uint16_t* v16 = vh16 != nullptr ? vh16 + tlo * dh : nullptr;
  for (int64_t d0 = 0; d0 < dh; d0 += ND * LANES) few_pv<NR, ND>(p, v32, v16, width, dh, d0, a);
  for (int r = 0; r < NR; ++r) {
    float* out = rows.y(j, r);
    for (int64_t d = 0; d < dh; ++d) out[d] = sums[r] == 0.0f ? 0.0f : a[r][d] / sums[r];
  }
}

}  // namespace

NPA_AVX2 bool run_few_rows_avx2(const Job& j, const Rows& rows, int64_t tlo, int64_t thi) {
  if (j.dh % 64 != 0 || rows.n > 4 || rows.n < 1) return false;
  switch (rows.n) {
    case 1: few_rows<1>(j, rows, tlo, thi); break;
    case 2: few_rows<2>(j, rows, tlo, thi); break;
    case 3: few_rows<3>(j, rows, tlo, thi); break;
    default: few_rows<4>(j, rows, tlo, thi); break;
  }
  return true;
}

}  // namespace npuchat_attention
