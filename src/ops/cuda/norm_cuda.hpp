// Private interface between src/ops/norm.cpp and its CUDA kernels (norm.cu). Plain pointers only,
// so the host side needs no CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// Launch shape of the row-in-registers norm kernels. Internal, not user API: the library always runs
/// the defaults; benchmarks/kernels/bench_norm.cpp sweeps alternatives on a card so that the defaults
/// can be chosen from one benchmark run. A thread holds `vecs` 16-byte vectors of its row, so a row of
/// h elements gets about h / (vecs * 16 / sizeof(T)) threads (a multiple of 32, at most 512); rows too
/// short for `min_block` threads share a block. Values the kernels cannot honour for a shape are
/// rounded to ones they can (more vectors per thread when a row would need over 512 threads).
struct NormTuning {
  // Defaults and the measurement behind them: megacore_bench_kernels on an H100 (2026-11-26,
  // benchmarks/results/kernels_NVIDIA_H100.json, bf16, % of copy at 16384x4096 / x8192 / 32768x2048).
  // Backward, shared-memory sums + 16-byte finalize, 4 vectors, 512-thread blocks: RMSNorm
  // 86.2 / 88.4 / 89.4, LayerNorm 85.1 / 88.2 / 86.0; register sums (row f8_breg_fin) 75.3 / 74.1 / 77.0
  // and 78.6 / 78.5 / 80.7; 128-thread blocks (f8_b4_sacc_fin_m128) 85.3 / 87.1 / 86.6 and
  // 82.1 / 86.4 / 84.5. Forward: 8 vectors, 128-thread blocks; 256 (f8_b4_m256_sacc_fin) costs LayerNorm
  // 5.5-6.7 points (84.4 / 89.5 / 86.3 against 90.7 / 96.2 / 91.8).
  int fwd_vecs = 8;               ///< forward: 1, 2, 4 or 8
  int bwd_vecs = 0;               ///< backward: 1 or 2, 4 without prefetch; 0: 4, except 2 for LayerNorm
                                  ///< with the register sums
  int min_block = 128;            ///< threads per block at least, for short rows (with bwd_smem_acc a
                                  ///< larger block also means fewer partial rows for the finalize)
  int bwd_min_block = 0;          ///< the backward's min_block; 0: 512 with the shared-memory sums; with
                                  ///< the register sums max(min_block, 256) for LayerNorm, min_block for
                                  ///< RMSNorm
  bool bwd_prefetch = false;      ///< backward issues the next row's loads before reducing this one
  int bwd_threads_per_sm = 1024;  ///< cap on resident backward threads per SM (0: occupancy only)
  bool bwd_smem_acc = true;       ///< backward keeps the dw/db sums in shared memory, not registers (frees
                                  ///< vecs x 8 (x2 for LayerNorm) registers a thread); one partial row per
                                  ///< block; falls back to the register sums (one partial row per row
                                  ///< group) where the block's sums do not fit in shared memory
  int bwd_finalize = 1;           ///< 0: scalar column-sum kernel per gradient; 1: one launch for dw and
                                  ///< db, 16-byte loads of 32 columns x 32 part slices per block, eight
                                  ///< loads in flight per thread (rows of a multiple of 4 floats; else 0)
  bool bwd_pdl = true;            ///< bwd_finalize 1 on sm_90: the finalize is launched as a programmatic
                                  ///< dependent of the backward (its launch overlaps the backward's last
                                  ///< rows; it waits for the backward's memory before reading)
};

struct NormForwardArgs {
  bool layer = false;         // LayerNorm (else RMSNorm)
  const void* x = nullptr;
  const void* residual = nullptr;  // optional: h = x + residual
  const void* w = nullptr;
  const void* b = nullptr;    // optional (LayerNorm only)
  void* y = nullptr;
  void* residual_out = nullptr;    // written when residual is given
  float* mean = nullptr;      // LayerNorm only
  float* rstd = nullptr;
  int64_t rows = 0, h = 0;
  float eps = 0;
  NormTuning tuning{};
};
void norm_forward(DType dt, const NormForwardArgs& a, int device, void* stream);

struct NormBackwardArgs {
  bool layer = false;
  const void* dy = nullptr;
  const void* dresidual = nullptr;  // optional, added to dx
  const void* x = nullptr;
  const void* w = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  void* dx = nullptr;
  void* dw = nullptr;
  DType dw_dtype = DType::F32;
  void* db = nullptr;  // optional
  DType db_dtype = DType::F32;
  bool accumulate = false;
  int64_t rows = 0, h = 0;
  NormTuning tuning{};
};
/// Bytes of f32 scratch norm_backward needs (per-block partial weight/bias gradients).
size_t norm_backward_workspace_bytes(const NormBackwardArgs& a, DType dt, int device);
void norm_backward(DType dt, const NormBackwardArgs& a, void* workspace, int device, void* stream);

}  // namespace megacore::ops::cuda
