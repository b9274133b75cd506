// Dropout from the counter-based Philox generator: the mask is a function of (seed, offset, element
// index) alone, so backward and activation recompute regenerate it instead of storing it, and the CPU
// and GPU draw the same mask.
//
// Element i is kept when the 24-bit uniform from word (i mod 4) of philox(seed, offset, i / 4) is
// >= p (one Philox evaluation serves four elements); kept elements are scaled by 1 / (1 - p).
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// y = x * keep / (1 - p); y may be x. p in [0, 1). mask (optional, u8, x's shape) receives keep.
void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset, const Stream& s = {},
                     Tensor* mask = nullptr);
/// dx = dy * keep / (1 - p), keep regenerated from (seed, offset); dx may be dy.
void dropout_backward(const Tensor& dy, Tensor& dx, float p, uint64_t seed, uint64_t offset, const Stream& s = {});

}  // namespace megacore::ops
