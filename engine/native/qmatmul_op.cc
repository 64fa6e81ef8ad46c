// The ONNX Runtime custom op `npuchat.QMatMul`: y = x @ W^T with W kept as the GGUF's own
// quantized blocks (one row of blocks per output feature), read in place.
//
//   inputs:  x float32 [..., K]; W uint8, N rows of K / block_elems blocks (any shape, N * row
//            bytes in all); optional bias float32 [N], added to the product; optional skip
//            float32 [..., K], added to x first; optional norm float32 [K]: the matmul reads
//            RMSNorm(x (+ skip)) * norm instead of x (the norm op before it, and its residual Add)
//   attrs:   ggml_type (the block type), N, K; scale, scaled_rows: outputs n < scaled_rows are
//            multiplied by scale (a fused Q|K|V matmul folds attention's 1/sqrt(dh) into Q);
//            glu (optional, 0): 1 = the rows are gate|up of a SwiGLU MLP and the output is
//            silu(gate) * up, N / 2 wide (the Split, Sigmoid and two Muls it replaces);
//            epsilon (optional, with norm): RMSNorm's epsilon
//   outputs: y float32 [..., N] (glu: [..., N / 2]); optional sum float32 [..., K]: x + skip
//            (the residual stream the next layer continues from)
//
// Every output element is one call of the same dot-product kernel on that row of x and that row
// of W, whatever the number of rows and however the work is split across threads, so a row's
// result never depends on the rows beside it (verify steps equal decode steps bit for bit).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "qblocks.h"

