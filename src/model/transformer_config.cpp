#include "megacore/model/transformer_config.hpp"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "megacore/core/error.hpp"

namespace megacore::model {

std::string_view norm_type_name(NormType t) { return t == NormType::RMSNorm ? "RMSNorm" : "LayerNorm"; }
std::string_view activation_type_name(ActivationType t) { return t == ActivationType::SwiGLU ? "swiglu" : "gelu"; }
std::string_view position_embedding_type_name(PositionEmbeddingType t) {
  return t == PositionEmbeddingType::RoPE ? "rope" : "learned_absolute";
}
std::string_view recompute_granularity_name(RecomputeGranularity g) {
  switch (g) {
    case RecomputeGranularity::None: return "none";
    case RecomputeGranularity::Selective: return "selective";
    case RecomputeGranularity::Full: return "full";
  }
  return "?";
}

namespace {

// Largest divisor of n that is <= limit: a concrete suggestion to put in an error message.
int64_t divisor_at_most(int64_t n, int64_t limit) {
  for (int64_t d = std::min(n, limit); d > 1; --d)
    if (n % d == 0) return d;
  return 1;
}

template <class T>
std::string field_text(const T& v) {
  if constexpr (NamedEnum<T>)
    return std::string(enum_name(v));
  else
    return fmt::format("{}", v);
}

// The moe_* fields of `c` whose value differs from the default, as (name, value, default).
std::vector<std::array<std::string, 3>> moe_fields_set(const TransformerConfig& c) {
  std::vector<std::pair<std::string_view, std::string>> mine, dflt;
  auto collect = [](const TransformerConfig& cfg, auto& out) {
    TransformerConfig::fields(cfg, [&](const Field& f, const auto& v) {
      if (f.name.starts_with("moe_")) out.emplace_back(f.name, field_text(v));
    });
  };
  collect(c, mine);
  collect(TransformerConfig{}, dflt);
  std::vector<std::array<std::string, 3>> out;
  for (size_t i = 0; i < mine.size(); ++i)
    if (mine[i].second != dflt[i].second) out.push_back({std::string(mine[i].first), mine[i].second, dflt[i].second});
  return out;
}

void moe_validation_errors(const TransformerConfig& c, int tp, int ep, int etp, std::vector<std::string>& errs) {
  auto add = [&]<class... A>(fmt::format_string<A...> f, A&&... a) { errs.push_back(fmt::format(f, std::forward<A>(a)...)); };
  const int64_t e = c.num_moe_experts;
  if (e < 0) {  // the one error: the other MoE fields' checks would follow from a wrong count
    add("num_moe_experts is {}; set it to the number of routed experts, or 0 for a dense model", e);
    return;
  }
  if (e == 0) {
    for (const auto& [name, value, dflt] : moe_fields_set(c))
      add("{} is {} but num_moe_experts is 0 (a dense model has no MoE layers); set num_moe_experts to the expert "
          "count, or leave {} at its default {}",
          name, value, name, dflt);
    if (ep > 1)
      add("expert parallelism (EP = {}) splits the experts of MoE layers but num_moe_experts is 0; set "
          "parallel.expert_model_parallel_size (ep) to 1, or give the model experts",
          ep);
    if (etp > 0 && etp != tp)
      add("expert_tensor_parallel_size {} applies to MoE experts but num_moe_experts is 0; set it to 0 (= TP)", etp);
    return;
  }
  if (c.moe_router_topk < 1 || c.moe_router_topk > e)
    add("moe_router_topk is {}; each token is routed to between 1 and num_moe_experts = {} experts: set "
        "moe_router_topk in [1, {}] (2 is common)",
        c.moe_router_topk, e, e);
  if (c.moe_ffn_hidden_size < 0)
    add("moe_ffn_hidden_size is {}; set the experts' FFN width (a positive number), or 0 for ffn_hidden_size",
        c.moe_ffn_hidden_size);
  if (c.moe_layer_freq < 1)
    add("moe_layer_freq is {}; set it to k >= 1 (every k-th layer is a MoE layer; 1 = every layer)", c.moe_layer_freq);
  if (!(c.moe_aux_loss_coeff >= 0) || std::isinf(c.moe_aux_loss_coeff))
    add("moe_aux_loss_coeff is {}; set a finite coefficient >= 0 (0 = no load-balancing loss, 1e-2 is common)",
        c.moe_aux_loss_coeff);
  if (!(c.moe_z_loss_coeff >= 0) || std::isinf(c.moe_z_loss_coeff))
    add("moe_z_loss_coeff is {}; set a finite coefficient >= 0 (0 = no z-loss, 1e-3 is common)", c.moe_z_loss_coeff);
  if (c.moe_shared_expert_size < 0)
    add("moe_shared_expert_size is {}; set the shared expert's FFN width, or 0 for none", c.moe_shared_expert_size);
  if (!(c.moe_router_topk_scaling_factor > 0) || std::isinf(c.moe_router_topk_scaling_factor))
    add("moe_router_topk_scaling_factor is {}; set a finite positive factor (1 = unscaled)",
        c.moe_router_topk_scaling_factor);
  if (!(c.moe_router_bias_update_rate >= 0) || std::isinf(c.moe_router_bias_update_rate))
    add("moe_router_bias_update_rate is {}; set a finite rate >= 0 (1e-3 is DeepSeek-V3's)", c.moe_router_bias_update_rate);
  if (!(c.moe_expert_capacity_factor >= 0) || std::isinf(c.moe_expert_capacity_factor))
    add("moe_expert_capacity_factor is {}; set a positive factor (e.g. 1.0 keeps at most the even share of token "
        "slots per expert) or 0 for dropless routing",
        c.moe_expert_capacity_factor);
  if (c.moe_router_pre_softmax && c.moe_router_score_function == MoERouterScore::Sigmoid)
    add("moe_router_pre_softmax applies to softmax scores but moe_router_score_function is sigmoid; set "
        "moe_router_pre_softmax = false or use softmax scores");
  if (c.add_bias_linear)
    add("MoE experts have no biases but add_bias_linear is true; set add_bias_linear = false for a MoE model");
  if (ep >= 1 && e % ep != 0)
    add("num_moe_experts {} is not divisible by EP = {}; every expert-parallel rank holds the same number of "
        "experts: use an EP that divides {} (e.g. {}) or change the expert count",
        e, ep, e, divisor_at_most(e, ep));
  const int expert_tp = etp > 0 ? etp : tp;
  const int64_t f = c.moe_ffn_size();
  if (expert_tp >= 1 && c.moe_ffn_hidden_size >= 0 && f > 0 && f % expert_tp != 0)
    add("the experts' FFN width {} (moe_ffn_hidden_size, or ffn_hidden_size when 0) is not divisible by expert-TP "
        "= {}; round it to a multiple of {} or change expert_tensor_parallel_size",
        f, expert_tp, expert_tp);
  if (tp >= 1 && c.moe_shared_expert_size > 0 && c.moe_shared_expert_size % tp != 0)
    add("moe_shared_expert_size {} is not divisible by TP = {} (the shared expert is split like a dense MLP); round "
        "it to a multiple of {}",
        c.moe_shared_expert_size, tp, tp);
}

}  // namespace

std::vector<std::string> validation_errors(const TransformerConfig& c, int tp, int ep, int etp) {
  // Collect every problem so one run of the check tells the user everything to change.
  std::vector<std::string> errs;
  auto add = [&]<class... A>(fmt::format_string<A...> f, A&&... a) { errs.push_back(fmt::format(f, std::forward<A>(a)...)); };

  if (tp < 1) add("the tensor-parallel size is {}; it must be at least 1", tp);
  auto positive = [&](int64_t v, std::string_view name, std::string_view what) {
    if (v <= 0) add("{} is {}; set it to the {} (a positive number)", name, v, what);
  };
  positive(c.num_layers, "num_layers", "number of transformer layers");
  positive(c.hidden_size, "hidden_size", "model width");
  positive(c.num_attention_heads, "num_attention_heads", "number of query heads");
  positive(c.vocab_size, "vocab_size", "tokenizer's vocabulary size");
  positive(c.max_position_embeddings, "max_position_embeddings", "longest sequence the model supports");
  positive(c.make_vocab_size_divisible_by, "make_vocab_size_divisible_by", "padding granule of the vocabulary (128)");
  auto derived = [&](int64_t v, std::string_view name, std::string_view dflt) {
    if (v < 0) add("{} is {}; set it to a positive value, or 0 for the default ({})", name, v, dflt);
  };
  derived(c.num_query_groups, "num_query_groups", "num_attention_heads, i.e. no GQA");
  derived(c.ffn_hidden_size, "ffn_hidden_size", "4 × hidden_size");
  derived(c.kv_channels, "kv_channels", "hidden_size / num_attention_heads");

  const int64_t heads = c.num_attention_heads, groups = c.query_groups();
  if (c.hidden_size > 0 && heads > 0 && c.kv_channels == 0 && c.hidden_size % heads != 0)
    add("hidden_size {} is not divisible by num_attention_heads {}; use a head count that divides it (e.g. {}) or set "
        "kv_channels to the head dimension explicitly",
        c.hidden_size, heads, divisor_at_most(c.hidden_size, heads));
  if (heads > 0 && groups > 0 && heads % groups != 0)
    add("num_attention_heads {} is not divisible by num_query_groups {}; each KV group must serve a whole number of "
        "query heads: use a group count that divides the heads (e.g. {})",
        heads, groups, divisor_at_most(heads, groups));
  if (tp >= 1) {
    if (heads > 0 && heads % tp != 0)
      add("num_attention_heads {} is not divisible by TP {}; use a TP that divides the heads (e.g. {}) or change the "
          "head count",
          heads, tp, divisor_at_most(heads, tp));
    if (groups > 0 && groups % tp != 0)
      add("num_query_groups {} is not divisible by TP {}; every TP rank needs whole KV groups: use a TP that divides "
          "them (e.g. {}) or raise num_query_groups",
          groups, tp, divisor_at_most(groups, tp));
    const int64_t ffn = c.ffn_size();
    if (c.ffn_hidden_size >= 0 && ffn > 0 && ffn % tp != 0)
      add("ffn_hidden_size {} is not divisible by TP {}; round it to a multiple of {}", ffn, tp, tp);
    if (c.tp_comm_overlap_forward && !c.sequence_parallel)
      add("tp_comm_overlap_forward overlaps the sequence-parallel all-gathers and reduce-scatters of the forward and "
          "needs sequence_parallel; turn sequence_parallel on or tp_comm_overlap_forward off");
    if (c.sequence_parallel && tp == 1)
      add("sequence_parallel needs TP > 1 (it splits the sequence over the TP group) but TP is 1; turn "
          "sequence_parallel off or raise TP");
  }
  if (c.position_embedding == PositionEmbeddingType::RoPE) {
    const int64_t d = c.head_dim();
    if (d > 0 && d % 2 != 0)
      add("RoPE rotates pairs of channels but the head dimension is {} (odd); use an even kv_channels / head size", d);
    if (!(c.rope_theta > 0)) add("rope_theta is {}; set it to the RoPE base (10000 for Llama 2, 500000 for Llama 3)", c.rope_theta);
    const RopeScaling& r = c.rope_scaling;
    if (r.type == RopeScalingType::Llama3) {
      if (!(r.factor >= 1)) add("rope_scaling.factor is {}; the llama3 scaling factor must be at least 1 (8 for 3.1, 32 for 3.2)", r.factor);
      if (!(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor))
        add("rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {} and {}; Llama 3 uses 1 and 4",
            r.low_freq_factor, r.high_freq_factor);
      if (r.original_max_position_embeddings <= 0)
        add("rope_scaling.original_max_position_embeddings is {}; set it to the pre-training context (8192 for Llama 3)",
            r.original_max_position_embeddings);
    }
  } else if (c.rope_scaling.type != RopeScalingType::None) {
    add("rope_scaling is set but position_embedding is learned; set rope_scaling.type to None or use RoPE");
  }
  if (!(c.norm_eps > 0)) add("norm_eps is {}; set it to a small positive number (1e-5)", c.norm_eps);
  if (c.qk_layernorm && c.normalization != NormType::RMSNorm)
    add("qk_layernorm normalises query and key heads with RMSNorm (Qwen3) but normalization is {}; set "
        "normalization = RMSNorm or qk_layernorm = false",
        norm_type_name(c.normalization));
  if (!(c.init_method_std > 0)) add("init_method_std is {}; set it to a positive standard deviation (0.02)", c.init_method_std);
  if (!is_floating(c.params_dtype))
    add("params_dtype is {}; parameters must be f32, bf16 or f16", dtype_name(c.params_dtype));
  if (ep < 1) add("the expert-parallel size is {}; it must be at least 1", ep);
  if (etp < 0) add("the expert-tensor-parallel size is {}; it must be at least 1, or 0 for TP", etp);
  moe_validation_errors(c, tp, ep, etp, errs);
  return errs;
}

void validate(const TransformerConfig& c, int tp, int ep, int etp) {
  const std::vector<std::string> errs = validation_errors(c, tp, ep, etp);
  if (errs.empty()) return;
  std::string msg = errs.size() == 1 ? "invalid TransformerConfig: " : fmt::format("invalid TransformerConfig ({} problems): ", errs.size());
  for (size_t i = 0; i < errs.size(); ++i) msg += (i ? "; " : "") + errs[i];
  throw ConfigError(msg);
}

int64_t padded_vocab_size(const TransformerConfig& c, int tp) {
  MC_CHECK_AS(ConfigError, tp >= 1 && c.make_vocab_size_divisible_by > 0 && c.vocab_size > 0,
              "padded_vocab_size: needs vocab_size > 0, make_vocab_size_divisible_by > 0 and TP >= 1 (got {}, {}, {}); "
              "fix the config (validate() lists everything)",
              c.vocab_size, c.make_vocab_size_divisible_by, tp);
  const int64_t m = c.make_vocab_size_divisible_by * tp;
  return (c.vocab_size + m - 1) / m * m;
}

namespace {

struct LayerShapes {
  int64_t qkv_w, proj_w, fc1_w, fc2_w;  // matmul weights of one dense layer
  int64_t biases, norms;                // everything else in the layer
  // A MoE layer replaces fc1/fc2 (and their biases) by these matmul weights.
  int64_t router_w, expert_w, shared_w;  // expert_w: one routed expert (fc1 + fc2)
};

// fc1 + fc2 weights of a (SwiGLU or GELU) MLP of width f.
int64_t mlp_weights(const TransformerConfig& c, int64_t f) {
  const int64_t fc1_out = c.activation == ActivationType::SwiGLU ? 2 * f : f;
  return c.hidden_size * fc1_out + f * c.hidden_size;
}

LayerShapes layer_shapes(const TransformerConfig& c) {
  const int64_t h = c.hidden_size, f = c.ffn_size();
  const int64_t fc1_out = c.activation == ActivationType::SwiGLU ? 2 * f : f;
  const int64_t norm = c.normalization == NormType::LayerNorm ? 2 * h : h;  // LayerNorm has a bias
  LayerShapes s{};
  s.qkv_w = h * c.qkv_width();
  s.proj_w = c.attention_width() * h;
  s.fc1_w = h * fc1_out;
  s.fc2_w = f * h;
  s.biases = c.add_bias_linear ? c.qkv_width() + h + fc1_out + h : 0;
  s.norms = 2 * norm + (c.qk_layernorm ? 2 * c.head_dim() : 0);
  if (c.is_moe()) {
    s.router_w = c.num_moe_experts * h;
    s.expert_w = mlp_weights(c, c.moe_ffn_size());
    s.shared_w = c.moe_shared_expert_size > 0 ? mlp_weights(c, c.moe_shared_expert_size) : 0;
  }
  return s;
}

}  // namespace

ParameterCount parameter_count(const TransformerConfig& c, int tp) {
  const int64_t h = c.hidden_size;
  const int64_t vocab = tp > 0 ? padded_vocab_size(c, tp) : c.vocab_size;
  const LayerShapes s = layer_shapes(c);
  ParameterCount p;
  p.embedding = vocab * h;
  p.position_embedding = c.position_embedding == PositionEmbeddingType::Learned ? c.max_position_embeddings * h : 0;
  p.per_layer = s.qkv_w + s.proj_w + s.fc1_w + s.fc2_w + s.biases + s.norms;
  const int64_t moe_layers = c.num_moe_layers();
  if (moe_layers > 0) {
    p.per_moe_layer_experts = c.num_moe_experts * s.expert_w;
    p.per_moe_layer = s.qkv_w + s.proj_w + s.norms + s.router_w + p.per_moe_layer_experts + s.shared_w;
  }
  p.layers = (c.num_layers - moe_layers) * p.per_layer + moe_layers * p.per_moe_layer;
  p.final_norm = c.normalization == NormType::LayerNorm ? 2 * h : h;
  p.output_layer = c.tie_word_embeddings ? 0 : vocab * h;
  p.total = p.embedding + p.position_embedding + p.layers + p.final_norm + p.output_layer;
  p.active = p.total - moe_layers * (c.num_moe_experts - c.moe_router_topk) * s.expert_w;
  return p;
}

FlopsPerToken flops_per_token(const TransformerConfig& c, int64_t seq_len, bool causal) {
  MC_CHECK(seq_len > 0, "flops_per_token: seq_len is {}; pass the training sequence length", seq_len);
  const LayerShapes s = layer_shapes(c);
  // The output layer is a matmul whether or not its weight is shared with the embedding lookup.
  const int64_t moe_layers = c.num_moe_layers();
  const double moe_layer_active = double(s.qkv_w + s.proj_w + s.router_w + s.shared_w) +
                                  double(c.moe_router_topk) * double(s.expert_w);
  const double n_output = double(c.vocab_size) * double(c.hidden_size);
  const double n_matmul = double(c.num_layers - moe_layers) * double(s.qkv_w + s.proj_w + s.fc1_w + s.fc2_w) +
                          double(moe_layers) * moe_layer_active + n_output;
  FlopsPerToken f;
  f.dense = 6.0 * n_matmul;
  f.output_layer = 6.0 * n_output;
  f.attention = 12.0 * double(c.num_layers) * double(c.attention_width()) * double(seq_len) * (causal ? 0.5 : 1.0);
  f.total = f.dense + f.attention;
  return f;
}

namespace presets {

// Each preset names only what differs from TransformerConfig's defaults (RMSNorm, SwiGLU, RoPE, untied);
// GPT-2 models share one flavour. Fields left out of the designated initializers keep their defaults, which is
// the point, so GCC's -Wmissing-field-initializers is off here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
namespace {
TransformerConfig gpt2_flavour(TransformerConfig c) {
  c.normalization = NormType::LayerNorm;
  c.activation = ActivationType::GELU;
  c.add_bias_linear = true;
  c.tie_word_embeddings = true;
  c.position_embedding = PositionEmbeddingType::Learned;
  return c;
}
}  // namespace

TransformerConfig tiny_llama() {
  return {.num_layers = 2, .hidden_size = 64, .num_attention_heads = 8, .num_query_groups = 4, .ffn_hidden_size = 128,
          .vocab_size = 256, .max_position_embeddings = 128};
}

TransformerConfig tiny_gpt2() {
  return gpt2_flavour({.num_layers = 2, .hidden_size = 64, .num_attention_heads = 8, .ffn_hidden_size = 256,
                       .vocab_size = 256, .max_position_embeddings = 128});
}

TransformerConfig llama32_1b() {
  return {.num_layers = 16, .hidden_size = 2048, .num_attention_heads = 32, .num_query_groups = 8,
          .ffn_hidden_size = 8192, .kv_channels = 64, .vocab_size = 128256, .max_position_embeddings = 131072,
          .tie_word_embeddings = true, .rope_theta = 500000.0,
          .rope_scaling = {RopeScalingType::Llama3, 32.0, 1.0, 4.0, 8192}};
}

TransformerConfig llama3_8b() {
  return {.num_layers = 32, .hidden_size = 4096, .num_attention_heads = 32, .num_query_groups = 8,
          .ffn_hidden_size = 14336, .kv_channels = 128, .vocab_size = 128256, .max_position_embeddings = 8192,
          .rope_theta = 500000.0};
}

TransformerConfig mixtral_8x7b() {
  TransformerConfig c{.num_layers = 32, .hidden_size = 4096, .num_attention_heads = 32, .num_query_groups = 8,
                      .ffn_hidden_size = 14336, .kv_channels = 128, .vocab_size = 32000,
                      .max_position_embeddings = 32768, .norm_eps = 1e-5, .rope_theta = 1e6};
  c.num_moe_experts = 8;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 14336;
  c.moe_aux_loss_coeff = 1e-2;  // Megatron-Core's Mixtral recipe
  return c;
}

TransformerConfig gpt2_124m() {
  return gpt2_flavour({.num_layers = 12, .hidden_size = 768, .num_attention_heads = 12, .ffn_hidden_size = 3072,
                       .vocab_size = 50257, .max_position_embeddings = 1024});
}
#pragma GCC diagnostic pop

}  // namespace presets
}  // namespace megacore::model
