// Parameter: one trainable tensor (this rank's shard) with its f32 gradient accumulator.
#pragma once

#include <string>
#include <vector>

#include "megacore/core/tensor.hpp"

namespace megacore::layers {

struct Parameter {
  std::string name;  ///< "weight", "bias"; models prefix it with the module path
  /// This rank's shard, in the layer's params dtype.
  Tensor data;
  /// f32 gradient of the same shape; backward accumulates into it (gemm beta = 1), so several
  /// micro-batches add up until the optimizer zeroes it.
  Tensor main_grad;
  /// Dimension along which the full tensor is split over TP, or -1 when it is replicated.
  int partition_dim = -1;
  /// How the full tensor maps onto the TP shards along partition_dim: the full dimension is
  /// `partition_chunks` equal blocks, each split evenly over TP, and this rank's shard is its piece of
  /// every block, concatenated in block order. 1 for an ordinary contiguous slice; 2 for SwiGLU's fused
  /// fc1 ([gate ; up] full, [gate_r ; up_r] on rank r). Checkpoints use it to place shards in the full
  /// tensor independently of the TP degree.
  int partition_chunks = 1;
  /// True for a replicated parameter whose gradient each TP rank computed from only its share (biases and
  /// norms after a sequence-parallel region: its sequence chunk; qk_layernorm's head norms: its heads):
  /// main_grad must be summed over the TP group before the optimizer uses it
  /// (layers::allreduce_sequence_parallel_grads). model::TransformerBlock sums it after each layer's backward,
  /// one small all-reduce per flagged parameter (Megatron-Core defers it to once per step).
  bool sequence_parallel = false;
  /// True for a routed expert's weight (MoE): its gradient is reduced over the expert-data-parallel group
  /// (ProcessGrid::expert_dp), not DP×CP, and ZeRO-1 shards it over that group.
  bool expert = false;
  /// For an expert parameter: dim 0 indexes local experts; this shard holds global experts
  /// [expert_offset, expert_offset + data.size(0)) of num_experts (checkpoints place it with them).
  int64_t expert_offset = 0;
  int64_t num_experts = 0;
};

}  // namespace megacore::layers
