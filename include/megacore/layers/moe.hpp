// MoELayer: a mixture-of-experts block in place of a transformer layer's MLP (Megatron-Core's MoELayer),
// with explicit forward and backward.
//
//   router:     logits = x W_r^T (W_r [E, h], replicated, computed in f32), top-k (ops::router_topk),
//               optional capacity (token dropping), switch aux loss and z-loss added in backward
//   dispatch:   tokens grouped by expert (ops::moe_permute) and moved to the ranks holding their experts
//   experts:    SwiGLU (or GELU) FFNs of all local experts through the grouped GEMM ops
//   combine:    outputs moved back and summed per token with the routing probabilities (ops::moe_unpermute),
//               plus an optional shared expert (a plain layers::MLP every token passes through)
//
// Tokens. Each rank routes a disjoint part of the TP group's tokens: with sequence parallelism its own
// sequence chunk [s/TP, b, h] (the output keeps that layout); without it, with TP > 1, the replicated
// input [s, b, h] is split evenly along the flattened tokens, each rank routes its share, and the outputs
// are all-gathered over TP at the end (their gradients split again in backward). So a token is routed
// once, never once per TP rank, and no TP all-gather of activations precedes the router under SP.
//
// Groups (all passed in; a group of size 1 issues no collective):
//   tp         the attention TP group (the shared expert is tensor-parallel over it; token counts of the
//              aux loss are summed over it)
//   ep         expert parallelism: E / EP experts per rank, rank p of EP holds experts [p·E/EP, (p+1)·E/EP)
//   expert_tp  tensor parallelism inside experts: each expert's FFN width is split over it
//   tp_ep      expert-TP × EP (ProcessGrid GroupKind::TpEp): only the all-gather dispatcher uses it
//
// Dispatchers.
//   AllToAll:  per-expert counts are exchanged over EP (all-to-all of E integers), then the tokens with
//              uneven splits; with expert-TP > 1 the received tokens are all-gathered over expert-TP
//              (padded to the largest rank's count) so every shard of an expert sees them; received rows
//              are sorted by local expert for the grouped GEMM. The way back is the reverse (reduce-scatter
//              over expert-TP, which also sums the FFN-width partial products, then all-to-all).
//   AllGather: every token (with its routing) is all-gathered over tp_ep; each rank computes its
//              experts for all of them (partial sums over expert-TP) and a reduce-scatter over tp_ep
//              returns each rank its own tokens' sums.
//
// Losses. The aux loss and z-loss of a forward are local: the switch loss uses this rank's router scores
// with the token counts summed over the TP group (total tokens = the TP group's), and the z-loss is this
// rank's mean scaled by its share of the TP group's tokens, so the sum of the local losses over the TP
// group is the loss of all its tokens (the single-rank value). Backward adds their gradients, scaled by
// aux_loss_grad_scale, to the router's.
//
// Parameters. router.weight [E, h] is replicated (and marked sequence_parallel when TP > 1: each TP rank
// computed its gradient from its own tokens). experts.fc1.weight [E/EP, fc1/ETP, h] (SwiGLU:
// [gate rows of expert-TP rank r ; up rows of r], partition_chunks 2 along dim 1) and experts.fc2.weight
// [E/EP, h, F/ETP] are marked expert (Parameter::expert, expert_offset, num_experts): their gradients
// are reduced over expert-DP, not DP×CP. partition_dim refers to the expert-TP split. The shared expert's
// parameters are ordinary dense ones ("shared_expert.fc1.weight", ...).
//
// LoRA (layers/moe_lora.hpp): attach_lora puts low-rank adapters on every local expert's fc1 (gate_proj /
// up_proj segments with SwiGLU, the whole fc1 with GELU) and/or fc2, run per expert beside the grouped GEMMs.
// set_frozen(true) freezes the router and the experts' base weights: no weight gradients (the wgrad GEMMs and
// their main_grad buffers are skipped), while the input gradient (through the router too) is still computed.
// The shared expert is an ordinary MLP: its adapters are attached to its linears directly.
//
// Forced load balancing (MoEOptions::force_load_balancing, Megatron-Core's --moe-router-force-load-balancing;
// benchmarking only): the top-k and the combine weights come from random logits (ops::router_random_logits,
// standard normal) instead of the learned ones, so every expert gets about T·k/E tokens whatever the
// router has learned; the combine weights are the softmax (or sigmoid) of the random scores, so the output
// is still a weighted sum of expert outputs. The draws are keyed by the run seed, the layer (init_offset),
// the step and the data-parallel replica given to set_routing_step, the forward's index since that call
// (a full-recompute replay reuses its forward's draw) and the token's index in the TP group's micro-batch,
// so every TP / SP / EP / expert-TP layout of the same tokens routes them identically. The router weight
// gets no gradient from routing; the learned logits are still computed, and the aux loss (over the learned
// scores, with the forced token counts) and the z-loss are computed and back-propagated as usual. The
// expert bias does not take part in the selection.
//
// Initialisation is deterministic and independent of EP and expert-TP: the router uses Philox offset
// init_offset, global expert g offsets init_offset + 1 + 3g (gate, up, fc2 — GELU's fc1 uses the first),
// the shared expert the three after the experts (moe_init_offsets()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/layer_types.hpp"
#include "megacore/layers/mlp.hpp"
#include "megacore/layers/moe_lora.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::layers {

