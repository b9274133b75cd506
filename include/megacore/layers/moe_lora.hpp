// LoRA adapters on the routed experts of a MoE layer (layers/moe.hpp): one (A_e, B_e) pair per expert and
// segment, the low-rank path computed per expert on the expert-sorted rows, next to the base grouped GEMM.
//
//   y_e = x_e W_eᵀ + (alpha / r) · dropout(x_e) A_eᵀ B_eᵀ        A_e [r, in], B_e [out, r]
//
// Parameters are stacked over this rank's experts: A [E/EP, r, in(/ETP)], B [E/EP, out(/ETP), r], marked
// expert (Parameter::expert, expert_offset, num_experts) so their gradients are reduced over expert-DP as the
// base experts' are. Expert-TP splits them the way the dense adapters split over TP (layers/lora.hpp):
//   fc1 (column-parallel over expert-TP, Kind::Column): A replicated, B split by output rows. SwiGLU keeps gate
//     and up separable as two segments of the local [gate_r | up_r] output (as the dense fc1), so they export
//     to Hugging Face PEFT's w1 / w3 of each expert.
//   fc2 (row-parallel over expert-TP, Kind::Row): A split by input columns, B replicated; h = a_local A_localᵀ
//     is an expert-TP partial sum and so is h Bᵀ, which is added to the base's partial product before the
//     dispatcher's reduce-scatter over expert-TP sums it.
// The expert-TP-partial gradients (fc1's A, fc2's B: each expert-TP rank holds only its share of dh or h)
// are summed over expert-TP inside backward (one all-reduce of the adapter-sized gradient per backward),
// since no other group reduction covers expert-TP. partition_dim refers to the expert-TP split.
//
// Compute: per expert e (rows_e > 0), one GEMM for h_e = xd_e A_eᵀ ([rows_e, r]) and one accumulating GEMM
// y_e += scale · h_e B_eᵀ into the base output rows (strided column block of a segment), on the call's stream
// (CPU and CUDA through ops::gemm, no host sync). Backward: dB_e += scale · dy_eᵀ h_e, dh_e = scale · dy_e B_e,
// dA_e += dh_eᵀ xd_e and the input gradient dh_e A_e, written first so that the base's dgrad accumulates into
// it (looped_gemm with beta = 1).
//
// Initialisation (as PEFT, independent of EP and expert-TP): B = 0; A of global expert g, segment j uniform in
// ±1/sqrt(in) drawn in full with Philox (seed, init_offset + kExpertLoRAStride · g + j) and sliced.
// Dropout on the adapter input as the dense adapters (regenerated in backward from (seed, counter)); the mask
// covers this rank's expert-sorted rows, so masks (not their distribution) depend on EP and the routing.
// Not fused with the base GEMM (the fused [W; A] buffer is for the dense linears).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/lora.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::layers {

/// Philox offsets reserved per global expert in one expert adapter (segment j of expert g: init_offset + 4g + j).
inline constexpr uint64_t kExpertLoRAStride = 4;

/// Per group g (rows [start_g, start_g + sizes[g]) of x and y): y_g = alpha · x_g op(w_g) + beta · y_g with
/// op(w) = wᵀ when trans_w. x [N, K] (row stride may exceed K: a column block), w [G, ·, ·], y [N, M] (any row
/// stride, last dim contiguous). One ops::gemm per group with rows; the groups' rows are host values.
void looped_gemm(const Tensor& x, const Tensor& w, std::span<const int64_t> sizes, Tensor& y, bool trans_w,
                 float alpha, float beta, const Stream& s = {});

/// The LoRA path of one expert linear (fc1: Kind::Column, fc2: Kind::Row) over this rank's local experts.
class ExpertLoRAAdapter : public LoRABase {
 public:
  using Kind = LoRAAdapter::Kind;
  /// expert_tp: the group the expert FFN widths are split over. in_features: the base's FULL input features.
  /// segments as for LoRAAdapter (out_features full over expert-TP; placement in the local output); for
  /// Kind::Row one segment covering the output. Throws ValueError naming the fix for r ≤ 0 or larger than a
  /// segment's min(in, out), dropout outside [0, 1), alpha ≤ 0, or a placement that does not fit.
  ExpertLoRAAdapter(comm::Communicator& expert_tp, Kind kind, int64_t local_experts, int64_t expert_offset,
                    int64_t num_experts, int64_t in_features, std::vector<LoRASegment> segments,
                    const LoRAOptions& options, DType dtype, Device device);

  /// x: the base's input rows sorted by local expert ([N, in] for Column, [N, in/ETP] for Row); sizes: rows
  /// per local expert (host values); y: the base's output [N, out_local], to which the scaled low-rank
  /// product is added.
  void forward(const ForwardContext& ctx, const Tensor& x, std::span<const int64_t> sizes, Tensor& y);
  /// x, sizes: what forward saw; dy [N, out_local]. Accumulates the A and B main_grads (summed over expert-TP
  /// where they are partial) and returns the low-rank input gradient [N, x's features] (contiguous), into
  /// which the caller accumulates the base's dgrad. Collective over expert_tp when its size > 1.
  Tensor backward(const ForwardContext& ctx, const Tensor& x, std::span<const int64_t> sizes, const Tensor& dy);

  /// Adds scale · B_e A_e of every segment into `weight` [E/EP, out_local, in_local] (the base's local experts).
  void merge_into(Tensor& weight, const Stream& s = {}) const;

  Kind kind() const { return kind_; }

 private:
  comm::Communicator& etp_;
  Kind kind_;
  int64_t local_experts_, in_, in_local_;
};

}  // namespace megacore::layers
