// GPTModel: a decoder-only language model (Llama or GPT-2 flavour, chosen by the TransformerConfig)
// over one tensor-parallel group, with explicit forward and backward.
//
//   tokens [b, s] → (transpose to [s, b]) → VocabParallelEmbedding (+ learned positions, GPT-2)
//     → N × TransformerLayer → final norm → output layer (column-parallel, no gather) → logits
//     [s, b, V/TP] → vocab-parallel cross-entropy → mean loss over the unmasked tokens
//
// Sequence parallelism (cfg.sequence_parallel) follows Megatron-Core: the embedding reduce-scatters
// its output to this rank's sequence chunk [s/TP, b, h] (the scatter after the embedding), the layers
// and the final norm run on chunks, and the output layer all-gathers the sequence before its GEMM.
// backward ends with layers::allreduce_sequence_parallel_grads, so every main_grad is complete after
// each backward, also when micro-batches accumulate.
//
// Tied embeddings (cfg.tie_word_embeddings): the output layer uses the embedding's weight and writes
// its weight gradient into the same main_grad, so the two gradients add; parameters() lists the
// shared weight once, as "embedding.weight".
//
// Philox offsets (all TP-invariant full-tensor draws from cfg.seed): 0 word embedding, 1 learned
// positions, 2 untied output layer; layer i uses kModelLayerInitBase + i × kTransformerLayerInitStride.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/cross_entropy.hpp"
#include "megacore/layers/embedding.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/layers/norm.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/model/transformer_config.hpp"
#include "megacore/model/transformer_layer.hpp"

namespace megacore::model {

constexpr uint64_t kModelLayerInitBase = 16;

struct GPTModelOptions {
  Device device = Device::cpu();
  float label_smoothing = 0.f;
};

class GPTModel {
 public:
  /// `tp` must outlive the model. The config is validated for tp.size()-way TP before anything is
  /// allocated (ConfigError listing every problem with its fix).
  GPTModel(const TransformerConfig& cfg, comm::Communicator& tp, const GPTModelOptions& options = {});

  /// tokens, labels: i32/i64 [b, s] (the same on every TP rank; labels = ignore_index -100 are skipped);
  /// loss_mask: optional f32 [b, s]. Returns the mean loss over the counted tokens,
  /// Σ mask·loss / Σ mask over tokens whose label is not ignored (f32 [1] on the model's device;
  /// 0 when no token counts). The count is taken on the host from labels and mask.
  Tensor forward(const layers::ForwardContext& ctx, const Tensor& tokens, const Tensor& labels,
                 const Tensor& loss_mask = {});
  /// Backpropagates the mean loss of the last forward: accumulates every parameter's main_grad
  /// (sequence-parallel partial sums included, so they are complete on return).
  void backward(const layers::ForwardContext& ctx);

  /// This rank's vocabulary shard of the last forward's logits, [b, s, padded_vocab/TP] (a view);
  /// columns ≥ vocab_size of the gathered logits are padding.
  Tensor logits() const;
  /// Every trainable parameter once, named with its module path ("embedding.weight",
  /// "layers.0.self_attention.linear_qkv.weight", ..., "final_layernorm.weight", "output_layer.weight").
  const std::vector<layers::Parameter*>& parameters() const { return params_; }
  /// The parameter of that name; ValueError listing the names when there is none.
  layers::Parameter& parameter(const std::string& name) const;
  void zero_grad();

  const TransformerConfig& config() const { return cfg_; }
  int64_t padded_vocab_size() const { return embedding_.padded_vocab_size(); }
  int64_t num_layers() const { return int64_t(layers_.size()); }
  TransformerLayer& layer(int64_t i) { return *layers_.at(size_t(i)); }
  layers::VocabParallelEmbedding& embedding() { return embedding_; }
  layers::ColumnParallelLinear& output_layer() { return output_layer_; }
  layers::NormLayer& final_layernorm() { return *final_norm_; }

 private:
  comm::Communicator& tp_;
  TransformerConfig cfg_;
  GPTModelOptions opts_;
  layers::VocabParallelEmbedding embedding_;
  layers::Parameter position_;  // learned positions [max_positions, h], replicated; undefined for RoPE
  std::vector<std::unique_ptr<TransformerLayer>> layers_;
  std::unique_ptr<layers::NormLayer> final_norm_;
  layers::ColumnParallelLinear output_layer_;
  layers::VocabParallelCrossEntropy loss_;
  std::vector<layers::Parameter*> params_;
  // Saved by forward.
  Tensor logits_;     // [s, b, V/TP]
  Tensor positions_;  // i64 [s_local, b] ids into position_, learned positions only
  float grad_scale_ = 0.f;
  bool has_forward_ = false;
};

}  // namespace megacore::model
