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
//            absent: all B S); optional q_norm, k_norm float32 [dh]: each head's row of Q /
//            K RMS-normed and scaled by them before the rotary (qwen3, gemma3)
//   attrs:   num_heads H, kv_heads Hkv; hidden as `npuchat.Attention`'s; epsilon (the norms')
//   outputs: y float32 [N, H dh]; present_k, present_v: the cache with the new rows written
//            (bound to the past buffers by the host: written in place, else copied first)
//
// `npuchat.RopeAttentionF16` is the same op over a float16 cache (past and present K/V): the
// new rows are rounded to half (nearest even, as a Cast to float16 rounds) as they are written,
// and attention widens each block of cached rows back to float exactly, so it computes what
// the f32 op computes over the cache's half values, half the bytes read per step.
//
// The numbers are those of the ops it replaces: the head norms as ONNX Runtime's
// SimplifiedLayerNormalization computes them on x86 (squares summed by fused multiply-adds in
// eight lanes, the lanes added as (0+4, 1+5, 2+6, 3+7), then pairs, then the two; each value
// times the inverse root, then the weight: found by probing it, `tests/test_rope_attention.py`
// holds it to that), rotary as its MLAS kernel does (x1 cos - x2 sin and x1 sin + x2 cos, each
// one fused multiply-add over a rounded product), rows scattered in ScatterND's order, and
// `npuchat.Attention`'s own tasks over the same Q layout, so a row's result is the same at any
// row count (verify = decode).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "attention.h"

namespace npuchat_attention {  // attention_op.cc
// A job's tasks on the op's threads (one task: on the calling thread).
void run_job(OrtKernelContext* context, Job* job, size_t tasks);
// The `hidden` attribute into *hidden (absent: left as it is); false when it is NaN.
bool read_hidden(const OrtApi& api, const OrtKernelInfo* info, float* hidden);
}  // namespace npuchat_attention

namespace {

using namespace npuchat_attention;

using RopeFn = void (*)(const float* x, const float* cs, const float* sn, int64_t half, float* out);
using NormFn = void (*)(const float* x, const float* w, float eps, int64_t dh, float* out);

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

// out = x / rms(x) * w, in the order of the note at the top (dh a multiple of 8).
__attribute__((always_inline)) inline void norm_body(const float* x, const float* w, float eps,
                                                     int64_t dh, float* out) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < dh; i += 8) {
    for (int l = 0; l < 8; ++l) lane[l] = std::fma(x[i + l], x[i + l], lane[l]);
  }
  float half[4];
  for (int l = 0; l < 4; ++l) half[l] = lane[l] + lane[l + 4];
  const float squares = (half[0] + half[2]) + (half[1] + half[3]);
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dh) + eps);
  for (int64_t i = 0; i < dh; ++i) out[i] = x[i] * inv * w[i];
}
__attribute__((target("avx2,fma"))) void norm_fma(const float* x, const float* w, float eps,
                                                  int64_t dh, float* out) {
  norm_body(x, w, eps, dh, out);
}
void norm_portable(const float* x, const float* w, float eps, int64_t dh, float* out) {
  norm_body(x, w, eps, dh, out);
}
NormFn chosen_norm() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("fma") ? &norm_fma : &norm_portable;
}