namespace {

using npq::ActBlock;
using npq::ActSuper;
using npq::Kernels;

using npq::chosen_kernels;

bool is_super(int type) { return type == npq::Q4_K || type == npq::Q6_K; }

struct Job {
  const Kernels* kern;
  int type;
  int64_t m, n, k;
  int64_t tile;
  const uint8_t* w;
  size_t row_bytes;
  const uint8_t* act;
  size_t act_row_bytes;
  float* y;
  float scale;
  int64_t scaled_rows;
  const float* bias;  // nullptr: none
  bool glu;
};

// silu(gate) * up, as the ONNX graph computes it without the fused op: gate * sigmoid(gate) * up.
inline float swiglu(float gate, float up) {
  return gate * (1.0f / (1.0f + std::exp(-gate))) * up;
}

npq::DotRows kernel_for(const Kernels& k, int type) {
  switch (type) {
    case npq::Q4_0: return k.q4_0;
    case npq::Q4_1: return k.q4_1;
    case npq::Q5_0: return k.q5_0;
    case npq::Q8_0: return k.q8_0;
    case npq::Q4_K: return k.q4_k;
    default: return k.q6_k;
  }
}

npq::DotCols cols_for(const Kernels& k, int type) {
  switch (type) {
    case npq::Q4_0: return k.q4_0_cols;
    case npq::Q4_1: return k.q4_1_cols;
    case npq::Q5_0: return k.q5_0_cols;
    case npq::Q8_0: return k.q8_0_cols;
    case npq::Q4_K: return k.q4_k_cols;
    default: return k.q6_k_cols;
  }
}

// Output features [t * tile, (t + 1) * tile) for every row, in blocks of BLOCK_N weight rows:
// within a block each group of MAX_ROWS activation rows meets every weight row while both sit
// in L1 (a weight row is unpacked once per group; activations are read once per block).
constexpr int64_t BLOCK_N = 16;

// Output features [b0, b1) of one activation row x into y (that row's outputs): the same
// numbers as the loop below gives a row among others (DotCols computes what DotRows does).
void one_row(const Job& j, npq::DotCols cols, const uint8_t* x, int nb, int64_t b0, int64_t b1,
             float* y) {
  float out[BLOCK_N], up[BLOCK_N];
  const int len = static_cast<int>(b1 - b0);
  cols(j.w + static_cast<size_t>(b0) * j.row_bytes, j.row_bytes, x, len, nb, out);
  if (!j.glu) {
    for (int i = 0; i < len; ++i) {
      const int64_t n = b0 + i;
      const float s = n < j.scaled_rows ? j.scale : 1.0f;
      y[n] = s * out[i] + (j.bias != nullptr ? j.bias[n] : 0.0f);
    }
    return;
  }
  const int64_t width = j.n / 2;  // up row width + n pairs with gate row n
  cols(j.w + static_cast<size_t>(width + b0) * j.row_bytes, j.row_bytes, x, len, nb, up);
  for (int i = 0; i < len; ++i) {
    const int64_t n = b0 + i;
    const float bias = j.bias != nullptr ? j.bias[n] : 0.0f;
    const float bias_up = j.bias != nullptr ? j.bias[width + n] : 0.0f;
    y[n] = swiglu(out[i] + bias, up[i] + bias_up);
  }
}

void run_tile(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  const npq::DotRows dot = kernel_for(*j.kern, j.type);
  const npq::DotCols cols = cols_for(*j.kern, j.type);
  const int nb = static_cast<int>(j.k / npq::block_elems(j.type));
  const int64_t width = j.glu ? j.n / 2 : j.n;  // output features
  const int64_t n0 = static_cast<int64_t>(t) * j.tile;
  const int64_t n1 = std::min(width, n0 + j.tile);
  const uint8_t* rows[npq::MAX_ROWS];
  float out[npq::MAX_ROWS], up[npq::MAX_ROWS];
  for (int64_t b0 = n0; b0 < n1; b0 += BLOCK_N) {
    const int64_t b1 = std::min(n1, b0 + BLOCK_N);
    for (int64_t r0 = 0; r0 < j.m; r0 += npq::MAX_ROWS) {
      const int count = static_cast<int>(std::min<int64_t>(npq::MAX_ROWS, j.m - r0));
      for (int i = 0; i < count; ++i) {
        rows[i] = j.act + static_cast<size_t>(r0 + i) * j.act_row_bytes;
      }
      if (count == 1) {  // one activation row (a decode step): the block's weight rows at once
        one_row(j, cols, rows[0], nb, b0, b1, j.y + r0 * width);
        continue;
      }
      for (int64_t n = b0; n < b1; ++n) {
        const float s = n < j.scaled_rows ? j.scale : 1.0f;
        dot(j.w + static_cast<size_t>(n) * j.row_bytes, rows, count, nb, out);
        const float bias = j.bias != nullptr ? j.bias[n] : 0.0f;
        if (!j.glu) {
          for (int i = 0; i < count; ++i) j.y[(r0 + i) * width + n] = s * out[i] + bias;
          continue;
        }
        const int64_t nu = width + n;  // the up row paired with gate row n
        dot(j.w + static_cast<size_t>(nu) * j.row_bytes, rows, count, nb, up);
        const float bias_up = j.bias != nullptr ? j.bias[nu] : 0.0f;
        for (int i = 0; i < count; ++i) {
          j.y[(r0 + i) * width + n] = swiglu(s * out[i] + bias, up[i] + bias_up);
        }
      }
    }
  }
}

// Activation rows [t * QUANT_ROWS, ...) quantized into their blocks; rows are independent, so
// many-row calls (prefill) split them across threads and get the same bytes.
constexpr int64_t QUANT_ROWS = 8;

struct QuantJob {
  const Kernels* kern;
  bool super;
  const float* x;
  int64_t m, k;
  uint8_t* act;
  size_t act_row_bytes;
  const float* skip;  // nullptr: none
  const float* norm;  // nullptr: x is quantized as it is
  float eps;
  float* sum;  // x + skip, when the graph takes it (nullptr: not wanted)
};

// Row r's input to the matmul: x (+ skip), RMS-normed and scaled when the op has a norm, by
// the arithmetic of ONNX Runtime's (Skip)SimplifiedLayerNormalization (float sums in order,
// each value divided by the root, then scaled). `tmp` holds K floats; the row as read is
// returned.
const float* prepared_row(const QuantJob& j, int64_t r, float* tmp) {
  const float* src = j.x + r * j.k;
  if (j.skip != nullptr) {
    const float* add = j.skip + r * j.k;
    float* h = j.sum != nullptr ? j.sum + r * j.k : tmp;
    for (int64_t i = 0; i < j.k; ++i) h[i] = src[i] + add[i];
    src = h;
  }
  if (j.norm == nullptr) return src;
  float squares = 0.0f;
  for (int64_t i = 0; i < j.k; ++i) squares += src[i] * src[i];
  const float root = std::sqrt(squares / static_cast<float>(j.k) + j.eps);
  for (int64_t i = 0; i < j.k; ++i) tmp[i] = src[i] / root * j.norm[i];
  return tmp;
}

void quantize_rows(void* data, size_t t) {
  const QuantJob& j = *static_cast<const QuantJob*>(data);
  const int64_t r1 = std::min(j.m, static_cast<int64_t>(t + 1) * QUANT_ROWS);
  std::vector<float> tmp(j.skip != nullptr || j.norm != nullptr ? static_cast<size_t>(j.k) : 0);
  for (int64_t r = static_cast<int64_t>(t) * QUANT_ROWS; r < r1; ++r) {
    uint8_t* dst = j.act + static_cast<size_t>(r) * j.act_row_bytes;
    const float* src = tmp.empty() ? j.x + r * j.k : prepared_row(j, r, tmp.data());
    if (j.super) {
      j.kern->quantize_supers(src, reinterpret_cast<ActSuper*>(dst), static_cast<int>(j.k));
    } else {
      j.kern->quantize_blocks(src, reinterpret_cast<ActBlock*>(dst), static_cast<int>(j.k));
    }
  }
}

OrtStatusPtr error(OrtErrorCode code, const std::string& msg) {
  return Ort::GetApi().CreateStatus(code, ("npuchat.QMatMul: " + msg).c_str());
}

struct QMatMulKernel {
  int type = 0;
  int64_t n = 0, k = 0, scaled_rows = 0;
  float scale = 1.0f;
  float eps = 0.0f;
  bool glu = false;
  size_t row_bytes = 0;

