// The ONNX Runtime custom op `npuchat.RopeAttention`: one layer's attention from its fused
// Q|K|V rows to the rows the output projection reads, in one op instead of seventeen (Gather,
// Split, the Reshape/Transpose pairs, two RotaryEmbedding, two ScatterND, Attention and the way
// back). A small model's decode step is bound by per-op costs, not by arithmetic.
//
//   inputs:  qkv float32 [R, (H + 2 Hkv) dh]; cos, sin float32 [B, S, dh / 2] (non-interleaved
//            rotary over the whole head); slots int64 [B, Hkv, S, 3] (ScatterND indices of the
//            new K/V rows); past_k, past_v float32 [B, Hkv, C, dh]; mask float32 [B, 1, S, A];
//            optional row_tokens int64 [B S] (the qkv row of each token position; absent:
//            position p is row p) and token_rows int64 [N] (the positions the output keeps;
//            absent: all B S)
//   attrs:   num_heads H, kv_heads Hkv; hidden as `npuchat.Attention`'s
//   outputs: y float32 [N, H dh]; present_k, present_v: the cache with the new rows written
//            (bound to the past buffers by the host: written in place, else copied first)
//
// The numbers are those of the ops it replaces: rotary as ONNX Runtime's MLAS kernel computes
// it (x1 cos - x2 sin and x1 sin + x2 cos, each as one fused multiply-add over a rounded
// product), rows scattered in ScatterND's order, and `npuchat.Attention`'s own tasks over the
// same Q layout, so a row's result is the same at any row count (verify = decode).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "attention.h"

namespace {

using namespace npuchat_attention;

using RopeFn = void (*)(const float* x, const float* cs, const float* sn, int64_t half, float* out);

// out = x rotated by the position's angles: halves (x1, x2) -> (x1 c - x2 s, x1 s + x2 c).
__attribute__((always_inline)) inline void rope_body(const float* x, const float* cs,
                                                     const float* sn, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float re = x[i], im = x[i + half];
    const float im_s = im * sn[i], im_c = im * cs[i];
    out[i] = std::fma(re, cs[i], -im_s);
    out[i + half] = std::fma(re, sn[i], im_c);
  }
}
__attribute__((target("avx2,fma"))) void rope_fma(const float* x, const float* cs,
                                                  const float* sn, int64_t half, float* out) {
  rope_body(x, cs, sn, half, out);
}
void rope_portable(const float* x, const float* cs, const float* sn, int64_t half, float* out) {
  rope_body(x, cs, sn, half, out);  // std::fma in software: the same bits, slower
}
RopeFn chosen_rope() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("fma") ? &rope_fma : &rope_portable;
}

OrtStatusPtr error(const std::string& msg) {
  return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, ("npuchat.RopeAttention: " + msg).c_str());
}

Ort::ConstValue optional(const Ort::KernelContext& ctx, size_t i) {
  return i < ctx.GetInputCount() ? ctx.GetInput(i) : Ort::ConstValue{nullptr};
}

size_t count(const Ort::ConstValue& v) {
  return v == nullptr ? 0 : v.GetTensorTypeAndShapeInfo().GetElementCount();
}

// An optional int64 input's values, each checked to lie in [0, limit) (`bad` set if one does not).
const int64_t* indices(const Ort::ConstValue& v, int64_t limit, bool* bad) {
  if (v == nullptr) return nullptr;
  const int64_t* p = v.GetTensorData<int64_t>();
  for (size_t i = 0; !*bad && i < count(v); ++i) *bad = p[i] < 0 || p[i] >= limit;
  return p;
}