// One head's row as the rotary reads it: normed into `tmp` when the layer norms its heads.
const float* head_row(NormFn norm, const float* x, const float* w, float eps, int64_t dh,
                      float* tmp) {
  if (w == nullptr) return x;
  norm(x, w, eps, dh, tmp);
  return tmp;
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

struct RopeAttentionKernel;

constexpr int64_t POSITIONS_PER_TASK = 16;

// Q rows of positions [t * POSITIONS_PER_TASK, ...) normed (when the layer norms its heads),
// rotated and laid out as `npuchat.Attention` reads them; each is independent of the others.
struct QJob {
  const RopeAttentionKernel* kern;
  const float* x;
  const int64_t* rt;
  const float *cos, *sin, *norm;
  float* q;
  int64_t positions, s, g, width, half, dh;
};
void rotate_q(void* data, size_t t);

struct RopeAttentionKernel {
  bool f16 = false;  // a float16 cache (`npuchat.RopeAttentionF16`)
  int64_t h = 0, hkv = 0;
  float hidden = NEG_INF, eps = 0.0f;
  RopeFn rope = chosen_rope();
  NormFn norm = chosen_norm();

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
    const Ort::ConstValue q_norm = optional(ctx, 9), k_norm = optional(ctx, 10);
    const auto xs = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const auto cs = cos.GetTensorTypeAndShapeInfo().GetShape();
    const auto ks = pk.GetTensorTypeAndShapeInfo().GetShape();
    const auto ms = mask.GetTensorTypeAndShapeInfo().GetShape();
    if (xs.size() != 2 || cs.size() != 3 || ks.size() != 4 || ms.size() != 4) {
      return error("qkv must be 2-D, cos/sin 3-D, the caches and mask 4-D");
    }
    const int64_t b = cs[0], s = cs[1], rot = cs[2], c = ks[2], dh = ks[3], a = ms[3];
    const int64_t width = (h + 2 * hkv) * dh, positions = b * s;
    if (ks[0] != b || ks[1] != hkv || 2 * rot != dh || xs[1] != width ||
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
    const bool norms = q_norm != nullptr || k_norm != nullptr;
    if ((q_norm != nullptr && count(q_norm) != static_cast<size_t>(dh)) ||
        (k_norm != nullptr && count(k_norm) != static_cast<size_t>(dh)) || (norms && dh % 8 != 0)) {
      return error("q_norm and k_norm must hold dh values, dh a multiple of 8");
    }
    const float* qn = q_norm != nullptr ? q_norm.GetTensorData<float>() : nullptr;
    const float* kn = k_norm != nullptr ? k_norm.GetTensorData<float>() : nullptr;
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
    void* k = ctx.GetOutput(1, ks).GetTensorMutableRawData();
    void* v = ctx.GetOutput(2, ks).GetTensorMutableRawData();
    const size_t elem = f16 ? sizeof(uint16_t) : sizeof(float);
    const size_t cache = static_cast<size_t>(b * hkv * c * dh) * elem;
    if (k != pk.GetTensorRawData()) std::memcpy(k, pk.GetTensorRawData(), cache);
    if (v != pv.GetTensorRawData()) std::memcpy(v, pv.GetTensorRawData(), cache);
    if (positions == 0 || dh == 0) return nullptr;

    // Q rotated into Attention's layout [B, Hkv, G S, dh] (head hk * G + g, token s: row g S + s)
    const int64_t g = h / hkv, rows = g * s;
    const float* x = qkv.GetTensorData<float>();
    const float *cos_p = cos.GetTensorData<float>(), *sin_p = sin.GetTensorData<float>();
    std::vector<float> q(static_cast<size_t>(b * h * s * dh)), att(q.size()), tmp(dh), kr(dh);
    QJob qj{this, x, rt, cos_p, sin_p, qn, q.data(), positions, s, g, width, rot, dh};
    const size_t q_tasks = static_cast<size_t>((positions + POSITIONS_PER_TASK - 1) /
                                               POSITIONS_PER_TASK);
    if (q_tasks == 1) {
      rotate_q(&qj, 0);
    } else {  // a prompt's chunk: its positions' Q rows on every thread
      ctx.ParallelFor(rotate_q, q_tasks, 0, &qj);
    }
    // New K (rotated) and V rows into their slots, in ScatterND's order
    for (int64_t i = 0; i < b * hkv * s; ++i) {
      const int64_t bi = i / (hkv * s), hk = i / s % hkv, p = bi * s + i % s;
      const float* row = x + (rt != nullptr ? rt[p] : p) * width;
      const int64_t* t = sl + 3 * i;
      const int64_t at = ((t[0] * hkv + t[1]) * c + t[2]) * dh;
      const float* xk = head_row(norm, row + (h + hk) * dh, kn, eps, dh, tmp.data());
      const float* xv = row + (h + hkv + hk) * dh;
      if (f16) {
        rope(xk, cos_p + p * rot, sin_p + p * rot, rot, kr.data());
        uint16_t* k16 = static_cast<uint16_t*>(k) + at;
        uint16_t* v16 = static_cast<uint16_t*>(v) + at;
        for (int64_t d = 0; d < dh; ++d) k16[d] = float_to_half(kr[d]);
        for (int64_t d = 0; d < dh; ++d) v16[d] = float_to_half(xv[d]);
      } else {
        rope(xk, cos_p + p * rot, sin_p + p * rot, rot, static_cast<float*>(k) + at);
        std::memcpy(static_cast<float*>(v) + at, xv, static_cast<size_t>(dh) * sizeof(float));
      }
    }
    if (a == 0) {
      std::fill(y, y + n_out * h * dh, 0.0f);
      return nullptr;
    }
    const int64_t row_tasks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    Job job{q.data(), nullptr, nullptr, mask.GetTensorData<float>(), att.data(), hidden,
            hkv, rows, s, c, a, dh, row_tasks};
    if (f16) {
      job.k16 = static_cast<const uint16_t*>(k);
      job.v16 = static_cast<const uint16_t*>(v);
    } else {
      job.k = static_cast<const float*>(k);
      job.v = static_cast<const float*>(v);
    }
    run_job(context, &job, static_cast<size_t>(b * hkv * row_tasks));
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

void rotate_q(void* data, size_t t) {
  const QJob& j = *static_cast<const QJob*>(data);
  const int64_t h = j.kern->h, hkv = j.kern->hkv, rows = j.g * j.s;
  std::vector<float> tmp(static_cast<size_t>(j.dh));
  const int64_t p1 = std::min(j.positions, static_cast<int64_t>(t + 1) * POSITIONS_PER_TASK);
  for (int64_t p = static_cast<int64_t>(t) * POSITIONS_PER_TASK; p < p1; ++p) {
    const float* row = j.x + (j.rt != nullptr ? j.rt[p] : p) * j.width;
    const int64_t bi = p / j.s, si = p % j.s;
    for (int64_t hi = 0; hi < h; ++hi) {
      float* dst = j.q + ((bi * hkv + hi / j.g) * rows + hi % j.g * j.s + si) * j.dh;
      const float* xq = head_row(j.kern->norm, row + hi * j.dh, j.norm, j.kern->eps, j.dh,
                                 tmp.data());
      j.kern->rope(xq, j.cos + p * j.half, j.sin + p * j.half, j.half, dst);
    }
  }
}

// HALF: the float16 cache's op (`npuchat.RopeAttentionF16`).
template <bool HALF>
struct RopeAttentionOp : Ort::CustomOpBase<RopeAttentionOp<HALF>, RopeAttentionKernel, true> {
  static constexpr ONNXTensorElementDataType CACHE =
      HALF ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto* kn = new RopeAttentionKernel();
    kn->f16 = HALF;
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
    OrtStatus* no_eps = api.KernelInfoGetAttribute_float(info, "epsilon", &kn->eps);
    if (no_eps != nullptr) api.ReleaseStatus(no_eps);  // a layer without head norms
    if (!read_hidden(api, info, &kn->hidden)) {
      delete kn;
      return error("hidden must be a number");
    }
    *kernel = kn;
    return nullptr;
  }
  const char* GetName() const { return HALF ? "RopeAttentionF16" : "RopeAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 11; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    const bool ints = i == 3 || i == 7 || i == 8;  // slots, row_tokens, token_rows
    if (ints) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return i == 4 || i == 5 ? CACHE : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;  // past_k, past_v
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : CACHE;
  }
};

}  // namespace

// The op for the library's registration entry point (kernels_entry.cc).
const OrtCustomOp* npuchat_rope_attention_op() {
  static RopeAttentionOp<false> op;
  return &op;
}
const OrtCustomOp* npuchat_rope_attention_f16_op() {
  static RopeAttentionOp<true> op;
  return &op;
}
