// Private interface between src/ops/rope.cpp and its CUDA kernel (rope.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

struct RopeArgs {
  const void* x = nullptr;
  void* y = nullptr;
  const void* positions = nullptr;
  bool positions_i64 = false;
  const float* inv_freq = nullptr;
  int64_t tokens = 0, heads = 0, head_dim = 0, rotary_dim = 0;
  bool interleaved = false;
  bool backward = false;  // rotate by the negative angle
};
void rope(DType dt, const RopeArgs& a, int device, void* stream);

}  // namespace megacore::ops::cuda
