// Dtype conversion between f32, bf16 and f16 for contiguous tensors, with 16-byte accesses
// (Tensor::copy_ handles any layout; this is the fast path for the common contiguous case).
#pragma once

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// dst = src rounded to dst's dtype (nearest even); same shape, both contiguous, one device.
void cast(const Tensor& src, Tensor& dst, const Stream& s = {});

}  // namespace megacore::ops
