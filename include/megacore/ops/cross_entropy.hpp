// Softmax cross-entropy over the vocabulary, fused so that training never holds a second
// vocabulary-sized tensor: the gradient can be written over the logits in place.
//
// logits are [N, V] (f32/bf16/f16, contiguous), labels [N] (i32/i64). Per row i with target t:
//   lse_i  = log sum_j exp(z_ij)
//   loss_i = lse_i - (1 - eps) z_it - (eps / V) sum_j z_ij     (label smoothing eps, as torch defines it)
//   dz_ij  = dloss_i (softmax_ij - (1 - eps) [j == t] - eps / V)
// Rows whose label equals ignore_index have loss 0 and gradient 0. A per-token loss mask (f32 [N])
// multiplies loss and gradient. Labels outside [0, V) (other than ignore_index) are a ValueError on
// the CPU; on the GPU, where checking would need a host sync, such a row's loss is NaN, never a
// plausible number. Statistics are accumulated in f32 (CPU reference: f64).
//
// Vocabulary-parallel (tensor-parallel) use: each rank holds logits for vocab columns
// [vocab_start, vocab_start + V_local). It computes cross_entropy_shard_stats, all-reduces the row
// max (MAX), rescales its sum-exp to the global max (cross_entropy_rescale_sum_exp), all-reduces
// sum-exp, target logit and sum of logits (SUM), then cross_entropy_loss_from_stats gives loss and
// lse, and cross_entropy_backward (with vocab_start and the full vocab size) the shard's gradient.
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

struct CrossEntropyOptions {
  float label_smoothing = 0.f;  ///< in [0, 1)
  int64_t ignore_index = -100;  ///< label that marks a row without loss (Megatron / torch default)
};

/// Forward and backward in one pass over the logits. loss and lse (may be undefined) are f32 [N];
/// dlogits has logits' shape and dtype and may be logits itself. The gradient is that of
/// sum_i loss_i times grad_scale (for a mean over tokens pass 1 / number of counted tokens).
/// loss_mask (f32 [N]) may be undefined.
void cross_entropy_fused(const Tensor& logits, const Tensor& labels, Tensor& loss, Tensor& lse, Tensor& dlogits,
                         float grad_scale, const Tensor& loss_mask = {}, const CrossEntropyOptions& opts = {},
                         const Stream& s = {});

/// Loss and lse (f32 [N]) only; loss_mask may be undefined.
void cross_entropy_forward(const Tensor& logits, const Tensor& labels, Tensor& loss, Tensor& lse,
                           const Tensor& loss_mask = {}, const CrossEntropyOptions& opts = {}, const Stream& s = {});

/// dlogits = dloss_i (softmax - target distribution) from the saved lse; dloss is f32 [N] (mask and
/// scale already applied). dlogits may be logits. For a vocabulary shard, logits are the shard's
/// columns starting at vocab_start and vocab_size is the full vocabulary (-1: the shard is all of it).
void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, const Tensor& dloss,
                            Tensor& dlogits, const CrossEntropyOptions& opts = {}, const Stream& s = {},
                            int64_t vocab_start = 0, int64_t vocab_size = -1);

/// Per-row statistics of a vocabulary shard, all f32 [N]: row_max, sum_exp = sum exp(z - row_max),
/// target_logit (0 where the label is outside the shard or ignored), sum_logits.
void cross_entropy_shard_stats(const Tensor& logits, const Tensor& labels, int64_t vocab_start, Tensor& row_max,
                               Tensor& sum_exp, Tensor& target_logit, Tensor& sum_logits, const Stream& s = {});
/// sum_exp *= exp(local_max - global_max), in place, before the sum over ranks.
void cross_entropy_rescale_sum_exp(const Tensor& local_max, const Tensor& global_max, Tensor& sum_exp,
                                   const Stream& s = {});
/// loss and lse from the combined statistics (global max, global sum-exp relative to it, target
/// logit, sum of logits over the full vocabulary of vocab_size entries).
void cross_entropy_loss_from_stats(const Tensor& global_max, const Tensor& sum_exp, const Tensor& target_logit,
                                   const Tensor& sum_logits, const Tensor& labels, int64_t vocab_size, Tensor& loss,
                                   Tensor& lse, const Tensor& loss_mask = {}, const CrossEntropyOptions& opts = {},
                                   const Stream& s = {});

namespace ref {
/// Float64 reference: loss [n] and, when dlogits != nullptr, the gradient of sum_i dloss_i loss_i.
void cross_entropy_f64(const double* logits, const int64_t* labels, const double* dloss, double* loss,
                       double* dlogits, int64_t n, int64_t v, double label_smoothing, int64_t ignore_index);
}  // namespace ref

}  // namespace megacore::ops
