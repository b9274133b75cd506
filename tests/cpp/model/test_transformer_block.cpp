// Single-process checks of TransformerBlock (TP = 1): a block holding layers {0, 2} of a 3-layer model
// plus the final norm gives exactly (bit-for-bit: the same operations in the same order) what
// independently built TransformerLayers 0 and 2 and a final norm give when applied in sequence —
// output, input gradient and every parameter gradient — for Llama and GPT-2 configs, with and without
// full recompute limited to the first layer; the grad-ready groups come in backward order with the
// model's names; a stashed micro-batch restores and backpropagates to the same result; bad input is
// refused with the fix.
#include <string>
#include <vector>

#include "layers/layers_test_util.hpp"
#include "megacore/model/transformer_block.hpp"
#include "megacore/model/transformer_layer.hpp"

using namespace megacore;
namespace ly = megacore::layers;
namespace mdl = megacore::model;
using layers_test::randn;
using layers_test::require_equal;

namespace {

constexpr int64_t kSeq = 6, kBatch = 2;

mdl::TransformerConfig three_layers(mdl::TransformerConfig cfg) {
  cfg.num_layers = 3;
  cfg.init_method_std = 0.1;
  return cfg;
}

// Layers 0 and 2 and a final norm, built and run one by one.
struct Reference {
  std::vector<std::unique_ptr<mdl::TransformerLayer>> layers;
  std::unique_ptr<ly::NormLayer> norm;

  Reference(comm::Communicator& tp, const mdl::TransformerConfig& cfg) {
    for (int64_t i : {0, 2})
      layers.push_back(std::make_unique<mdl::TransformerLayer>(
          tp, cfg, mdl::TransformerLayerOptions{.layer_number = i, .init_offset_base = 16}));
    norm = mdl::make_model_norm(cfg, Device::cpu());
  }
  Tensor forward(const ly::ForwardContext& ctx, Tensor x) {
    for (auto& l : layers) x = l->forward(ctx, x);
    return norm->forward(ctx, x);
  }
  Tensor backward(const ly::ForwardContext& ctx, Tensor dy) {
    dy = norm->backward(ctx, dy);
    for (size_t i = layers.size(); i-- > 0;) dy = layers[i]->backward(ctx, dy);
    return dy;
  }
  // Gradients in the block's named_parameters() order.
  std::vector<Tensor> grads() {
    std::vector<Tensor> g;
    for (auto& l : layers)
      for (ly::Parameter* p : l->parameters()) g.push_back(p->main_grad);
    g.push_back(norm->weight().main_grad);
    if (norm->has_bias()) g.push_back(norm->bias().main_grad);
    return g;
  }
};

mdl::TransformerBlock make_block(comm::Communicator& tp, const mdl::TransformerConfig& cfg, int64_t recompute_n = -1) {
  return mdl::TransformerBlock(tp, cfg,
                               mdl::TransformerBlockOptions{.layer_indices = std::vector<int64_t>{0, 2},
                                                            .final_layernorm = true,
                                                            .recompute_num_layers = recompute_n});
}

}  // namespace

TEST_CASE("TransformerBlock equals its layers and final norm applied in sequence", "[model]") {
  layers_test::NoCommCommunicator tp(0, 1);
  for (mdl::TransformerConfig base : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()})
    for (bool recompute : {false, true}) {
      mdl::TransformerConfig cfg = three_layers(base);
      INFO(mdl::norm_type_name(cfg.normalization) << " recompute " << recompute);
      Reference ref(tp, cfg);
      mdl::TransformerConfig block_cfg = cfg;
      if (recompute) block_cfg.recompute_granularity = mdl::RecomputeGranularity::Full;
      mdl::TransformerBlock block = make_block(tp, block_cfg, recompute ? 1 : -1);
      REQUIRE(block.num_layers() == 2);
      REQUIRE(block.layer(0).recompute() == block_cfg.recompute_granularity);
      REQUIRE(block.layer(1).recompute() == mdl::RecomputeGranularity::None);

      // The same weights (the same Philox draws), named with the global layer index.
      const auto& named = block.named_parameters();
      std::vector<Tensor> ref_grads = ref.grads();
      REQUIRE(named.size() == ref_grads.size());
      REQUIRE(named.front().first == "layers.0.input_layernorm.weight");
      REQUIRE(named.back().first == (cfg.add_bias_linear ? "final_layernorm.bias" : "final_layernorm.weight"));
      REQUIRE(block.layer_parameters(1).front()->name == "layers.2.input_layernorm.weight");

      std::vector<std::string> reported;
      block.set_grad_ready_callback([&](const std::vector<ly::Parameter*>& g) { reported.push_back(g.front()->name); });

      ly::ForwardContext ctx;
      const Tensor x = randn({kSeq, kBatch, cfg.hidden_size}, 1), dy = randn({kSeq, kBatch, cfg.hidden_size}, 2);
      // Two micro-batches accumulate, the second one through a stash round trip.
      const Tensor x2 = randn({kSeq, kBatch, cfg.hidden_size}, 3), dy2 = randn({kSeq, kBatch, cfg.hidden_size}, 4);
      require_equal(block.forward(ctx, x), ref.forward(ctx, x), "output");
      require_equal(block.backward(ctx, dy), ref.backward(ctx, dy), "input gradient");
      REQUIRE(reported == std::vector<std::string>{"final_layernorm.weight", "layers.2.input_layernorm.weight",
                                                   "layers.0.input_layernorm.weight"});

      const Tensor y2 = block.forward(ctx, x2);
      ly::ActivationStash stash;
      block.stash_activations(stash);
      REQUIRE_THROWS_WITH(block.backward(ctx, dy2), Catch::Contains("no saved forward"));
      block.forward(ctx, x);  // another micro-batch, evaluated only
      ly::ActivationStash other;
      block.stash_activations(other);
      block.restore_activations(stash);
      REQUIRE(stash.empty());
      require_equal(y2, ref.forward(ctx, x2), "output (2nd micro-batch)");
      require_equal(block.backward(ctx, dy2), ref.backward(ctx, dy2), "input gradient (restored micro-batch)");
      for (size_t i = 0; i < named.size(); ++i)
        require_equal(named[i].second->main_grad, ref_grads[i], named[i].first.c_str());
    }
}

