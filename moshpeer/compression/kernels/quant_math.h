// Scalar math shared by the CPU and CUDA quantization kernels. No torch headers: plain C++ / CUDA.
//
// The function is defined in reference.py; every step is one IEEE float32 operation or an exact integer one,
// so all backends produce the same bits. MP_MUL / MP_ADD / MP_DIV stop nvcc from fusing them into FMAs (the
// C++ build passes -ffp-contract=off for the same reason).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define MP_HD __host__ __device__ __forceinline__
#else
#define MP_HD inline
#endif

#if defined(__CUDA_ARCH__)
#define MP_MUL(a, b) __fmul_rn((a), (b))
#define MP_ADD(a, b) __fadd_rn((a), (b))
#define MP_DIV(a, b) __fdiv_rn((a), (b))
#else
#define MP_MUL(a, b) ((a) * (b))
#define MP_ADD(a, b) ((a) + (b))
#define MP_DIV(a, b) ((a) / (b))
#endif

namespace moshpeer {

// Counter-based RNG: u_i = mp_hash32(i ^ key) ("lowbias32" mixer). Matches reference.hash32.
MP_HD uint32_t mp_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

MP_HD float mp_abs(float x) { return x < 0.0f ? -x : x; }

// Round half to even for |y| < 2^22 (always true here: |y| <= qmax * (1 + 2^-23)): y + 1.5 * 2^23 lies in
// (2^23, 2^24) where the float spacing is 1, so the addition rounds y to the nearest integer (ties to even, as
// 1.5 * 2^23 is even) and the subtraction is exact. Branch-free, so it vectorizes.
MP_HD float mp_round_even(float y) {
  const float magic = 12582912.0f;
  return MP_ADD(MP_ADD(y, magic), -magic);
}

// floor(m) for 0 <= m < 2^23: truncation toward zero.
MP_HD float mp_floor_pos(float m) { return (float)(int32_t)m; }

// Scale and inverse scale of a block from its absmax (already known to be finite).
MP_HD void mp_block_scale(float absmax, float qmax, float* scale, float* inv) {
  float s = MP_DIV(absmax, qmax);
  float i = MP_DIV(qmax, absmax);
  // inv is +inf when absmax == 0 or absmax < qmax / FLT_MAX: such a block is encoded as zeros.
  if (!(i <= 3.402823466e+38f)) {
    s = 0.0f;
    i = 0.0f;
  }
  *scale = s;
  *inv = i;
}

// The integer code of value x in a block with inverse scale inv.
// No clamp needed: inv <= (qmax / absmax)(1 + 2^-24), so |x * inv| <= qmax (1 + 2^-23) rounds to at most qmax.
MP_HD int32_t mp_quantize_nearest(float x, float inv) { return (int32_t)mp_round_even(MP_MUL(x, inv)); }

MP_HD int32_t mp_quantize_stochastic(float x, float inv, float qmax, uint32_t index, uint32_t key) {
  float y = MP_MUL(x, inv);
  float mag = mp_abs(y);
  float low = mp_floor_pos(mag);
  float frac = MP_ADD(mag, -low);
  float u = (float)(int32_t)(mp_hash32(index ^ key) >> 8);
  float q = MP_ADD(low, u < MP_MUL(frac, 16777216.0f) ? 1.0f : 0.0f);
  q = q > qmax ? qmax : q;
  return (int32_t)(y < 0.0f ? -q : q);
}

// Sign-extend a 4-bit two's complement nibble.
MP_HD int32_t mp_nibble_value(uint32_t nib) { return (int32_t)((nib ^ 8u) & 15u) - 8; }

}  // namespace moshpeer
