// Private interface between src/ops/dropout.cpp and its CUDA kernel (dropout.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// Launch shape of the dropout kernel. Internal, not user API: the library runs the defaults;
/// benchmarks/kernels/bench_optimizer.cpp times alternatives so that the defaults can be chosen from
/// one benchmark run. The mask does not depend on it (element i always uses word i mod 4 of Philox
/// call i / 4). Values the kernel cannot honour are rounded to ones it can.
struct DropoutTuning {
  int elems = 8;         ///< elements per thread and step: 4 (one Philox call; 8-byte bf16 accesses, the
                         ///< first kernel's shape) or 8 (two calls; 16-byte bf16 accesses)
  int unroll = 2;        ///< steps whose loads are issued before any is used: 1, 2 or 4
  int threads = 256;     ///< per block
  int blocks_per_sm = 16; ///< grid = SMs x this; 0: as many blocks as are resident at once (one wave).
                          ///< H100, 16384 x 8192 bf16 (kernels_NVIDIA_H100.json): 16 per SM 88.8 % of
                          ///< copy, one wave 86.5 %, 4 elements per step 83.6 %.
};

/// y = x * keep * scale for n elements; mask (optional) gets keep as 0/1 bytes.
void dropout(DType dt, const void* x, void* y, uint8_t* mask, int64_t n, uint32_t threshold, float scale,
             uint64_t seed, uint64_t offset, int device, void* stream, const DropoutTuning& tuning = {});

}  // namespace megacore::ops::cuda
