// Thin torch binding of the CPU kernels: argument checks, threading with at::parallel_for, op registration.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "quant_cpu.h"
#include "raw_cpu.h"

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

// Raw float32 payload rows (the `none` codec): values row r (its first n = out.numel() / R values) is written into
// out[r * n : (r + 1) * n] by modes[r] (0: skip, 1: out = weight * row, 2: out += weight * row), but only if every one
// of its values is finite; the row is checked whole before anything is written. -> per row, 1 if it was refused for a
// non-finite value, else 0. One pass to check and one to write, while the row is still in cache.
std::vector<int64_t> take_float_rows(const at::Tensor& values, at::Tensor out, at::IntArrayRef modes, double weight) {
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kFloat && values.dim() == 2 &&
                  values.stride(1) == 1, "values must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 1,
              "out must be a contiguous 1-D float32 CPU tensor");
  const int64_t count = values.size(0);
  TORCH_CHECK((int64_t)modes.size() == count, "one mode per row");
  std::vector<int64_t> refused(count, 0);
  if (count == 0) return refused;
  TORCH_CHECK(out.numel() % count == 0 && out.numel() / count <= values.size(1),
              "out must hold the same number of values for every row, at most a row's length");
  const int64_t n = out.numel() / count, stride = values.stride(0);
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float w = (float)weight;
  at::parallel_for(0, count, std::max<int64_t>(1, kGrainValues / std::max<int64_t>(n, 1)), [&](int64_t begin,
                                                                                                 int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (modes[r] == 0) continue;
      const float* row = vp + r * stride;
      if (!moshpeer::all_finite_cpu(row, n)) {
        refused[r] = 1;
        continue;
      }
      moshpeer::write_row_cpu(row, op + r * n, n, w, modes[r] == 1);
    }
  });
  return refused;
}

// The owner's estimate of its part's average, chunk by chunk (averaging/estimator.py has the math): for chunk c of
// n values (the last may be shorter), sum_c = sum_c * k1 + own_c * k2, and own_c = sum_c only if all of it is finite.
// -> per chunk, 1 if its estimate was not finite (own_c untouched, sum_c scratch), else 0. Each chunk is blended
// in one pass and copied while it is still in cache.
std::vector<int64_t> estimate_chunks(at::Tensor sum, at::Tensor own, int64_t n, double k1, double k2) {
  TORCH_CHECK(sum.device().is_cpu() && sum.scalar_type() == at::kFloat && sum.is_contiguous() && sum.dim() == 1,
              "sum must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(own.device().is_cpu() && own.scalar_type() == at::kFloat && own.is_contiguous() &&
                  own.numel() == sum.numel(), "own must be a contiguous float32 CPU tensor the size of sum");
  TORCH_CHECK(n > 0, "chunks must hold values");
  const int64_t numel = sum.numel(), count = (numel + n - 1) / n;
  std::vector<int64_t> refused(count, 0);
  float* sp = sum.data_ptr<float>();
  float* op = own.data_ptr<float>();
  const float a = (float)k1, b = (float)k2;
  at::parallel_for(0, count, std::max<int64_t>(1, kGrainValues / n), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t start = c * n, len = std::min(n, numel - start);
      if (moshpeer::blend_row_cpu(sp + start, op + start, len, a, b))
        std::memcpy(op + start, sp + start, len * sizeof(float));
      else
        refused[c] = 1;
    }
  });
  return refused;
}

// Per payload row (scales as float32 at byte offset 16 of each row, `nb` of them): 1 if a scale is non-finite,
// negative or above max_scale (the decoder refuses such a row), else 0. The check of a batch of received rows in
// one call, with no tensor temporaries.
std::vector<int64_t> bad_scale_rows(const at::Tensor& rows, int64_t nb, double max_scale) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.stride(1) == 1,
              "rows must be a 2-D uint8 CPU tensor with contiguous rows");
  TORCH_CHECK(nb >= 0 && 16 + 4 * nb <= rows.size(1) && rows.stride(0) % 4 == 0, "rows too narrow for the scales");
  const uint8_t* rp = rows.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(rp) % 4 == 0, "rows must be 4-byte aligned");
  const float limit = (float)max_scale;
  std::vector<int64_t> bad(rows.size(0), 0);
  for (int64_t r = 0; r < rows.size(0); ++r) {
    const float* scales = reinterpret_cast<const float*>(rp + r * rows.stride(0) + 16);
    bool ok = true;
    for (int64_t b = 0; b < nb; ++b) ok &= scales[b] >= 0.0f && scales[b] <= limit;  // NaN fails both
    bad[r] = ok ? 0 : 1;
  }
  return bad;
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
  m.def("take_float_rows(Tensor values, Tensor(a!) out, int[] modes, float weight) -> int[]", &take_float_rows);
  m.def("estimate_chunks(Tensor(a!) sum, Tensor(b!) own, int n, float k1, float k2) -> int[]", &estimate_chunks);
  m.def("bad_scale_rows(Tensor rows, int nb, float max_scale) -> int[]", &bad_scale_rows);
}
