// LoRA on one rank: the adapter parameter count (checked against the real model, dense and MoE, then applied
// to Llama shapes), the frozen base (no base parameter listed or given a gradient buffer), the adapter's
// TP = 1 arithmetic against a direct f64 computation of y = x Wᵀ + s·x Aᵀ Bᵀ and its gradients, and the
// errors for bad settings.
#include <cmath>
#include <string>

#include "megacore/layers/linear.hpp"
#include "megacore/model/gpt_model.hpp"
#include "test_helpers.hpp"

using namespace megacore;
namespace ly = megacore::layers;
namespace mdl = megacore::model;
using mctest::SoloCommunicator;

namespace {

int64_t trainable(mdl::GPTModel& m) {
  int64_t n = 0;
  for (ly::Parameter* p : m.parameters()) n += p->data.numel();
  return n;
}

std::string problems_of(const mdl::LoRAConfig& l, const mdl::TransformerConfig& c) {
  std::string all;
  for (const std::string& p : mdl::lora_problems(l, c)) all += p + "\n";
  return all;
}

Tensor randn(const Shape& shape, uint64_t offset) {
  Tensor t = Tensor::empty(shape);
  Generator g(99, offset);
  t.normal_(g);
  return t;
}

}  // namespace

TEST_CASE("LoRA trains only the adapters; their count matches the formula and is < 1% of Llama for r = 8",
          "[lora]") {
  SoloCommunicator tp;
  for (const mdl::TransformerConfig& cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()})
    for (const std::vector<std::string>& targets :
         {std::vector<std::string>{"q_proj", "v_proj"}, std::vector<std::string>{"linear_qkv", "o_proj", "linear_fc1",
                                                                                  "linear_fc2"}}) {
      mdl::LoRAConfig l;
      l.dim = 4;
      l.target_modules = targets;
      mdl::GPTModel m(cfg, tp);
      m.apply_lora(l);
      CHECK(trainable(m) == mdl::lora_parameter_count(l, cfg));
      for (ly::Parameter* p : m.parameters()) CHECK(p->name.find(".lora_") != std::string::npos);
      CHECK_FALSE(m.layer(0).mlp().fc2().weight().main_grad.defined());
      CHECK(m.all_parameters().size() > m.parameters().size());
    }
  const mdl::TransformerConfig llama = mdl::presets::llama32_1b();
  mdl::LoRAConfig l;
  l.dim = 8;
  for (auto targets : {std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"},
                       std::vector<std::string>{"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}}) {
    l.target_modules = targets;
    const double frac = double(mdl::lora_parameter_count(l, llama)) / double(mdl::parameter_count(llama).total);
    INFO("trainable fraction " << frac);
    CHECK(frac < 0.01);
  }
}

TEST_CASE("LoRA on a MoE model: experts, shared expert and dense layers adapted; count matches the formula",
          "[lora][moe]") {
  SoloCommunicator tp;
  mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  cfg.num_layers = 3;
  cfg.num_moe_experts = 4;
  cfg.moe_router_topk = 2;
  cfg.moe_layer_freq = 2;  // layers 0 and 2 are MoE, layer 1 dense
  cfg.moe_ffn_hidden_size = 24;
  cfg.moe_shared_expert_size = 16;
  for (const std::vector<std::string>& targets :
       {std::vector<std::string>{"gate_proj", "up_proj", "down_proj"}, std::vector<std::string>{"q_proj", "w1", "w3", "w2"},
        std::vector<std::string>{"o_proj", "linear_fc1", "linear_fc2"}, std::vector<std::string>{"w2"}}) {
    mdl::LoRAConfig l;
    l.dim = 4;
    l.target_modules = targets;
    mdl::GPTModel m(cfg, tp);
    const size_t all = m.all_parameters().size();
    m.apply_lora(l);
    CHECK(trainable(m) == mdl::lora_parameter_count(l, cfg));
    int experts = 0;
    for (ly::Parameter* p : m.parameters()) {
      CHECK(p->name.find(".lora_") != std::string::npos);
      if (p->name.find(".mlp.experts.") != std::string::npos) {
        ++experts;
        CHECK(p->expert);
        CHECK(p->data.size(0) == 4);
      }
    }
    // Per MoE layer (2 of them): A and B of gate, up and down, or of down alone.
    CHECK(experts == (targets == std::vector<std::string>{"w2"} ? 4 : 12));
    ly::MoELayer& moe = *m.layer(0).moe();
    CHECK(moe.frozen());
    CHECK_FALSE(moe.router_weight().main_grad.defined());
    CHECK_FALSE(moe.shared_expert()->fc1().weight().main_grad.defined());
    CHECK(m.all_parameters().size() == all + m.parameters().size());
    m.merge_lora();
    CHECK_FALSE(moe.frozen());
    CHECK(moe.fc1_lora() == nullptr);
    CHECK(moe.router_weight().main_grad.defined());
    CHECK(m.parameters().size() == all);
  }
}

TEST_CASE("LoRA on a column-parallel linear equals x Wᵀ + s·x Aᵀ Bᵀ with the right gradients", "[lora]") {
  SoloCommunicator tp;
  const int64_t rows = 5, in = 6, out = 7, r = 3;
  ly::ColumnParallelLinear lin(tp, in, out, {.bias = false});
  lin.attach_lora(std::make_unique<ly::LoRAAdapter>(
      tp, ly::LoRAAdapter::Kind::Column, in, std::vector<ly::LoRASegment>{{.out_features = out, .block_width = out,
                                                                           .width = out}},
      ly::LoRAOptions{.rank = r, .alpha = 6}, DType::F32, Device::cpu()));
  lin.set_frozen(true);
  lin.lora()->lora_b(0).data.copy_(randn({out, r}, 1));
  const Tensor x = randn({rows, in}, 2), dy = randn({rows, out}, 3);
  ly::ForwardContext ctx;
  const Tensor y = lin.forward(ctx, x);
  const Tensor dx = lin.backward(ctx, dy);
  auto v = [](const Tensor& t) { return t.contiguous().to_double_vector(); };
  const auto X = v(x), DY = v(dy), W = v(lin.weight().data), A = v(lin.lora()->lora_a(0).data),
             B = v(lin.lora()->lora_b(0).data);
  const double s = 6.0 / r;
  std::vector<double> h(rows * r, 0), wy(rows * out, 0), dh(rows * r, 0), wdx(rows * in, 0), wda(r * in, 0),
      wdb(out * r, 0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t k = 0; k < r; ++k)
      for (int64_t c = 0; c < in; ++c) h[i * r + k] += X[i * in + c] * A[k * in + c];
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t c = 0; c < in; ++c) acc += X[i * in + c] * W[o * in + c];
      for (int64_t k = 0; k < r; ++k) acc += s * h[i * r + k] * B[o * r + k];
      wy[i * out + o] = acc;
    }
    for (int64_t k = 0; k < r; ++k)
      for (int64_t o = 0; o < out; ++o) dh[i * r + k] += s * DY[i * out + o] * B[o * r + k];
    for (int64_t c = 0; c < in; ++c) {
      double acc = 0;
      for (int64_t o = 0; o < out; ++o) acc += DY[i * out + o] * W[o * in + c];
      for (int64_t k = 0; k < r; ++k) acc += dh[i * r + k] * A[k * in + c];
      wdx[i * in + c] = acc;
    }
    for (int64_t k = 0; k < r; ++k) {
      for (int64_t c = 0; c < in; ++c) wda[k * in + c] += dh[i * r + k] * X[i * in + c];
      for (int64_t o = 0; o < out; ++o) wdb[o * r + k] += s * DY[i * out + o] * h[i * r + k];
    }
  }
  CHECK(mctest::rel_err(v(y), wy) < 1e-6);
  CHECK(mctest::rel_err(v(dx), wdx) < 1e-6);
  CHECK(mctest::rel_err(v(lin.lora()->lora_a(0).main_grad), wda) < 1e-6);
  CHECK(mctest::rel_err(v(lin.lora()->lora_b(0).main_grad), wdb) < 1e-6);
  CHECK_FALSE(lin.weight().main_grad.defined());
}