struct MoEOptions {
  int64_t num_experts = 8;
  int topk = 2;
  /// Each routed expert's FFN width (full, before the expert-TP split).
  int64_t ffn_hidden_size = 0;
  /// FFN width of the shared expert; 0 = none.
  int64_t shared_expert_size = 0;
  ActivationType activation = ActivationType::SwiGLU;
  MoERouterScore score = MoERouterScore::Softmax;
  bool pre_softmax = false;
  float topk_scaling_factor = 1.f;
  float aux_loss_coeff = 0.f;
  float z_loss_coeff = 0.f;
  /// Aux-loss-free balancing: a per-expert bias added to the scores for selection only.
  bool enable_expert_bias = false;
  float expert_bias_update_rate = 1e-3f;
  /// > 0: each expert keeps at most ceil(factor · tokens · topk / E) of this rank's token slots; 0 = dropless.
  double capacity_factor = 0.0;
  MoETokenDispatcher dispatcher = MoETokenDispatcher::AllToAll;
  /// Benchmarking only: routing ignores the router's scores (see "Forced load balancing" above).
  bool force_load_balancing = false;
  bool sequence_parallel = false;
  DType params_dtype = DType::F32;
  Device device = Device::cpu();
  double init_std = 0.02;
  /// Std of the experts' fc2 weights; < 0 means init_std.
  double output_init_std = -1.0;
  uint64_t seed = 1234;
  uint64_t init_offset = 0;
};

/// Philox offsets used by a MoE layer of `num_experts` experts built with init_offset = base.
constexpr uint64_t moe_init_offsets(int64_t num_experts) { return 1 + 3 * uint64_t(num_experts) + kMLPInitOffsets; }

/// The communicators a MoE layer uses (see the header comment); they must outlive the layer.
struct MoEGroups {
  comm::Communicator* tp = nullptr;
  comm::Communicator* ep = nullptr;
  comm::Communicator* expert_tp = nullptr;
  /// Needed only by the all-gather dispatcher.
  comm::Communicator* tp_ep = nullptr;
};

/// The all-to-all dispatcher's plan for one forward: rows this rank sends to and receives from each EP peer.
struct MoEExchangePlan {
  /// [E]: rows this rank sends to each global expert (the counts passed in, on the host).
  std::vector<int64_t> send_counts;
  /// [E]: recv_counts[q·El + j] = rows of local expert j coming from EP rank q (El = local experts).
  std::vector<int64_t> recv_counts;
  /// [EP]: rows sent to / received from each EP rank (the forward token all-to-all's splits; backward reverses them).
  std::vector<int64_t> send_rows, recv_rows;
  /// With an expert-TP group: [ETP·E], every expert-TP rank's recv_counts in rank order (the layout of the rows
  /// gathered over expert-TP); without one, recv_counts. `layout_device` holds it on the counts' device (for
  /// ops::moe_sort_map).
  std::vector<int64_t> layout;
  Tensor layout_device;
  /// The `also` tensor's values (copied to the host with the counts).
  std::vector<int64_t> also;
};

