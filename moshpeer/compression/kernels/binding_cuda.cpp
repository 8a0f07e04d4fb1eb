// Thin torch binding of the CUDA kernels: argument checks, device guard and stream, op registration.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "quant_cuda.h"

namespace {

void check_args(const at::Tensor& scales, const at::Tensor& codes, int64_t numel, int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 4 or 8");
  TORCH_CHECK(block >= 16 && block % 16 == 0, "block must be a positive multiple of 16");
  TORCH_CHECK(numel < (int64_t(1) << 32), "at most 2^32 - 1 values per call");
  const int64_t blocks = (numel + block - 1) / block;
  const int64_t code_bytes = bits == 8 ? numel : (numel + 1) / 2;
  TORCH_CHECK(scales.is_cuda() && codes.is_cuda(), "CUDA tensors expected");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == blocks,
              "scales must be a contiguous float32 tensor with one value per block");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == code_bytes,
              "codes must be a contiguous uint8 tensor of the encoded size");
}

// Payload rows (quantize_rows / dequantize_rows): `count` rows of `stride` bytes, each the payload of n values.
struct RowLayout {
  int64_t count, stride, n;
};

// Checks bits, block and that `rows` (2-D uint8 CUDA, 4-byte aligned) can hold payloads of numel / count values
// each (`what` names the values' tensor in the error).
RowLayout check_rows(const at::Tensor& rows, int64_t numel, int64_t bits, int64_t block, const char* what) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 4 or 8");
  TORCH_CHECK(block >= 16 && block % 16 == 0, "block must be a positive multiple of 16");
  TORCH_CHECK(rows.is_cuda() && rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be a contiguous 2-D uint8 CUDA tensor");
  const int64_t count = rows.size(0), stride = rows.size(1);
  if (count == 0) return {0, stride, 0};
  TORCH_CHECK(numel % count == 0, what, " must hold a whole number of values per row");
  const int64_t n = numel / count;
  TORCH_CHECK(n % block == 0 && n < (int64_t(1) << 32), "a row must hold whole blocks (and fewer than 2^32 values)");
  const int64_t code_bytes = bits == 8 ? n : n / 2;
  TORCH_CHECK(16 + 4 * (n / block) + code_bytes <= stride && stride % 4 == 0,
              "rows too narrow for header, scales and codes (or not 4-byte aligned)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 4 == 0, "rows must be 4-byte aligned");
  return {count, stride, n};
}

bool quantize(const at::Tensor& x, at::Tensor scales, at::Tensor codes, int64_t bits, int64_t block,
              bool stochastic, int64_t key) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "x must be a contiguous 1-D float32 CUDA tensor");
  check_args(scales, codes, x.numel(), bits, block);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor flag = at::zeros({1}, x.options().dtype(at::kInt));
  cudaError_t status = moshpeer::quantize_cuda(
      x.data_ptr<float>(), x.numel(), (int)bits, block, stochastic, (uint32_t)key, scales.data_ptr<float>(),
      codes.data_ptr<uint8_t>(), flag.data_ptr<int>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == cudaSuccess, "quantize kernel launch failed: ", cudaGetErrorString(status));
  return flag.item<int>() == 0;
}

void dequantize_accumulate(const at::Tensor& scales, const at::Tensor& codes, at::Tensor out, int64_t bits,
                           int64_t block, double weight) {
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 1,
              "out must be a contiguous 1-D float32 CUDA tensor");
  check_args(scales, codes, out.numel(), bits, block);
  c10::cuda::CUDAGuard guard(out.device());
  cudaError_t status = moshpeer::dequantize_accumulate_cuda(
      scales.data_ptr<float>(), codes.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), (int)bits, block,
      (float)weight, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == cudaSuccess, "dequantize kernel launch failed: ", cudaGetErrorString(status));
}

void quantize_rows(const at::Tensor& x, at::Tensor rows, at::IntArrayRef header, at::Tensor status, int64_t bits,
                   int64_t block, double max_scale) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "x must be a contiguous 1-D float32 CUDA tensor");
  TORCH_CHECK(header.size() == 16, "the payload header is 16 bytes");
  const RowLayout layout = check_rows(rows, x.numel(), bits, block, "x");
  TORCH_CHECK(status.is_cuda() && status.scalar_type() == at::kInt && status.is_contiguous() &&
              status.numel() == rows.size(0), "status must be a contiguous int32 CUDA tensor with one entry per row");
  if (layout.count == 0) return;
  uint8_t bytes[16];
  for (int i = 0; i < 16; ++i) bytes[i] = (uint8_t)header[i];
  c10::cuda::CUDAGuard guard(x.device());
  cudaError_t result = moshpeer::quantize_rows_cuda(
      x.data_ptr<float>(), layout.count, layout.n, (int)bits, block, rows.data_ptr<uint8_t>(), layout.stride, bytes,
      (float)max_scale, status.data_ptr<int>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(result == cudaSuccess, "quantize_rows kernel launch failed: ", cudaGetErrorString(result));
}

void dequantize_rows(const at::Tensor& rows, at::Tensor out, int64_t bits, int64_t block, double weight,
                     bool overwrite) {
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 1,
              "out must be a contiguous 1-D float32 CUDA tensor");
  TORCH_CHECK(rows.device() == out.device(), "rows and out must be on the same device");
  const RowLayout layout = check_rows(rows, out.numel(), bits, block, "out");
  if (layout.count == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  cudaError_t result = moshpeer::dequantize_rows_cuda(
      rows.data_ptr<uint8_t>(), layout.count, layout.stride, layout.n, (int)bits, block, out.data_ptr<float>(),
      (float)weight, overwrite, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(result == cudaSuccess, "dequantize_rows kernel launch failed: ", cudaGetErrorString(result));
}

}  // namespace

TORCH_LIBRARY(moshpeer_cuda, m) {
  m.def("quantize(Tensor x, Tensor(a!) scales, Tensor(b!) codes, int bits, int block, bool stochastic, int key) -> bool",
        &quantize);
  m.def("dequantize_accumulate(Tensor scales, Tensor codes, Tensor(a!) out, int bits, int block, float weight) -> ()",
        &dequantize_accumulate);
  m.def("quantize_rows(Tensor x, Tensor(a!) rows, int[] header, Tensor(b!) status, int bits, int block, "
        "float max_scale) -> ()", &quantize_rows);
  m.def("dequantize_rows(Tensor rows, Tensor(a!) out, int bits, int block, float weight, bool overwrite) -> ()",
        &dequantize_rows);
}
