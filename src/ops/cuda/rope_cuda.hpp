// Private interface between src/ops/rope.cpp and its CUDA kernel (rope.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// Launch shape of the RoPE kernel. Internal, not user API: the library runs the defaults;
/// benchmarks/kernels/bench_rope_act.cpp times alternatives so that the defaults can be chosen from one
/// benchmark run. Values the kernel cannot honour are rounded to ones it can.
struct RopeTuning {
  int threads = 128;    ///< per block (a block holds whole tokens: at least the threads of one token)
  int head_chunk = 4;   ///< heads a thread walks with one sin/cos evaluation; 0: all heads of the token
                        ///< (the first kernel's shape: one wave of long-lived threads)
  int unroll = 4;       ///< heads whose loads are issued before any is used: 1, 2 or 4 (4: 117 registers
                        ///< for bf16 on sm_90, a third of the threads per SM)
                        ///< Defaults: H100, 16384 x 32 x 128 bf16 (kernels_NVIDIA_H100.json): chunk 4 +
                        ///< unroll 4 90.7 % of copy, chunk 8 + unroll 2 88.4 %, all heads unroll 1 85.5 %.
};

struct RopeArgs {
  const void* x = nullptr;
  void* y = nullptr;
  const void* positions = nullptr;
  bool positions_i64 = false;
  const float* inv_freq = nullptr;
  int64_t tokens = 0, heads = 0, head_dim = 0, rotary_dim = 0;
  bool interleaved = false;
  bool backward = false;  // rotate by the negative angle
  RopeTuning tuning{};
};
void rope(DType dt, const RopeArgs& a, int device, void* stream);

}  // namespace megacore::ops::cuda
