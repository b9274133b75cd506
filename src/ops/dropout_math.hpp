// The dropout keep decision shared by the CPU path and the CUDA kernel.
#pragma once

#include <cmath>
#include <cstdint>

#include "megacore/core/random.hpp"

namespace megacore::ops::dropmath {

/// Keep when (word >> 8) >= threshold, i.e. uniform = (word >> 8) / 2^24 >= p, decided in integers so
/// host and device agree exactly.
inline uint32_t threshold(float p) { return uint32_t(std::ceil(double(p) * 16777216.0)); }

MC_HOST_DEVICE bool keep_word(uint32_t word, uint32_t thr) { return (word >> 8) >= thr; }

}  // namespace megacore::ops::dropmath
