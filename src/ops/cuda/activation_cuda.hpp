// Private interface between src/ops/activation.cpp and its CUDA kernels (activation.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"
#include "ops/activation_math.hpp"

namespace megacore::ops::cuda {

/// out = act(x) (dy == nullptr) or dy * act'(x), n elements.
void activation(DType dt, actmath::Act act, const void* x, const void* dy, void* out, int64_t n, int device,
                void* stream);
/// Forward: x [rows, 2f] -> y [rows, f]. Backward (dy != nullptr): dx [rows, 2f].
void swiglu(DType dt, const void* x, const void* dy, void* out, int64_t rows, int64_t f, int device, void* stream);

}  // namespace megacore::ops::cuda
