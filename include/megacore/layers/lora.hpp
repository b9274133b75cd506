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
//
// Fused path (LoRAOptions::fused, on by default; MEGACORE_LORA_FUSED=0 in the environment turns it off
// for every adapter attached later). attach_lora binds the adapter to its base weight: W [out, in] and the
// A's of all segments, stacked as rows, move into ONE buffer F = [W ; A_0 ; A_1 ..] of [out + ΣR, in]
// (ΣR = r · segments; for a row-parallel base the local [out, in/TP] and [r, in/TP], which share the
// input-column split). The Parameter objects point at their rows of F, so the optimizer, checkpoints,
// merge and export see the same tensors as before. Then
//   forward:  Z = x Fᵀ, one GEMM and one read of x, gives [x Wᵀ (+ bias) | h_0 | h_1 ..] ([rows, out + ΣR],
//             the bias padded with zeros for the h columns); per segment y_j = scale · h_j B_jᵀ + Z's
//             segment columns, written straight into the contiguous output (GEMM with a separate beta
//             source, ops::GemmOptions::c; strided-batched over the segment's blocks, so q/k/v of the
//             grouped QKV need no gather or scatter). A segment set that leaves output columns uncovered
//             (q_proj alone) first copies Z's output columns.
//   backward: every segment's dh_j = scale · dy_j B_j is written into one [rows, ΣR] buffer and the input
//             gradient of the low-rank path is ONE product dh · [A_0 ; A_1 ..] (K = ΣR) with F's A rows,
//             into which the base's dy W accumulates (beta = 1). dy is not copied beside dh to make it a
//             single [dy | dh] · F product: that copy moves rows · out elements each way, more than the
//             one accumulating read of dx (rows · in) it would save for q/k/v and gate/up.
// A's gradients are TP-partial or exact as in the unfused path; their f32 main_grads and f32 masters are
// untouched (only A's bf16/f32 data lives in F). When data-parallel buffers move A's data elsewhere
// (optim::ParamAndGradBuffer re-points every trainable parameter), each forward copies the current A's
// into F's rows (r · in elements per segment, small beside the activations). If the base weight itself
// was moved out of F (a trainable base in a DDP buffer), the layer runs the unfused path.
// Not fused: dropout > 0 (the adapter's input dropout(x) is not the base's x, so one product cannot
// serve both; said once in the log at attach), a base weight of another dtype or not contiguous.
// merge_lora adds scale · B A into W's rows of F and then gives W its own storage again.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
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
  /// Run the base GEMM and the low-rank path fused (see the header comment); MEGACORE_LORA_FUSED=0 in the
  /// environment overrides it to false. Both paths give the same results up to rounding.
  bool fused = true;
};

/// Where a segment's outputs sit in the base's local output features (see the header comment).
struct LoRASegment {
  std::string name;         ///< "q_proj", "gate_proj", ...; empty for an adapter covering the whole layer
  int64_t out_features = 0; ///< full (all TP ranks) output features of the segment = rows of its full B
  int64_t blocks = 1, block_width = 0, col0 = 0, width = 0;  ///< local placement; width · blocks = out/TP
};

