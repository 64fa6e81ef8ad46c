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
//            epsilon (optional, with norm): RMSNorm's epsilon; layout (optional, 0): 1 = W holds
//            Q4_K, Q6_K, Q8_0, Q5_0 or Q4_1 rows regrouped eight at a time (N / 8 groups of
//            K / block Q4KX8, Q6KX8, Q8X8, Q5X8 or Q41X8 blocks, qblocks.h);
//            paired (optional, 0): 1 = with glu, gate rows 8i..8i+7 are followed by up rows
//            8i..8i+7 (an output's two rows come from one stream)
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
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "qblocks.h"
#include "qmatmul_act.h"

namespace {

using npq::ActBlock;
using npq::ActSuper;
using npq::Kernels;

using npq::chosen_kernels;
using npq::QUANT_ROWS;
using npq::QuantJob;
using npq::quantize_rows;

bool is_super(int type) { return type == npq::Q4_K || type == npq::Q6_K; }

// The types whose rows may come regrouped eight at a time (layout 1), and a group's block bytes.
size_t x8_block_bytes(int type) {
  switch (type) {
    case npq::Q4_K: return sizeof(npq::Q4KX8);
    case npq::Q6_K: return sizeof(npq::Q6KX8);
    case npq::Q8_0: return sizeof(npq::Q8X8);
    case npq::Q5_0: return sizeof(npq::Q5X8);
    case npq::Q4_1: return sizeof(npq::Q41X8);
    default: return 0;
  }
}

npq::DotX8 x8_kernel_for(const Kernels& k, int type) {
  switch (type) {
    case npq::Q4_K: return k.q4_k_x8;
    case npq::Q6_K: return k.q6_k_x8;
    case npq::Q8_0: return k.q8_0_x8;
    case npq::Q4_1: return k.q4_1_x8;
    default: return k.q5_0_x8;
  }
}

struct Job {
  const Kernels* kern;
  int type;
  int64_t m, n, k;
  int64_t tile;
  const uint8_t* w;  // the GGUF's rows, or nullptr (x8)
  size_t row_bytes;
  const uint8_t* act;
  size_t act_row_bytes;
  float* y;
  float scale;
  int64_t scaled_rows;
  const float* bias;  // nullptr: none
  bool glu;
  const uint8_t* x8;  // or the rows regrouped eight at a time (layout 1; w is then nullptr)
  bool paired;        // gate and up rows alternate in eights (glu)
};

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

// Output features [t * tile, (t + 1) * tile) for every row: each group of MAX_ROWS activation
// rows meets the tile's weight rows in blocks of BLOCK_N, the group outside, so its activations
// stay in L1 while the tile's weights (~32 KiB) come from L2. (Blocks outside read every
// group's activations from L2 again for each block: 128 rows of the 1.5B's ffn_up took ~1.25x
// as long with the eight-row kernels of qdot_x86.h's dot_bcast.)
constexpr int64_t BLOCK_N = 16;

// Activation rows `rows` (count of them) . weight rows [n0, n0 + len), len <= BLOCK_N, into
// out[i * BLOCK_N + c]: the eight-row kernel where the matrix is regrouped (n0 and len are
// multiples of 8 there), else the one-row (DotCols) or many-row (DotRows) kernel. All three
// compute a pair's number by the same steps (qblocks.h), so it never depends on the path.
void products(const Job& j, int64_t n0, int len, const uint8_t* const* rows, int count, int nb,
              float* out) {
  const int64_t width = j.n / 2;
  // Paired: gate rows 8i..8i+7 lie just before up rows 8i..8i+7 (a block is one such run).
  const int64_t first = !j.paired ? n0 : n0 < width ? 2 * n0 - n0 % 8 : 2 * (n0 - width) - n0 % 8 + 8;
  if (j.x8 != nullptr) {
    float part[npq::MAX_ROWS * 8];
    const npq::DotX8 dot8 = x8_kernel_for(*j.kern, j.type);
    const size_t group_bytes = static_cast<size_t>(nb) * x8_block_bytes(j.type);
    for (int c = 0; c < len; c += 8) {
      dot8(j.x8 + static_cast<size_t>((first + c) / 8) * group_bytes, rows, count, nb, part);
      for (int i = 0; i < count; ++i) {
        for (int e = 0; e < 8; ++e) out[i * BLOCK_N + c + e] = part[8 * i + e];
      }
    }
    return;
  }
  const uint8_t* w = j.w + static_cast<size_t>(first) * j.row_bytes;
  if (count == 1) {  // one activation row (a decode step): the block's weight rows at once
    cols_for(*j.kern, j.type)(w, j.row_bytes, rows[0], len, nb, out);
    return;
  }
  const npq::DotRows dot = kernel_for(*j.kern, j.type);
  float col[npq::MAX_ROWS];
  for (int c = 0; c < len; ++c) {
    dot(w + static_cast<size_t>(c) * j.row_bytes, rows, count, nb, col);
    for (int i = 0; i < count; ++i) out[i * BLOCK_N + c] = col[i];
  }
}

void run_tile(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  const int nb = static_cast<int>(j.k / npq::block_elems(j.type));
  const int64_t width = j.glu ? j.n / 2 : j.n;  // output features
  const int64_t n0 = static_cast<int64_t>(t) * j.tile;
  const int64_t n1 = std::min(width, n0 + j.tile);
  const uint8_t* rows[npq::MAX_ROWS];
  float out[npq::MAX_ROWS * BLOCK_N], up[npq::MAX_ROWS * BLOCK_N];
  const int64_t block = j.paired ? 8 : BLOCK_N;  // paired: gate then up group, in file order
  for (int64_t r0 = 0; r0 < j.m; r0 += npq::MAX_ROWS) {
    const int count = static_cast<int>(std::min<int64_t>(npq::MAX_ROWS, j.m - r0));
    for (int i = 0; i < count; ++i) {
      rows[i] = j.act + static_cast<size_t>(r0 + i) * j.act_row_bytes;
    }
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int len = static_cast<int>(std::min(n1, b0 + block) - b0);
      products(j, b0, len, rows, count, nb, out);
      if (j.glu) products(j, width + b0, len, rows, count, nb, up);  // the up rows
      // glu: every row's gate and up halves side by side (i * len + c), then silu(gate) * up
      // in one call: its exp chains overlap across the rows
      float gate[npq::MAX_ROWS * BLOCK_N], rise[npq::MAX_ROWS * BLOCK_N];
      for (int i = 0; i < count; ++i) {
        float* first = j.glu ? gate + i * len : j.y + (r0 + i) * width + b0;
        for (int c = 0; c < len; ++c) {
          const int64_t n = b0 + c;
          const float s = n < j.scaled_rows ? j.scale : 1.0f;
          first[c] = s * out[i * BLOCK_N + c] + (j.bias != nullptr ? j.bias[n] : 0.0f);
        }
        if (!j.glu) continue;
        for (int c = 0; c < len; ++c) {
          const float bias = j.bias != nullptr ? j.bias[width + b0 + c] : 0.0f;
          rise[i * len + c] = up[i * BLOCK_N + c] + bias;
        }
      }
      if (!j.glu) continue;
      j.kern->swiglu(gate, rise, gate, count * len);
      for (int i = 0; i < count; ++i) {
        std::memcpy(j.y + (r0 + i) * width + b0, gate + i * len,
                    sizeof(float) * static_cast<size_t>(len));
      }
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
  bool x8 = false;      // W holds the rows regrouped eight at a time (layout 1)
  bool paired = false;  // gate rows 8i.. then up rows 8i.. (glu)

  OrtStatusPtr init(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    type = static_cast<int>(ki.GetAttribute<int64_t>("ggml_type"));
    n = ki.GetAttribute<int64_t>("N");
    k = ki.GetAttribute<int64_t>("K");
    scale = ki.GetAttribute<float>("scale");
    scaled_rows = ki.GetAttribute<int64_t>("scaled_rows");
    const int64_t glu_attr = optional_int(info, "glu");  // absent: no fused activation
    const int64_t layout = optional_int(info, "layout");
    if (glu_attr != 0 && glu_attr != 1) return error(ORT_INVALID_ARGUMENT, "glu must be 0 or 1");
    OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_float(info, "epsilon", &eps);
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
    x8 = layout == 1;
    paired = optional_int(info, "paired") == 1;
    const bool groups = x8_block_bytes(type) != 0;
    if (layout != 0 && !(x8 && groups && n % 8 == 0 && (!glu || (n / 2) % 8 == 0))) {
      return error(ORT_INVALID_ARGUMENT,
                   "layout 1 (rows regrouped in eights) needs Q4_K, Q6_K, Q8_0, Q5_0 or Q4_1 "
                   "and N (N / 2 with glu) a multiple of 8; layout 0 is the GGUF's rows");
    }
    if (paired && !(glu && (n / 2) % 8 == 0)) {
      return error(ORT_INVALID_ARGUMENT, "paired gate/up rows need glu and N / 2 a multiple of 8");
    }
    return nullptr;
  }

  // An int attribute that graphs may leave out (0 then).
  static int64_t optional_int(const OrtKernelInfo* info, const char* name) {
    int64_t value = 0;
    OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &value);
    if (absent == nullptr) return value;
    Ort::GetApi().ReleaseStatus(absent);
    return 0;
  }

  // W's bytes: N rows of blocks, or N / 8 groups of regrouped blocks (layout 1).
  size_t weight_bytes() const {
    if (!x8) return static_cast<size_t>(n) * row_bytes;
    return static_cast<size_t>(n / 8) * static_cast<size_t>(k / npq::block_elems(type)) *
           x8_block_bytes(type);
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
    if (w.GetTensorTypeAndShapeInfo().GetElementCount() != weight_bytes()) {
      return error(ORT_INVALID_ARGUMENT, x8 ? "W must hold N / 8 groups of eight regrouped rows"
                                            : "W must hold N rows of K/block blocks");
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
    // Weights per task: a few activation rows (decode) read each weight once, so a task's
    // share is a run of memory: an eighth of the matrix, 32-512 KiB (two threads streaming
    // 32 KiB runs in turn read ~25 GB/s here, 512 KiB runs ~35). More rows (prefill) take
    // 32 KiB: the tile is read again from L2 for every eight rows (run_tile).
    const int64_t rows_per_output = glu ? 2 : 1;
    const uint8_t* wd = w.GetTensorData<uint8_t>();
    const int64_t matrix = static_cast<int64_t>(row_bytes) * n;
    const int64_t run =
        m > npq::MAX_ROWS ? 32768 : std::clamp<int64_t>(matrix / 8, 32768, 524288);
    int64_t tile = std::max<int64_t>(4, run / static_cast<int64_t>(row_bytes) / rows_per_output);
    if (x8 || paired) tile = (tile + 7) / 8 * 8;  // whole groups or pairs of eight rows
    Job job{&kern,  type, m, n, k, tile, x8 ? nullptr : wd, row_bytes, act.data(), act_row,
            y.GetTensorMutableData<float>(), scale, scaled_rows, bias, glu, x8 ? wd : nullptr,
            paired};
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
