// Private interface between src/ops/dropout.cpp and its CUDA kernel (dropout.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// y = x * keep * scale for n elements; mask (optional) gets keep as 0/1 bytes.
void dropout(DType dt, const void* x, void* y, uint8_t* mask, int64_t n, uint32_t threshold, float scale,
             uint64_t seed, uint64_t offset, int device, void* stream);

}  // namespace megacore::ops::cuda
