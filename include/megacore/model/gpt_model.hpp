// GPTModel: a decoder-only language model (Llama or GPT-2 flavour, chosen by the TransformerConfig)
// over one tensor-parallel group, with explicit forward and backward — the whole model, or one
// pipeline stage (model chunk) of it.
//
//   tokens [b, s] → (transpose to [s, b]) → VocabParallelEmbedding (+ learned positions, GPT-2)
//     → TransformerBlock (N × TransformerLayer → final norm) → output layer (column-parallel, no gather)
//     → logits [s, b, V/TP] → vocab-parallel cross-entropy → mean loss over the unmasked tokens
//
// Sequence parallelism (cfg.sequence_parallel) follows Megatron-Core: the embedding reduce-scatters
// its output to this rank's sequence chunk [s/TP, b, h] (the scatter after the embedding), the layers
// and the final norm run on chunks, and the output layer all-gathers the sequence before its GEMM.
// Sequence-parallel gradients (norms, biases, positions) are all-reduced over TP during backward, per
// gradient group (see "grad-ready groups" below), so every main_grad is complete after each backward,
// also when micro-batches accumulate.
//
// Pipeline stages (GPTModelOptions::layer_indices / pre_process / post_process): a stage holds a set
// of the model's transformer layers, plus the embedding (pre_process, the first stage) and/or the final
// norm, output layer and loss (post_process, the last stage). Layers keep their GLOBAL index in their
// parameter names ("layers.7.mlp.linear_fc1.weight") and in their Philox init offsets, so a stage's
// weights are exactly the same layers of the PP = 1 model. forward_stage / backward_stage run one
// stage on one micro-batch: hidden states in and out are [s, b, h], or [s/TP, b, h] under SP.
// stash_activations / restore_activations move a forward's saved state out of the modules and back,
// so a pipeline schedule can hold several micro-batches in flight on one stage.
//
// Tied embeddings (cfg.tie_word_embeddings): when one model holds both ends, the output layer uses the
// embedding's weight and writes its weight gradient into the same main_grad, so the two gradients add;
// parameters() lists the shared weight once, as "embedding.weight". On a last stage without the
// embedding (post_process && !pre_process), the stage holds its own copy of the table, initialised
// from the same draw, also named "embedding.weight" (so names map 1:1 onto the PP = 1 model) and
// reported by is_tied_copy(). Each copy only gets its own stage's gradient; after the step's last
// backward, allreduce_tied_embedding_grads sums them over the embedding group (first and last stage),
// so both copies then hold the PP = 1 gradient and stay equal under any optimizer. A checkpoint saves
// the weight from the first stage and skips the copy (is_tied_copy), loading it from the same tensor.
//
// Grad-ready groups (set_grad_ready_callback): backward reports parameters whose main_grad is final
// for this backward (TP sequence-parallel sums included) as soon as they are, in this order:
//   1. post_process: after the loss, output layer and final norm: {final_layernorm.*, output_layer.weight
//      or, on a last stage without the embedding, the tied copy "embedding.weight"};
//   2. after each transformer layer's backward (last layer first): that layer's parameters;
//   3. pre_process: after the embedding: {embedding.weight (with the head's contribution when tied
//      on the same model), position_embedding.weight}.
// Empty groups are not reported. The cross-stage tied-embedding sum is not part of it (it is a separate
// collective, linear like a DP average, so it may run before or after the DP reduction).
//
// Philox offsets (all TP-invariant full-tensor draws from cfg.seed): 0 word embedding, 1 learned
// positions, 2 untied output layer; layer i uses kModelLayerInitBase + i × kTransformerLayerInitStride.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/cross_entropy.hpp"
#include "megacore/layers/embedding.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/layers/norm.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/model/lora.hpp"
#include "megacore/model/transformer_block.hpp"
#include "megacore/model/transformer_config.hpp"
#include "megacore/model/transformer_layer.hpp"

namespace megacore::parallel {
class ProcessGrid;
}

