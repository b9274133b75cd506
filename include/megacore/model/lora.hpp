// LoRA on a transformer model: which linear layers a target name selects, and how each gets its adapter
// (layers/lora.hpp) in the model's own layouts.
//
// Targets, as users know them (Hugging Face PEFT names and Megatron-Core module names):
//   q_proj, k_proj, v_proj   one adapter each inside the fused linear_qkv (its grouped layout)
//   o_proj                   linear_proj (the attention output projection, row-parallel)
//   gate_proj, up_proj       one adapter each inside SwiGLU's fused linear_fc1 ([gate | up] per rank)
//   down_proj                linear_fc2 (row-parallel)
//   linear_qkv               = q_proj + k_proj + v_proj;  linear_proj = o_proj;  linear_fc2 = down_proj
//   linear_fc1               = gate_proj + up_proj with SwiGLU, one adapter on the whole fc1 with GELU
// On MoE layers the MLP targets adapt every routed expert's FFN (layers/moe_lora.hpp) and the shared expert's
// MLP when there is one; Hugging Face Mixtral's expert names are accepted too: w1 = gate_proj, w3 = up_proj,
// w2 = down_proj (on a model with dense layers as well they select the same linears there). The router is
// frozen and never gets an adapter (targeting it, as "router" or Mixtral's "gate", is an error saying so).
// Expert adapters are named "layers.<i>.mlp.experts.linear_fc1.gate_proj.lora_A.weight" [E/EP, r, h] etc.
// and draw from kLoRAExpertInitBase + (i · E + g) · kExpertLoRAStride for global expert g.
// With LoRA every base weight of the model (embedding, norms, linears, output layer) is frozen: only the
// adapters' A and B are parameters(). Adapter parameters are named after their layer,
// "layers.<i>.self_attention.linear_qkv.q_proj.lora_A.weight", "layers.<i>.mlp.linear_fc2.lora_B.weight".
// Philox offsets: layer i's adapters draw from kLoRAInitBase + i · kLoRALayerStride (+ 4 per linear,
// + the segment), away from the base weights' offsets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megacore/layers/lora.hpp"
#include "megacore/model/transformer_config.hpp"

namespace megacore::model {

constexpr uint64_t kLoRAInitBase = uint64_t(1) << 40;
constexpr uint64_t kLoRALayerStride = 16;
constexpr uint64_t kLoRAExpertInitBase = uint64_t(1) << 44;

struct LoRAConfig {
  int64_t dim = 8;        ///< rank r
  double alpha = 16.0;    ///< scale alpha / r
  double dropout = 0.0;
  std::vector<std::string> target_modules{"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"};
  uint64_t seed = 1234;
};

/// Every problem of `lora` for the model `cfg` (unknown target names, listed with the valid ones; a
/// gate_proj/up_proj target on a GELU MLP; the router targeted; a w1/w2/w3 target on a model without MoE; r ≤ 0 or larger than a targeted layer's smallest dimension;
/// alpha ≤ 0; dropout outside [0, 1)), one message each; empty when it is fine.
std::vector<std::string> lora_problems(const LoRAConfig& lora, const TransformerConfig& cfg);

/// The linears a target list selects: "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2" each with
/// the segment names inside it ("q_proj" ...; empty for a whole-layer adapter). Assumes valid targets.
struct LoRATargets {
  std::vector<std::string> qkv, fc1;  ///< selected segments of the fused linears
  bool proj = false, fc2 = false, fc1_whole = false;
};
LoRATargets resolve_lora_targets(const std::vector<std::string>& targets, const TransformerConfig& cfg);

/// Adapter parameters (A and B of every adapter, whole model) that `lora` adds to `cfg`'s model.
int64_t lora_parameter_count(const LoRAConfig& lora, const TransformerConfig& cfg);

}  // namespace megacore::model
