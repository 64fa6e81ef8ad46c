// The ONNX Runtime custom op `npuchat.Attention`: softmax(Q K^T + mask) V over the first A slots
// of a float32 K/V cache, read in place (no Slice copy, no packing of K or V).
//
//   inputs:  q float32 [B, Hkv, G*S, dh] (row g*S + s: query head g of the KV head, token s;
//            1/sqrt(dh) already applied); k, v float32 [B, Hkv, C, dh] (the cache);
//            mask float32 [B, 1, S, A], additive, A <= C: the slots the step attends
//   attrs:   hidden (optional, -inf): a mask value at or below it hides its slot: probability
//            exactly 0, and the slot's K and V are not read (the host's "ignore" value)
//   output:  float32 [B, Hkv, G*S, dh]
//
// Each query row is computed by the same code whatever the number of rows, the batch or A:
// scores one column at a time (a dot over dh), the max and the sum of the exponentials in
// eight lanes by column index, and P.V in column order, where a column of probability exactly
// zero (one the mask hides) is skipped. Columns a wider A adds are hidden ones, so a row's result
// is the same bit for bit at any A that covers it (verify steps equal decode steps).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int64_t LANES = 8;
constexpr int64_t ROWS_PER_TASK = 8;   // query rows of one KV head per task
constexpr int64_t BLOCK_COLS = 64;     // cache slots whose K or V rows stay in L1 for a row group

// The per-ISA pieces: scores of one row against a block of K rows, x = exp(x - max) in place
// returning the sum, over
// a multiple of LANES (each lane j over the columns j, j + 8, ...), and acc += p * v for a block of V rows (columns with p == 0 skipped).
struct AttnKernels {
  void (*scores)(const float* q, const float* k, int64_t cols, int64_t dh, const float* mask,
                 float* out);
  float (*softmax)(float* x, int64_t n);
  void (*accumulate)(float* acc, const float* p, const float* v, int64_t cols, int64_t dh);
  const char* isa;
};

// ---- portable ----
void scores_scalar(const float* q, const float* k, int64_t cols, int64_t dh, const float* mask,
                   float* out) {
  for (int64_t c = 0; c < cols; ++c) {
    const float* kc = k + c * dh;
    float s = 0.0f;
    for (int64_t d = 0; d < dh; ++d) s += q[d] * kc[d];
    out[c] = s + mask[c];
  }
}

const float NEG_INF = -std::numeric_limits<float>::infinity();

// A row whose every slot is hidden gets no weights (zeros, sum 0) instead of NaNs.
float softmax_scalar(float* x, int64_t n) {
  float lane[LANES];
  std::fill(lane, lane + LANES, NEG_INF);
  for (int64_t c = 0; c < n; ++c) lane[c % LANES] = std::max(lane[c % LANES], x[c]);
  const float max = *std::max_element(lane, lane + LANES);
  if (max == NEG_INF) {
    std::fill(x, x + n, 0.0f);
    return 0.0f;
  }
  std::fill(lane, lane + LANES, 0.0f);
  for (int64_t c = 0; c < n; ++c) {
    x[c] = std::exp(x[c] - max);
    lane[c % LANES] += x[c];
  }
  float sum = 0.0f;
  for (float l : lane) sum += l;
  return sum;
}

void accumulate_scalar(float* acc, const float* p, const float* v, int64_t cols, int64_t dh) {
  for (int64_t c = 0; c < cols; ++c) {
    if (p[c] == 0.0f) continue;
    const float* vc = v + c * dh;
    for (int64_t d = 0; d < dh; ++d) acc[d] += p[c] * vc[d];
  }
}

const AttnKernels SCALAR{scores_scalar, softmax_scalar, accumulate_scalar, "scalar"};

// ---- AVX2 + FMA ----
#define NPA_AVX2 __attribute__((target("avx2,fma")))