namespace megacore::model {

constexpr uint64_t kModelLayerInitBase = 16;

struct GPTModelOptions {
  Device device = Device::cpu();
  float label_smoothing = 0.f;
  /// Global indices (0 .. cfg.num_layers − 1, strictly increasing) of the transformer layers this model
  /// chunk holds; unset = all of them. An empty list is a stage with no transformer layer (allowed by
  /// PipelineLayout::from_counts). Pass PipelineLayout::layer_indices(pp_rank, chunk).
  std::optional<std::vector<int64_t>> layer_indices;
  /// With cfg.recompute_granularity = Full: how many of this chunk's transformer layers (the first ones)
  /// recompute; the others keep their activations (TransformerBlockOptions::recompute_num_layers). < 0 = all.
  int64_t recompute_num_layers = -1;
  /// Holds the word embedding (and learned positions): the first pipeline stage.
  bool pre_process = true;
  /// Holds the final norm, the output layer and the loss: the last pipeline stage.
  bool post_process = true;
  /// Context-parallel group (ProcessGrid::cp(); must outlive the model); nullptr or size 1 = none. With
  /// CP > 1 every [b, s] input (tokens, labels, loss_mask) is this rank's local sequence
  /// (parallel::cp_slice_sequence of the full one: 2 chunks of s/(2·CP)), attention runs the CP ring,
  /// positions are global, and forward's loss is this rank's share (see forward()).
  comm::Communicator* cp = nullptr;
  /// With CP > 1: the ring (P2P) or AllGather attention (layers/attention.hpp).
  layers::CpCommType cp_comm_type = layers::CpCommType::P2P;
  /// MoE layers' groups (cfg.num_moe_experts > 0): ProcessGrid ep(), expert_tp() and the TpEp group; they
  /// must outlive the model. Unset members are the TP group when it has one rank (see TransformerLayerOptions).
  layers::MoEGroups moe;
};

/// The MoE groups of a grid for GPTModelOptions::moe (ep, expert_tp, and tp_ep when built).
layers::MoEGroups moe_groups(const parallel::ProcessGrid& grid);

// GradReadyCallback (transformer_block.hpp) is called with a group of parameters whose main_grad is
// final for the current backward (see the header comment for the groups and their order).

/// Σ mask over tokens whose label is not ignore_index (host arithmetic; labels i32/i64, mask optional
/// f32 of the same shape). The denominator of the model's mean loss.
double count_loss_tokens(const Tensor& labels, const Tensor& loss_mask = {}, int64_t ignore_index = -100,
                         const Stream& s = {});

class GPTModel {
 public:
  /// `tp` must outlive the model. The config is validated for tp.size()-way TP, and the stage options
  /// (layer_indices in range and increasing), before anything is allocated (ConfigError with the fix).
  GPTModel(const TransformerConfig& cfg, comm::Communicator& tp, const GPTModelOptions& options = {});

  /// tokens, labels: i32/i64 [b, s] (the same on every TP rank; labels = ignore_index -100 are skipped);
  /// loss_mask: optional f32 [b, s]. Returns the mean loss over the counted tokens,
  /// Σ mask·loss / Σ mask over tokens whose label is not ignored (f32 [1] on the model's device;
  /// 0 when no token counts). The count is taken on the host from labels and mask. With context
  /// parallelism (options.cp, CP > 1) the inputs are this rank's local sequence, the count is the whole
  /// sequence's (summed over CP) and the returned loss is this rank's share Σ_local mask·loss / count:
  /// the CP ranks' losses sum to the mean loss, and their gradients (summed over CP) to its gradient.
  /// (With ctx.loss_tokens given, e.g. by the pipeline engine, that count is used as it is.)
  Tensor forward(const layers::ForwardContext& ctx, const Tensor& tokens, const Tensor& labels,
                 const Tensor& loss_mask = {});
  /// Backpropagates the mean loss of the last forward: accumulates every parameter's main_grad
  /// (sequence-parallel partial sums included, so they are complete on return).
  void backward(const layers::ForwardContext& ctx);
  // forward/backward need a model holding the whole network (pre_process && post_process); they are
  // forward_stage(ctx, {}, tokens, labels, mask) and backward_stage(ctx, {}).

  /// One pipeline stage's forward on one micro-batch.
  ///  input: undefined on a pre_process stage (it embeds `tokens`), else the previous stage's output,
  ///         [s, b, h] or [s/TP, b, h] with SP, in the params dtype on the model's device.
  ///  tokens: [b, s] i32/i64, needed on pre_process (ignored elsewhere).
  ///  labels, loss_mask: [b, s], needed (labels) on post_process (ignored elsewhere).
  /// Returns the output hidden states (activation_shape(b, s)) or, on post_process, the mean loss over
  /// this micro-batch's counted tokens (f32 [1]; see forward()).
  Tensor forward_stage(const layers::ForwardContext& ctx, const Tensor& input, const Tensor& tokens,
                       const Tensor& labels = {}, const Tensor& loss_mask = {});
  /// Backward of the last forward_stage (or of the restored stash). grad_output: undefined on
  /// post_process (the loss is the output), else the gradient of forward_stage's output (same shape).
  /// On post_process the gradient of loss_grad_scale × (mean loss) is backpropagated: a pipeline uses
  /// it to weight micro-batches by their token counts. Returns the gradient of `input` (undefined on
  /// pre_process). Fires the grad-ready callback per group.
  Tensor backward_stage(const layers::ForwardContext& ctx, const Tensor& grad_output, float loss_grad_scale = 1.f);
  /// Shape of the hidden states between stages for a [batch, seq] micro-batch: {s, b, h}, or
  /// {s/TP, b, h} with sequence parallelism.
  Shape activation_shape(int64_t batch, int64_t seq) const;
  /// Tokens counted by the last forward on a post_process stage (the mean loss's denominator).
  double last_loss_tokens() const { return loss_tokens_; }

