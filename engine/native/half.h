// IEEE half <-> float in integers only, for the portable paths and the odd tail (the AVX2
// paths convert eight at a time with F16C): no dependence on the FPU's flush-to-zero modes.
// Widening is exact; narrowing rounds to nearest even, overflow to infinity, NaN stays NaN
// (quiet), as numpy's astype(float16) and F16C's vcvtps2ph do. Shared by the matmul kernels'
// block scales (qblocks.h) and attention's f16 cache (attention.h).
#pragma once

#include <cstdint>
#include <cstring>

namespace npuchat_half {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {  // subnormal: m * 2^-24, the top bit p of m gives 2^(p - 24)
    const uint32_t p = 31 - static_cast<uint32_t>(__builtin_clz(m));
    bits = sign | ((p + 103) << 23) | ((m << (23 - p)) & 0x7fffffu);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 2^16: infinity
  uint32_t r, rem, tie;
  if (ax < 0x38800000u) {                                    // below 2^-14: subnormal or zero
    if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // at most 2^-25: zero
    const uint32_t shift = 126 - (ax >> 23), m = (ax & 0x7fffffu) | 0x800000u;
    r = m >> shift;
    rem = m & ((1u << shift) - 1);
    tie = 1u << (shift - 1);
  } else {
    r = (ax >> 13) - (112u << 10);
    rem = ax & 0x1fffu;
    tie = 0x1000u;
  }
  if (rem > tie || (rem == tie && (r & 1u))) ++r;  // a carry rounds up the exponent (to inf)
  return static_cast<uint16_t>(sign | r);
}

}  // namespace npuchat_half
