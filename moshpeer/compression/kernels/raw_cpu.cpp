// CPU kernels for raw float32 payloads (see raw_cpu.h). Simple loops that the compiler vectorizes.
#include "raw_cpu.h"

#include "float_bits.h"

#include <cstring>

namespace moshpeer {

bool all_finite_cpu(const float* x, int64_t n) { return max_abs_bits(x, n) < kNonFiniteBits; }

void write_row_cpu(const float* src, float* out, int64_t n, float weight, bool overwrite) {
  if (overwrite && weight == 1.0f) {
    std::memcpy(out, src, n * sizeof(float));
  } else if (overwrite) {
    for (int64_t i = 0; i < n; ++i) out[i] = src[i] * weight;
  } else if (weight == 1.0f) {
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] + src[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] + src[i] * weight;
  }
}

bool blend_row_cpu(float* sum, const float* own, int64_t n, float k1, float k2) {
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float t = sum[i] * k1 + own[i] * k2;
    sum[i] = t;
    const uint32_t bits = abs_bits(t);
    max_bits = bits > max_bits ? bits : max_bits;
  }
  return max_bits < kNonFiniteBits;
}

}  // namespace moshpeer
