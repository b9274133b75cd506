// VocabParallelEmbedding: the word-embedding table split over TP along the vocabulary (Megatron-Core's
// VocabParallelEmbedding), with explicit forward and backward.
//
// The table is padded to `padded_vocab_size` rows (by default the vocabulary rounded up to a multiple
// of make_vocab_size_divisible_by × TP, as model::padded_vocab_size does) so every rank owns the same
// number of rows: rank r holds rows [r·V/TP, (r+1)·V/TP). A lookup gives this rank's rows for the ids
// in its range and zeros elsewhere; the TP partial results are summed:
//
//   without SP:  ids [s, b] → local lookup [s, b, h] → reduce_from_tp       → [s, b, h] (replicated)
//   with SP:     ids [s, b] → local lookup [s, b, h] → reduce_scatter_to_sp → [s/TP, b, h]
//
// Padding rows (ids ≥ vocab_size) start at zero and never receive gradient: backward clears their
// main_grad rows, so even an out-of-range id on the GPU (which is not checked there, to avoid a host
// sync) cannot train them. On the CPU such ids are a ValueError.
//
// Initialisation is TP-invariant: every rank draws the full [vocab_size, h] table with Philox from
// (seed, init_offset) (normal(0, init_std)) and keeps its rows; padding rows are zero.
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::layers {

struct VocabParallelEmbeddingOptions {
  /// Rows of the full (padded) table; 0 = vocab_size rounded up to make_vocab_size_divisible_by × TP.
  /// A given value must be ≥ vocab_size and divisible by TP.
  int64_t padded_vocab_size = 0;
  int64_t make_vocab_size_divisible_by = 128;
  /// Output is reduce-scattered along dim 0 (the sequence) instead of all-reduced.
  bool sequence_parallel = false;
  DType params_dtype = DType::F32;
  Device device = Device::cpu();
  double init_std = 0.02;
  uint64_t seed = 1234;
  uint64_t init_offset = 0;
};

/// vocab_size rounded up to a multiple of divisible_by × tp_size (the rule of model::padded_vocab_size).
int64_t pad_vocab_size(int64_t vocab_size, int64_t divisible_by, int tp_size);

class VocabParallelEmbedding {
 public:
  /// `tp` must outlive the layer. Throws ValueError naming the fix for non-positive sizes or a given
  /// padded_vocab_size that is smaller than vocab_size or not divisible by TP.
  VocabParallelEmbedding(comm::Communicator& tp, int64_t vocab_size, int64_t embedding_dim,
                         const VocabParallelEmbeddingOptions& options = {});

  /// ids: i32/i64 of any shape [s, ...] (the same on every TP rank). Returns [*ids.shape, h], or with
  /// sequence_parallel [s/TP, ..., h] (s must be divisible by TP).
  Tensor forward(const ForwardContext& ctx, const Tensor& ids);
  /// dy: gradient of forward's output (same shape). Accumulates the weight's main_grad (token ids
  /// have no gradient).
  void backward(const ForwardContext& ctx, const Tensor& dy);

  /// Moves the saved state of the last forward into `s` (the layer is left with nothing saved) /
  /// back from `s`, in a fixed order; see activation_stash.hpp.
  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  Parameter& weight() { return weight_; }  ///< [padded_vocab/TP, h], partition_dim 0
  std::vector<Parameter*> parameters() { return {&weight_}; }
  void zero_grad() { weight_.main_grad.zero_(); }
  int64_t vocab_size() const { return vocab_; }
  int64_t padded_vocab_size() const { return padded_; }
  int64_t embedding_dim() const { return dim_; }
  /// This rank's rows of the padded table: [vocab_start, vocab_start + vocab_per_rank).
  int64_t vocab_start() const { return start_; }
  int64_t vocab_per_rank() const { return local_; }
  /// Rows of this rank's shard that are real vocabulary (the rest are padding).
  int64_t valid_rows() const;
  const VocabParallelEmbeddingOptions& options() const { return opts_; }

 private:
  comm::Communicator& tp_;
  int64_t vocab_, dim_, padded_, local_, start_;
  VocabParallelEmbeddingOptions opts_;
  Parameter weight_;
  Tensor saved_ids_;
};

}  // namespace megacore::layers
