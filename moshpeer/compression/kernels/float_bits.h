// Float bit patterns for the CPU kernels' checks (plain C++, no torch headers).
//
// For non-negative floats the integer order of the bit patterns is the float order, and the inf / NaN patterns
// (>= kNonFiniteBits) exceed every finite one: one unsigned max over |x_i|'s patterns gives both the absmax and the
// non-finite check, and it vectorizes without fast-math.
#pragma once

#include <stdint.h>

#include <cstring>

namespace moshpeer {

constexpr uint32_t kNonFiniteBits = 0x7F800000u;

inline uint32_t abs_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits & 0x7FFFFFFFu;
}

// The largest bit pattern of |x_i| over x[0:n] (0 for n == 0).
inline uint32_t max_abs_bits(const float* x, int64_t n) {
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = abs_bits(x[i]);
    max_bits = bits > max_bits ? bits : max_bits;
  }
  return max_bits;
}

}  // namespace moshpeer
