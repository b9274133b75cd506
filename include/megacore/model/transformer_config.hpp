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
using layers::MoERouterScore;
using layers::MoETokenDispatcher;
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
  /// RMSNorm of each query and key head (over head_dim, one weight per layer for q and one for k) before RoPE:
  /// Qwen3's q_norm / k_norm, Megatron-Core's qk_layernorm.
  bool qk_layernorm = false;
  bool tie_word_embeddings = false;
  PositionEmbeddingType position_embedding = PositionEmbeddingType::RoPE;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;

  /// Mixture of experts (Megatron-Core names). num_moe_experts = 0 is a dense model; otherwise every
  /// moe_layer_freq-th layer (0, k, 2k, ...) replaces its MLP by a MoE layer of routed SwiGLU/GELU experts.
  int64_t num_moe_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;  ///< each expert's FFN width; 0 = ffn_size()
  int64_t moe_layer_freq = 1;
  double moe_aux_loss_coeff = 0.0;
  double moe_z_loss_coeff = 0.0;
  int64_t moe_shared_expert_size = 0;  ///< FFN width of the shared expert; 0 = none
  MoERouterScore moe_router_score_function = MoERouterScore::Softmax;
  bool moe_router_pre_softmax = false;
  double moe_router_topk_scaling_factor = 1.0;
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  double moe_expert_capacity_factor = 0.0;  ///< 0 = dropless
  MoETokenDispatcher moe_token_dispatcher_type = MoETokenDispatcher::AllToAll;
  bool moe_router_force_load_balancing = false;  ///< benchmarking only: random routing (layers/moe.hpp)

  double init_method_std = 0.02;
  DType params_dtype = DType::F32;
  bool sequence_parallel = false;
  RecomputeGranularity recompute_granularity = RecomputeGranularity::None;
  uint64_t seed = 1234;
  /// Overlap each column-parallel layer's backward TP collective (input-gradient all-reduce /
  /// reduce-scatter, SP input re-gather) with its GEMMs, as Megatron-Core does
  /// (ColumnParallelLinearOptions::overlap_grad_comm). Same results; default off: on 4 x H200 it does
  /// not pay yet (docs/performance.md).
  bool tp_comm_overlap = false;
  /// With sequence_parallel: every SP linear layer's forward all-gather (before linear_qkv, linear_fc1 and the
  /// output layer) and reduce-scatter (after linear_proj and linear_fc2) runs as a ring of TP steps
  /// overlapping the GEMM in row chunks (the layers' overlap_sp_forward). The all-gather side is exact; the
  /// reduce-scatter side adds partial sums in ring order (equal at TP 2, within round-off at TP 4).
  bool tp_comm_overlap_forward = false;
  /// CUDA priority of those layers' communication streams (ColumnParallelLinearOptions::comm_stream_priority).
  int tp_comm_stream_priority = 0;

  /// The architecture fields as a recipe's model section names them (the RoPE scaling flattened to
  /// rope_scaling, rope_scaling_factor, ...). params_dtype, sequence_parallel, recompute_granularity,
  /// tp_comm_overlap, tp_comm_overlap_forward and tp_comm_stream_priority are set from the trainer and parallel sections (train::RunConfig::transformer_config).
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
    f(Field{"qk_layernorm",
            "RMSNorm of each query and key head before RoPE (Qwen3's q_norm / k_norm); RMSNorm models only."},
      s.qk_layernorm);
    f(Field{"tie_word_embeddings", "The output layer shares the word-embedding weight."}, s.tie_word_embeddings);
    f(Field{"position_embedding", "RoPE or Learned (absolute positions, GPT-2)."}, s.position_embedding);
    f(Field{"rope_theta", "RoPE base (10000 Llama 2, 500000 Llama 3)."}, s.rope_theta);
    f(Field{"rope_scaling", "RoPE frequency scaling: none or llama3 (Llama 3.1+)."}, s.rope_scaling.type);
    f(Field{"rope_scaling_factor", "llama3 scaling: factor (8 for 3.1, 32 for 3.2)."}, s.rope_scaling.factor);
    f(Field{"rope_low_freq_factor", "llama3 scaling: low-frequency factor."}, s.rope_scaling.low_freq_factor);
    f(Field{"rope_high_freq_factor", "llama3 scaling: high-frequency factor."}, s.rope_scaling.high_freq_factor);
    f(Field{"rope_original_max_position_embeddings", "llama3 scaling: the pre-training context."},
      s.rope_scaling.original_max_position_embeddings);
    f(Field{"num_moe_experts", "Routed experts per MoE layer; 0 = a dense model (no MoE layers)."}, s.num_moe_experts);
    f(Field{"moe_router_topk", "Experts each token is routed to (top-k)."}, s.moe_router_topk);
    f(Field{"moe_ffn_hidden_size", "FFN width of each routed expert; 0 = ffn_hidden_size."}, s.moe_ffn_hidden_size);
    f(Field{"moe_layer_freq",
            "Every k-th layer is a MoE layer (layers 0, k, 2k, ...), the rest dense; 1 = every layer."},
      s.moe_layer_freq);
    f(Field{"moe_aux_loss_coeff",
            "Switch load-balancing loss coefficient (per MoE layer and micro-batch); 0 = off (1e-2 is common)."},
      s.moe_aux_loss_coeff);
    f(Field{"moe_z_loss_coeff", "Router z-loss coefficient, coeff x mean(logsumexp(logits)^2); 0 = off (1e-3 is common)."},
      s.moe_z_loss_coeff);
    f(Field{"moe_shared_expert_size",
            "FFN width of a shared expert every token passes through beside the routed ones; 0 = none."},
      s.moe_shared_expert_size);
    f(Field{"moe_router_score_function",
            "Router scores: softmax over the experts (Mixtral, Qwen-MoE) or a sigmoid per expert (DeepSeek-V3)."},
      s.moe_router_score_function);
    f(Field{"moe_router_pre_softmax",
            "Softmax scores: true = softmax over all experts, then top-k (probabilities not renormalised, "
            "Qwen2-MoE); false = top-k of the logits, then softmax over the k chosen (Mixtral)."},
      s.moe_router_pre_softmax);
    f(Field{"moe_router_topk_scaling_factor", "The routing probabilities are multiplied by this."},
      s.moe_router_topk_scaling_factor);
    f(Field{"moe_router_enable_expert_bias",
            "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only, "
            "moved after each step towards even load."},
      s.moe_router_enable_expert_bias);
    f(Field{"moe_router_bias_update_rate",
            "Expert bias step: bias += rate x sign(mean load - load of the expert) after each optimizer step."},
      s.moe_router_bias_update_rate);
    f(Field{"moe_expert_capacity_factor",
            "Token dropping: each expert keeps at most ceil(factor x tokens x topk / experts) token slots (the most "
            "probable); 0 = dropless."},
      s.moe_expert_capacity_factor);
    f(Field{"moe_token_dispatcher_type",
            "How tokens reach their experts' ranks: alltoall (uneven all-to-all over EP) or allgather (gather every "
            "token over EP, reduce-scatter back)."},
      s.moe_token_dispatcher_type);
    f(Field{"moe_router_force_load_balancing",
            "Benchmarking only: routing ignores the router's scores. Each token's top-k and combine weights come "
            "from random scores (fresh per micro-batch, from the seed, step and token index), so the experts get "
            "even loads; the router weight gets no gradient from routing (the aux and z-losses still apply)."},
      s.moe_router_force_load_balancing);
    f(Field{"init_method_std", "Standard deviation of the weight init."}, s.init_method_std);
    f(Field{"seed", "Seed of the weight init."}, s.seed);
  }

  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : (num_attention_heads > 0 ? hidden_size / num_attention_heads : 0); }
  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  int64_t ffn_size() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  bool is_moe() const { return num_moe_experts > 0; }
  /// True when layer `layer` (0-based) is a MoE layer: experts are configured and layer % moe_layer_freq == 0.
  bool is_moe_layer(int64_t layer) const {
    return num_moe_experts > 0 && moe_layer_freq > 0 && layer % moe_layer_freq == 0;
  }
  /// Number of MoE layers (the others are dense).
  int64_t num_moe_layers() const {
    return num_moe_experts > 0 && moe_layer_freq > 0 && num_layers > 0 ? (num_layers - 1) / moe_layer_freq + 1 : 0;
  }
  /// FFN width of one routed expert.
  int64_t moe_ffn_size() const { return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn_size(); }
  /// Width of the attention output (heads · head_dim), the input of the output projection.
  int64_t attention_width() const { return num_attention_heads * head_dim(); }
  /// Output width of the fused QKV projection: (heads + 2·query_groups) · head_dim.
  int64_t qkv_width() const { return (num_attention_heads + 2 * query_groups()) * head_dim(); }
};

