// LoRA adapters (low-rank adaptation, Hu et al. 2021) on the tensor-parallel linear layers, laid out
// as Megatron-Core / NeMo lay them out:
//
//   y = x Wᵀ + (alpha / r) · dropout(x) Aᵀ Bᵀ          A [r, in], B [out, r]
//
//   column-parallel base (W split by output rows): A [r, in] replicated, B [out/TP, r] split by output.
//     The low-rank path runs on the same (with SP: all-gathered) input as the base GEMM and adds to this
//     rank's output columns. In backward dh = dy_local B_local is this rank's share of the sum over TP, so
//     A's gradient is a TP-partial sum, and so is the input-gradient term dh A, which is added into the
//     base's input gradient before its TP all-reduce (or reduce-scatter with SP): no extra collective.
//   row-parallel base (W split by input columns): A [r, in/TP] split by input, B [out, r] replicated.
//     h = x_local A_localᵀ is a TP-partial sum; since B is replicated, h Bᵀ is added to the base's partial
//     product before its all-reduce (or reduce-scatter with SP), so the sum over TP is the exact low-rank
//     output, again with no extra collective. In backward dy is the full (gathered) gradient, so B's
//     gradient dyᵀ h_local is a TP-partial sum; dh = dy B is complete and A's gradient is exact.
//   The TP-partial gradients (A of a column adapter, B of a row adapter) are flagged like sequence-parallel
//   gradients (Parameter::sequence_parallel) and summed over TP once per backward group by the model.
//
// Segments: one adapter may hold several independent (A, B) pairs, each covering a block pattern of
// the base's local output features. The local output features are viewed as [blocks, block_width]
// and segment j owns columns [col0, col0 + width) of every block. This keeps the fused QKV weight's
// q, k and v adapters separable (grouped layout: blocks = query groups per rank, block_width =
// (heads/groups + 2)·d) and SwiGLU's [gate | up] fc1 (blocks = 1, two halves), so each exports to its
// own Hugging Face PEFT module (q_proj, k_proj, v_proj, gate_proj, up_proj). Segment j's B shard is a
// contiguous slice of its full B rows (rank r holds rows r·out_j/TP ..), as for an ordinary column split.
//
// Initialisation (as PEFT): B = 0 and A uniform in ±1/sqrt(in) (PyTorch's kaiming_uniform(a = √5)
// bound), drawn in full with Philox from (seed, init_offset + j) and sliced, so it does not depend on TP.
//
// Dropout on the adapter's input (Philox, ops/dropout.hpp): the mask is regenerated in backward from the
// forward's (seed, counter) instead of being stored. Every adapter draws from its own seed stream, and
// each training forward advances its counter. For a column-parallel base the input (and so the mask) is
// the same on every TP rank; for a row-parallel base each rank draws the mask of its input slice, so
// masks (not their distribution) depend on the TP degree. Full activation recompute replays the first
// pass's draw (ForwardContext::recompute_pass).
//
// Saved activations: h = dropout(x) Aᵀ per segment ([rows, r], small) and the dropout counter; the
// input itself is the base layer's saved input, which the base passes back into backward.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::layers {

struct LoRAOptions {
  int64_t rank = 8;      ///< r, the inner dimension (> 0)
  double alpha = 16.0;   ///< the low-rank output is scaled by alpha / r
  double dropout = 0.0;  ///< dropout probability on the adapter's input, [0, 1)
  uint64_t seed = 1234;
  /// Philox offset of segment 0's A draw (segment j uses init_offset + j); give every adapter its own range.
  uint64_t init_offset = 0;
};

/// Where a segment's outputs sit in the base's local output features (see the header comment).
struct LoRASegment {
  std::string name;         ///< "q_proj", "gate_proj", ...; empty for an adapter covering the whole layer
  int64_t out_features = 0; ///< full (all TP ranks) output features of the segment = rows of its full B
  int64_t blocks = 1, block_width = 0, col0 = 0, width = 0;  ///< local placement; width · blocks = out/TP
};

/// The low-rank path of one ColumnParallelLinear (Kind::Column) or RowParallelLinear (Kind::Row).
class LoRAAdapter {
 public:
  enum class Kind { Column, Row };

  /// in_features: the base's FULL input features. For Kind::Row `segments` must be one segment covering
  /// the full output. Throws ValueError naming the fix for a rank r ≤ 0 or larger than min(in, out) of a
  /// segment, a dropout outside [0, 1), or a placement that does not tile the output.
  LoRAAdapter(comm::Communicator& tp, Kind kind, int64_t in_features, std::vector<LoRASegment> segments,
              const LoRAOptions& options, DType dtype, Device device);

  /// x2: the base's GEMM input rows ([rows, in] for Column (SP: gathered), [rows, in/TP] for Row);
  /// y2: the base's contiguous GEMM output [rows, out/TP] (Column) or partial product [rows, out] (Row)
  /// before any TP reduction; the scaled low-rank product is added into it.
  void forward(const ForwardContext& ctx, const Tensor& x2, Tensor& y2);
  /// x2: the same rows forward saw; dy2: [rows, out/TP] (Column) or the full [rows, out] (Row).
  /// Accumulates the A and B main_grads and returns the low-rank path's input gradient, contiguous
  /// [rows, x2's features] (for a Column adapter a TP-partial sum): the base accumulates its own dY·W
  /// into it (GEMM beta = 1) before its TP reduction.
  Tensor backward(const ForwardContext& ctx, const Tensor& x2, const Tensor& dy2);

  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  /// Adds scale · B A of every segment into `weight` (the base's local shard, [out/TP, in] or [out, in/TP]).
  void merge_into(Tensor& weight, const Stream& s = {}) const;

  /// (name suffix, parameter) pairs: "<segment>.lora_A.weight", "<segment>.lora_B.weight" per segment
  /// (without the "<segment>." for an unnamed one).
  std::vector<std::pair<std::string, Parameter*>> named_parameters();
  Kind kind() const { return kind_; }
  int64_t in_features() const { return in_; }
  const std::vector<LoRASegment>& segments() const { return segs_; }
  const LoRAOptions& options() const { return opts_; }
  double scale() const { return opts_.alpha / double(opts_.rank); }
  /// A and B of segment j.
  Parameter& lora_a(size_t j) { return a_.at(j); }
  Parameter& lora_b(size_t j) { return b_.at(j); }

 private:
  Tensor dropped(const Tensor& x2, const Stream& s) const;

  comm::Communicator& tp_;
  Kind kind_;
  int64_t in_, in_local_;
  std::vector<LoRASegment> segs_;
  LoRAOptions opts_;
  DType dtype_;
  Device device_;
  std::vector<Parameter> a_, b_;
  uint64_t dropout_seed_ = 0, next_counter_ = 0, counter_ = 0;
  std::vector<Tensor> saved_h_;
};

/// The target names a user may give, in the order they are documented.
const std::vector<std::string>& lora_target_names();

}  // namespace megacore::layers
