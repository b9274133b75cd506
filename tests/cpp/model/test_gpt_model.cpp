// Single-process checks of GPTModel (TP = 1): parameter names and count, loss decreasing under SGD on
// a fixed batch, a central-difference gradient check, and invalid configs refused before any
// allocation with errors that name the fix.
//
// Gradient check tolerance: the model is f32 (no f64 parameters yet), so the loss itself carries a
// rounding error of ~1e-7 relative (~5e-7 absolute at loss ≈ 5.5). With step eps = 1e-2 on weights
// of std 0.2 the rounding contributes ~5e-7 / 2e-2 ≈ 3e-5 to each difference quotient and the
// truncation error (eps² · f''' / 6) is of the same order for these smooth functions, so we require
// |fd − g| ≤ 2e-4 + 2e-2·|g| on the largest-gradient entries of each checked parameter.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "megacore/model/gpt_model.hpp"
#include "test_helpers.hpp"

using namespace megacore;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

namespace {

using mctest::SoloCommunicator;

struct Batch {
  Tensor tokens, labels, mask;
};

Batch make_batch(int64_t vocab, int64_t b = 2, int64_t s = 8) {
  std::vector<int64_t> tok, lab;
  std::vector<float> mask;
  for (int64_t i = 0; i < b * s; ++i) {
    tok.push_back((i * 37 + 5) % vocab);
    lab.push_back((i * 53 + 11) % vocab);
    mask.push_back(i % 7 == 3 ? 0.f : 1.f);
  }
  return {Tensor::from_vector<int64_t>(tok, {b, s}), Tensor::from_vector<int64_t>(lab, {b, s}),
          Tensor::from_vector<float>(mask, {b, s})};
}

double loss_of(mdl::GPTModel& m, const Batch& batch, bool training) {
  ly::ForwardContext ctx;
  ctx.training = training;
  return m.forward(ctx, batch.tokens, batch.labels, batch.mask).item();
}

}  // namespace

TEST_CASE("GPTModel names every parameter once and matches parameter_count", "[model]") {
  SoloCommunicator tp;
  for (bool tied : {false, true}) {
    mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
    cfg.tie_word_embeddings = tied;
    mdl::GPTModel m(cfg, tp);
    int64_t total = 0;
    for (ly::Parameter* p : m.parameters()) total += p->data.numel();
    CHECK(total == mdl::parameter_count(cfg, 1).total);
    CHECK(m.parameters().front()->name == "embedding.weight");
    CHECK(&m.parameter("layers.0.self_attention.linear_qkv.weight") == &m.layer(0).self_attention().linear_qkv().weight());
    CHECK(&m.parameter("layers.1.mlp.linear_fc2.weight") == &m.layer(1).mlp().fc2().weight());
    CHECK(m.parameters().back()->name == (tied ? "final_layernorm.weight" : "output_layer.weight"));
    REQUIRE_THROWS_WITH(m.parameter("nope"), Catch::Contains("embedding.weight"));
  }
  mdl::TransformerConfig g = mdl::presets::tiny_gpt2();
  mdl::GPTModel m(g, tp);
  int64_t total = 0;
  for (ly::Parameter* p : m.parameters()) total += p->data.numel();
  CHECK(total == mdl::parameter_count(g, 1).total);
  CHECK(m.parameter("position_embedding.weight").data.size(0) == g.max_position_embeddings);
  CHECK(m.parameter("layers.0.self_attention.linear_proj.bias").data.numel() == g.hidden_size);
}

TEST_CASE("GPTModel's pre-forward callback sees every parameter once, in forward order, before its use", "[model]") {
  SoloCommunicator tp;
  for (bool tied : {false, true}) {
    mdl::TransformerConfig cfg = mdl::presets::tiny_gpt2();  // with position embeddings and biases
    cfg.tie_word_embeddings = tied;
    mdl::GPTModel m(cfg, tp);
    const Batch batch = make_batch(cfg.vocab_size);
    // Each group's weights are poisoned until the callback "gathers" them: a forward that read a weight
    // before its group was announced would give a non-finite loss.
    std::vector<Tensor> saved;
    for (ly::Parameter* p : m.parameters()) {
      saved.push_back(p->data.clone());
      p->data.fill_(std::nan(""));
    }
    std::vector<std::string> order;
    std::vector<ly::Parameter*> seen;
    m.set_pre_forward_callback([&](const std::vector<ly::Parameter*>& group) {
      order.push_back(group.front()->name);
      for (ly::Parameter* p : group) {
        seen.push_back(p);
        const auto params = m.parameters();
        const size_t i = size_t(std::find(params.begin(), params.end(), p) - params.begin());
        REQUIRE(i < saved.size());
        p->data.copy_(saved[i]);
      }
    });
    const double loss = loss_of(m, batch, true);
    CHECK(std::isfinite(loss));
    std::vector<ly::Parameter*> all = m.parameters();
    std::sort(all.begin(), all.end());
    std::vector<ly::Parameter*> got = seen;
    std::sort(got.begin(), got.end());
    CHECK(got == all);  // every parameter, once
    CHECK(order == std::vector<std::string>{"embedding.weight", "layers.0.input_layernorm.weight",
                                            "layers.1.input_layernorm.weight", "final_layernorm.weight"});
    m.set_pre_forward_callback({});
    CHECK(loss_of(m, batch, false) == Approx(loss));  // removed: forward runs without it
  }
}

