// TransformerConfig: the shape and flavour of a GPT/Llama-style decoder, validated as a whole before
// anything is allocated, plus the parameter and FLOP counts that MFU reporting uses.
//
// Field names follow Megatron-Core's TransformerConfig where one exists. Zero means "derived" for
// kv_channels (hidden/heads), num_query_groups (= heads, plain multi-head attention) and
// ffn_hidden_size (4·hidden); use the accessors head_dim(), query_groups() and ffn_size().
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <vector>

#include "megacore/core/dtype.hpp"
#include "megacore/core/fields.hpp"
#include "megacore/layers/layer_types.hpp"

namespace megacore::model {

using layers::ActivationType;
using layers::NormType;
using layers::PositionEmbeddingType;
using layers::RecomputeGranularity;
using layers::RopeScaling;
using layers::RopeScalingType;

std::string_view norm_type_name(NormType t);
std::string_view activation_type_name(ActivationType t);
std::string_view position_embedding_type_name(PositionEmbeddingType t);
std::string_view recompute_granularity_name(RecomputeGranularity g);

struct TransformerConfig {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;  ///< KV heads (GQA); 0 = num_attention_heads
  int64_t ffn_hidden_size = 0;   ///< 0 = 4·hidden_size
  int64_t kv_channels = 0;       ///< head dimension; 0 = hidden_size / num_attention_heads
  int64_t vocab_size = 0;        ///< the tokenizer's vocabulary (unpadded)
  int64_t max_position_embeddings = 0;
  /// The embedding and output layer are padded to a multiple of this × TP (Megatron's
  /// make_vocab_size_divisible_by); the padding rows are masked out of the loss.
  int64_t make_vocab_size_divisible_by = 128;

  NormType normalization = NormType::RMSNorm;
  double norm_eps = 1e-5;
  ActivationType activation = ActivationType::SwiGLU;
  bool add_bias_linear = false;  ///< biases on every linear layer (GPT-2: yes, Llama: no)
  bool tie_word_embeddings = false;
  PositionEmbeddingType position_embedding = PositionEmbeddingType::RoPE;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;

  double init_method_std = 0.02;
  DType params_dtype = DType::F32;
  bool sequence_parallel = false;
  RecomputeGranularity recompute_granularity = RecomputeGranularity::None;
  uint64_t seed = 1234;
  /// Overlap each column-parallel layer's backward TP collective (input-gradient all-reduce /
  /// reduce-scatter, SP input re-gather) with its GEMMs, as Megatron-Core does
  /// (ColumnParallelLinearOptions::overlap_grad_comm). Same results; default off because the CUDA
  /// path (comm stream + events) has not yet been validated on a GPU.
  bool tp_comm_overlap = false;

  /// The architecture fields as a recipe's model section names them (the RoPE scaling flattened to
  /// rope_scaling, rope_scaling_factor, ...). params_dtype, sequence_parallel, recompute_granularity and
  /// tp_comm_overlap are set from the trainer and parallel sections (train::RunConfig::transformer_config).
  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"num_layers", "Transformer layers."}, s.num_layers);
    f(Field{"hidden_size", "Model width."}, s.hidden_size);
    f(Field{"num_attention_heads", "Query heads."}, s.num_attention_heads);
    f(Field{"num_query_groups", "KV heads (GQA); 0 = num_attention_heads."}, s.num_query_groups);
    f(Field{"ffn_hidden_size", "MLP width; 0 = 4 x hidden_size."}, s.ffn_hidden_size);
    f(Field{"kv_channels", "Head dimension; 0 = hidden_size / num_attention_heads."}, s.kv_channels);
    f(Field{"vocab_size", "The tokenizer's vocabulary (unpadded)."}, s.vocab_size);
    f(Field{"max_position_embeddings", "Longest sequence the model supports."}, s.max_position_embeddings);
    f(Field{"make_vocab_size_divisible_by",
            "The embedding and output layer are padded to a multiple of this x TP; padding rows are masked out."},
      s.make_vocab_size_divisible_by);
    f(Field{"normalization", "RMSNorm (Llama) or LayerNorm (GPT-2)."}, s.normalization);
    f(Field{"norm_eps", "Epsilon of the norms."}, s.norm_eps);
    f(Field{"activation", "SwiGLU (fc1 makes [gate | up]) or GELU (tanh, GPT-2)."}, s.activation);
    f(Field{"add_bias_linear", "Biases on every linear layer (GPT-2: yes, Llama: no)."}, s.add_bias_linear);
    f(Field{"tie_word_embeddings", "The output layer shares the word-embedding weight."}, s.tie_word_embeddings);
    f(Field{"position_embedding", "RoPE or Learned (absolute positions, GPT-2)."}, s.position_embedding);
    f(Field{"rope_theta", "RoPE base (10000 Llama 2, 500000 Llama 3)."}, s.rope_theta);
    f(Field{"rope_scaling", "RoPE frequency scaling: none or llama3 (Llama 3.1+)."}, s.rope_scaling.type);
    f(Field{"rope_scaling_factor", "llama3 scaling: factor (8 for 3.1, 32 for 3.2)."}, s.rope_scaling.factor);
    f(Field{"rope_low_freq_factor", "llama3 scaling: low-frequency factor."}, s.rope_scaling.low_freq_factor);
    f(Field{"rope_high_freq_factor", "llama3 scaling: high-frequency factor."}, s.rope_scaling.high_freq_factor);
    f(Field{"rope_original_max_position_embeddings", "llama3 scaling: the pre-training context."},
      s.rope_scaling.original_max_position_embeddings);
    f(Field{"init_method_std", "Standard deviation of the weight init."}, s.init_method_std);
    f(Field{"seed", "Seed of the weight init."}, s.seed);
  }

  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : (num_attention_heads > 0 ? hidden_size / num_attention_heads : 0); }
  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  int64_t ffn_size() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  /// Width of the attention output (heads · head_dim), the input of the output projection.
  int64_t attention_width() const { return num_attention_heads * head_dim(); }
  /// Output width of the fused QKV projection: (heads + 2·query_groups) · head_dim.
  int64_t qkv_width() const { return (num_attention_heads + 2 * query_groups()) * head_dim(); }
};

