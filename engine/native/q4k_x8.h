// The process's regrouped copies of Q4_K matrices (q4k_x8.cc), for QMatMul.
#pragma once
#include <cstdint>
#include <memory>

#include "qblocks.h"

namespace npq {

// `n` Q4_K rows (a multiple of 8) of `row_bytes` at `w`, regrouped eight at a time: group g's nb
// Q4KX8 blocks at g * nb. Made once per tensor and shared while anyone holds it; nullptr when
// the memory cannot be had.
std::shared_ptr<const uint8_t> shared_q4_k_x8(const uint8_t* w, size_t row_bytes, int64_t n);

}  // namespace npq