TEST_CASE("GPTModel loss decreases over a few SGD steps on a fixed batch", "[model]") {
  SoloCommunicator tp;
  for (mdl::TransformerConfig cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()}) {
    INFO(mdl::norm_type_name(cfg.normalization));
    mdl::GPTModel m(cfg, tp);
    const Batch batch = make_batch(cfg.vocab_size);
    ly::ForwardContext ctx;
    constexpr float kLr = 0.05f;
    std::vector<double> losses;
    for (int step = 0; step < 10; ++step) {
      m.zero_grad();
      losses.push_back(m.forward(ctx, batch.tokens, batch.labels, batch.mask).item());
      m.backward(ctx);
      for (ly::Parameter* p : m.parameters()) {
        float* w = p->data.data<float>();
        const float* g = p->main_grad.data<float>();
        for (int64_t i = 0; i < p->data.numel(); ++i) w[i] -= kLr * g[i];
      }
    }
    INFO("losses " << losses[0] << " → " << losses.back());
    // Plain SGD on 16 tokens is not strictly monotone near lr 0.05 (the tied GPT-2 embedding takes a
    // small upward step once), so the sanity bar is: never above the start, well below it at the end.
    for (size_t i = 1; i < losses.size(); ++i) CHECK(losses[i] < losses[0]);
    CHECK(losses.back() < losses.front() - 1.0);
  }
}

TEST_CASE("GPTModel gradients agree with central differences of the loss", "[model]") {
  SoloCommunicator tp;
  for (mdl::TransformerConfig cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()}) {
    cfg.init_method_std = 0.2;  // larger weights give gradients well above the f32 noise floor
    cfg.num_layers = 1;
    INFO(mdl::norm_type_name(cfg.normalization));
    mdl::GPTModel m(cfg, tp);
    const Batch batch = make_batch(cfg.vocab_size, 2, 6);
    ly::ForwardContext ctx;
    m.forward(ctx, batch.tokens, batch.labels, batch.mask);
    m.backward(ctx);
    // Every parameter (the tied output layer through the embedding).
    std::vector<std::string> names;
    for (ly::Parameter* p : m.parameters()) names.push_back(p->name);
    constexpr float kEps = 1e-2f;
    for (const std::string& name : names) {
      ly::Parameter& p = m.parameter(name);
      const std::vector<double> g = p.main_grad.to_double_vector();
      // The three largest-magnitude gradient entries: where a wrong gradient would show most.
      std::vector<int64_t> idx(g.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + 3, idx.end(),
                        [&](int64_t a, int64_t b) { return std::abs(g[size_t(a)]) > std::abs(g[size_t(b)]); });
      for (int k = 0; k < 3; ++k) {
        float* w = p.data.data<float>() + idx[size_t(k)];
        const float w0 = *w;
        *w = w0 + kEps;
        const double up = loss_of(m, batch, false);
        *w = w0 - kEps;
        const double down = loss_of(m, batch, false);
        *w = w0;
        const double fd = (up - down) / (2.0 * double(kEps)), an = g[size_t(idx[size_t(k)])];
        INFO(name << "[" << idx[size_t(k)] << "]: analytic " << an << " central difference " << fd);
        CHECK(std::abs(fd - an) <= 2e-4 + 2e-2 * std::abs(an));
      }
    }
  }
}