/// The dispatcher's count exchange, as MoELayer runs it: `counts` i64 [E] on ep's device are this rank's rows
/// per global expert (expert i lives on EP rank i / local_experts). An all-to-all of E integers over `ep`,
/// then (with `expert_tp` of more than one rank) an all-gather of the received counts over it, all on the
/// device; then ONE host copy of the sent counts, the layout and `also` (optional i64 values the caller needs
/// on the host too) — the dispatcher's only host synchronisation: the uneven all-to-all needs its splits on
/// the host, as in Megatron-Core. Collective over ep (and expert_tp). Throws ValueError when counts has not
/// local_experts · EP entries.
MoEExchangePlan moe_exchange_counts(comm::Communicator& ep, const Tensor& counts, int64_t local_experts,
                                    comm::Communicator* expert_tp = nullptr, const Tensor& also = {},
                                    const Stream& s = {});
/// The same from host counts (uploaded first).
MoEExchangePlan moe_exchange_counts(comm::Communicator& ep, const std::vector<int64_t>& counts, int64_t local_experts,
                                    const Stream& s = {});

/// The dispatcher's token all-to-all, as MoELayer runs it in both directions: `in` [Σ send, h] (rows grouped by
/// destination rank), send[p] rows go to rank p, recv[p] rows come from p; returns [Σ recv, h] in rank order,
/// waited on `s`. The combine direction is the same call with send and recv swapped. Collective over c.
Tensor moe_exchange_rows(comm::Communicator& c, const Tensor& in, const std::vector<int64_t>& send,
                         const std::vector<int64_t>& recv, const Stream& s = {});

class MoELayer {
 public:
  /// Throws ValueError naming the fix when the experts do not split over EP, the FFN width over
  /// expert-TP, top-k is outside [1, E], or a group is missing.
  MoELayer(const MoEGroups& groups, int64_t hidden_size, const MoEOptions& options);

  /// x: [s, ..., h] replicated over TP, or [s/TP, ..., h] with sequence_parallel. Returns the same layout.
  Tensor forward(const ForwardContext& ctx, const Tensor& x);
  /// dy: gradient of forward's output. Accumulates every main grad (router, experts, shared expert),
  /// adds the aux/z-loss gradients, and returns dx (x's layout).
  Tensor backward(const ForwardContext& ctx, const Tensor& dy);

  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  /// The trainable parameters: router and experts (unless frozen), the expert adapters, the shared expert's.
  std::vector<Parameter*> parameters();
  void zero_grad();

  /// The last forward's local switch aux loss and z-loss, f32 [1] each with the coefficients applied
  /// (zero when the coefficient is 0); summed over the TP group they are the losses of its tokens.
  const Tensor& aux_loss() const { return aux_loss_; }
  const Tensor& z_loss() const { return z_loss_; }
  /// Tokens routed to each global expert by the last forward on this rank (before dropping), [E].
  const std::vector<int64_t>& tokens_per_expert() const { return tokens_per_expert_; }
  /// max/mean of tokens_per_expert (1 = perfectly balanced); 0 before the first forward.
  double load_imbalance() const;
  /// Sum of aux_loss() + z_loss() over the training forwards since the last reset_step_stats(), f32 [1] on
  /// the layer's device (added on the stream, no host sync); under full recompute each micro-batch counts once.
  const Tensor& step_loss_sum() const { return step_loss_sum_; }
  /// Tokens routed to each global expert (before dropping) by this rank's training forwards since the last
  /// reset_step_stats(), [E].
  const std::vector<int64_t>& step_tokens_per_expert() const { return step_tokens_; }
  /// Starts a new step's sums (the trainer calls it before each step's micro-batches).
  void reset_step_stats(const Stream& s = {});
  /// Multiplies the aux/z-loss gradients in backward (e.g. 1 / micro-batches when the main loss is averaged
  /// over them, as Megatron-Core's MoEAuxLossAutoScaler).
  void set_aux_loss_grad_scale(float s) { aux_grad_scale_ = s; }

  /// Aux-loss-free balancing, called by the trainer after the optimizer step: the tokens counted by the
  /// training forwards since the last call are summed over the TP group and `dp` (the data-parallel
  /// group of the dense layers, DP×CP), and bias_e += rate · sign(mean load − load_e). Collective over tp
  /// and dp. No-op unless enable_expert_bias.
  void update_expert_bias(comm::Communicator& dp, const Stream& s = {});
  /// Forced load balancing: keys the random routing of the forwards that follow by (step, replica) and
  /// restarts their forward index (the trainer calls it before each step with the DP×CP rank as replica).
  /// No effect on learned routing.
  void set_routing_step(uint64_t step, uint64_t replica = 0) {
    force_step_ = step, force_replica_ = replica, next_draw_ = 0;
  }
  /// The expert bias, f32 [E] (undefined unless enable_expert_bias).
  Tensor& expert_bias() { return expert_bias_; }