/// Every inconsistency of `cfg` for `tp_size`-way tensor parallelism, `ep_size`-way expert parallelism and
/// `expert_tp_size`-way tensor parallelism inside experts (0 = tp_size), each with the change that fixes it
/// (empty when the config is valid).
std::vector<std::string> validation_errors(const TransformerConfig& cfg, int tp_size = 1, int ep_size = 1,
                                           int expert_tp_size = 0);
/// Throws ConfigError listing validation_errors() when there are any. Call it before allocating anything.
void validate(const TransformerConfig& cfg, int tp_size = 1, int ep_size = 1, int expert_tp_size = 0);

/// vocab_size rounded up to a multiple of make_vocab_size_divisible_by × tp_size.
int64_t padded_vocab_size(const TransformerConfig& cfg, int tp_size = 1);

/// Parameters of the whole model by part (biases and norm weights included).
struct ParameterCount {
  int64_t embedding = 0;           ///< word embedding (vocab × hidden)
  int64_t position_embedding = 0;  ///< learned positions (max_positions × hidden), else 0
  int64_t per_layer = 0;           ///< one dense transformer layer
  /// One MoE layer (attention, norms, router, every routed expert, the shared expert); 0 for a dense model.
  int64_t per_moe_layer = 0;
  /// Of a MoE layer, the routed experts' weights (all of them; an EP rank holds 1/EP of them).
  int64_t per_moe_layer_experts = 0;
  int64_t layers = 0;              ///< dense layers × per_layer + MoE layers × per_moe_layer
  int64_t final_norm = 0;
  int64_t output_layer = 0;        ///< 0 when tied to the embedding
  int64_t total = 0;
  /// Parameters one token passes through: total less the routed experts it is not sent to (a MoE layer
  /// counts moe_router_topk of its experts). Equals total for a dense model.
  int64_t active = 0;
};