TEST_CASE("GPTModel refuses invalid configs before allocating, naming the fix", "[model]") {
  // Sizes that would need terabytes: if anything were allocated before the check, this would fail
  // with an allocation error (or not finish) instead of a ConfigError.
  mdl::TransformerConfig huge = mdl::presets::tiny_llama();
  huge.hidden_size = int64_t(1) << 20;
  huge.num_attention_heads = 8;
  huge.num_query_groups = 4;
  huge.ffn_hidden_size = int64_t(1) << 22;
  huge.vocab_size = int64_t(1) << 24;
  SoloCommunicator tp3(3);  // collectives throw: nothing may communicate either
  REQUIRE_THROWS_AS(mdl::GPTModel(huge, tp3), ConfigError);
  REQUIRE_THROWS_WITH(mdl::GPTModel(huge, tp3), Catch::Contains("num_attention_heads 8 is not divisible by TP 3") &&
                                                    Catch::Contains("use a TP that divides"));

  SoloCommunicator tp1;
  mdl::TransformerConfig sp = huge;
  sp.sequence_parallel = true;
  REQUIRE_THROWS_WITH(mdl::GPTModel(sp, tp1), Catch::Contains("turn sequence_parallel off"));

  mdl::TransformerConfig heads = huge;
  heads.num_attention_heads = 6;
  heads.num_query_groups = 4;
  REQUIRE_THROWS_WITH(mdl::GPTModel(heads, tp1), Catch::Contains("num_query_groups"));

  mdl::TransformerConfig layers = mdl::presets::tiny_gpt2();
  layers.num_layers = 0;
  REQUIRE_THROWS_WITH(mdl::GPTModel(layers, tp1), Catch::Contains("num_layers is 0"));
}

TEST_CASE("GPTModel refuses bad batches with the fix", "[model]") {
  SoloCommunicator tp;
  mdl::TransformerConfig cfg = mdl::presets::tiny_gpt2();
  mdl::GPTModel m(cfg, tp);
  ly::ForwardContext ctx;
  const Batch ok = make_batch(cfg.vocab_size);
  REQUIRE_THROWS_WITH(m.backward(ctx), Catch::Contains("call forward with ctx.training = true"));
  const Batch long_batch = make_batch(cfg.vocab_size, 1, cfg.max_position_embeddings + 1);
  REQUIRE_THROWS_WITH(m.forward(ctx, long_batch.tokens, long_batch.labels),
                      Catch::Contains("raise max_position_embeddings"));
  REQUIRE_THROWS_WITH(m.forward(ctx, ok.tokens, ok.labels.view({16, 1})), Catch::Contains("differ in shape"));
  REQUIRE_THROWS_WITH(m.forward(ctx, ok.tokens, ok.labels, ok.tokens), Catch::Contains("use f32"));
}

TEST_CASE("GPTModel refuses a non-finite MoE aux-loss gradient scale", "[model][moe]") {
  SoloCommunicator tp;
  mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  cfg.num_moe_experts = 4;
  cfg.moe_router_topk = 2;
  cfg.moe_aux_loss_coeff = 1e-2;
  mdl::GPTModel m(cfg, tp);
  REQUIRE(!m.moe_layers().empty());
  m.set_moe_aux_loss_grad_scale(0.25f);
  m.set_moe_aux_loss_grad_scale(0.f);
  for (float bad : {INFINITY, NAN, -1.f})
    REQUIRE_THROWS_AS(m.set_moe_aux_loss_grad_scale(bad), ValueError);
  REQUIRE_THROWS_WITH(m.set_moe_aux_loss_grad_scale(INFINITY), Catch::Contains("finite and >= 0"));
}

TEST_CASE("GPTModel full recompute keeps no sub-module activations between forward and backward", "[model]") {
  SoloCommunicator tp;
  mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  cfg.recompute_granularity = mdl::RecomputeGranularity::Full;
  mdl::GPTModel m(cfg, tp);
  const Batch batch = make_batch(cfg.vocab_size);
  ly::ForwardContext ctx;
  m.forward(ctx, batch.tokens, batch.labels, batch.mask);
  // The sub-modules ran without saving: their backward has nothing to work from.
  const Tensor dy = Tensor::zeros({8, 2, cfg.hidden_size});
  REQUIRE_THROWS_WITH(m.layer(0).mlp().backward(ctx, dy), Catch::Contains("no saved"));
  REQUIRE_THROWS_WITH(m.layer(1).input_layernorm().backward(ctx, dy), Catch::Contains("no saved"));
  // The layer's own backward reruns the forward first, so the model's backward works.
  m.backward(ctx);
  double norm = 0;
  for (ly::Parameter* p : m.parameters())
    for (double g : p->main_grad.to_double_vector()) norm += g * g;
  CHECK(norm > 0);
}

