// CUDA quantization kernels (plain CUDA; per-value math in quant_math.h, spec in reference.py).
// Quantize: one warp per block of values (coalesced loads, warp-shuffle absmax). Dequantize: one thread per
// value (int8) or per byte (int4), grid-stride.
#include "quant_cuda.h"

#include "quant_math.h"

namespace moshpeer {
namespace {

const int kThreads = 256;
const int kWarpsPerCta = kThreads / 32;
const int64_t kMaxGrid = 1 << 20;

template <int kBits>
__global__ void quantize_kernel(const float* __restrict__ x, int64_t numel, int64_t block, bool stochastic,
                                uint32_t key, int64_t blocks, float* __restrict__ scales,
                                uint8_t* __restrict__ codes, int* nonfinite_flag) {
  const float qmax = kBits == 8 ? 127.0f : 7.0f;
  const int lane = threadIdx.x & 31;
  const int64_t b = (int64_t)blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
  if (b >= blocks) return;  // uniform per warp
  const int64_t start = b * block;
  const int64_t len = numel - start < block ? numel - start : block;

  // absmax over the bit patterns of |x|: also flags inf / NaN (patterns >= 0x7F800000), like the CPU kernel.
  uint32_t max_bits = 0;
  for (int64_t i = lane; i < len; i += 32) {
    uint32_t bits = __float_as_uint(x[start + i]) & 0x7FFFFFFFu;
    max_bits = bits > max_bits ? bits : max_bits;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, max_bits, offset);
    max_bits = other > max_bits ? other : max_bits;
  }
  if (max_bits >= 0x7F800000u) {
    if (lane == 0) atomicOr(nonfinite_flag, 1);
    return;
  }
  float scale, inv;
  mp_block_scale(__uint_as_float(max_bits), qmax, &scale, &inv);
  if (lane == 0) scales[b] = scale;

  if (kBits == 8) {
    for (int64_t i = lane; i < len; i += 32) {
      const uint32_t index = (uint32_t)(start + i);
      int32_t q = stochastic ? mp_quantize_stochastic(x[start + i], inv, qmax, index, key)
                             : mp_quantize_nearest(x[start + i], inv);
      codes[start + i] = (uint8_t)(int8_t)q;
    }
  } else {
    const int64_t pairs = (len + 1) / 2;
    for (int64_t j = lane; j < pairs; j += 32) {
      const int64_t i = start + 2 * j;
      const uint32_t index = (uint32_t)i;
      int32_t lo = stochastic ? mp_quantize_stochastic(x[i], inv, qmax, index, key) : mp_quantize_nearest(x[i], inv);
      int32_t hi = 0;
      if (2 * j + 1 < len)
        hi = stochastic ? mp_quantize_stochastic(x[i + 1], inv, qmax, index + 1, key) : mp_quantize_nearest(x[i + 1], inv);
      codes[i / 2] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
    }
  }
}

__global__ void dequantize_int8_kernel(const float* __restrict__ scales, const int8_t* __restrict__ codes,
                                       float* __restrict__ out, int64_t numel, int64_t block, float weight) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += (int64_t)gridDim.x * blockDim.x) {
    const float sw = MP_MUL(scales[i / block], weight);
    out[i] = MP_ADD(out[i], MP_MUL((float)codes[i], sw));
  }
}

__global__ void dequantize_int4_kernel(const float* __restrict__ scales, const uint8_t* __restrict__ codes,
                                       float* __restrict__ out, int64_t numel, int64_t block, float weight) {
  const int64_t bytes = (numel + 1) / 2;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < bytes; j += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = 2 * j;  // both values of a byte share a block: block sizes are even
    const float sw = MP_MUL(scales[i / block], weight);
    const uint32_t byte = codes[j];
    out[i] = MP_ADD(out[i], MP_MUL((float)mp_nibble_value(byte & 15u), sw));
    if (i + 1 < numel) out[i + 1] = MP_ADD(out[i + 1], MP_MUL((float)mp_nibble_value(byte >> 4), sw));
  }
}

int64_t grid_for(int64_t work) {
  int64_t grid = (work + kThreads - 1) / kThreads;
  return grid < kMaxGrid ? grid : kMaxGrid;
}

}  // namespace

cudaError_t quantize_cuda(const float* x, int64_t numel, int bits, int64_t block, bool stochastic, uint32_t key,
                          float* scales, uint8_t* codes, int* nonfinite_flag, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const int64_t blocks = (numel + block - 1) / block;
  const int64_t grid = (blocks + kWarpsPerCta - 1) / kWarpsPerCta;
  if (bits == 8)
    quantize_kernel<8><<<(unsigned)grid, kThreads, 0, stream>>>(x, numel, block, stochastic, key, blocks, scales,
                                                                codes, nonfinite_flag);
  else
    quantize_kernel<4><<<(unsigned)grid, kThreads, 0, stream>>>(x, numel, block, stochastic, key, blocks, scales,
                                                                codes, nonfinite_flag);
  return cudaGetLastError();
}

cudaError_t dequantize_accumulate_cuda(const float* scales, const uint8_t* codes, float* out, int64_t numel, int bits,
                                       int64_t block, float weight, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  if (bits == 8)
    dequantize_int8_kernel<<<(unsigned)grid_for(numel), kThreads, 0, stream>>>(
        scales, (const int8_t*)codes, out, numel, block, weight);
  else
    dequantize_int4_kernel<<<(unsigned)grid_for((numel + 1) / 2), kThreads, 0, stream>>>(
        scales, codes, out, numel, block, weight);
  return cudaGetLastError();
}

}  // namespace moshpeer