/// Counts every parameter. tp_size = 0 counts the true vocabulary (as Hugging Face reports it); a
/// positive tp_size counts the padded vocabulary that is allocated for that TP degree.
ParameterCount parameter_count(const TransformerConfig& cfg, int tp_size = 0);

/// Training FLOPs per token (forward + backward, no recompute), the numerator of MFU.
struct FlopsPerToken {
  /// 6 · N_matmul: N_matmul counts the weights that take part in a matrix product (every linear
  /// layer and the output layer, whether or not it is tied), not the embedding lookup, norms, biases
  /// or position tables. In a MoE layer only the *active* weights count: the router, the top-k routed
  /// experts a token is sent to, and the shared expert (so MFU is by active parameters).
  double dense = 0;
  /// 12 · L · (heads · head_dim) · s for QK^T and AV over the full s×s score matrix (forward 4·L·a·d·s,
  /// backward twice that); halved when `causal` is set, counting only the lower triangle.
  double attention = 0;
  /// Of `dense`, the output layer's share: 6 · vocab · hidden (the rest is the transformer layers').
  double output_layer = 0;
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
/// Mixtral 8x7B: h4096, 32 layers, 32 heads, 8 KV, 8 experts (top-2, softmax over the chosen) of FFN
/// 14336 in every layer, vocab 32000, RMSNorm eps 1e-5, RoPE theta 1e6, 32768 positions, untied.
TransformerConfig mixtral_8x7b();
}  // namespace presets

}  // namespace megacore::model
