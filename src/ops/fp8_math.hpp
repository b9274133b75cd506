// Per-element and per-column FP8 scaling math shared by the CPU path (fp8.cpp) and the CUDA kernels
// (cuda/fp8.cu), so both give the same bits.
#pragma once

#include <cstdint>

#include <type_traits>

#include "megacore/core/dtype.hpp"
#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace megacore::ops::fp8_math {

/// |v| as f32 bits: unsigned comparison orders them like the magnitudes, with NaN above +inf (so a NaN
/// wins an amax reduction done with integer max, which the CUDA kernels do with atomicMax).
MC_HOST_DEVICE uint32_t abs_bits(float v) { return f32_bits(v) & 0x7fffffffu; }

MC_HOST_DEVICE bool finite(float v) { return (f32_bits(v) & 0x7f800000u) != 0x7f800000u; }

/// Quantises v · scale into Q; reports saturation (|v · scale| > max, NaN not counted) and flush to zero.
/// Q::from_float(y); on sm_89+ the hardware conversion (round to nearest even, saturating to the largest
/// finite value: the same code as Q::from_float for every non-NaN f32, checked on an H200) for all but NaN.
template <class Q>
MC_HOST_DEVICE uint8_t encode(float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (abs_bits(y) <= 0x7f800000u)
    return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, std::is_same_v<Q, float8_e4m3> ? __NV_E4M3 : __NV_E5M2);
#endif
  return Q::from_float(y);
}

template <class Q>
MC_HOST_DEVICE uint8_t quantize(float v, float scale, bool& overflow, bool& underflow) {
  const float y = v * scale;
  if (abs_bits(y) > 0x7f800000u) {  // NaN: one code on every device (a NaN's sign after the multiply is not)
    overflow = underflow = false;
    return 0x7f;
  }
  const uint8_t q = encode<Q>(y);
  overflow = finite(y) ? (y > Q::kMax || y < -Q::kMax) : (abs_bits(y) == 0x7f800000u);
  underflow = y != 0.f && (q & 0x7fu) == 0;
  return q;
}

/// One tensor's scale update from its history column (see ops::fp8_update_scales). `hist` points at row 0
/// of the column, rows `stride` floats apart.
MC_HOST_DEVICE void update_column(float* hist, int64_t len, int64_t stride, float* scale, float* scale_inv,
                                  float fp8_max, bool amax_max, int margin, bool roll) {
  float amax = hist[0];
  if (amax_max)
    for (int64_t l = 1; l < len; ++l) {
      const float h = hist[l * stride];
      if (abs_bits(h) > abs_bits(amax)) amax = h;  // NaN propagates
    }
  float s = *scale;
  if (amax > 0.f && finite(amax)) {
    float cand = fp8_max / amax;
    for (int i = 0; i < margin; ++i) cand *= 0.5f;
    for (int i = 0; i > margin; --i) cand *= 2.f;
    if (finite(cand) && cand > 0.f) s = cand;
  }
  *scale = s;
  *scale_inv = 1.f / s;
  if (roll) {
    for (int64_t l = len - 1; l >= 1; --l) hist[l * stride] = hist[(l - 1) * stride];
    hist[0] = 0.f;
  }
}

/// ops::fp8_seed_scales for one tensor.
MC_HOST_DEVICE void seed_column(float amax, float* seeded, float* scale, float* scale_inv, float fp8_max, int margin) {
  if (!(amax >= 0.f) || *seeded != 0.f) return;
  float a = amax;
  update_column(&a, 1, 1, scale, scale_inv, fp8_max, false, margin, false);
  *seeded = 1.f;
}

}  // namespace megacore::ops::fp8_math
