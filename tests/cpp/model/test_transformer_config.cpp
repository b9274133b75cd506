// TransformerConfig: counts against hand computations and published sizes; every validation error.
#include "megacore/model/transformer_config.hpp"

#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::model;

namespace {

// The Llama-1.1B of NOTES.md (TinyLlama shape): h2048, 16 layers, 32 heads, 8 KV, FFN 8192, vocab 32000.
TransformerConfig llama_1b1() {
  TransformerConfig c = presets::llama32_1b();
  c.vocab_size = 32000;
  c.tie_word_embeddings = false;
  c.rope_scaling = {};
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 2048;
  return c;
}

void require_error(const TransformerConfig& c, int tp, const std::string& what) {
  INFO("expecting: " << what);
  REQUIRE_THROWS_AS(validate(c, tp), ConfigError);
  REQUIRE_THROWS_WITH(validate(c, tp), Catch::Contains(what));
}

}  // namespace

TEST_CASE("parameter count of the Llama-1.1B matches a hand computation", "[model]") {
  const TransformerConfig c = llama_1b1();
  REQUIRE_NOTHROW(validate(c, 1));
  // Per layer: q 2048·2048 = 4,194,304; k and v 2·2048·(8·64) = 2,097,152; o 4,194,304;
  // SwiGLU gate+up+down 3·2048·8192 = 50,331,648; two RMSNorm weights 2·2048 = 4,096.
  const int64_t per_layer = 4'194'304 + 2'097'152 + 4'194'304 + 50'331'648 + 4'096;
  REQUIRE(per_layer == 60'821'504);
  ParameterCount p = parameter_count(c);
  REQUIRE(p.per_layer == per_layer);
  REQUIRE(p.layers == 16 * per_layer);            // 973,144,064
  REQUIRE(p.embedding == 32000LL * 2048);         // 65,536,000
  REQUIRE(p.output_layer == 32000LL * 2048);      // untied
  REQUIRE(p.final_norm == 2048);
  REQUIRE(p.position_embedding == 0);
  // 65,536,000 + 65,536,000 + 973,144,064 + 2,048
  REQUIRE(p.total == 1'104'218'112);
  // At TP 4 the vocabulary is padded to a multiple of 128·4 = 512: 32000 → 32256 (+256 rows, twice).
  REQUIRE(padded_vocab_size(c, 1) == 32000);
  REQUIRE(padded_vocab_size(c, 2) == 32000);
  REQUIRE(padded_vocab_size(c, 4) == 32256);
  REQUIRE(parameter_count(c, 4).total == 1'104'218'112 + 2 * 256 * 2048);
  REQUIRE(parameter_count(c, 1).total == p.total);
}

TEST_CASE("FLOPs per token of the Llama-1.1B: 6N_matmul + 12·L·h·s", "[model]") {
  const TransformerConfig c = llama_1b1();
  // N_matmul = 16 · (q, k, v, o, gate, up, down) + output layer = 16 · 60,817,408 + 65,536,000.
  const double n_matmul = 16.0 * 60'817'408 + 65'536'000;
  REQUIRE(n_matmul == 1'038'614'528.0);
  FlopsPerToken f = flops_per_token(c, 2048);
  REQUIRE(f.dense == 6 * n_matmul);                    // 6,231,687,168
  REQUIRE(f.attention == 12.0 * 16 * 2048 * 2048);     // 805,306,368 (non-causal)
  REQUIRE(f.total == 7'036'993'536.0);
  FlopsPerToken fc = flops_per_token(c, 2048, /*causal=*/true);
  REQUIRE(fc.attention == f.attention / 2);
  REQUIRE(fc.dense == f.dense);
  // A tied output layer is still a matmul: same dense FLOPs, fewer parameters.
  TransformerConfig tied = c;
  tied.tie_word_embeddings = true;
  REQUIRE(flops_per_token(tied, 2048).dense == f.dense);
  REQUIRE(parameter_count(tied).total == 1'104'218'112 - 32000LL * 2048);
}

TEST_CASE("presets have their published parameter counts and are valid", "[model]") {
  // Published sizes: GPT-2 small 124,439,808 (tied, learned positions, biases, LayerNorm);
  // Llama 3.2 1B 1,235,814,400 (tied); Llama 3 8B 8,030,261,248.
  REQUIRE(parameter_count(presets::gpt2_124m()).total == 124'439'808);
  REQUIRE(parameter_count(presets::llama32_1b()).total == 1'235'814'400);
  REQUIRE(parameter_count(presets::llama3_8b()).total == 8'030'261'248);
  for (int tp : {1, 2, 4}) {
    REQUIRE_NOTHROW(validate(presets::tiny_llama(), tp));
    REQUIRE_NOTHROW(validate(presets::tiny_gpt2(), tp));
    REQUIRE_NOTHROW(validate(presets::llama32_1b(), tp));
    REQUIRE_NOTHROW(validate(presets::llama3_8b(), tp));
    REQUIRE_NOTHROW(validate(presets::gpt2_124m(), tp));
  }
  // GPT-2's 12 heads do not split 8 ways.
  require_error(presets::gpt2_124m(), 8, "num_attention_heads 12 is not divisible by TP 8");
  REQUIRE(padded_vocab_size(presets::gpt2_124m(), 1) == 50304);
  REQUIRE(presets::tiny_llama().head_dim() == 8);
  REQUIRE(presets::tiny_llama().qkv_width() == (8 + 2 * 4) * 8);
  REQUIRE(presets::gpt2_124m().ffn_size() == 3072);
}

TEST_CASE("derived sizes: kv_channels, query groups and ffn default as in Megatron-Core", "[model]") {
  TransformerConfig c = presets::tiny_llama();
  c.num_query_groups = 0;
  c.ffn_hidden_size = 0;
  REQUIRE(c.query_groups() == 8);
  REQUIRE(c.ffn_size() == 256);
  c.kv_channels = 16;  // head_dim may differ from hidden / heads
  REQUIRE(c.head_dim() == 16);
  REQUIRE(c.attention_width() == 128);
  REQUIRE_NOTHROW(validate(c, 2));
}

TEST_CASE("every inconsistency is a ConfigError that names the fix", "[model]") {
  const TransformerConfig ok = presets::tiny_llama();
  auto with = [&](auto edit) {
    TransformerConfig c = ok;
    edit(c);
    return c;
  };
  require_error(ok, 0, "tensor-parallel size is 0; it must be at least 1");
  require_error(with([](auto& c) { c.num_layers = 0; }), 1, "num_layers is 0; set it to the number of transformer layers");
  require_error(with([](auto& c) { c.hidden_size = -1; }), 1, "hidden_size is -1; set it to the model width");
  require_error(with([](auto& c) { c.num_attention_heads = 0; }), 1, "num_attention_heads is 0; set it");
  require_error(with([](auto& c) { c.vocab_size = 0; }), 1, "vocab_size is 0; set it to the tokenizer's vocabulary size");
  require_error(with([](auto& c) { c.max_position_embeddings = 0; }), 1, "max_position_embeddings is 0");
  require_error(with([](auto& c) { c.make_vocab_size_divisible_by = 0; }), 1, "make_vocab_size_divisible_by is 0");
  require_error(with([](auto& c) { c.num_query_groups = -2; }), 1, "num_query_groups is -2; set it to a positive value, or 0 for the default");
  require_error(with([](auto& c) { c.ffn_hidden_size = -1; }), 1, "ffn_hidden_size is -1; set it to a positive value, or 0");
  require_error(with([](auto& c) { c.kv_channels = -8; }), 1, "kv_channels is -8");
  require_error(with([](auto& c) { c.hidden_size = 60; }), 1,
                "hidden_size 60 is not divisible by num_attention_heads 8; use a head count that divides it (e.g. 6) or set "
                "kv_channels");
  require_error(with([](auto& c) { c.num_query_groups = 3; }), 1,
                "num_attention_heads 8 is not divisible by num_query_groups 3; each KV group must serve a whole number of "
                "query heads: use a group count that divides the heads (e.g. 2)");
  require_error(ok, 8, "num_query_groups 4 is not divisible by TP 8; every TP rank needs whole KV groups: use a TP that "
                       "divides them (e.g. 4)");
  require_error(with([](auto& c) { c.num_attention_heads = 6; c.num_query_groups = 6; c.kv_channels = 8; }), 4,
                "num_attention_heads 6 is not divisible by TP 4; use a TP that divides the heads (e.g. 3)");
  require_error(with([](auto& c) { c.ffn_hidden_size = 130; }), 4, "ffn_hidden_size 130 is not divisible by TP 4; round it to a multiple of 4");
  require_error(with([](auto& c) { c.sequence_parallel = true; }), 1,
                "sequence_parallel needs TP > 1 (it splits the sequence over the TP group) but TP is 1; turn "
                "sequence_parallel off or raise TP");
  REQUIRE_NOTHROW(validate(with([](auto& c) { c.sequence_parallel = true; }), 2));
  require_error(with([](auto& c) { c.kv_channels = 7; }), 1, "the head dimension is 7 (odd); use an even kv_channels");
  require_error(with([](auto& c) { c.rope_theta = 0; }), 1, "rope_theta is 0; set it to the RoPE base");
  require_error(with([](auto& c) { c.rope_scaling.type = RopeScalingType::Llama3; c.rope_scaling.factor = 0.5; }), 1,
                "rope_scaling.factor is 0.5; the llama3 scaling factor must be at least 1");
  require_error(with([](auto& c) { c.rope_scaling.type = RopeScalingType::Llama3; c.rope_scaling.high_freq_factor = 1; }), 1,
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got 1 and 1");
  require_error(with([](auto& c) { c.rope_scaling.type = RopeScalingType::Llama3; c.rope_scaling.original_max_position_embeddings = 0; }), 1,
                "rope_scaling.original_max_position_embeddings is 0; set it to the pre-training context");
  require_error(with([](auto& c) { c.position_embedding = PositionEmbeddingType::Learned; c.rope_scaling.type = RopeScalingType::Llama3; }), 1,
                "rope_scaling is set but position_embedding is learned; set rope_scaling.type to None or use RoPE");
  require_error(with([](auto& c) { c.norm_eps = 0; }), 1, "norm_eps is 0; set it to a small positive number");
  require_error(with([](auto& c) { c.init_method_std = -0.02; }), 1, "init_method_std is -0.02; set it to a positive");
  require_error(with([](auto& c) { c.params_dtype = DType::I32; }), 1, "params_dtype is i32; parameters must be f32, bf16 or f16");
  // Several problems are reported together, so one edit-and-retry fixes them all.
  require_error(with([](auto& c) { c.num_layers = 0; c.norm_eps = 0; }), 1, "invalid TransformerConfig (2 problems): num_layers is 0");
  REQUIRE_THROWS_AS(padded_vocab_size(with([](auto& c) { c.vocab_size = 0; }), 1), ConfigError);
  REQUIRE_THROWS_WITH(flops_per_token(ok, 0), Catch::Contains("pass the training sequence length"));
}

namespace {

// Mixtral 8x7B: h4096, 32 layers, 32 heads, 8 KV, expert FFN 14336, vocab 32000, 8 experts, top-2, untied.
TransformerConfig mixtral_8x7b() {
  TransformerConfig c = presets::llama3_8b();
  c.vocab_size = 32000;
  c.max_position_embeddings = 32768;
  c.rope_theta = 1e6;
  c.num_moe_experts = 8;
  c.moe_router_topk = 2;
  return c;
}

void require_moe_error(const TransformerConfig& c, int tp, int ep, int etp, const std::string& what) {
  INFO("expecting: " << what);
  REQUIRE_THROWS_AS(validate(c, tp, ep, etp), ConfigError);
  REQUIRE_THROWS_WITH(validate(c, tp, ep, etp), Catch::Contains(what));
}

}  // namespace

TEST_CASE("MoE parameter counts: Mixtral 8x7B's published total and active sizes", "[model][moe]") {
  const TransformerConfig c = mixtral_8x7b();
  REQUIRE_NOTHROW(validate(c, 4, 8, 1));
  // Per layer: attention 41,943,040 + norms 8,192 + router 8·4096 + 8 experts · 3·4096·14336 (176,160,768 each).
  const int64_t expert = 3LL * 4096 * 14336;
  const int64_t per_moe_layer = 41'943'040 + 8'192 + 8 * 4096 + 8 * expert;
  const ParameterCount p = parameter_count(c);
  REQUIRE(p.per_moe_layer == per_moe_layer);
  REQUIRE(p.per_moe_layer_experts == 8 * expert);
  REQUIRE(p.layers == 32 * per_moe_layer);
  REQUIRE(p.total == 46'702'792'704);   // "46.7B" (Hugging Face's count of Mixtral-8x7B)
  REQUIRE(p.active == 12'879'925'248);  // "12.9B active": 6 of 8 experts idle per token in each layer
  // Active FLOPs: every matmul weight a token passes through (top-2 experts, the router, attention, the output layer).
  const double n_active = 32.0 * (41'943'040 + 8 * 4096 + 2.0 * expert) + 32000.0 * 4096;
  REQUIRE(flops_per_token(c, 4096).dense == 6 * n_active);

  // Every other layer MoE (layers 0, 2, ...), and a shared expert in each MoE layer.
  TransformerConfig half = c;
  half.moe_layer_freq = 2;
  half.moe_shared_expert_size = 4096;
  half.num_layers = 5;  // MoE layers 0, 2, 4; dense 1, 3
  REQUIRE(half.num_moe_layers() == 3);
  REQUIRE(half.is_moe_layer(0));
  REQUIRE_FALSE(half.is_moe_layer(1));
  REQUIRE(half.is_moe_layer(4));
  const ParameterCount q = parameter_count(half);
  const int64_t shared = 3LL * 4096 * 4096;
  REQUIRE(q.per_moe_layer == per_moe_layer + shared);
  REQUIRE(q.layers == 3 * (per_moe_layer + shared) + 2 * q.per_layer);
  REQUIRE(q.active == q.total - 3 * 6 * expert);
  // A dense model: active = total, no MoE layers.
  const ParameterCount d = parameter_count(presets::llama3_8b());
  REQUIRE(d.active == d.total);
  REQUIRE(d.per_moe_layer == 0);
}

TEST_CASE("MoE config errors name the fix, all at once", "[model][moe]") {
  TransformerConfig ok = presets::tiny_llama();
  ok.num_moe_experts = 4;
  REQUIRE_NOTHROW(validate(ok, 2, 4, 1));
  REQUIRE_NOTHROW(validate(ok, 2, 2, 2));
  auto with = [&](auto edit) {
    TransformerConfig c = ok;
    edit(c);
    return c;
  };
  require_moe_error(ok, 1, 3, 0,
                    "num_moe_experts 4 is not divisible by EP = 3; every expert-parallel rank holds the same number of "
                    "experts: use an EP that divides 4 (e.g. 2)");
  require_moe_error(with([](auto& c) { c.moe_router_topk = 5; }), 1, 1, 0,
                    "moe_router_topk is 5; each token is routed to between 1 and num_moe_experts = 4 experts: set "
                    "moe_router_topk in [1, 4]");
  require_moe_error(with([](auto& c) { c.moe_router_topk = 0; }), 1, 1, 0, "moe_router_topk is 0");
  require_moe_error(with([](auto& c) { c.moe_expert_capacity_factor = -1; }), 1, 1, 0,
                    "moe_expert_capacity_factor is -1; set a positive factor");
  require_moe_error(with([](auto& c) { c.moe_layer_freq = 0; }), 1, 1, 0, "moe_layer_freq is 0; set it to k >= 1");
  require_moe_error(with([](auto& c) { c.moe_ffn_hidden_size = 96; }), 1, 1, 64,
                    "the experts' FFN width 96 (moe_ffn_hidden_size, or ffn_hidden_size when 0) is not divisible by "
                    "expert-TP = 64; round it to a multiple of 64");
  require_moe_error(with([](auto& c) { c.moe_shared_expert_size = 66; }), 4, 1, 0,
                    "moe_shared_expert_size 66 is not divisible by TP = 4");
  require_moe_error(with([](auto& c) { c.moe_aux_loss_coeff = -0.1; }), 1, 1, 0, "moe_aux_loss_coeff is -0.1");
  require_moe_error(with([](auto& c) { c.moe_z_loss_coeff = -1; }), 1, 1, 0, "moe_z_loss_coeff is -1");
  require_moe_error(with([](auto& c) { c.moe_router_topk_scaling_factor = 0; }), 1, 1, 0,
                    "moe_router_topk_scaling_factor is 0");
  require_moe_error(with([](auto& c) { c.moe_router_pre_softmax = true; c.moe_router_score_function = MoERouterScore::Sigmoid; }),
                    1, 1, 0, "moe_router_pre_softmax applies to softmax scores but moe_router_score_function is sigmoid");
  require_moe_error(with([](auto& c) { c.add_bias_linear = true; }), 1, 1, 0,
                    "MoE experts have no biases but add_bias_linear is true");
  // MoE settings on a dense model are refused rather than ignored.
  TransformerConfig dense = presets::tiny_llama();
  dense.moe_router_topk = 4;
  dense.moe_token_dispatcher_type = MoETokenDispatcher::AllGather;
  require_moe_error(dense, 1, 1, 0,
                    "moe_router_topk is 4 but num_moe_experts is 0 (a dense model has no MoE layers); set "
                    "num_moe_experts to the expert count, or leave moe_router_topk at its default 2");
  require_moe_error(dense, 1, 1, 0, "invalid TransformerConfig (2 problems)");
  require_moe_error(dense, 1, 1, 0, "moe_token_dispatcher_type is allgather but num_moe_experts is 0");
  require_moe_error(presets::tiny_llama(), 1, 2, 0,
                    "expert parallelism (EP = 2) splits the experts of MoE layers but num_moe_experts is 0; set "
                    "parallel.expert_model_parallel_size (ep) to 1");
  require_moe_error(with([](auto& c) { c.num_moe_experts = -1; }), 1, 1, 0, "num_moe_experts is -1");
  // A negative count is the one error (the MoE fields it comes with are not also called settings of a dense model).
  require_moe_error(with([](auto& c) { c.num_moe_experts = -4; }), 2, 2, 0,
                    "invalid TransformerConfig: num_moe_experts is -4; set it to the number of routed experts, or 0 "
                    "for a dense model");
}
