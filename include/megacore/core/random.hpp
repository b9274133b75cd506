// Counter-based random numbers (Philox4x32-10) that are identical on the host and on the GPU.
//
// Element i of a draw with (seed, offset) uses counter (i_lo, i_hi, offset_lo, offset_hi) and key
// (seed_lo, seed_hi), so the value depends only on (seed, offset, i): not on thread layout or
// device. A Generator hands out a fresh offset per draw, so recomputation (dropout in activation
// recompute) reproduces a draw by reusing its (seed, offset).
#pragma once

#include <cmath>
#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore {

struct Philox4 {
  uint32_t v[4];
};

/// Philox4x32 with 10 rounds.
MC_HOST_DEVICE Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = uint64_t(kM0) * ctr.v[0];
    uint64_t p1 = uint64_t(kM1) * ctr.v[2];
    uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

/// The four raw 32-bit words for element i of draw (seed, offset).
MC_HOST_DEVICE Philox4 philox_words(uint64_t seed, uint64_t offset, uint64_t i) {
  return philox4x32_10(Philox4{{uint32_t(i), uint32_t(i >> 32), uint32_t(offset), uint32_t(offset >> 32)}},
                       uint32_t(seed), uint32_t(seed >> 32));
}

/// Uniform in [0, 1) with 24 random bits (exactly representable in f32).
MC_HOST_DEVICE float philox_uniform(uint64_t seed, uint64_t offset, uint64_t i) {
  return float(philox_words(seed, offset, i).v[0] >> 8) * (1.0f / 16777216.0f);
}

/// Standard normal by Box-Muller, computed in f64 so host and device round to the same f32.
MC_HOST_DEVICE float philox_normal(uint64_t seed, uint64_t offset, uint64_t i) {
  Philox4 w = philox_words(seed, offset, i);
  double u1 = (double(w.v[0] >> 8) + 1.0) * (1.0 / 16777216.0);  // (0, 1]
  double u2 = double(w.v[1] >> 8) * (1.0 / 16777216.0);          // [0, 1)
  return float(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/// Hands out (seed, offset) pairs. Not thread-safe; keep one per stream of work.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0, uint64_t offset = 0) : seed_(seed), offset_(offset) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  /// Returns the offset for the next draw and advances past it.
  uint64_t next_offset(uint64_t n = 1) {
    uint64_t o = offset_;
    offset_ += n;
    return o;
  }
  void set_state(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }

 private:
  uint64_t seed_, offset_;
};

}  // namespace megacore
