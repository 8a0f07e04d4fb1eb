// CPU quantization kernels (plain C++; see quant_math.h for the per-value math and reference.py for the spec).
// Written as simple fixed-trip loops over one block so that the compiler vectorizes them; the binding runs
// ranges of blocks on several threads.
#include "quant_cpu.h"

#include "float_bits.h"
#include "quant_math.h"

#include <cstring>

namespace moshpeer {
namespace {

// absmax of a block and whether it is finite, from one max over the bit patterns (float_bits.h).
float block_absmax(const float* x, int64_t len, bool* finite) {
  const uint32_t max_bits = max_abs_bits(x, len);
  *finite = max_bits < kNonFiniteBits;
  float amax;
  std::memcpy(&amax, &max_bits, sizeof(amax));
  return amax;
}

void quantize_block_int8(const float* x, int64_t len, float inv, float qmax, bool stochastic, uint32_t key,
                         uint32_t first_index, int8_t* codes) {
  if (stochastic) {
    for (int64_t i = 0; i < len; ++i)
      codes[i] = (int8_t)mp_quantize_stochastic(x[i], inv, qmax, first_index + (uint32_t)i, key);
  } else {
    for (int64_t i = 0; i < len; ++i) codes[i] = (int8_t)mp_quantize_nearest(x[i], inv);
  }
}

void quantize_block_int4(const float* x, int64_t len, float inv, float qmax, bool stochastic, uint32_t key,
                         uint32_t first_index, uint8_t* codes) {
  const int64_t pairs = len / 2;
  if (stochastic) {
    for (int64_t j = 0; j < pairs; ++j) {
      uint32_t index = first_index + 2 * (uint32_t)j;
      int32_t lo = mp_quantize_stochastic(x[2 * j], inv, qmax, index, key);
      int32_t hi = mp_quantize_stochastic(x[2 * j + 1], inv, qmax, index + 1, key);
      codes[j] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
    }
    if (len % 2) codes[pairs] = (uint8_t)(mp_quantize_stochastic(x[len - 1], inv, qmax, first_index + (uint32_t)len - 1, key) & 15);
  } else {
    for (int64_t j = 0; j < pairs; ++j) {
      int32_t lo = mp_quantize_nearest(x[2 * j], inv);
      int32_t hi = mp_quantize_nearest(x[2 * j + 1], inv);
      codes[j] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
    }
    if (len % 2) codes[pairs] = (uint8_t)(mp_quantize_nearest(x[len - 1], inv) & 15);
  }
}

}  // namespace

bool quantize_blocks_cpu(const float* x, int64_t numel, int bits, int64_t block, bool stochastic, uint32_t key,
                         int64_t block_begin, int64_t block_end, float* scales, uint8_t* codes) {
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  bool all_finite = true;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t start = b * block;
    const int64_t len = numel - start < block ? numel - start : block;
    bool finite = true;
    float absmax = block_absmax(x + start, len, &finite);
    if (!finite) {
      all_finite = false;
      continue;
    }
    float inv;
    mp_block_scale(absmax, qmax, &scales[b], &inv);
    if (bits == 8)
      quantize_block_int8(x + start, len, inv, qmax, stochastic, key, (uint32_t)start, (int8_t*)codes + start);
    else
      quantize_block_int4(x + start, len, inv, qmax, stochastic, key, (uint32_t)start, codes + start / 2);
  }
  return all_finite;
}

// Separate instantiations keep both loops branch-free (and vectorizable).
template <bool kOverwrite>
void dequantize_blocks(const float* scales, const uint8_t* codes, float* out, int64_t numel, int bits, int64_t block,
                       float weight, int64_t block_begin, int64_t block_end) {
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t start = b * block;
    const int64_t len = numel - start < block ? numel - start : block;
    const float sw = scales[b] * weight;
    float* o = out + start;
    if (bits == 8) {
      const int8_t* c = (const int8_t*)codes + start;
      for (int64_t i = 0; i < len; ++i) o[i] = (kOverwrite ? 0.0f : o[i]) + (float)c[i] * sw;
    } else {
      const uint8_t* c = codes + start / 2;
      const int64_t pairs = len / 2;
      for (int64_t j = 0; j < pairs; ++j) {
        o[2 * j] = (kOverwrite ? 0.0f : o[2 * j]) + (float)mp_nibble_value(c[j] & 15u) * sw;
        o[2 * j + 1] = (kOverwrite ? 0.0f : o[2 * j + 1]) + (float)mp_nibble_value(c[j] >> 4) * sw;
      }
      if (len % 2) o[len - 1] = (kOverwrite ? 0.0f : o[len - 1]) + (float)mp_nibble_value(c[pairs] & 15u) * sw;
    }
  }
}

void dequantize_accumulate_blocks_cpu(const float* scales, const uint8_t* codes, float* out, int64_t numel, int bits,
                                      int64_t block, float weight, int64_t block_begin, int64_t block_end,
                                      bool overwrite) {
  if (overwrite)
    dequantize_blocks<true>(scales, codes, out, numel, bits, block, weight, block_begin, block_end);
  else
    dequantize_blocks<false>(scales, codes, out, numel, bits, block, weight, block_begin, block_end);
}

}  // namespace moshpeer