  /// Moves everything the last forward saved (every module's activations and the model's own state)
  /// into the returned stash, leaving the model as if no forward had run. restore_activations puts a
  /// stash taken from THIS model back (then backward_stage can run). See layers/activation_stash.hpp.
  layers::ActivationStash stash_activations();
  void restore_activations(layers::ActivationStash&& stash);

  /// Installs (or, with an empty function, removes) the grad-ready callback; see the header comment.
  void set_grad_ready_callback(GradReadyCallback cb) {
    grad_ready_ = cb;
    block_->set_grad_ready_callback(std::move(cb));
  }
  /// Installs (or removes) the pre-forward callback: forward calls it with each parameter group (the
  /// embedding's, each layer's, the final norm's with the output layer) right before first reading them,
  /// so a ZeRO-1 optimizer with overlap_param_gather can wait for exactly those all-gathers.
  void set_pre_forward_callback(GradReadyCallback cb) {
    pre_forward_ = cb;
    block_->set_pre_forward_callback(std::move(cb));
  }

  /// True for the tied-embedding copy a last stage without the embedding holds ("embedding.weight"
  /// with post_process && !pre_process && tie_word_embeddings): a checkpoint skips it.
  bool is_tied_copy(const layers::Parameter& p) const;
  /// The weight shared by the embedding and the output layer on this stage (the embedding itself or
  /// the tied copy); nullptr when the model is untied or this stage holds neither end.
  layers::Parameter* tied_embedding_weight();
  /// Sums the tied weight's main_grad over `embedding_group` (the first and last stage of this pipeline,
  /// ProcessGrid's GroupKind::Embedding) so both copies hold the full gradient. Call once per step after
  /// the last backward, on the stages holding the tied weight; a no-op when the model is untied, holds
  /// both ends itself, or holds neither.
  void allreduce_tied_embedding_grads(comm::Communicator& embedding_group, const Stream& s = {});

  /// This rank's vocabulary shard of the last forward's logits, [b, s, padded_vocab/TP] (a view);
  /// columns ≥ vocab_size of the gathered logits are padding.
  Tensor logits() const;
  /// Every trainable parameter once, named with its module path ("embedding.weight",
  /// "layers.0.self_attention.linear_qkv.weight", ..., "final_layernorm.weight", "output_layer.weight").
  const std::vector<layers::Parameter*>& parameters() const { return params_; }
  /// The parameter of that name; ValueError listing the names when there is none.
  layers::Parameter& parameter(const std::string& name) const;
  void zero_grad();

  /// This chunk's MoE layers (empty for a dense model).
  std::vector<layers::MoELayer*> moe_layers();
  /// Sum over this chunk's MoE layers of the last forward's local aux loss and z-loss (host values, with
  /// their coefficients); 0 without MoE layers. Summed over TP (and averaged over DP) they are the
  /// model's auxiliary losses; their gradients are added by each MoE layer's backward.
  double moe_aux_loss() const;
  /// Starts a new step's MoE statistics (MoELayer::reset_step_stats of every MoE layer; see moe_step_metrics).
  void reset_moe_step_stats(const Stream& s = {});
  /// Keys the forced (random) routing of every MoE layer by (step, replica) (MoELayer::set_routing_step);
  /// no effect unless moe_router_force_load_balancing.
  void set_moe_routing_step(uint64_t step, uint64_t replica);
  /// Scales the aux/z-loss gradients of every MoE layer (loss scale / micro-batches, as the LM loss's).
  /// ValueError unless finite and >= 0.
  void set_moe_aux_loss_grad_scale(float s);
  /// After the optimizer step: every MoE layer's expert-bias update (collective over TP and `dp`).
  void update_expert_bias(comm::Communicator& dp, const Stream& s = {});