TEST_CASE("GPTModel on packed rows equals each sequence run alone (loss and every gradient)", "[model]") {
  // Two rows of 8 tokens holding four sequences (5 + 3, 2 + 6). With ctx.cu_seqlens and the restarting
  // position ids, the packed batch's mean loss and gradients must be the token-weighted combination of
  // the four sequences run as their own batches: no attention across a boundary, positions from 0 in
  // each (RoPE and learned positions), in every recompute mode (full recompute reruns the forward in
  // backward with the saved boundaries). f32 on the CPU: relative 1e-5 (loss) and 1e-4 (gradients).
  SoloCommunicator tp;
  const int64_t b = 2, s = 8;
  const std::vector<std::vector<int64_t>> rows_lens{{5, 3}, {2, 6}};
  for (mdl::TransformerConfig cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()})
    for (auto [rg, pos_dt] : {std::pair{mdl::RecomputeGranularity::None, DType::I64},
                              std::pair{mdl::RecomputeGranularity::Selective, DType::I64},
                              std::pair{mdl::RecomputeGranularity::Full, DType::I64},
                              std::pair{mdl::RecomputeGranularity::None, DType::I32}}) {
      // i64 ids on the model's device take the device path, i32 the host one
      cfg.recompute_granularity = rg;
      INFO(mdl::norm_type_name(cfg.normalization) << " recompute " << int(rg) << " ids " << dtype_name(pos_dt));
      mdl::GPTModel m(cfg, tp);
      const Batch batch = make_batch(cfg.vocab_size, b, s);
      std::vector<int32_t> cu{0};
      std::vector<int64_t> pos;
      for (const auto& lens : rows_lens)
        for (int64_t l : lens) {
          cu.push_back(cu.back() + int32_t(l));
          for (int64_t i = 0; i < l; ++i) pos.push_back(i);
        }
      ly::ForwardContext pctx;
      pctx.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())});
      pctx.max_seqlen = 6;
      pctx.position_ids = Tensor::from_vector<int64_t>(pos, {b, s}).to(pos_dt);

      m.zero_grad();
      const double packed_loss = m.forward(pctx, batch.tokens, batch.labels, batch.mask).item();
      m.backward(pctx);
      std::vector<std::vector<double>> packed_grads;
      for (ly::Parameter* p : m.parameters()) packed_grads.push_back(p->main_grad.to_double_vector());

      // Each sequence alone, weighted by its share of the loss tokens.
      const std::vector<double> mask = batch.mask.to_double_vector();
      const double total = std::accumulate(mask.begin(), mask.end(), 0.0);
      double want_loss = 0;
      std::vector<std::vector<double>> want_grads(packed_grads.size());
      for (size_t i = 0; i < want_grads.size(); ++i) want_grads[i].assign(packed_grads[i].size(), 0.0);
      for (size_t seg = 0; seg + 1 < cu.size(); ++seg) {
        const int64_t start = cu[seg], len = cu[seg + 1] - cu[seg];
        Batch one;
        one.tokens = batch.tokens.view({b * s}).narrow(0, start, len).contiguous().view({1, len});
        one.labels = batch.labels.view({b * s}).narrow(0, start, len).contiguous().view({1, len});
        one.mask = batch.mask.view({b * s}).narrow(0, start, len).contiguous().view({1, len});
        const std::vector<double> mk = one.mask.to_double_vector();
        const double n = std::accumulate(mk.begin(), mk.end(), 0.0);
        REQUIRE(n > 0);
        ly::ForwardContext ctx;
        m.zero_grad();
        want_loss += m.forward(ctx, one.tokens, one.labels, one.mask).item() * n / total;
        m.backward(ctx);
        std::vector<ly::Parameter*> ps = m.parameters();
        for (size_t i = 0; i < ps.size(); ++i) {
          const std::vector<double> g = ps[i]->main_grad.to_double_vector();
          for (size_t j = 0; j < g.size(); ++j) want_grads[i][j] += g[j] * n / total;
        }
      }
      CHECK(std::abs(packed_loss - want_loss) <= 1e-5 * std::abs(want_loss));
      std::vector<ly::Parameter*> ps = m.parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        INFO("parameter " << ps[i]->name);
        CHECK(mctest::rel_err(packed_grads[i], want_grads[i]) < 1e-4);
      }
      // Negative control: the same rows without boundaries are a different computation.
      ly::ForwardContext plain;
      plain.training = false;
      CHECK(std::abs(m.forward(plain, batch.tokens, batch.labels, batch.mask).item() - want_loss) >
            1e-3 * std::abs(want_loss));
    }
}

TEST_CASE("GPTModel refuses packed-row boundaries it cannot use, naming the fix", "[model]") {
  SoloCommunicator tp;
  mdl::GPTModel m(mdl::presets::tiny_llama(), tp);
  const Batch batch = make_batch(m.config().vocab_size, 2, 8);
  ly::ForwardContext ctx;
  ctx.cu_seqlens = Tensor::from_vector(std::vector<int64_t>{0, 8, 16}, {3});  // i64: wrong dtype
  ctx.max_seqlen = 8;
  CHECK_THROWS_WITH(m.forward(ctx, batch.tokens, batch.labels, batch.mask), Catch::Contains("cu_seqlens must be i32"));
  ctx.cu_seqlens = Tensor::from_vector(std::vector<int32_t>{0, 8, 16}, {3});
  ctx.max_seqlen = 0;
  CHECK_THROWS_WITH(m.forward(ctx, batch.tokens, batch.labels, batch.mask), Catch::Contains("Batch.max_seqlen"));
}
