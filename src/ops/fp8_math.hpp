// Per-element and per-column FP8 scaling math shared by the CPU path (fp8.cpp) and the CUDA kernels
// (cuda/fp8.cu), so both give the same bits.
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::fp8_math {

/// |v| as f32 bits: unsigned comparison orders them like the magnitudes, with NaN above +inf (so a NaN
/// wins an amax reduction done with integer max, which the CUDA kernels do with atomicMax).
MC_HOST_DEVICE uint32_t abs_bits(float v) { return f32_bits(v) & 0x7fffffffu; }

MC_HOST_DEVICE bool finite(float v) { return (f32_bits(v) & 0x7f800000u) != 0x7f800000u; }

/// Quantises v · scale into Q; reports saturation (|v · scale| > max, NaN not counted) and flush to zero.
template <class Q>
MC_HOST_DEVICE uint8_t quantize(float v, float scale, bool& overflow, bool& underflow) {
  const float y = v * scale;
  const uint8_t q = Q::from_float(y);
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

}  // namespace megacore::ops::fp8_math