  const TransformerConfig& config() const { return cfg_; }
  const GPTModelOptions& options() const { return opts_; }
  Device device() const { return opts_.device; }
  int64_t padded_vocab_size() const;
  bool pre_process() const { return opts_.pre_process; }
  bool post_process() const { return opts_.post_process; }
  /// Transformer layers held by this model (chunk).
  int64_t num_layers() const { return block_->num_layers(); }
  /// Their global indices, ascending.
  const std::vector<int64_t>& layer_indices() const { return layer_indices_; }
  /// The i-th layer held here (LOCAL index 0 .. num_layers() − 1; its global index is layer_indices()[i]).
  TransformerLayer& layer(int64_t i) { return block_->layer(i); }
  /// The chunk's layers and (post_process) final norm.
  TransformerBlock& block() { return *block_; }
  /// ValueError when this stage has no such module (embedding: pre_process, or the tied copy on a last
  /// stage; output layer / final norm: post_process).
  layers::VocabParallelEmbedding& embedding();
  layers::ColumnParallelLinear& output_layer();
  layers::NormLayer& final_layernorm();

  /// LoRA fine-tuning (model/lora.hpp): attaches adapters to the targeted linears of every layer held
  /// and freezes every base weight (embedding, positions, norms, linears, output layer): parameters()
  /// then lists only the adapters, which is what DDP, the optimizer and checkpoints see. The embedding's
  /// backward is skipped. `lora` is validated (ConfigError listing every problem).
  void apply_lora(const LoRAConfig& lora);
  /// Folds every adapter into its base weight (W += alpha/r · B A) and unfreezes the model: parameters()
  /// lists the (merged) base weights again.
  void merge_lora();
  bool has_lora() const { return lora_; }
  /// Every parameter the model holds, frozen ones included (with LoRA: the base weights, then the
  /// adapters), named like parameters().
  std::vector<layers::Parameter*> all_parameters();

 private:
  void collect_parameters();
  void sync_tied_output_weight();
  bool cp_active() const { return opts_.cp != nullptr && opts_.cp->size() > 1; }

  comm::Communicator& tp_;
  TransformerConfig cfg_;
  GPTModelOptions opts_;
  std::vector<int64_t> layer_indices_;
  std::unique_ptr<layers::VocabParallelEmbedding> embedding_;  // pre_process, or the tied copy
  layers::Parameter position_;  // learned positions [max_positions, h], replicated; undefined for RoPE
  std::unique_ptr<TransformerBlock> block_;  // the layers, and the final norm on post_process
  std::unique_ptr<layers::ColumnParallelLinear> output_layer_;  // post_process
  std::unique_ptr<layers::VocabParallelCrossEntropy> loss_;     // post_process
  std::vector<layers::Parameter*> params_;
  std::vector<layers::Parameter*> embedding_group_;  // grad-ready group (the others are the block's)
  std::vector<layers::Parameter*> head_extra_;       // the output layer's weight (or the tied copy)
  bool lora_ = false;
  GradReadyCallback grad_ready_;
  GradReadyCallback pre_forward_;
  // Saved by forward (moved by stash_activations).
  Tensor logits_;     // [s, b, V/TP]
  Tensor positions_;  // i64 [s_local, b] ids into position_, learned positions only
  Shape out_shape_;   // shape of forward_stage's output
  float grad_scale_ = 0.f;
  double loss_tokens_ = 0;
  bool has_forward_ = false;
};

/// A training step's MoE metrics, the same on every rank (the step log's "aux loss" and "load max/mean").
struct MoEStepMetrics {
  /// Switch aux loss + z-loss (coefficients applied) of one MoE layer, as Megatron-Core logs
  /// load_balancing_loss: the mean over the model's MoE layers (every pipeline stage's), over the step's
  /// micro-batches and over the DP×CP replicas, of the loss of a micro-batch's tokens.
  double aux_loss = 0;
  /// max/mean tokens per expert, the tokens being every token routed in the step (all micro-batches, all
  /// ranks) before dropping; the largest over the MoE layers (1 = balanced).
  double load_imbalance = 0;
};

/// The MoE metrics of the training forwards since the chunks' last reset_moe_step_stats(), from every
/// rank's MoE layers (`chunks`: this rank's model chunks, `micro_batches`: forwards per chunk in the step).
/// Collective over grid.world() (two all-reduces and a host copy); all zero for a dense model.
MoEStepMetrics moe_step_metrics(const std::vector<GPTModel*>& chunks, const parallel::ProcessGrid& grid,
                                int64_t micro_batches, const Stream& s = {});

}  // namespace megacore::model