struct RopeAttentionKernel {
  int64_t h = 0, hkv = 0;
  float hidden = NEG_INF;
  RopeFn rope = chosen_rope();

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      return compute(context);
    } catch (const std::exception& e) {
      return error(e.what());
    }
  }

  OrtStatusPtr compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue qkv = ctx.GetInput(0), cos = ctx.GetInput(1), sin = ctx.GetInput(2);
    const Ort::ConstValue slots = ctx.GetInput(3), pk = ctx.GetInput(4), pv = ctx.GetInput(5);
    const Ort::ConstValue mask = ctx.GetInput(6);
    const Ort::ConstValue row_tokens = optional(ctx, 7), token_rows = optional(ctx, 8);
    const auto xs = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const auto cs = cos.GetTensorTypeAndShapeInfo().GetShape();
    const auto ks = pk.GetTensorTypeAndShapeInfo().GetShape();
    const auto ms = mask.GetTensorTypeAndShapeInfo().GetShape();
    if (xs.size() != 2 || cs.size() != 3 || ks.size() != 4 || ms.size() != 4) {
      return error("qkv must be 2-D, cos/sin 3-D, the caches and mask 4-D");
    }
    const int64_t b = cs[0], s = cs[1], half = cs[2], c = ks[2], dh = ks[3], a = ms[3];
    const int64_t width = (h + 2 * hkv) * dh, positions = b * s;
    if (ks[0] != b || ks[1] != hkv || 2 * half != dh || xs[1] != width ||
        pv.GetTensorTypeAndShapeInfo().GetShape() != ks ||
        sin.GetTensorTypeAndShapeInfo().GetShape() != cs || ms[0] != b || ms[1] != 1 ||
        ms[2] != s || a > c) {
      return error("inconsistent shapes (qkv [R, (H + 2 Hkv) dh], cos/sin [B, S, dh / 2], "
                   "caches [B, Hkv, C, dh], mask [B, 1, S, A <= C])");
    }
    bool bad = row_tokens != nullptr && count(row_tokens) != static_cast<size_t>(positions);
    const int64_t* rt = indices(row_tokens, xs[0], &bad);
    const int64_t* tr = indices(token_rows, positions, &bad);
    if (bad || (rt == nullptr && xs[0] != positions)) {
      return error("row_tokens / token_rows out of range, or qkv rows != B S without row_tokens");
    }
    const int64_t* sl = slots.GetTensorData<int64_t>();
    if (slots.GetTensorTypeAndShapeInfo().GetShape() != std::vector<int64_t>{b, hkv, s, 3}) {
      return error("slots must be [B, Hkv, S, 3]");
    }
    for (int64_t i = 0; i < b * hkv * s; ++i) {
      const int64_t* t = sl + 3 * i;
      if (t[0] < 0 || t[0] >= b || t[1] < 0 || t[1] >= hkv || t[2] < 0 || t[2] >= c) {
        return error("a K/V slot index lies outside the cache");
      }
    }
    const int64_t n_out = tr != nullptr ? static_cast<int64_t>(count(token_rows)) : positions;
    float* y = ctx.GetOutput(0, {n_out, h * dh}).GetTensorMutableData<float>();
    float* k = ctx.GetOutput(1, ks).GetTensorMutableData<float>();
    float* v = ctx.GetOutput(2, ks).GetTensorMutableData<float>();
    const size_t cache = static_cast<size_t>(b * hkv * c * dh) * sizeof(float);
    if (k != pk.GetTensorData<float>()) std::memcpy(k, pk.GetTensorData<float>(), cache);
    if (v != pv.GetTensorData<float>()) std::memcpy(v, pv.GetTensorData<float>(), cache);
    if (positions == 0 || dh == 0) return nullptr;

    // Q rotated into Attention's layout [B, Hkv, G S, dh] (head hk * G + g, token s: row g S + s)
    const int64_t g = h / hkv, rows = g * s;
    const float* x = qkv.GetTensorData<float>();
    const float *cos_p = cos.GetTensorData<float>(), *sin_p = sin.GetTensorData<float>();
    std::vector<float> q(static_cast<size_t>(b * h * s * dh)), att(q.size());
    for (int64_t p = 0; p < positions; ++p) {
      const float* row = x + (rt != nullptr ? rt[p] : p) * width;
      const int64_t bi = p / s, si = p % s;
      for (int64_t hi = 0; hi < h; ++hi) {
        float* dst = q.data() + ((bi * hkv + hi / g) * rows + hi % g * s + si) * dh;
        rope(row + hi * dh, cos_p + p * half, sin_p + p * half, half, dst);
      }
    }
    // New K (rotated) and V rows into their slots, in ScatterND's order
    for (int64_t i = 0; i < b * hkv * s; ++i) {
      const int64_t bi = i / (hkv * s), hk = i / s % hkv, p = bi * s + i % s;
      const float* row = x + (rt != nullptr ? rt[p] : p) * width;
      const int64_t* t = sl + 3 * i;
      const int64_t at = ((t[0] * hkv + t[1]) * c + t[2]) * dh;
      rope(row + (h + hk) * dh, cos_p + p * half, sin_p + p * half, half, k + at);
      std::memcpy(v + at, row + (h + hkv + hk) * dh, static_cast<size_t>(dh) * sizeof(float));
    }
    if (a == 0) {
      std::fill(y, y + n_out * h * dh, 0.0f);
      return nullptr;
    }
    const int64_t row_tasks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    Job job{q.data(), k, v, mask.GetTensorData<float>(), att.data(), hidden,
            hkv, rows, s, c, a, dh, row_tasks};
    const size_t tasks = static_cast<size_t>(b * hkv * row_tasks);
    if (tasks == 1) {
      attention_task()(&job, 0);
    } else {
      ctx.ParallelFor(attention_task(), tasks, 0, &job);
    }
    // Back to token-major rows [position, head * dh], the positions token_rows keeps
    for (int64_t o = 0; o < n_out; ++o) {
      const int64_t p = tr != nullptr ? tr[o] : o, bi = p / s, si = p % s;
      for (int64_t hi = 0; hi < h; ++hi) {
        const float* src = att.data() + ((bi * hkv + hi / g) * rows + hi % g * s + si) * dh;
        std::memcpy(y + (o * h + hi) * dh, src, static_cast<size_t>(dh) * sizeof(float));
      }
    }
    return nullptr;
  }
};

struct RopeAttentionOp : Ort::CustomOpBase<RopeAttentionOp, RopeAttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* kn = new RopeAttentionKernel();
    OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "num_heads", &kn->h);
    if (st == nullptr) st = api.KernelInfoGetAttribute_int64(info, "kv_heads", &kn->hkv);
    if (st != nullptr) {
      delete kn;
      return st;
    }
    if (kn->h <= 0 || kn->hkv <= 0 || kn->h % kn->hkv != 0) {
      delete kn;
      return error("num_heads must be a positive multiple of kv_heads");
    }
    float hidden = 0.0f;
    OrtStatus* absent = api.KernelInfoGetAttribute_float(info, "hidden", &hidden);
    if (absent != nullptr) {
      api.ReleaseStatus(absent);  // not given: only -inf hides a slot
    } else if (std::isnan(hidden)) {
      delete kn;
      return error("hidden must be a number");
    } else {
      kn->hidden = hidden;
    }
    *kernel = kn;
    return nullptr;
  }
  const char* GetName() const { return "RopeAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 9; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 3 || i >= 7 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

// The op for the library's registration entry point (kernels_entry.cc).
const OrtCustomOp* npuchat_rope_attention_op() {
  static RopeAttentionOp op;
  return &op;
}
