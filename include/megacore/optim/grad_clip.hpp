// Global-norm gradient clipping across model-parallel ranks, counting every parameter exactly once.
//
// The global norm is sqrt(Σ over the *full* model's parameters of ||grad||²). Each rank holds shards
// and copies, so a naive per-rank sum all-reduced over the model-parallel group double counts:
//   - a TP-replicated parameter (partition_dim == -1: norms, row-parallel biases) has the same gradient
//     on every TP rank → counted on TP rank 0 only;
//   - a TP-sharded parameter is a disjoint piece on each rank → counted everywhere;
//   - a weight held on two pipeline stages (tied embeddings: the first stage's embedding and the last
//     stage's output layer, kept equal by the embedding group) → the caller skips the copy with `skip`.
// The per-rank sums of squares are then all-reduced over `reduce` — normally the model-parallel group
// (TP × PP); add the DP group when gradients are sharded over DP (ZeRO), since each DP rank then holds a
// disjoint part.
//
// Expert parameters (MoE, Parameter::expert) are laid out over other groups: sharded over expert-TP × EP ×
// PP and replicated over expert-DP. As in Megatron-Core (whose dense and expert optimizers each report a
// norm, combined as sqrt(dense² + expert²)), their squares are summed apart from the dense ones — over
// `expert_reduce` (expert-TP × EP × PP, plus expert-DP when sharded by ZeRO), an expert-TP-replicated one
// counted on expert-TP rank 0 only — and the two sums are added. A NaN/Inf in either part makes the total
// non-finite, so the loss scaler's overflow check covers both.
#pragma once

#include <functional>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::parallel {
class ProcessGrid;
}

namespace megacore::optim {

struct GradNormGroups {
  /// This rank's position in its TP group: replicated parameters count on TP rank 0 only.
  int tp_rank = 0;
  /// The squared norm is summed over each of these in turn (e.g. {&mp} or {&mp, &dp_cp}).
  std::vector<comm::Communicator*> reduce;
  /// Parameters this rank must not count (a tied copy on a non-first pipeline stage); empty = none.
  std::function<bool(const layers::Parameter&)> skip;
  /// This rank's position in its expert-TP group: expert parameters with partition_dim < 0 count there only.
  int expert_tp_rank = 0;
  /// The expert parameters' squared norm is summed over each of these (e.g. {&tp_ep_pp, &expert_dp}), then
  /// added to the dense part. Empty: expert parameters are counted with the dense ones, which is right
  /// only for one process (`reduce` empty too); with any `reduce` group an expert parameter is then a
  /// ValueError naming grad_norm_groups(..., experts = true).
  std::vector<comm::Communicator*> expert_reduce;
};

/// Groups for a grid: TP rank from the grid, reduction over its model-parallel group (tp × pp), plus
/// dp_cp when `grads_sharded_over_dp`. With `experts` (a model with MoE layers on any stage; every rank
/// must pass the same), the expert part is reduced over expert-TP × EP × PP, plus expert-DP when sharded.
/// The grid must have built Mp (and DpCp when sharded; TpEpPp and ExpertDp for experts).
GradNormGroups grad_norm_groups(const parallel::ProcessGrid& grid, bool grads_sharded_over_dp = false,
                                bool experts = false);

/// Whether this rank counts `p` in the norm: not a TP (expert-TP for an expert) copy held by a rank other
/// than 0 of that group, and not skipped.
bool counts_in_grad_norm(const layers::Parameter& p, const GradNormGroups& groups);

struct GradNormResult {
  double norm = 0.0;        ///< global L2 norm of the gradients (before clipping); NaN/Inf when not finite
  bool finite = true;       ///< false when any gradient holds NaN or Inf: skip the step
  double clip_coef = 1.0;   ///< min(1, max_norm / (norm + 1e-6)); 1 when not finite (nothing scaled)
  std::vector<double> values;  ///< the host values of combine_grad_norm's `read_along` tensors
};

/// The global gradient norm over `params` (each rank passes its own list). Collective over every
/// communicator in groups.reduce. Parameters with an undefined main_grad are ValueError; a parameter
/// listed twice, or two sharing one main_grad, is ValueError (it would be counted twice).
GradNormResult global_grad_norm(const std::vector<layers::Parameter*>& params, const GradNormGroups& groups);

/// The gradients of `params` this rank counts (counts_in_grad_norm), appended to `dense` or `expert` by
/// Parameter::expert, with global_grad_norm's checks (undefined or shared main_grad: ValueError).
void counted_grads(const std::vector<layers::Parameter*>& params, const GradNormGroups& groups,
                   std::vector<Tensor>& dense, std::vector<Tensor>& expert);

/// The norm from this rank's counted gradients: Σ‖g‖² of `dense` summed over groups.reduce plus Σ‖g‖² of
/// `expert` summed over groups.expert_reduce (see GradNormGroups). Collective over both lists of groups;
/// the sums live on `device` and are ordered on `stream`. `who` names the caller in errors. The sums
/// reach the host in one device→host copy (one host sync), which also carries the one-element f32
/// tensors of `read_along` (device values the caller needs this step, e.g. the loss), returned in
/// GradNormResult::values in their order.
GradNormResult combine_grad_norm(const std::vector<Tensor>& dense, const std::vector<Tensor>& expert,
                                 const GradNormGroups& groups, Device device, const Stream& stream, const char* who,
                                 const std::vector<Tensor>& read_along = {});

/// global_grad_norm, then, when finite and above max_norm, multiplies every main_grad by clip_coef
/// (all of this rank's parameters, also those skipped in the count: their copies must stay equal).
/// max_norm <= 0 disables clipping (the norm is still computed and reported).
GradNormResult clip_grad_norm(const std::vector<layers::Parameter*>& params, double max_norm,
                              const GradNormGroups& groups);

}  // namespace megacore::optim
