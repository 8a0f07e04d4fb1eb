// Thin torch binding of the CPU kernels: argument checks, threading with at::parallel_for, op registration.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "quant_cpu.h"

namespace {

// Enough values per task that thread hand-off costs little next to the work.
const int64_t kGrainValues = 1 << 16;

void check_args(const at::Tensor& scales, const at::Tensor& codes, int64_t numel, int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 4 or 8");
  TORCH_CHECK(block >= 16 && block % 16 == 0, "block must be a positive multiple of 16");
  TORCH_CHECK(numel < (int64_t(1) << 32), "at most 2^32 - 1 values per call");
  const int64_t blocks = (numel + block - 1) / block;
  const int64_t code_bytes = bits == 8 ? numel : (numel + 1) / 2;
  TORCH_CHECK(scales.device().is_cpu() && codes.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == blocks,
              "scales must be a contiguous float32 tensor with one value per block");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == code_bytes,
              "codes must be a contiguous uint8 tensor of the encoded size");
}

bool quantize(const at::Tensor& x, at::Tensor scales, at::Tensor codes, int64_t bits, int64_t block,
              bool stochastic, int64_t key) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "x must be a contiguous 1-D float32 CPU tensor");
  const int64_t numel = x.numel();
  check_args(scales, codes, numel, bits, block);
  const float* xp = x.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t blocks = scales.numel();
  std::atomic<bool> finite{true};
  at::parallel_for(0, blocks, std::max<int64_t>(1, kGrainValues / block), [&](int64_t begin, int64_t end) {
    if (!moshpeer::quantize_blocks_cpu(xp, numel, (int)bits, block, stochastic, (uint32_t)key, begin, end, sp, cp))
      finite = false;
  });
  return finite.load();
}

void dequantize_into(const at::Tensor& scales, const at::Tensor& codes, at::Tensor out, int64_t bits, int64_t block,
                     double weight, bool overwrite) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 1,
              "out must be a contiguous 1-D float32 CPU tensor");
  const int64_t numel = out.numel();
  check_args(scales, codes, numel, bits, block);
  const float* sp = scales.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const float w = (float)weight;
  at::parallel_for(0, scales.numel(), std::max<int64_t>(1, kGrainValues / block), [&](int64_t begin, int64_t end) {
    moshpeer::dequantize_accumulate_blocks_cpu(sp, cp, op, numel, (int)bits, block, w, begin, end, overwrite);
  });
}

void dequantize_accumulate(const at::Tensor& scales, const at::Tensor& codes, at::Tensor out, int64_t bits,
                           int64_t block, double weight) {
  dequantize_into(scales, codes, out, bits, block, weight, false);
}

void dequantize(const at::Tensor& scales, const at::Tensor& codes, at::Tensor out, int64_t bits, int64_t block,
                double weight) {
  dequantize_into(scales, codes, out, bits, block, weight, true);
}

