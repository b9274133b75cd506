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

/// What every RoPE launch shares: the angles' inputs and the per-token row shape.
struct RopeCommon {
  const void* positions = nullptr;
  bool positions_i64 = false;
  const float* inv_freq = nullptr;
  int64_t tokens = 0, head_dim = 0, rotary_dim = 0;
  bool interleaved = false;
  RopeTuning tuning{};
};

/// rope_forward / rope_backward: x and y [tokens, heads, head_dim] (y may be x).
struct RopeArgs : RopeCommon {
  const void* x = nullptr;
  void* y = nullptr;
  int64_t heads = 0;
  bool backward = false;  // rotate by the negative angle
};
void rope(DType dt, const RopeArgs& a, int device, void* stream);

/// qkv_split_rope (merge = false) and qkv_merge_rope_backward (merge = true): the grouped QKV tensor
/// [tokens, groups, hpg + 2, head_dim] against contiguous q [tokens, groups · hpg, head_dim] and k, v
/// [tokens, groups, head_dim]. The split reads qkv and writes q, k, v; the merge reads q, k, v (the
/// gradients) and writes qkv, rotating by the negative angle.
struct QkvRopeArgs : RopeCommon {
  void* qkv = nullptr;
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  int64_t groups = 0, hpg = 0;
  bool merge = false;
};
void qkv_rope(DType dt, const QkvRopeArgs& a, int device, void* stream);

/// The fused kernel's launch shapes (its rows are found through their group, so its best shape is not plain
/// RoPE's): `megacore_bench_kernels --filter qkv_rope --variants` on an H200, 2026-11-27, at the 1.1B step's
/// 8192 tokens x 8 groups x (4 + 2) heads x 64: split 0.055 ms with all heads per thread and unroll 2 (0.079
/// with RopeTuning's defaults), merge 0.036 ms with 16 heads per thread and unroll 2 (0.053).
inline constexpr RopeTuning kQkvSplitTuning{.threads = 128, .head_chunk = 0, .unroll = 2};
inline constexpr RopeTuning kQkvMergeTuning{.threads = 128, .head_chunk = 16, .unroll = 2};

}  // namespace megacore::ops::cuda
