// CUDA quantization kernels: host-side launchers on raw pointers. No torch headers, so plain nvcc compiles
// quant_cuda.cu; binding_cuda.cpp adapts torch tensors to these calls.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace moshpeer {

// Quantize numel float32 values (see quant_cpu.h for the layout). Sets *nonfinite_flag (device memory, zeroed
// by the caller) to 1 if any value is NaN or inf. Returns the launch status.
cudaError_t quantize_cuda(const float* x, int64_t numel, int bits, int64_t block, bool stochastic, uint32_t key,
                          float* scales, uint8_t* codes, int* nonfinite_flag, cudaStream_t stream);

// Encode `count` chunks of row_numel values of x (whole blocks each) into the rows of `rows` (count x stride bytes,
// 4-byte aligned): a 16-byte header, the chunk's scales, its codes (round to nearest). status[r] (device memory,
// cleared here) gets 1 if chunk r holds a non-finite value, 2 if a scale exceeds max_scale. Nothing syncs.
// loads_in_flight: 16-byte loads each lane issues before its first reduction (1, 2, 4, 8 or 16; the sweep that
// chose the default is in docs/benchmarks.md).
const int kDefaultLoadsInFlight = 8;
cudaError_t quantize_rows_cuda(const float* x, int64_t count, int64_t row_numel, int bits, int64_t block,
                               uint8_t* rows, int64_t stride, const uint8_t header[16], float max_scale, int* status,
                               cudaStream_t stream, int loads_in_flight = kDefaultLoadsInFlight);

// The inverse for validated rows: out[r*n, (r+1)*n) = (or += without overwrite) weight * row r's values, read where
// its scales and codes lie (n = row_numel, a multiple of 16 and of block; out and rows 4-byte aligned).
cudaError_t dequantize_rows_cuda(const uint8_t* rows, int64_t count, int64_t stride, int64_t row_numel, int bits,
                                 int64_t block, float* out, float weight, bool overwrite, cudaStream_t stream);

// out[i] += code_i * float32(scale_b * weight). Returns the launch status.
cudaError_t dequantize_accumulate_cuda(const float* scales, const uint8_t* codes, float* out, int64_t numel, int bits,
                                       int64_t block, float weight, cudaStream_t stream);

}  // namespace moshpeer
