// QMatMul's activation rows: see qmatmul_act.h.
#include "qmatmul_act.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace npq {

namespace {

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

}  // namespace

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

}  // namespace npq
