// CUDA quantization kernels (plain CUDA; per-value math in quant_math.h, spec in reference.py).
// Quantize: one warp per block of values (coalesced loads, warp-shuffle absmax); quantize_rows: several blocks per
// warp. Dequantize: one thread per value (int8) or per byte (int4), grid-stride; dequantize_rows: per 4 values.
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

// quantize_rows: chunk r of x (whole blocks) encoded straight into row r of `rows` as a payload (header, scales,
// codes). Row status: 1 non-finite value, 2 scale above max_scale.
//
// The vector kernel (x 16-byte aligned) is bound by memory-level parallelism, not arithmetic: a warp that loads
// one block, reduces it with five shuffles and stores its codes has one 16-byte load per lane in flight (an H100
// encoded 1.16 TB/s of input that way, a device copy moves 1.49). So each warp takes kGroup consecutive blocks,
// issues all their float4 loads (kLoads per lane per block) before the first reduction, and reduces the group's
// maxima together: 2.1 TB/s at 8 loads in flight (docs/benchmarks.md, session 14). The unaligned fallback keeps
// one block per warp.
struct RowHeader {
  uint32_t words[4];
};

template <int kBits>
__device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d, float inv) {
  const int32_t q0 = mp_quantize_nearest(a, inv), q1 = mp_quantize_nearest(b, inv);
  const int32_t q2 = mp_quantize_nearest(c, inv), q3 = mp_quantize_nearest(d, inv);
  if (kBits == 8)
    return (uint32_t)(q0 & 255) | ((uint32_t)(q1 & 255) << 8) | ((uint32_t)(q2 & 255) << 16) |
           ((uint32_t)(q3 & 255) << 24);
  return (uint32_t)(q0 & 15) | ((uint32_t)(q1 & 15) << 4) | ((uint32_t)(q2 & 15) << 8) | ((uint32_t)(q3 & 15) << 12);
}

__device__ __forceinline__ uint32_t abs_bits_max4(float4 q) {
  const uint32_t m01 = max(__float_as_uint(q.x) & 0x7FFFFFFFu, __float_as_uint(q.y) & 0x7FFFFFFFu);
  const uint32_t m23 = max(__float_as_uint(q.z) & 0x7FFFFFFFu, __float_as_uint(q.w) & 0x7FFFFFFFu);
  return max(m01, m23);
}

// Block b of the part, given its absmax bit pattern: writes its row's header (first block of a row), its scale and
// the row status; -> false (nothing more to write) if the block holds a non-finite value. Sets *codes and *inv.
template <int kBits>
__device__ __forceinline__ bool begin_block(int64_t b, uint32_t max_bits, int64_t block, int64_t per_row,
                                            uint8_t* rows, int64_t stride, const RowHeader& header, float max_scale,
                                            int* status, int lane, uint8_t** codes, float* inv) {
  const int64_t r = b / per_row, j = b - r * per_row;
  uint8_t* row = rows + r * stride;
  if (j == 0 && lane < 4) reinterpret_cast<uint32_t*>(row)[lane] = header.words[lane];
  if (max_bits >= 0x7F800000u) {  // inf / NaN bit patterns
    if (lane == 0) atomicOr(status + r, 1);
    return false;
  }
  float scale;
  mp_block_scale(__uint_as_float(max_bits), kBits == 8 ? 127.0f : 7.0f, &scale, inv);
  if (lane == 0) {
    reinterpret_cast<float*>(row + 16)[j] = scale;
    if (scale > max_scale) atomicOr(status + r, 2);
  }
  *codes = row + 16 + 4 * per_row + (kBits == 8 ? j * block : j * block / 2);
  return true;
}