/// What every LoRA adapter keeps (the dense LoRAAdapter here, ExpertLoRAAdapter on MoE experts,
/// layers/moe_lora.hpp): the settings, the (A, B) pair of each segment, the dropout draw state and the saved
/// low-rank activations h, with the naming, stashing and dropout logic they share.
class LoRABase {
 public:
  /// (name suffix, parameter) pairs: "<segment>.lora_A.weight", "<segment>.lora_B.weight" per segment
  /// (without the "<segment>." for an unnamed one).
  std::vector<std::pair<std::string, Parameter*>> named_parameters();
  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);
  const std::vector<LoRASegment>& segments() const { return segs_; }
  const LoRAOptions& options() const { return opts_; }
  double scale() const { return opts_.alpha / double(opts_.rank); }
  /// A and B of segment j.
  Parameter& lora_a(size_t j) { return a_.at(j); }
  Parameter& lora_b(size_t j) { return b_.at(j); }

 protected:
  /// Checks the settings every adapter shares (segments given, dropout in [0, 1), alpha > 0), naming `who`
  /// in the error; derives the adapter's own dropout seed stream from (seed, init_offset).
  LoRABase(std::string_view who, std::vector<LoRASegment> segments, const LoRAOptions& options, DType dtype,
           Device device);
  /// Called at the start of a forward: advances the dropout counter for a training (or discarded recompute)
  /// pass that drops, keeps the saved one on a replay pass; returns whether this forward drops its input.
  bool begin_forward(const ForwardContext& ctx);
  /// dropout(x) with the current counter (x itself without dropout or rows).
  Tensor dropped(const Tensor& x, const Stream& s) const;
  /// The input gradient through the dropout of the last forward (in place; unchanged without dropout).
  Tensor dropout_grad(Tensor dx, const Stream& s) const;
  /// Checks the segments against a base of `in` full input features split over `n` ranks (row-parallel: by
  /// input, one segment covering the output; column-parallel: by output) and the rank against each segment's
  /// min(in, out), naming `who` and `group` (e.g. "TP") in the errors; returns the local input features.
  int64_t check_layout(std::string_view who, std::string_view group, bool row, int64_t in, int n) const;
  /// A of one segment as PEFT initialises it: uniform in ±1/sqrt(in), drawn in full [r, in] (f32, Philox
  /// (seed, offset)) so it does not depend on the split, then cut to input columns [rank · in_local, + in_local)
  /// and cast to the adapter's dtype.
  Tensor init_a(uint64_t offset, int64_t in, int64_t in_local, int rank) const;

  std::vector<LoRASegment> segs_;
  LoRAOptions opts_;
  DType dtype_;
  Device device_;
  std::vector<Parameter> a_, b_;
  std::vector<Tensor> saved_h_;  // per segment [rows, r]

 private:
  uint64_t dropout_seed_ = 0, next_counter_ = 0, counter_ = 0;
};

/// The low-rank path of one ColumnParallelLinear (Kind::Column) or RowParallelLinear (Kind::Row).
class LoRAAdapter : public LoRABase {
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

  /// Binds the adapter to its base weight [out, in] (ColumnParallel/RowParallelLinear::attach_lora calls it):
  /// with the fused path on and possible, W and the A's move into one buffer and the parameters are
  /// re-pointed at their rows (see the header comment). `layer` names the layer in the log line.
  void bind(Parameter& weight, std::string_view layer);
  /// Gives the weight its own storage again and drops the fused buffer (before the adapter goes away).
  void unbind(Parameter& weight, const Stream& s = {});
  /// True when forward_fused can run for this weight: bound, and W still lives in the fused buffer.
  bool fused_for(const Tensor& weight) const;
  /// The base product and the low-rank path together: returns y2 = x2 Wᵀ (+ bias) + scale · h Bᵀ
  /// ([rows, out], contiguous), with one GEMM over x2. Needs fused_for(weight). bias: [out] or undefined.
  Tensor forward_fused(const ForwardContext& ctx, const Tensor& x2, const Tensor& weight, const Tensor& bias);

  /// Adds scale · B A of every segment into `weight` (the base's local shard, [out/TP, in] or [out, in/TP]).
  void merge_into(Tensor& weight, const Stream& s = {}) const;

  Kind kind() const { return kind_; }
  int64_t in_features() const { return in_; }

 private:
  void refresh_fused_a(const Stream& s);  // copies A's that live outside F (a DDP buffer) into F's rows

  comm::Communicator& tp_;
  Kind kind_;
  int64_t in_, in_local_;
  Tensor fused_;       // [out + ΣR, in]: W's rows, then each segment's A rows (undefined: unfused)
  Tensor fused_bias_;  // [out + ΣR]: the base's bias, then zeros (forward_fused with a bias)
  bool fused_tiles_ = false;  // the segments cover every output column once (Z's columns feed the beta term)
};

/// out = alpha · op(a) op(b) + beta · out (ops::gemm; op transposes where ta / tb). autotune: as
/// ops::GemmOptions::autotune (false for products whose shape follows the routing).
void lora_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& out, float alpha, float beta,
               const Stream& s = {}, bool autotune = true);

/// The target names a user may give, in the order they are documented.
const std::vector<std::string>& lora_target_names();

}  // namespace megacore::layers
