// TransformerLayer: one pre-norm decoder layer with explicit forward and backward.
//
//   x ─┬─ input_layernorm → self_attention ─(+)─┬─ pre_mlp_layernorm → mlp ─(+)─ y
//      └────────────────────────────────────────┘└──────────────────────────────┘
//
// The second norm is fused with the residual add in front of it (NormLayer::forward_residual).
// Activations are [s, b, h], or this rank's sequence chunk [s/TP, b, h] with sequence parallelism.
//
// Activation recompute (cfg.recompute_granularity):
//   None       every sub-module keeps what its backward needs.
//   Selective  passed down to SelfAttention, which recomputes core attention in backward.
//   Full       forward runs the sub-modules with ctx.training = false (they save nothing) and the layer
//              keeps only its input (and position ids); backward first reruns the forward with saving
//              on, then runs the ordinary backward. Same operations in the same order, so the
//              gradients are bit-identical to None.
//
// Initialisation is TP-invariant and distinct per layer: the layer's Philox offsets are
// base + layer_number × kTransformerLayerInitStride (attention: +0 qkv, +1 proj; MLP: +2 .. +4).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/attention.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/mlp.hpp"
#include "megacore/layers/moe.hpp"
#include "megacore/layers/norm.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/model/lora.hpp"
#include "megacore/model/transformer_config.hpp"

namespace megacore::model {

/// Philox offsets reserved per layer (2 for attention, 3 for the MLP, the rest spare for additions
/// such as MoE or LoRA without changing the existing layers' draws).
constexpr uint64_t kTransformerLayerInitStride = 8;

struct TransformerLayerOptions {
  /// 0-based index of the layer in the model; selects its Philox offsets.
  int64_t layer_number = 0;
  /// Offset of layer 0's first draw (a model puts its embeddings below it).
  uint64_t init_offset_base = 16;
  Device device = Device::cpu();
  /// Context-parallel group of the attention (must outlive the layer); nullptr = none (SelfAttentionOptions::cp).
  comm::Communicator* cp = nullptr;
  layers::CpCommType cp_comm_type = layers::CpCommType::P2P;
  /// Groups of the MoE layer when cfg.is_moe_layer(layer_number) (they must outlive the layer): EP,
  /// expert-TP and expert-TP × EP (layers::MoEGroups; its tp is the layer's own). Unset members are the
  /// layer's TP group when that has one rank (a single-rank model), else ValueError naming them.
  layers::MoEGroups moe;
};

/// First Philox offset of the MoE layers' draws: far above the dense layers', so a MoE layer's router and
/// experts (layers::moe_init_offsets(E) draws each) never meet another layer's.
constexpr uint64_t kMoEInitBase = uint64_t(1) << 40;

/// Elementwise a + b (same shape and dtype, any device) into a new contiguous tensor. Used for the
/// residual adds and gradient sums the fused norm kernels do not cover.
Tensor add(const Tensor& a, const Tensor& b, const Stream& s = {});

/// The attention layer's part of a model config (sizes, biases, SP, RoPE, selective recompute).
layers::AttentionConfig attention_config(const TransformerConfig& cfg);

class TransformerLayer {
 public:
  /// `tp` must outlive the layer. Its attention and MLP check their own invariants (ValueError naming the
  /// fix); the config as a whole is validated at the boundary (GPTModel, train::validate).
  TransformerLayer(comm::Communicator& tp, const TransformerConfig& cfg, const TransformerLayerOptions& options = {});

  /// x: [s, b, h] replicated, or [s/TP, b, h] with sequence_parallel. position_ids: see
  /// SelfAttention::forward (full sequence, undefined = 0..s-1). Returns y in x's layout.
  Tensor forward(const layers::ForwardContext& ctx, const Tensor& x, const Tensor& position_ids = {});
  /// dy: gradient of forward's output. Accumulates every parameter's main_grad and returns dx.
  Tensor backward(const layers::ForwardContext& ctx, const Tensor& dy);

  /// Moves everything the last forward saved (sub-modules included) into `s`, leaving the layer as if
  /// no forward had run; restore_activations moves it back (same order). See activation_stash.hpp.
  void stash_activations(layers::ActivationStash& s);
  void restore_activations(layers::ActivationStash& s);

  layers::NormLayer& input_layernorm() { return *input_norm_; }
  layers::SelfAttention& self_attention() { return attention_; }
  layers::NormLayer& pre_mlp_layernorm() { return *mlp_norm_; }
  /// The dense MLP (ValueError on a MoE layer).
  layers::MLP& mlp();
  /// The MoE layer in place of the MLP (cfg.is_moe_layer(layer_number)); nullptr on a dense layer.
  layers::MoELayer* moe() { return moe_.get(); }
  /// Parameters with their names relative to the layer ("self_attention.linear_qkv.weight", ...).
  std::vector<std::pair<std::string, layers::Parameter*>> named_parameters();
  std::vector<layers::Parameter*> parameters();
  void zero_grad();
  int64_t layer_number() const { return opts_.layer_number; }
  RecomputeGranularity recompute() const { return cfg_.recompute_granularity; }

  /// Attaches LoRA adapters to the linears `lora.target_modules` selects and freezes every base weight of
  /// the layer (model/lora.hpp); named_parameters() then lists only the adapters. `tp` is the group the
  /// layer was built with; `lora` must have passed lora_problems.
  void apply_lora(comm::Communicator& tp, const LoRAConfig& lora);
  /// Merges every adapter into its base weight (W += alpha/r · B A) and unfreezes the base weights.
  void merge_lora();
  bool has_lora() const { return lora_; }

 private:
  Tensor forward_impl(const layers::ForwardContext& ctx, const Tensor& x, const Tensor& position_ids);

  TransformerConfig cfg_;
  TransformerLayerOptions opts_;
  std::unique_ptr<layers::NormLayer> input_norm_;
  layers::SelfAttention attention_;
  std::unique_ptr<layers::NormLayer> mlp_norm_;
  std::unique_ptr<layers::MLP> mlp_;      // a dense layer
  std::unique_ptr<layers::MoELayer> moe_;  // a MoE layer
  // Full recompute: the layer input and position ids, kept instead of the sub-modules' activations.
  Tensor saved_x_, saved_positions_, saved_cu_;  // saved_cu_: the forward's ctx.cu_seqlens (packed rows)
  int64_t saved_max_seqlen_ = 0;
  bool has_forward_ = false;
  bool lora_ = false;  // adapters attached, base weights frozen
};

}  // namespace megacore::model
