// QMatMul's activation rows (qmatmul_act.cc): x (+ skip), RMS-normed when the op carries the
// norm, quantized into the int8 blocks the kernels read.
#pragma once
#include <cstddef>
#include <cstdint>

#include "qblocks.h"

namespace npq {

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

// Quantizes task t's rows of the QuantJob at `data` (ParallelFor's signature).
void quantize_rows(void* data, size_t t);

}  // namespace npq
