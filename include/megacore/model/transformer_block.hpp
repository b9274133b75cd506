// TransformerBlock: the stack of TransformerLayers one model chunk holds (Megatron-Core's
// TransformerBlock), with an optional final norm for the last pipeline stage (post_process), and
// explicit forward and backward.
//
//   x → layer[l0] → layer[l1] → … → (final_layernorm) → y        activations [s, b, h] or [s/TP, b, h] (SP)
//
// Layers are given by their GLOBAL indices (PipelineLayout::layer_indices), which select their Philox
// init offsets and their parameter names ("layers.7.mlp.linear_fc1.weight"), so a chunk's layers are
// exactly the same layers as in the whole model. The final norm is named "final_layernorm.weight"
// (and ".bias" for LayerNorm).
//
// Grad-ready groups (set_grad_ready_callback): backward reports, as soon as their main_grad is final
// for this backward, first the final-norm group {final_layernorm.*, then the parameters given to
// set_final_norm_group_extra (GPTModel: the output layer's weight)} and then each layer's parameters,
// last layer first. Under sequence parallelism every group's sequence-parallel gradients (norm
// weights/biases, row-parallel biases) are all-reduced over TP right after the group's backward; the
// totals of earlier micro-batches are set aside and added back, so accumulation stays right
// (see run_grad_group). Empty groups are not reported.
//
// Activation recompute follows cfg.recompute_granularity in every layer; with Full,
// TransformerBlockOptions::recompute_num_layers limits it to the first N layers of this block (the
// others keep their activations), Megatron-Core's recompute_method = "block". Either way the
// gradients are bit-identical to no recompute.
//
// stash_activations / restore_activations move every layer's (and the final norm's) saved state
// out and back, so a pipeline schedule can keep several micro-batches in flight.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/norm.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/model/transformer_config.hpp"
#include "megacore/model/transformer_layer.hpp"

namespace megacore::model {

/// Called with a group of parameters whose main_grad is final for the current backward.
using GradReadyCallback = std::function<void(const std::vector<layers::Parameter*>&)>;

/// Runs `backward` (the backward of the modules owning `group`) as one grad-ready group: with sequence
/// parallelism (cfg.sequence_parallel, TP > 1) the group's sequence-parallel main_grads are set aside
/// and zeroed first, all-reduced over `tp` afterwards and the set-aside totals added back; then `cb`
/// (when set and the group is not empty) is called with the group.
void run_grad_group(comm::Communicator& tp, const TransformerConfig& cfg, const std::vector<layers::Parameter*>& group,
                    const GradReadyCallback& cb, const Stream& s, const std::function<void()>& backward);

/// The norm a TransformerConfig asks for (RMSNorm or LayerNorm over hidden_size, SP-aware).
std::unique_ptr<layers::NormLayer> make_model_norm(const TransformerConfig& cfg, Device device);

struct TransformerBlockOptions {
  /// Global indices (0 .. cfg.num_layers − 1, strictly increasing) of the layers held; unset = all.
  /// An empty list holds no layer.
  std::optional<std::vector<int64_t>> layer_indices;
  /// Append the final norm (the last pipeline stage, Megatron's post_process / post_layer_norm).
  bool final_layernorm = false;
  /// With cfg.recompute_granularity = Full: how many of this block's layers (the first ones) recompute;
  /// < 0 = all. Ignored for None and Selective.
  int64_t recompute_num_layers = -1;
  /// Philox offset of layer 0's first draw (GPTModel puts its embeddings below it).
  uint64_t init_offset_base = 16;
  Device device = Device::cpu();
  /// Context-parallel group of every layer's attention; nullptr = none (SelfAttentionOptions::cp).
  comm::Communicator* cp = nullptr;
  layers::CpCommType cp_comm_type = layers::CpCommType::P2P;
  /// Groups of the MoE layers (TransformerLayerOptions::moe).
  layers::MoEGroups moe;
};

class TransformerBlock {
 public:
  /// `tp` must outlive the block. Validates cfg for tp.size()-way TP and the options (indices in range
  /// and increasing) before allocating anything (ConfigError naming the fix).
  TransformerBlock(comm::Communicator& tp, const TransformerConfig& cfg, const TransformerBlockOptions& options = {});

