// CPU kernels for raw float32 payloads (the `none` codec). No torch headers: the binding threads them.
#pragma once

#include <stdint.h>

namespace moshpeer {

// Does x[0:n] hold only finite values? (One unsigned max over the bit patterns of |x_i|: float_bits.h.)
bool all_finite_cpu(const float* x, int64_t n);

// out[0:n] = src * weight (overwrite) or out[0:n] + src * weight; a weight of 1 copies or adds without multiplying.
void write_row_cpu(const float* src, float* out, int64_t n, float weight, bool overwrite);

// sum[0:n] = sum * k1 + own * k2 (in place, two roundings and an add, no FMA) -> are all the results finite?
bool blend_row_cpu(float* sum, const float* own, int64_t n, float k1, float k2);

}  // namespace moshpeer