// The lane sums of eight accumulators as one vector (column i's in lane i), each the same tree
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) whatever its position.
NPA_AVX2 inline __m256 hsum8(const __m256* acc) {
  const __m256 t01 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 t45 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 lo = _mm256_permute2f128_ps(t01, t45, 0x20);  // lanes 0-3 of every column
  const __m256 hi = _mm256_permute2f128_ps(t01, t45, 0x31);  // lanes 4-7
  return _mm256_add_ps(lo, hi);
}

// Scores of eight columns at a time:
// each column's dot runs in eight lanes over dh's body in order, then the tree, then the tail.
NPA_AVX2 void scores_avx2(const float* q, const float* k, int64_t cols, int64_t dh,
                          const float* mask, float* out) {
  const int64_t body = dh / LANES * LANES;
  for (int64_t c = 0; c < cols; c += LANES) {
    const int64_t n = std::min(LANES, cols - c);
    const float* kp[LANES];  // a short last group repeats its last column (results unused)
    for (int64_t i = 0; i < LANES; ++i) kp[i] = k + (c + std::min(i, n - 1)) * dh;
    __m256 acc[LANES];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < body; d += LANES) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int64_t i = 0; i < LANES; ++i) {
        acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kp[i] + d), acc[i]);
      }
    }
    const __m256 sums8 = hsum8(acc);
    if (n == LANES && body == dh) {
      _mm256_storeu_ps(out + c, _mm256_add_ps(sums8, _mm256_loadu_ps(mask + c)));
      continue;
    }
    float sums[LANES];
    _mm256_storeu_ps(sums, sums8);
    for (int64_t i = 0; i < n; ++i) {
      const float* kc = k + (c + i) * dh;
      float s = sums[i];
      for (int64_t d = body; d < dh; ++d) s = std::fma(q[d], kc[d], s);
      out[c + i] = s + mask[c + i];
    }
  }
}

// exp(x) for x <= 0 (the softmax's shifted scores): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// a degree-6 polynomial (relative error ~2e-7); below -87.3 (or -inf) exactly 0.
NPA_AVX2 inline __m256 exp_neg(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

NPA_AVX2 float softmax_avx2(float* x, int64_t n) {
  __m256 lanes = _mm256_set1_ps(NEG_INF);
  for (int64_t i = 0; i < n; i += LANES) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(x + i));
  float lane[LANES];
  _mm256_storeu_ps(lane, lanes);
  const float max = *std::max_element(lane, lane + LANES);
  if (max == NEG_INF) {
    std::fill(x, x + n, 0.0f);
    return 0.0f;
  }
  const __m256 m = _mm256_set1_ps(max);
  __m256 sums = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += LANES) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    sums = _mm256_add_ps(sums, e);
  }
  _mm256_storeu_ps(lane, sums);
  float sum = 0.0f;
  for (float l : lane) sum += l;
  return sum;
}

// acc[0, 8 * NR) += p[c] * v[c][0, 8 * NR) over the columns, held in registers meanwhile.
template <int NR>
NPA_AVX2 void accumulate_lanes(float* acc, const float* p, const float* v, int64_t cols,
                               int64_t dh) {
  __m256 a[NR];
  for (int i = 0; i < NR; ++i) a[i] = _mm256_loadu_ps(acc + i * LANES);
  for (int64_t c = 0; c < cols; ++c) {
    if (p[c] == 0.0f) continue;
    const __m256 pc = _mm256_set1_ps(p[c]);
    const float* vc = v + c * dh;
    for (int i = 0; i < NR; ++i) a[i] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vc + i * LANES), a[i]);
  }
  for (int i = 0; i < NR; ++i) _mm256_storeu_ps(acc + i * LANES, a[i]);
}

