// Vocabulary-parallel softmax cross-entropy (Megatron-Core's vocab_parallel_cross_entropy), with
// explicit forward and backward.
//
// Each TP rank holds the logits of its vocabulary shard [tokens, V/TP] (columns
// [r·V/TP, (r+1)·V/TP) of the padded vocabulary, as the column-parallel output layer produces them).
// The full-vocabulary softmax is assembled from per-shard statistics without gathering the logits:
//
//   local row max, sum-exp, target logit, sum of logits  →  all-reduce MAX of the row max
//   → rescale the local sum-exp to the global max  →  one all-reduce SUM of [sum-exp; target; sum]
//   → per-token loss and lse (every rank gets the same loss)
//
// The target logit comes from the one rank whose shard holds the label (the others contribute 0).
// Padded vocabulary columns (ids ≥ vocab_size) are excluded: they never enter the max, the sum-exp,
// the label-smoothing sum, and their gradient is zero, so the result equals ops::cross_entropy_fused
// on the unpadded [tokens, vocab_size] logits. Label smoothing spreads eps over vocab_size classes.
// Rows labelled ignore_index, and rows whose loss_mask is 0, have loss 0 and no gradient.
#pragma once

#include <cstdint>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/ops/cross_entropy.hpp"

namespace megacore::layers {

struct VocabParallelCrossEntropyOptions {
  float label_smoothing = 0.f;  ///< in [0, 1)
  int64_t ignore_index = -100;
};

class VocabParallelCrossEntropy {
 public:
  /// `vocab_size` is the real (unpadded) vocabulary. `tp` must outlive the object.
  VocabParallelCrossEntropy(comm::Communicator& tp, int64_t vocab_size,
                            const VocabParallelCrossEntropyOptions& options = {});

  /// logits: [..., V/TP] (f32/bf16/f16), this rank's vocabulary shard of the padded vocabulary;
  /// labels: i32/i64 with one entry per logits row (e.g. [s, b] for [s, b, V/TP]), the same on every
  /// TP rank; loss_mask: optional f32 with labels' element count, multiplying each token's loss.
  /// Returns the per-token loss (f32, labels' shape), identical on every TP rank.
  Tensor forward(const ForwardContext& ctx, const Tensor& logits, const Tensor& labels, const Tensor& loss_mask = {});
  /// Gradient of grad_scale · Σ_tokens loss (pass 1 / counted tokens for a mean) with respect to this
  /// rank's logits shard (logits' shape and dtype). Stays on the device.
  Tensor backward(const ForwardContext& ctx, float grad_scale);
  /// Gradient given dloss (f32, labels' element count), the gradient of forward's returned loss. With
  /// a loss_mask on a GPU this multiplies mask and dloss on the host (a sync); prefer the grad_scale
  /// overload in training loops.
  Tensor backward(const ForwardContext& ctx, const Tensor& dloss);

  /// Moves the saved state of the last forward into `s` (the loss is left with nothing saved) /
  /// back from `s`, in a fixed order; see activation_stash.hpp.
  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  /// The log-sum-exp of each row over the full vocabulary, from the last forward (f32 [tokens]).
  const Tensor& lse() const { return lse_; }
  int64_t vocab_size() const { return vocab_; }
  const VocabParallelCrossEntropyOptions& options() const { return opts_; }

 private:
  Tensor backward_impl(const ForwardContext& ctx, const Tensor& dloss_flat);

  comm::Communicator& tp_;
  int64_t vocab_;
  VocabParallelCrossEntropyOptions opts_;
  // Saved by forward for backward.
  Tensor logits_;       // [N, V/TP] rows as given
  Tensor valid_logits_; // the real-vocabulary columns, contiguous (logits_ itself when no padding)
  Tensor labels_;       // [N]
  Tensor mask_;         // [N] or undefined
  Tensor lse_;          // [N]
  Shape logits_shape_;
  int64_t start_ = 0, valid_ = 0;
};

}  // namespace megacore::layers