/// Every inconsistency of `cfg` for `tp_size`-way tensor parallelism, each with the change that fixes it
/// (empty when the config is valid).
std::vector<std::string> validation_errors(const TransformerConfig& cfg, int tp_size = 1);
/// Throws ConfigError listing validation_errors() when there are any. Call it before allocating anything.
void validate(const TransformerConfig& cfg, int tp_size = 1);

/// vocab_size rounded up to a multiple of make_vocab_size_divisible_by × tp_size.
int64_t padded_vocab_size(const TransformerConfig& cfg, int tp_size = 1);

/// Parameters of the whole model by part (biases and norm weights included).
struct ParameterCount {
  int64_t embedding = 0;           ///< word embedding (vocab × hidden)
  int64_t position_embedding = 0;  ///< learned positions (max_positions × hidden), else 0
  int64_t per_layer = 0;           ///< one transformer layer
  int64_t layers = 0;              ///< num_layers × per_layer
  int64_t final_norm = 0;
  int64_t output_layer = 0;        ///< 0 when tied to the embedding
  int64_t total = 0;
};

/// Counts every parameter. tp_size = 0 counts the true vocabulary (as Hugging Face reports it); a
/// positive tp_size counts the padded vocabulary that is allocated for that TP degree.
ParameterCount parameter_count(const TransformerConfig& cfg, int tp_size = 0);

/// Training FLOPs per token (forward + backward, no recompute), the numerator of MFU.
struct FlopsPerToken {
  /// 6 · N_matmul: N_matmul counts the weights that take part in a matrix product (every linear
  /// layer and the output layer, whether or not it is tied), not the embedding lookup, norms, biases
  /// or position tables.
  double dense = 0;
  /// 12 · L · (heads · head_dim) · s for QK^T and AV over the full s×s score matrix (forward 4·L·a·d·s,
  /// backward twice that); halved when `causal` is set, counting only the lower triangle.
  double attention = 0;
  double total = 0;
};

/// FLOPs per token at sequence length `seq_len`. By default the non-causal attention count (the
/// convention of Megatron-LM's and PaLM's MFU), so numbers compare with theirs; pass causal = true for
/// the work a causal kernel actually does.
FlopsPerToken flops_per_token(const TransformerConfig& cfg, int64_t seq_len, bool causal = false);

/// Ready-made configs (parameters dtype f32; set params_dtype for bf16 training).
namespace presets {
/// A two-layer Llama small enough for CPU tests: h64, 8 heads, 4 KV groups (GQA), ffn 128,
/// vocab 256; valid for TP 1, 2 and 4.
TransformerConfig tiny_llama();
/// A two-layer GPT-2 (LayerNorm, learned positions, GELU, biases, tied) of the same size.
TransformerConfig tiny_gpt2();
/// Llama 3.2 1B: h2048, 16 layers, 32 heads, 8 KV, ffn 8192, vocab 128256, tied, llama3 RoPE scaling.
TransformerConfig llama32_1b();
/// Llama 3 8B: h4096, 32 layers, 32 heads, 8 KV, ffn 14336, vocab 128256, untied.
TransformerConfig llama3_8b();
/// GPT-2 small (124M): h768, 12 layers, 12 heads, vocab 50257, 1024 positions.
TransformerConfig gpt2_124m();
}  // namespace presets

}  // namespace megacore::model
