#include "megacore/model/fp8.hpp"

#include <fmt/format.h>

#include "megacore/core/log.hpp"
#include "megacore/model/transformer_layer.hpp"

namespace megacore::model {

std::vector<NamedLinear> transformer_linears(GPTModel& m) {
  std::vector<NamedLinear> out;
  for (int64_t i = 0; i < m.num_layers(); ++i) {
    TransformerLayer& l = m.layer(i);
    const int64_t g = m.layer_indices()[size_t(i)];
    const std::string p = fmt::format("layers.{}.", g);
    out.push_back({p + "self_attention.linear_qkv", g, &l.self_attention().linear_qkv()});
    out.push_back({p + "self_attention.linear_proj", g, &l.self_attention().linear_proj()});
    layers::MLP* mlp = l.moe() ? l.moe()->shared_expert() : &l.mlp();
    const std::string mp = p + (l.moe() ? "mlp.shared_experts." : "mlp.");
    if (mlp) {
      out.push_back({mp + "linear_fc1", g, &mlp->fc1()});
      out.push_back({mp + "linear_fc2", g, &mlp->fc2()});
    }
  }
  return out;
}

int64_t enable_fp8(GPTModel& m, const layers::Fp8Recipe& recipe, int64_t bf16_layers) {
  const int64_t total = m.config().num_layers;
  int64_t on = 0;
  for (NamedLinear& nl : transformer_linears(m)) {
    const bool kept = nl.global_layer < bf16_layers || nl.global_layer >= total - bf16_layers;
    layers::Fp8Recipe r = recipe;
    if (kept) r.scaling = layers::Fp8Scaling::None;
    on += nl.linear->enable_fp8(r, nl.name) ? 1 : 0;
  }
  if (m.config().num_moe_experts > 0)
    log_once(LogLevel::Info, "fp8-moe-experts", "fp8", "the routed experts' grouped GEMMs run in the model's dtype");
  return on;
}

void fp8_begin_step(GPTModel& m, const Stream& s) {
  for (NamedLinear& nl : transformer_linears(m)) nl.linear->fp8_begin_step(s);
}

void fp8_begin_step(const std::vector<GPTModel*>& chunks, comm::Communicator& amax_group, const Stream& s) {
  std::vector<layers::Fp8LinearState*> states;
  for (GPTModel* m : chunks)
    for (NamedLinear& nl : transformer_linears(*m))
      if (layers::Fp8LinearState* st = nl.linear->fp8()) states.push_back(st);
  layers::fp8_begin_step(states, amax_group, s);
}

std::vector<std::pair<layers::Parameter*, layers::Fp8LinearState*>> fp8_weights(GPTModel& m) {
  std::vector<std::pair<layers::Parameter*, layers::Fp8LinearState*>> out;
  for (NamedLinear& nl : transformer_linears(m))
    if (layers::Fp8LinearState* st = nl.linear->fp8()) out.emplace_back(&nl.linear->weight(), st);
  return out;
}

std::vector<std::pair<std::string, Tensor>> fp8_state(GPTModel& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (NamedLinear& nl : transformer_linears(m))
    if (layers::Fp8LinearState* st = nl.linear->fp8())
      for (auto& [leaf, t] : st->state()) out.emplace_back(nl.name + ".fp8." + leaf, t);
  return out;
}

std::vector<Fp8LayerCounts> fp8_counts(GPTModel& m) {
  std::vector<Fp8LayerCounts> out;
  for (NamedLinear& nl : transformer_linears(m)) {
    layers::Fp8LinearState* st = nl.linear->fp8();
    if (!st) continue;
    Fp8LayerCounts c;
    c.name = nl.name;
    for (auto& [leaf, t] : st->state())
      if (leaf == "counts") {
        const std::vector<double> v = t.to_double_vector();
        for (int k = 0; k < 3; ++k) c.saturated[k] = int64_t(v[size_t(2 * k)]), c.flushed[k] = int64_t(v[size_t(2 * k + 1)]);
      }
    out.push_back(c);
  }
  return out;
}

}  // namespace megacore::model