  /// Attaches LoRA adapters (layers/moe_lora.hpp) to every local expert: on fc1 the segments named in
  /// `fc1_segments` ("gate_proj", "up_proj"; SwiGLU only) or, with fc1_whole, one adapter on the whole fc1;
  /// on fc2 when `fc2`. The fc1 adapter draws from options.init_offset, the fc2 adapter from init_offset + 2
  /// (kExpertLoRAStride per global expert each). Throws ValueError when adapters are already attached or a
  /// segment name does not fit the activation.
  void attach_lora(const std::vector<std::string>& fc1_segments, bool fc1_whole, bool fc2, const LoRAOptions& options);
  ExpertLoRAAdapter* fc1_lora() { return fc1_lora_.get(); }
  ExpertLoRAAdapter* fc2_lora() { return fc2_lora_.get(); }
  /// Folds the adapters into the experts' weights (W_e += alpha/r · B_e A_e) and drops them.
  void merge_lora(const Stream& s = {});
  /// Freezes (or thaws) the router and the experts' base weights (see the header comment).
  void set_frozen(bool frozen);
  bool frozen() const { return frozen_; }

  Parameter& router_weight() { return router_w_; }
  Parameter& fc1_weight() { return fc1_w_; }
  Parameter& fc2_weight() { return fc2_w_; }
  MLP* shared_expert() { return shared_.get(); }
  int64_t num_local_experts() const { return local_experts_; }
  /// First global expert held by this rank.
  int64_t expert_offset() const { return expert_offset_; }
  const MoEOptions& options() const { return opts_; }

 private:
  // All-to-all dispatcher: this rank's expert-grouped rows → its experts' rows sorted by local expert, and back.
  Tensor to_experts(const Tensor& permuted, const Stream& s);
  Tensor from_experts(const Tensor& sorted, const Stream& s);
  Tensor experts_forward(const ForwardContext& ctx, const Tensor& xs, const std::vector<int64_t>& sizes);
  Tensor experts_backward(const ForwardContext& ctx, const Tensor& dys);
  uint64_t force_seed() const;

  MoEGroups g_;
  int64_t hidden_;
  MoEOptions opts_;
  int64_t local_experts_, expert_offset_, ffn_local_;
  Parameter router_w_, fc1_w_, fc2_w_;
  Tensor expert_bias_;
  std::unique_ptr<MLP> shared_;
  std::unique_ptr<ExpertLoRAAdapter> fc1_lora_, fc2_lora_;
  bool frozen_ = false;
  float aux_grad_scale_ = 1.f;
  uint64_t force_step_ = 0, force_replica_ = 0, next_draw_ = 0, draw_ = 0;  // forced routing's draw key

  // Saved by forward for backward.
  Shape in_shape_;
  Tensor x_tokens_;      // [T, h] this rank's routed tokens (params dtype)
  Tensor logits_;        // [T, E] f32
  Tensor probs_;         // [T, k] f32 after capacity
  Tensor indices_;       // [T, k] i32 after capacity
  Tensor row_map_;       // [T, k] i32
  Tensor tpe_f32_;       // [E] f32 token counts summed over TP (aux loss)
  Tensor expert_out_;    // [N, h] this rank's permuted tokens after the experts (combine input)
  Tensor xs_, h_, a_;    // sorted expert inputs, fc1 output, activation
  std::vector<int64_t> send_rows_, recv_rows_;   // EP all-to-all rows per peer
  std::vector<int64_t> group_sizes_;             // rows per local expert after sorting
  Tensor sort_map_;      // [R, 1] i32: received row → sorted row (-1 padding)
  int64_t pad_rows_ = 0;  // expert-TP all-gather: rows per rank after padding
  int64_t recv_total_ = 0;
  Tensor gathered_probs_;  // all-gather dispatcher: [P·T, k]
  Tensor local_map_;       // all-gather dispatcher: [P·T, k] i32 row map of the local experts

  Tensor aux_loss_, z_loss_;
  std::vector<int64_t> tokens_per_expert_;
  Tensor step_loss_sum_;            // f32 [1]: Σ (aux + z) over the step's training forwards
  std::vector<int64_t> step_tokens_;  // [E]: tokens per expert over the step's training forwards
  std::vector<double> bias_counts_;  // tokens per expert since the last update_expert_bias
};

}  // namespace megacore::layers