  /// x: [s, b, h] (replicated) or [s/TP, b, h] with sequence parallelism, in params dtype on the
  /// block's device. position_ids: see TransformerLayer::forward. Returns y in x's layout.
  Tensor forward(const layers::ForwardContext& ctx, const Tensor& x, const Tensor& position_ids = {});
  /// dy: gradient of forward's output (same shape). Accumulates every parameter's main_grad (SP sums
  /// included), reports the grad-ready groups, and returns dx.
  Tensor backward(const layers::ForwardContext& ctx, const Tensor& dy);

  /// Moves everything the last forward saved into `s` (the block is left as if no forward had run) /
  /// back from `s` (same order). See layers/activation_stash.hpp.
  void stash_activations(layers::ActivationStash& s);
  void restore_activations(layers::ActivationStash& s);

  /// Installs (or removes, with an empty function) the grad-ready callback; see the header comment.
  void set_grad_ready_callback(GradReadyCallback cb) { grad_ready_ = std::move(cb); }
  /// Called in forward with each group of parameters (a layer's; the final norm's with the head extras)
  /// right before they are first read: where a ZeRO-1 optimizer waits for their all-gather
  /// (DistributedOptimizer::wait_param_gather). Empty: nothing is called.
  void set_pre_forward_callback(GradReadyCallback cb) { pre_forward_ = std::move(cb); }
  /// Parameters owned elsewhere reported with the final norm's group (after its own parameters).
  void set_final_norm_group_extra(std::vector<layers::Parameter*> extra);

  /// Parameters with their names ("layers.<global index>.<path>", "final_layernorm.weight"), in model
  /// order: layers ascending, then the final norm. The same names are set on the Parameters.
  const std::vector<std::pair<std::string, layers::Parameter*>>& named_parameters() const { return named_; }
  std::vector<layers::Parameter*> parameters() const;
  /// The parameters of local layer i (its grad-ready group), in named_parameters() order.
  const std::vector<layers::Parameter*>& layer_parameters(int64_t i) const { return layer_groups_.at(size_t(i)); }
  void zero_grad();

  int64_t num_layers() const { return int64_t(layers_.size()); }
  /// Global indices of the layers held, ascending.
  const std::vector<int64_t>& layer_indices() const { return layer_indices_; }
  /// The i-th layer held (LOCAL index; its global index is layer_indices()[i]).
  TransformerLayer& layer(int64_t i) { return *layers_.at(size_t(i)); }
  bool has_final_layernorm() const { return final_norm_ != nullptr; }
  /// ValueError when the block was built without it.
  layers::NormLayer& final_layernorm();
  const TransformerConfig& config() const { return cfg_; }

  /// LoRA on every layer (TransformerLayer::apply_lora) and the final norm frozen: named_parameters()
  /// and the grad-ready groups then hold only the adapters. merge_lora folds them back into the weights.
  void apply_lora(const LoRAConfig& lora);
  void merge_lora();

 private:
  void collect_parameters();  // named_, layer_groups_ and final_group_ from the modules' current parameters

  comm::Communicator& tp_;
  TransformerConfig cfg_;
  TransformerBlockOptions opts_;
  std::vector<int64_t> layer_indices_;
  std::vector<std::unique_ptr<TransformerLayer>> layers_;
  std::unique_ptr<layers::NormLayer> final_norm_;
  std::vector<std::pair<std::string, layers::Parameter*>> named_;
  std::vector<std::vector<layers::Parameter*>> layer_groups_;
  std::vector<layers::Parameter*> final_group_;  // final norm's parameters + the extra ones
  size_t final_norm_params_ = 0;
  std::vector<layers::Parameter*> final_extra_;  // set_final_norm_group_extra's
  bool lora_ = false;
  GradReadyCallback grad_ready_;
  GradReadyCallback pre_forward_;
  // Saved by forward (moved by stash_activations).
  Shape out_shape_;
  bool has_forward_ = false;
};

}  // namespace megacore::model