  OrtStatusPtr init(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    type = static_cast<int>(ki.GetAttribute<int64_t>("ggml_type"));
    n = ki.GetAttribute<int64_t>("N");
    k = ki.GetAttribute<int64_t>("K");
    scale = ki.GetAttribute<float>("scale");
    scaled_rows = ki.GetAttribute<int64_t>("scaled_rows");
    int64_t glu_attr = 0;  // absent in graphs that do not fuse the MLP's activation
    OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_int64(info, "glu", &glu_attr);
    if (absent != nullptr) {
      Ort::GetApi().ReleaseStatus(absent);
      glu_attr = 0;
    }
    if (glu_attr != 0 && glu_attr != 1) return error(ORT_INVALID_ARGUMENT, "glu must be 0 or 1");
    absent = Ort::GetApi().KernelInfoGetAttribute_float(info, "epsilon", &eps);
    if (absent != nullptr) {  // graphs without a fused norm
      Ort::GetApi().ReleaseStatus(absent);
      eps = 0.0f;
    }
    glu = glu_attr == 1;
    const int bytes = npq::block_bytes(type);
    if (bytes == 0) return error(ORT_INVALID_ARGUMENT, "unsupported ggml_type " + std::to_string(type));
    if (n <= 0 || k <= 0 || k % npq::block_elems(type) != 0) {
      return error(ORT_INVALID_ARGUMENT, "K must be a positive multiple of the block size");
    }
    if (glu && (n % 2 != 0 || scaled_rows != 0)) {
      return error(ORT_INVALID_ARGUMENT, "glu needs an even N (gate rows, then up rows), no scale");
    }
    row_bytes = static_cast<size_t>(k / npq::block_elems(type)) * static_cast<size_t>(bytes);
    return nullptr;
  }

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
    const Ort::ConstValue x = ctx.GetInput(0);
    const Ort::ConstValue w = ctx.GetInput(1);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != k) {
      return error(ORT_INVALID_ARGUMENT, "x's last dimension must be K = " + std::to_string(k));
    }
    if (w.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n) * row_bytes) {
      return error(ORT_INVALID_ARGUMENT, "W must hold N rows of K/block blocks");
    }
    const size_t inputs = ctx.GetInputCount();
    const float* bias = nullptr;
    if (inputs > 2) {
      const Ort::ConstValue b = ctx.GetInput(2);
      if (b != nullptr) {
        if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n)) {
          return error(ORT_INVALID_ARGUMENT, "bias must hold N = " + std::to_string(n) + " values");
        }
        bias = b.GetTensorData<float>();
      }
    }
    const float* skip = nullptr;
    if (inputs > 3) {
      const Ort::ConstValue sk = ctx.GetInput(3);
      if (sk != nullptr) {
        if (sk.GetTensorTypeAndShapeInfo().GetShape() != shape) {
          return error(ORT_INVALID_ARGUMENT, "skip must have x's shape");
        }
        skip = sk.GetTensorData<float>();
      }
    }
    const float* norm = nullptr;
    if (inputs > 4) {
      const Ort::ConstValue nw = ctx.GetInput(4);
      if (nw != nullptr) {
        if (nw.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(k)) {
          return error(ORT_INVALID_ARGUMENT, "norm must hold K = " + std::to_string(k) + " values");
        }
        norm = nw.GetTensorData<float>();
      }
    }
    float* sum = nullptr;
    if (ctx.GetOutputCount() > 1) {
      if (skip == nullptr) return error(ORT_INVALID_ARGUMENT, "the sum output needs a skip input");
      sum = ctx.GetOutput(1, shape).GetTensorMutableData<float>();
    }
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    std::vector<int64_t> y_shape = shape;
    y_shape.back() = glu ? n / 2 : n;
    Ort::UnownedValue y = ctx.GetOutput(0, y_shape);
    if (m == 0) return nullptr;

    const Kernels& kern = chosen_kernels();
    const float* xs = x.GetTensorData<float>();
    const bool super = is_super(type);
    const size_t act_row = super ? static_cast<size_t>(k / npq::QK_K) * sizeof(ActSuper)
                                 : static_cast<size_t>(k / npq::QK) * sizeof(ActBlock);
    std::vector<uint8_t> act(act_row * static_cast<size_t>(m));
    QuantJob quant{&kern, super, xs, m, k, act.data(), act_row, skip, norm, eps, sum};
    const size_t quant_tasks = static_cast<size_t>((m + QUANT_ROWS - 1) / QUANT_ROWS);
    if (quant_tasks == 1) {
      quantize_rows(&quant, 0);
    } else {
      ctx.ParallelFor(quantize_rows, quant_tasks, 0, &quant);
    }
    // About 32 KiB of weights per task: enough work to hide the hand-off, small enough that two
    // threads share a 1,536-row matrix evenly.
    const int64_t rows_per_output = glu ? 2 : 1;
    const int64_t tile =
        std::max<int64_t>(4, static_cast<int64_t>(32768 / row_bytes) / rows_per_output);
    Job job{&kern,    type,    m,     n, k, tile, w.GetTensorData<uint8_t>(), row_bytes,
            act.data(), act_row, y.GetTensorMutableData<float>(), scale, scaled_rows, bias, glu};
    const int64_t width = glu ? n / 2 : n;  // a glu task reads two weight rows per output
    const size_t tiles = static_cast<size_t>((width + tile - 1) / tile);
    ctx.ParallelFor(run_tile, tiles, 0, &job);
    return nullptr;
  }
};

struct QMatMulOp : Ort::CustomOpBase<QMatMulOp, QMatMulKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    auto* kn = new QMatMulKernel();
    OrtStatusPtr status = nullptr;
    try {
      status = kn->init(info);
    } catch (const Ort::Exception& e) {
      status = error(e.GetOrtErrorCode(), e.what());
    }
    if (status != nullptr) {
      delete kn;
      return status;
    }
    *kernel = kn;
    return nullptr;
  }
  const char* GetName() const { return "QMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 5; }  // x, W, bias, skip, norm
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // y, sum
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

}  // namespace

// The op for the library's registration entry point (kernels_entry.cc).
const OrtCustomOp* npuchat_qmatmul_op() {
  static QMatMulOp op;
  return &op;
}