TEST_CASE("LoRA settings are validated with the fix named", "[lora]") {
  const mdl::TransformerConfig llama = mdl::presets::tiny_llama(), gpt2 = mdl::presets::tiny_gpt2();
  mdl::LoRAConfig l;
  l.target_modules = {"q_proj", "qkv_proj"};
  std::string e = problems_of(l, llama);
  CHECK(e.find("unknown module 'qkv_proj'") != std::string::npos);
  CHECK(e.find("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, linear_qkv") != std::string::npos);
  l.target_modules = {"q_proj"};
  l.dim = 0;
  CHECK(problems_of(l, llama).find("must be positive") != std::string::npos);
  l.dim = 65;  // hidden 64
  CHECK(problems_of(l, llama).find("use peft.dim <= ") != std::string::npos);
  l.dim = 8;
  CHECK(problems_of(l, llama).empty());
  l.target_modules = {"gate_proj"};
  CHECK(problems_of(l, gpt2).find("target linear_fc1 instead") != std::string::npos);
  mdl::TransformerConfig moe = llama;
  moe.num_moe_experts = 4;
  moe.moe_router_topk = 2;
  for (const char* n : {"gate_proj", "down_proj", "linear_fc1", "w1", "w2", "w3"}) {
    l.target_modules = {"q_proj", n};
    CHECK(problems_of(l, moe).empty());
  }
  for (const char* n : {"router", "gate"}) {
    l.target_modules = {"q_proj", n};
    CHECK(problems_of(l, moe).find("stays frozen and never gets a LoRA adapter") != std::string::npos);
  }
  l.target_modules = {"w1"};
  CHECK(problems_of(l, llama).find("has no MoE layers") != std::string::npos);
  moe.moe_ffn_hidden_size = 4;
  l.target_modules = {"w2"};
  CHECK(problems_of(l, moe).find("the experts' down_proj's smallest dimension 4") != std::string::npos);
  moe.moe_ffn_hidden_size = 0;
  l.target_modules = {"q_proj", "o_proj"};
  CHECK(problems_of(l, moe).empty());
  SoloCommunicator tp;
  mdl::GPTModel m(llama, tp);
  l.target_modules = {"nope"};
  CHECK_THROWS_AS(m.apply_lora(l), ConfigError);
}