template <int kBits, int kLoads, int kGroup>
__global__ void __launch_bounds__(kThreads)
    quantize_rows_vector_kernel(const float* __restrict__ x, int64_t blocks, int64_t block, int64_t per_row,
                                uint8_t* __restrict__ rows, int64_t stride, RowHeader header, float max_scale,
                                int* __restrict__ status) {
  const int lane = threadIdx.x & 31;
  const int64_t first = ((int64_t)blockIdx.x * kWarpsPerCta + threadIdx.x / 32) * kGroup;
  if (first >= blocks) return;  // uniform per warp
  float4 held[kGroup][kLoads];
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int64_t i = 4 * lane + 128 * k;
      held[g][k] = (first + g < blocks && i < block)
                       ? __ldcs(reinterpret_cast<const float4*>(x + (first + g) * block + i))  // read once: no cache
                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  uint32_t max_bits[kGroup];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    max_bits[g] = 0;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) max_bits[g] = max(max_bits[g], abs_bits_max4(held[g][k]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
#pragma unroll
    for (int g = 0; g < kGroup; ++g) max_bits[g] = max(max_bits[g], __shfl_xor_sync(0xFFFFFFFFu, max_bits[g], offset));
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (first + g >= blocks) break;  // uniform per warp
    uint8_t* codes;
    float inv;
    if (!begin_block<kBits>(first + g, max_bits[g], block, per_row, rows, stride, header, max_scale, status, lane,
                            &codes, &inv))
      continue;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int64_t i = 4 * lane + 128 * k;
      if (i < block) {
        const float4 q = held[g][k];
        const uint32_t packed = pack4<kBits>(q.x, q.y, q.z, q.w, inv);
        if (kBits == 8)
          *reinterpret_cast<uint32_t*>(codes + i) = packed;
        else
          *reinterpret_cast<uint16_t*>(codes + i / 2) = (uint16_t)packed;
      }
    }
  }
}

// x not 16-byte aligned (a part that starts mid-tensor at an odd offset): scalar loads, one block per warp.
template <int kBits>
__global__ void quantize_rows_scalar_kernel(const float* __restrict__ x, int64_t blocks, int64_t block,
                                            int64_t per_row, uint8_t* __restrict__ rows, int64_t stride,
                                            RowHeader header, float max_scale, int* __restrict__ status) {
  const int lane = threadIdx.x & 31;
  const int64_t b = (int64_t)blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
  if (b >= blocks) return;  // uniform per warp
  const float* v = x + b * block;
  uint32_t max_bits = 0;
  for (int64_t i = lane; i < block; i += 32) max_bits = max(max_bits, __float_as_uint(v[i]) & 0x7FFFFFFFu);
  for (int offset = 16; offset > 0; offset >>= 1) max_bits = max(max_bits, __shfl_xor_sync(0xFFFFFFFFu, max_bits, offset));
  uint8_t* codes;
  float inv;
  if (!begin_block<kBits>(b, max_bits, block, per_row, rows, stride, header, max_scale, status, lane, &codes, &inv))
    return;
  if (kBits == 8) {
    for (int64_t i = lane; i < block; i += 32) codes[i] = (uint8_t)(int8_t)mp_quantize_nearest(v[i], inv);
  } else {
    for (int64_t p = lane; p < block / 2; p += 32) {
      const int32_t lo = mp_quantize_nearest(v[2 * p], inv), hi = mp_quantize_nearest(v[2 * p + 1], inv);
      codes[p] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
    }
  }
}

struct RowsLaunch {
  const float* x;
  int64_t blocks, block, per_row;
  uint8_t* rows;
  int64_t stride;
  RowHeader header;
  float max_scale;
  int* status;
  cudaStream_t stream;
};

template <int kBits, int kLoads, int kGroup>
void launch_vector(const RowsLaunch& a) {
  const int64_t warps = (a.blocks + kGroup - 1) / kGroup;
  const unsigned grid = (unsigned)((warps + kWarpsPerCta - 1) / kWarpsPerCta);
  quantize_rows_vector_kernel<kBits, kLoads, kGroup><<<grid, kThreads, 0, a.stream>>>(
      a.x, a.blocks, a.block, a.per_row, a.rows, a.stride, a.header, a.max_scale, a.status);
}

// kLoads float4 loads per lane cover a block of up to 128 * kLoads values; a group of blocks per warp makes
// loads_in_flight of them (at most 16 per lane: 64 registers of held values).
constexpr int clamp_group(int loads, int group) { return loads * group <= 16 ? group : 16 / loads; }

template <int kBits, int kLoads>
void launch_vector_group(const RowsLaunch& a, int loads_in_flight) {
  const int group = loads_in_flight / kLoads;
  if (group >= 16)
    launch_vector<kBits, kLoads, clamp_group(kLoads, 16)>(a);
  else if (group >= 8)
    launch_vector<kBits, kLoads, clamp_group(kLoads, 8)>(a);
  else if (group >= 4)
    launch_vector<kBits, kLoads, clamp_group(kLoads, 4)>(a);
  else if (group >= 2)
    launch_vector<kBits, kLoads, 2>(a);
  else
    launch_vector<kBits, kLoads, 1>(a);
}