TEST_CASE("TransformerBlock with no layers and no final norm is the identity", "[model]") {
  layers_test::NoCommCommunicator tp(0, 1);
  const mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  mdl::TransformerBlock block(tp, cfg, {.layer_indices = std::vector<int64_t>{}});
  REQUIRE(block.parameters().empty());
  ly::ForwardContext ctx;
  const Tensor x = randn({kSeq, kBatch, cfg.hidden_size}, 5), dy = randn({kSeq, kBatch, cfg.hidden_size}, 6);
  require_equal(block.forward(ctx, x), x, "output");
  require_equal(block.backward(ctx, dy), dy, "input gradient");
}

TEST_CASE("TransformerBlock refuses bad input with the fix", "[model]") {
  layers_test::NoCommCommunicator tp(0, 1);
  const mdl::TransformerConfig cfg = three_layers(mdl::presets::tiny_llama());
  REQUIRE_THROWS_AS(mdl::TransformerBlock(tp, cfg, {.layer_indices = std::vector<int64_t>{0, 3}}), ConfigError);
  REQUIRE_THROWS_WITH(mdl::TransformerBlock(tp, cfg, {.layer_indices = std::vector<int64_t>{0, 3}}),
                      Catch::Contains("pass global indices 0..2"));
  REQUIRE_THROWS_WITH(mdl::TransformerBlock(tp, cfg, {.layer_indices = std::vector<int64_t>{1, 1}}),
                      Catch::Contains("strictly increasing"));
  mdl::TransformerConfig bad = cfg;
  bad.hidden_size = 60;  // not a multiple of the 8 heads: the attention layer's own check refuses it
  REQUIRE_THROWS_AS(mdl::TransformerBlock(tp, bad), ValueError);
  REQUIRE_THROWS_WITH(mdl::TransformerBlock(tp, bad), Catch::Contains("not divisible by num_attention_heads 8"));

  mdl::TransformerBlock block(tp, cfg, {.layer_indices = std::vector<int64_t>{1}});
  REQUIRE_THROWS_WITH(block.final_layernorm(), Catch::Contains("final_layernorm = true"));
  REQUIRE_THROWS_WITH(block.set_final_norm_group_extra({&block.layer(0).mlp().fc1().weight()}),
                      Catch::Contains("final_layernorm = true"));
  ly::ForwardContext ctx;
  const Tensor dy = randn({kSeq, kBatch, cfg.hidden_size}, 7);
  REQUIRE_THROWS_WITH(block.backward(ctx, dy), Catch::Contains("call forward with ctx.training = true"));
  REQUIRE_THROWS_WITH(block.forward(ctx, Tensor()), Catch::Contains("input is undefined"));
  REQUIRE_THROWS_WITH(block.forward(ctx, randn({kSeq, kBatch, 32}, 8)), Catch::Contains("it must be [s, b, 64]"));
  REQUIRE_THROWS_WITH(block.forward(ctx, randn({kSeq * kBatch, cfg.hidden_size}, 8)),
                      Catch::Contains("it must be [s, b, 64]"));
  REQUIRE_THROWS_WITH(block.forward(ctx, randn({kSeq, kBatch, cfg.hidden_size}, 8).to(DType::BF16)),
                      Catch::Contains("convert it"));
  block.forward(ctx, randn({kSeq, kBatch, cfg.hidden_size}, 9));
  REQUIRE_THROWS_WITH(block.backward(ctx, randn({kSeq - 1, kBatch, cfg.hidden_size}, 7)),
                      Catch::Contains("does not match forward's output"));
  ctx.training = false;
  block.forward(ctx, randn({kSeq, kBatch, cfg.hidden_size}, 9));
  REQUIRE_THROWS_WITH(block.backward(ctx, dy), Catch::Contains("call forward with ctx.training = true"));
}
