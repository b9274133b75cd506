// Private interface between src/ops/activation.cpp and its CUDA kernels (activation.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"
#include "ops/activation_math.hpp"

namespace megacore::ops::cuda {

/// Launch shape of the elementwise activation kernels: `unroll` 16-byte vectors in flight per thread
/// (1, 2 or 4), `threads` per block, at most `blocks_per_sm` blocks per SM with grid-stride rounds
/// beyond (0: one round, as many blocks as the tensor needs). ops::activation_* use {}; the benchmark
/// runs the others.
struct ActTuning {
  // H100 (benchmarks/results/kernels_NVIDIA_H100.json, 2026-11-26), bf16 16384 x 14336: one vector per
  // thread in one round of blocks, GELU-tanh fwd 98.7 % of copy, against 90.5 % with 16 blocks per SM
  // and grid-stride rounds (bench row u1_g16).
  int unroll = 1;
  int threads = 256;
  int blocks_per_sm = 0;
};

/// out = act(x) (dy == nullptr) or dy * act'(x), n elements.
void activation(DType dt, actmath::Act act, const void* x, const void* dy, void* out, int64_t n, int device,
                void* stream, const ActTuning& tuning = {});
/// Forward: x [rows, 2f] -> y [rows, f]. Backward (dy != nullptr): dx [rows, 2f].
void swiglu(DType dt, const void* x, const void* dy, void* out, int64_t rows, int64_t f, int device, void* stream);

}  // namespace megacore::ops::cuda