NPA_AVX2 void accumulate_avx2(float* acc, const float* p, const float* v, int64_t cols,
                              int64_t dh) {
  using Lanes = void (*)(float*, const float*, const float*, int64_t, int64_t);
  static constexpr Lanes BY_WIDTH[8] = {
      nullptr,             accumulate_lanes<1>, accumulate_lanes<2>, accumulate_lanes<3>,
      accumulate_lanes<4>, accumulate_lanes<5>, accumulate_lanes<6>, accumulate_lanes<7>};
  const int64_t body = dh / LANES * LANES;
  int64_t d = 0;
  for (; d + 8 * LANES <= body; d += 8 * LANES) accumulate_lanes<8>(acc + d, p, v + d, cols, dh);
  if (d < body) BY_WIDTH[(body - d) / LANES](acc + d, p, v + d, cols, dh);
  for (int64_t c = 0; c < cols && body < dh; ++c) {
    if (p[c] == 0.0f) continue;
    for (int64_t t = body; t < dh; ++t) acc[t] = std::fma(p[c], v[c * dh + t], acc[t]);
  }
}

const AttnKernels AVX2{scores_avx2, softmax_avx2, accumulate_avx2, "avx2"};

const AttnKernels& chosen() {
  static const AttnKernels* k = [] {
    const char* force = std::getenv("NPUCHAT_KERNEL_ISA");
    if (force != nullptr && std::string(force) == "scalar") return &SCALAR;
    __builtin_cpu_init();
    const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return ok ? &AVX2 : &SCALAR;
  }();
  return *k;
}

struct Job {
  const AttnKernels* kern;
  const float *q, *k, *v, *mask;
  float* y;
  float hidden;
  int64_t hkv, rows, s, c, a, dh, row_tasks;
};