template <int kBits>
void launch_rows(const RowsLaunch& a, bool vector, int loads_in_flight) {
  if (!vector) {
    const unsigned grid = (unsigned)((a.blocks + kWarpsPerCta - 1) / kWarpsPerCta);
    quantize_rows_scalar_kernel<kBits><<<grid, kThreads, 0, a.stream>>>(a.x, a.blocks, a.block, a.per_row, a.rows,
                                                                         a.stride, a.header, a.max_scale, a.status);
  } else if (a.block <= 128) {
    launch_vector_group<kBits, 1>(a, loads_in_flight);
  } else if (a.block <= 256) {
    launch_vector_group<kBits, 2>(a, loads_in_flight);
  } else if (a.block <= 512) {
    launch_vector_group<kBits, 4>(a, loads_in_flight);
  } else {
    launch_vector_group<kBits, 8>(a, loads_in_flight);  // block <= 1024 (quantization.MAX_BLOCK)
  }
}

// dequantize_rows: row r of `rows` (a validated payload of n values) decoded into out[r*n, (r+1)*n), read where its
// scales and codes lie in the row (no gather). One thread per 4 values (n is a multiple of 16).
template <int kBits, bool kOverwrite>
__global__ void dequantize_rows_kernel(const uint8_t* __restrict__ rows, int64_t stride, int64_t n, int64_t block,
                                       float* __restrict__ out, int64_t quads, float weight) {
  const int64_t per_row = n / block;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < quads; t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = 4 * t, r = i / n, k = i - r * n;
    const uint8_t* row = rows + r * stride;
    const float sw = MP_MUL(reinterpret_cast<const float*>(row + 16)[k / block], weight);
    const uint8_t* codes = row + 16 + 4 * per_row;
    int32_t c[4];
    if (kBits == 8) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + k);  // k % 4 == 0, the code offset too
      for (int q = 0; q < 4; ++q) c[q] = (int32_t)(int8_t)(uint8_t)(w >> (8 * q));
    } else {
      const uint32_t w = *reinterpret_cast<const uint16_t*>(codes + k / 2);
      for (int q = 0; q < 4; ++q) c[q] = mp_nibble_value((w >> (4 * q)) & 15u);
    }
    float* o = out + i;
    for (int q = 0; q < 4; ++q)  // 0 + v, not v: the same -0.0 handling as the CPU kernel
      o[q] = MP_ADD(kOverwrite ? 0.0f : o[q], MP_MUL((float)c[q], sw));
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

cudaError_t quantize_rows_cuda(const float* x, int64_t count, int64_t row_numel, int bits, int64_t block,
                               uint8_t* rows, int64_t stride, const uint8_t header[16], float max_scale, int* status,
                               cudaStream_t stream, int loads_in_flight) {
  if (count == 0) return cudaSuccess;
  cudaError_t cleared = cudaMemsetAsync(status, 0, count * sizeof(int), stream);
  if (cleared != cudaSuccess) return cleared;
  RowsLaunch a;
  for (int w = 0; w < 4; ++w)
    a.header.words[w] = (uint32_t)header[4 * w] | ((uint32_t)header[4 * w + 1] << 8) |
                        ((uint32_t)header[4 * w + 2] << 16) | ((uint32_t)header[4 * w + 3] << 24);
  a.x = x;
  a.per_row = row_numel / block;
  a.blocks = count * a.per_row;
  a.block = block;
  a.rows = rows;
  a.stride = stride;
  a.max_scale = max_scale;
  a.status = status;
  a.stream = stream;
  // float4 loads need x 16-byte aligned (blocks are multiples of 16 values, so every block then is).
  const bool vector = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (bits == 8)
    launch_rows<8>(a, vector, loads_in_flight);
  else
    launch_rows<4>(a, vector, loads_in_flight);
  return cudaGetLastError();
}

cudaError_t dequantize_rows_cuda(const uint8_t* rows, int64_t count, int64_t stride, int64_t row_numel, int bits,
                                 int64_t block, float* out, float weight, bool overwrite, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int64_t quads = count * row_numel / 4;
  const unsigned grid = (unsigned)grid_for(quads);
  if (bits == 8 && overwrite)
    dequantize_rows_kernel<8, true><<<grid, kThreads, 0, stream>>>(rows, stride, row_numel, block, out, quads, weight);
  else if (bits == 8)
    dequantize_rows_kernel<8, false><<<grid, kThreads, 0, stream>>>(rows, stride, row_numel, block, out, quads, weight);
  else if (overwrite)
    dequantize_rows_kernel<4, true><<<grid, kThreads, 0, stream>>>(rows, stride, row_numel, block, out, quads, weight);
  else
    dequantize_rows_kernel<4, false><<<grid, kThreads, 0, stream>>>(rows, stride, row_numel, block, out, quads, weight);
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
