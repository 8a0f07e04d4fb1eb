// CPU quantization kernels over a range of blocks. No torch headers: the binding threads them.
#pragma once

#include <stdint.h>

namespace moshpeer {

// Quantize blocks [block_begin, block_end) of x (numel float32 values) into scales (one float32 per block) and
// codes (int8: one byte per value; int4: two values per byte, low nibble first). Returns false if a block holds a
// non-finite value (its scale is then left unspecified and the caller must reject the whole input).
bool quantize_blocks_cpu(const float* x, int64_t numel, int bits, int64_t block, bool stochastic, uint32_t key,
                         int64_t block_begin, int64_t block_end, float* scales, uint8_t* codes);

// out[i] += code_i * float32(scale_b * weight) for the values of blocks [block_begin, block_end); with
// overwrite, out[i] = 0.0f + code_i * float32(scale_b * weight) (the same bits as accumulating onto zeros,
// without reading out: one memory pass less for a decode into a buffer).
void dequantize_accumulate_blocks_cpu(const float* scales, const uint8_t* codes, float* out, int64_t numel, int bits,
                                      int64_t block, float weight, int64_t block_begin, int64_t block_end,
                                      bool overwrite = false);

}  // namespace moshpeer
