// The ONNX Runtime custom op `npuchat.Attention`: softmax(Q K^T + mask) V over the first A slots
// of a float32 K/V cache, read in place (no Slice copy, no packing of K or V).
//
//   inputs:  q float32 [B, Hkv, G*S, dh] (row g*S + s: query head g of the KV head, token s;
//            1/sqrt(dh) already applied); k, v float32 [B, Hkv, C, dh] (the cache);
//            mask float32 [B, 1, S, A], additive, A <= C: the slots the step attends
//   attrs:   hidden (optional, -inf): a mask value at or below it hides its slot: probability
//            exactly 0 (the host's "ignore" value); slots outside the span the rows see are
//            never read, and a hidden slot's values (NaN too) never reach the output
//   output:  float32 [B, Hkv, G*S, dh]
//
// Each query row is computed by the same arithmetic whatever the number of rows, the batch or
// A: on AVX2 eight rows ride in the eight lanes of a vector (the G query heads of a token side
// by side: they share its mask row), a score is q . k summed over dh in order, the softmax's
// max and sum and P.V run over the slots in order, and a slot a row does not see adds exact
// zeros. So a row's result is the same bit for bit alone, beside any rows and at any A that
// covers it (verify steps equal decode steps; a decode row beside a prompt's chunk equals it
// alone). Each K and V element a task reads is copied (or, from an f16 cache, widened) into an
// L1 block once, then loaded once per 16 rows (one broadcast against two vectors of rows):
// prefill chunks run as a blocked matrix product, decode steps read K/V once. Slots outside
// the span a task's rows see are not read; neither are blocks of it that every row hides, in
// P.V.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"

namespace npuchat_attention {

// ---- portable: one row at a time ----
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return half_to_float(x); }

template <typename T>
void scalar_rows(const Job& j, const Rows& rows, const T* kh, const T* vh) {
  std::vector<float> p(static_cast<size_t>(j.a));
  for (int64_t i = 0; i < rows.n; ++i) {
    const float* q = rows.q(j, i);
    float* out = rows.y(j, i);
    std::fill(out, out + j.dh, 0.0f);
    const float* mask = rows.mask_row(j, i);
    const int64_t lo = rows.lo[i], hi = rows.hi[i];
    float max = NEG_INF;
    for (int64_t c = lo; c < hi; ++c) {
      float s = 0.0f;
      for (int64_t d = 0; d < j.dh; ++d) s += q[d] * widen(kh[c * j.dh + d]);
      p[c] = mask[c] <= j.hidden ? NEG_INF : s + mask[c];
      max = std::max(max, p[c]);
    }
    if (max == NEG_INF) continue;  // every slot hidden: a zero row
    float sum = 0.0f;
    for (int64_t c = lo; c < hi; ++c) {
      p[c] = std::exp(p[c] - max);
      sum += p[c];
      if (p[c] == 0.0f) continue;
      for (int64_t d = 0; d < j.dh; ++d) out[d] += p[c] * widen(vh[c * j.dh + d]);
    }
    for (int64_t d = 0; d < j.dh; ++d) out[d] /= sum;
  }
}

void run_task_scalar(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  const Rows rows(j, t);
  const int64_t head = rows.bh * j.c * j.dh;
  if (j.k16 != nullptr) {
    scalar_rows(j, rows, j.k16 + head, j.v16 + head);
  } else {
    scalar_rows(j, rows, j.k + head, j.v + head);
  }
}

TaskFn attention_task() {
  static const TaskFn f = [] {
    const char* force = std::getenv("NPUCHAT_KERNEL_ISA");
    if (force != nullptr && std::string(force) == "scalar") return &run_task_scalar;
    __builtin_cpu_init();
    const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
    return ok ? &run_task_avx2 : &run_task_scalar;
  }();
  return f;
}

void run_job(OrtKernelContext* context, Job* job, size_t tasks) {
  if (tasks == 1) {
    attention_task()(job, 0);
  } else {
    Ort::KernelContext(context).ParallelFor(attention_task(), tasks, 0, job);
  }
}

bool read_hidden(const OrtApi& api, const OrtKernelInfo* info, float* hidden) {
  float value = 0.0f;
  OrtStatus* absent = api.KernelInfoGetAttribute_float(info, "hidden", &value);
  if (absent != nullptr) {
    api.ReleaseStatus(absent);  // not given: only -inf hides a slot
    return true;
  }
  if (std::isnan(value)) return false;
  *hidden = value;
  return true;
}

}  // namespace npuchat_attention

namespace {

using namespace npuchat_attention;

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
    Job job{q.GetTensorData<float>(), k.GetTensorData<float>(),
            v.GetTensorData<float>(), mask.GetTensorData<float>(), out, hidden, hkv, rows, s, c, a, dh,
            row_tasks};
    run_job(context, &job, static_cast<size_t>(b * hkv * row_tasks));
    return nullptr;
  }
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* kn = new AttentionKernel();
    if (!read_hidden(api, info, &kn->hidden)) {
      delete kn;
      return error(ORT_INVALID_ARGUMENT, "hidden must be a number");
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

// The op for the library's registration entry point (kernels_entry.cc).
const OrtCustomOp* npuchat_attention_op() {
  static AttentionOp op;
  return &op;
}