// R = rows.size(0) chunks of x, each a whole number of blocks, encoded straight into payload rows (header, scales,
// codes: reference.quantize_rows). status[r]: 1 if chunk r holds a non-finite value, 2 if a scale exceeds max_scale.
void quantize_rows(const at::Tensor& x, at::Tensor rows, at::IntArrayRef header, at::Tensor status, int64_t bits,
                   int64_t block, double max_scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "x must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 4 or 8");
  TORCH_CHECK(block >= 16 && block % 16 == 0, "block must be a positive multiple of 16");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be a contiguous 2-D uint8 CPU tensor");
  const int64_t count = rows.size(0), stride = rows.size(1);
  TORCH_CHECK(status.device().is_cpu() && status.scalar_type() == at::kInt && status.is_contiguous() &&
                  status.numel() == count, "status must be a contiguous int32 tensor with one entry per row");
  if (count == 0) return;
  TORCH_CHECK(x.numel() % count == 0, "x must hold a whole number of values per row");
  const int64_t n = x.numel() / count;
  TORCH_CHECK(n % block == 0 && n < (int64_t(1) << 32), "a row must hold whole blocks (and fewer than 2^32 values)");
  const int64_t nb = n / block, h = (int64_t)header.size();
  const int64_t code_bytes = bits == 8 ? n : n / 2;
  TORCH_CHECK(h % 4 == 0 && h + 4 * nb + code_bytes <= stride && stride % 4 == 0,
              "rows too narrow for header, scales and codes (or not 4-byte aligned)");
  uint8_t* rp = rows.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(rp) % 4 == 0, "rows must be 4-byte aligned");
  int32_t* st = status.data_ptr<int32_t>();
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t i = 0; i < h; ++i) rp[r * stride + i] = (uint8_t)header[i];
    st[r] = 0;
  }
  const float* xp = x.data_ptr<float>();
  const float limit = (float)max_scale;
  at::parallel_for(0, count * nb, std::max<int64_t>(1, kGrainValues / block), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end;) {  // one segment of blocks of one row at a time
      const int64_t r = b / nb, first = b - r * nb, last = std::min(end - r * nb, nb);
      uint8_t* row = rp + r * stride;
      float* scales = reinterpret_cast<float*>(row + h);
      int32_t flags = 0;
      if (!moshpeer::quantize_blocks_cpu(xp + r * n, n, (int)bits, block, false, 0, first, last, scales,
                                         row + h + 4 * nb))
        flags |= 1;
      for (int64_t j = first; j < last; ++j)
        if (scales[j] > limit) flags |= 2;
      if (flags) __atomic_fetch_or(&st[r], flags, __ATOMIC_RELAXED);
      b = r * nb + last;
    }
  });
}

// The inverse of quantize_rows, straight from payload rows: out[r * n : (r + 1) * n] (+)= weight * chunk r's values,
// reading its scales and codes where they lie in row r (after the 16-byte header). Rows already validated.
void dequantize_rows(const at::Tensor& rows, at::Tensor out, int64_t bits, int64_t block, double weight,
                     bool overwrite) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 4 or 8");
  TORCH_CHECK(block >= 16 && block % 16 == 0, "block must be a positive multiple of 16");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 1,
              "out must be a contiguous 1-D float32 CPU tensor");
  const int64_t count = rows.size(0), stride = rows.size(1);
  if (count == 0) return;
  TORCH_CHECK(out.numel() % count == 0, "out must hold a whole number of values per row");
  const int64_t n = out.numel() / count;
  TORCH_CHECK(n % block == 0 && n < (int64_t(1) << 32), "a row must hold whole blocks (and fewer than 2^32 values)");
  const int64_t nb = n / block, code_bytes = bits == 8 ? n : n / 2;
  TORCH_CHECK(16 + 4 * nb + code_bytes <= stride && stride % 4 == 0, "rows too narrow for header, scales and codes");
  const uint8_t* rp = rows.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(rp) % 4 == 0, "rows must be 4-byte aligned");
  float* op = out.data_ptr<float>();
  const float w = (float)weight;
  at::parallel_for(0, count * nb, std::max<int64_t>(1, kGrainValues / block), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end;) {  // one segment of blocks of one row at a time
      const int64_t r = b / nb, first = b - r * nb, last = std::min(end - r * nb, nb);
      const uint8_t* row = rp + r * stride;
      moshpeer::dequantize_accumulate_blocks_cpu(reinterpret_cast<const float*>(row + 16), row + 16 + 4 * nb,
                                                 op + r * n, n, (int)bits, block, w, first, last, overwrite);
      b = r * nb + last;
    }
  });
}

}  // namespace

TORCH_LIBRARY(moshpeer_cpu, m) {
  m.def("quantize(Tensor x, Tensor(a!) scales, Tensor(b!) codes, int bits, int block, bool stochastic, int key) -> bool",
        &quantize);
  m.def("dequantize_accumulate(Tensor scales, Tensor codes, Tensor(a!) out, int bits, int block, float weight) -> ()",
        &dequantize_accumulate);
  m.def("dequantize(Tensor scales, Tensor codes, Tensor(a!) out, int bits, int block, float weight) -> ()",
        &dequantize);
  m.def("quantize_rows(Tensor x, Tensor(a!) rows, int[] header, Tensor(b!) status, int bits, int block, "
        "float max_scale) -> ()", &quantize_rows);
  m.def("dequantize_rows(Tensor rows, Tensor(a!) out, int bits, int block, float weight, bool overwrite) -> ()",
        &dequantize_rows);
}
