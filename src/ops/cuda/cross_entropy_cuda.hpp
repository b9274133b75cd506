// Private interface between src/ops/cross_entropy.cpp and its CUDA kernels (cross_entropy.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

enum class CeMode : int { Fused = 0, Forward = 1, Backward = 2, Stats = 3 };

/// Launch shape of the cross-entropy kernel. Internal, not user API: the library always runs the
/// defaults; benchmarks/kernels/bench_cross_entropy.cpp sweeps alternatives on a card so the defaults
/// can be chosen from one benchmark run.
struct CeTuning {
  int threads = 512;          ///< per block (one row at a time): 128..512, a multiple of 32
  int unroll = 0;             ///< 16-byte loads in flight per thread: 1, 2, 4 or 8; 0: 8 for rows over
                              ///< 128 KiB, else 4
  int blocks_per_sm = 4;      ///< persistent grid, before the L2 limit below
  float l2_fraction = 0.f;    ///< Fused: rows in flight hold at most this share of L2, so pass 2 hits it;
                              ///< 0: 0.75 for rows up to 128 KiB, else 0.5
  bool stream_pass2 = true;   ///< pass 2 reads are the logits' last use: evict-first
  int cluster = 0;            ///< Fused only: >= 1 keeps each row in the shared memory of a cluster of this
                              ///< many CTAs (1..8; bulk-copied once from device memory, gradient written
                              ///< from shared memory; threads as above, unroll / blocks_per_sm / l2_fraction
                              ///< unused); 0, or a row slice that does not fit, or not the 16-byte path:
                              ///< the two-pass kernel
};

struct CeArgs {
  CeMode mode = CeMode::Fused;
  const void* logits = nullptr;  // [n, v_local]
  void* dlogits = nullptr;       // Fused / Backward; may equal logits
  const void* labels = nullptr;
  bool labels_i64 = false;
  const float* loss_mask = nullptr;  // optional (Fused / Forward)
  const float* lse_in = nullptr;     // Backward
  const float* dloss = nullptr;      // Backward
  float* loss = nullptr;             // Fused / Forward
  float* lse_out = nullptr;          // Fused / Forward, optional
  float* row_max = nullptr;          // Stats
  float* sum_exp = nullptr;          // Stats
  float* target = nullptr;           // Stats
  float* sum_logits = nullptr;       // Stats
  int64_t n = 0, v = 0;              // rows, local vocab
  int64_t vocab_start = 0, vocab_total = 0;
  float grad_scale = 1.f;
  float label_smoothing = 0.f;
  int64_t ignore_index = -100;
  CeTuning tuning{};
};
void cross_entropy(DType dt, const CeArgs& a, int device, void* stream);
/// The launch shape the library uses (the public ops): CeTuning{}, the two-pass kernel, at every shape
/// (H100, bf16 fused, kernels_NVIDIA_H100.json: 94.5 % of copy at 8192x32000, 89.6 % at 8192x128256; the
/// row-on-chip kernel at best 91.0 / 89.0 %). The row-on-chip kernel stays a tuning choice (CeTuning::cluster).
CeTuning ce_default_tuning(DType dt, CeMode mode, int64_t v);
/// Whether cross_entropy runs a's row-on-chip kernel (a.tuning.cluster >= 1 and the row slice fits).
bool ce_row_on_chip(DType dt, const CeArgs& a, int device);

/// sum_exp[i] *= exp(local_max[i] - global_max[i]).
void ce_rescale(const float* local_max, const float* global_max, float* sum_exp, int64_t n, int device, void* stream);
/// loss and lse from combined statistics.
void ce_loss_from_stats(const float* gmax, const float* sum_exp, const float* target, const float* sum_logits,
                        const void* labels, bool labels_i64, const float* mask, int64_t n, int64_t vocab,
                        float label_smoothing, int64_t ignore_index, float* loss, float* lse, int device,
                        void* stream);

}  // namespace megacore::ops::cuda