// Rows [r0, r1) of one (batch, KV head): their scores over A slots in blocks of BLOCK_COLS (the
// block's K rows shared by the row group), softmax per row, then P.V block by block.
void run_task(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t bh = static_cast<int64_t>(t) / j.row_tasks;
  const int64_t r0 = (static_cast<int64_t>(t) % j.row_tasks) * ROWS_PER_TASK;
  const int64_t r1 = std::min(j.rows, r0 + ROWS_PER_TASK);
  const int64_t b = bh / j.hkv;
  const int64_t padded = (j.a + LANES - 1) / LANES * LANES;
  const float* kh = j.k + bh * j.c * j.dh;
  const float* vh = j.v + bh * j.c * j.dh;
  std::vector<float> scores(static_cast<size_t>((r1 - r0) * padded));
  for (int64_t c0 = 0; c0 < j.a; c0 += BLOCK_COLS) {
    const int64_t cols = std::min(BLOCK_COLS, j.a - c0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* mask = j.mask + (b * j.s + r % j.s) * j.a + c0;
      float* out = scores.data() + (r - r0) * padded + c0;
      // only the block's span from its first to its last visible slot is scored
      int64_t lo = 0, hi = cols;
      while (lo < cols && mask[lo] <= j.hidden) ++lo;
      while (hi > lo && mask[hi - 1] <= j.hidden) --hi;
      std::fill(out, out + cols, NEG_INF);
      if (lo == hi) continue;
      j.kern->scores(j.q + (bh * j.rows + r) * j.dh, kh + (c0 + lo) * j.dh, hi - lo, j.dh,
                     mask + lo, out + lo);
      for (int64_t c = lo; c < hi; ++c) {
        if (mask[c] <= j.hidden) out[c] = NEG_INF;
      }
    }
  }
  std::vector<float> sums(static_cast<size_t>(r1 - r0));
  for (int64_t r = r0; r < r1; ++r) {
    float* row = scores.data() + (r - r0) * padded;
    std::fill(row + j.a, row + padded, NEG_INF);
    sums[r - r0] = j.kern->softmax(row, padded);
  }
  float* out = j.y + (bh * j.rows + r0) * j.dh;
  std::fill(out, out + (r1 - r0) * j.dh, 0.0f);
  for (int64_t c0 = 0; c0 < j.a; c0 += BLOCK_COLS) {
    const int64_t cols = std::min(BLOCK_COLS, j.a - c0);
    for (int64_t r = r0; r < r1; ++r) {
      j.kern->accumulate(out + (r - r0) * j.dh, scores.data() + (r - r0) * padded + c0,
                         vh + c0 * j.dh, cols, j.dh);
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    if (sums[r - r0] == 0.0f) continue;  // every slot hidden: the zero row stays
    float* o = out + (r - r0) * j.dh;
    for (int64_t d = 0; d < j.dh; ++d) o[d] /= sums[r - r0];
  }
}

OrtStatusPtr error(OrtErrorCode code, const std::string& msg) {
  return Ort::GetApi().CreateStatus(code, ("npuchat.Attention: " + msg).c_str());
}

std::string dims(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

struct AttentionKernel {
  float hidden = NEG_INF;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      return compute(context);
    } catch (const Ort::Exception& e) {
      return error(e.GetOrtErrorCode(), e.what());
    } catch (const std::exception& e) {
      return error(ORT_FAIL, e.what());
    }
  }

  OrtStatusPtr compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2);
    const Ort::ConstValue mask = ctx.GetInput(3);
    const auto qs = q.GetTensorTypeAndShapeInfo().GetShape();
    const auto ks = k.GetTensorTypeAndShapeInfo().GetShape();
    const auto vs = v.GetTensorTypeAndShapeInfo().GetShape();
    const auto ms = mask.GetTensorTypeAndShapeInfo().GetShape();
    if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4 || ms.size() != 4) {
      return error(ORT_INVALID_ARGUMENT, "q, k, v and mask must all be 4-D");
    }
    if (ks != vs) return error(ORT_INVALID_ARGUMENT, "k " + dims(ks) + " and v " + dims(vs) + " differ");
    const int64_t b = qs[0], hkv = qs[1], rows = qs[2], dh = qs[3];
    const int64_t c = ks[2], s = ms[2], a = ms[3];
    if (ks[0] != b || ks[1] != hkv || ks[3] != dh) {
      return error(ORT_INVALID_ARGUMENT, "q " + dims(qs) + " does not fit the cache " + dims(ks));
    }
    if (ms[0] != b || ms[1] != 1 || s <= 0 || rows % s != 0) {
      return error(ORT_INVALID_ARGUMENT,
                   "mask " + dims(ms) + " must be [B, 1, S, A] with q's rows G*S, q " + dims(qs));
    }
    if (a > c) {
      return error(ORT_INVALID_ARGUMENT, "the mask is " + std::to_string(a) +
                                             " slots wide but the cache holds " + std::to_string(c));
    }
    Ort::UnownedValue y = ctx.GetOutput(0, qs);
    if (b * hkv * rows * dh == 0) return nullptr;
    float* out = y.GetTensorMutableData<float>();
    if (a == 0) {  // nothing to attend
      std::fill(out, out + b * hkv * rows * dh, 0.0f);
      return nullptr;
    }
    const int64_t row_tasks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    Job job{&chosen(), q.GetTensorData<float>(), k.GetTensorData<float>(),
            v.GetTensorData<float>(), mask.GetTensorData<float>(), out, hidden, hkv, rows, s, c, a, dh,
            row_tasks};
    const size_t tasks = static_cast<size_t>(b * hkv * row_tasks);
    if (tasks == 1) {
      run_task(&job, 0);
    } else {
      ctx.ParallelFor(run_task, tasks, 0, &job);
    }
    return nullptr;
  }
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* kn = new AttentionKernel();
    float hidden = 0.0f;
    OrtStatus* absent = api.KernelInfoGetAttribute_float(info, "hidden", &hidden);
    if (absent != nullptr) {
      api.ReleaseStatus(absent);  // not given: only -inf hides a slot
    } else if (std::isnan(hidden)) {
      delete kn;
      return error(ORT_INVALID_ARGUMENT, "hidden must be a number");
    } else {
      kn->hidden = hidden;
    }
    *kernel = kn;
    return nullptr;
  }
  const char* GetName() const { return "Attention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

// The op for the library's registration entry point (qmatmul_op.cc).
const OrtCustomOp* npuchat_attention_op() {
  static AttentionOp op;
  return &op;
}
