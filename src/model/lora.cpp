#include "megacore/model/lora.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace megacore::model {
namespace {

bool has(const std::vector<std::string>& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); }

void add_unique(std::vector<std::string>& v, const std::string& s) {
  if (!has(v, s)) v.push_back(s);
}

}  // namespace

LoRATargets resolve_lora_targets(const std::vector<std::string>& targets, const TransformerConfig& cfg) {
  LoRATargets t;
  const bool swiglu = cfg.activation == ActivationType::SwiGLU;
  for (const std::string& n : targets) {
    if (n == "q_proj" || n == "k_proj" || n == "v_proj") add_unique(t.qkv, n);
    if (n == "linear_qkv")
      for (const char* s : {"q_proj", "k_proj", "v_proj"}) add_unique(t.qkv, s);
    if (n == "o_proj" || n == "linear_proj") t.proj = true;
    if (n == "down_proj" || n == "linear_fc2") t.fc2 = true;
    if (n == "gate_proj" || n == "up_proj") add_unique(t.fc1, n);
    if (n == "linear_fc1") {
      if (swiglu)
        for (const char* s : {"gate_proj", "up_proj"}) add_unique(t.fc1, s);
      else
        t.fc1_whole = true;
    }
  }
  // Segments in the layout's order (q, k, v; gate, up), whatever order the user listed them in.
  auto order = [](std::vector<std::string>& v, std::vector<std::string> by) {
    std::vector<std::string> out;
    for (const std::string& s : by)
      if (has(v, s)) out.push_back(s);
    v = out;
  };
  order(t.qkv, {"q_proj", "k_proj", "v_proj"});
  order(t.fc1, {"gate_proj", "up_proj"});
  return t;
}

std::vector<std::string> lora_problems(const LoRAConfig& lora, const TransformerConfig& cfg) {
  std::vector<std::string> out;
  const std::vector<std::string>& valid = layers::lora_target_names();
  std::string valid_list;
  for (const std::string& v : valid) valid_list += (valid_list.empty() ? "" : ", ") + v;
  if (lora.target_modules.empty())
    out.push_back(fmt::format("peft.target_modules is empty; name at least one of: {}", valid_list));
  for (const std::string& n : lora.target_modules)
    if (!has(valid, n))
      out.push_back(fmt::format("peft.target_modules: unknown module '{}'; valid names are: {}", n, valid_list));
  if (cfg.activation != ActivationType::SwiGLU)
    for (const char* n : {"gate_proj", "up_proj"})
      if (has(lora.target_modules, n))
        out.push_back(fmt::format("peft.target_modules: '{}' needs a SwiGLU MLP but this model's MLP is GELU; target "
                                  "linear_fc1 instead", n));
  if (cfg.is_moe())
    for (const char* n : {"gate_proj", "up_proj", "down_proj", "linear_fc1", "linear_fc2"})
      if (has(lora.target_modules, n))
        out.push_back(fmt::format("peft.target_modules: '{}' would adapt the MLPs, but this is a MoE model "
                                  "(num_moe_experts = {}) and LoRA adapters on experts are not supported; target the "
                                  "attention only (q_proj, k_proj, v_proj, o_proj)",
                                  n, cfg.num_moe_experts));
  if (lora.alpha <= 0) out.push_back(fmt::format("peft.alpha is {}; it must be positive (e.g. 32)", lora.alpha));
  if (!(lora.dropout >= 0 && lora.dropout < 1))
    out.push_back(fmt::format("peft.dropout is {}; it must be in [0, 1) (e.g. 0.1)", lora.dropout));
  if (lora.dim <= 0) {
    out.push_back(fmt::format("peft.dim (the LoRA rank r) is {}; it must be positive (e.g. 8 to 64)", lora.dim));
    return out;
  }
  if (!out.empty()) return out;
  // r may not exceed min(in, out) of any targeted (segment of a) layer.
  const LoRATargets t = resolve_lora_targets(lora.target_modules, cfg);
  const int64_t h = cfg.hidden_size, d = cfg.head_dim(), ffn = cfg.ffn_size();
  std::vector<std::pair<std::string, int64_t>> dims;
  for (const std::string& s : t.qkv)
    dims.emplace_back(s, std::min(h, (s == "q_proj" ? cfg.num_attention_heads : cfg.query_groups()) * d));
  if (t.proj) dims.emplace_back("o_proj", std::min(cfg.attention_width(), h));
  for (const std::string& s : t.fc1) dims.emplace_back(s, std::min(h, ffn));
  if (t.fc1_whole) dims.emplace_back("linear_fc1", std::min(h, ffn));
  if (t.fc2) dims.emplace_back("down_proj", std::min(ffn, h));
  for (auto& [name, m] : dims)
    if (lora.dim > m) {
      out.push_back(fmt::format("peft.dim {} is larger than {}'s smallest dimension {}; use peft.dim <= {}", lora.dim,
                                name, m, m));
      break;
    }
  return out;
}

int64_t lora_parameter_count(const LoRAConfig& lora, const TransformerConfig& cfg) {
  const LoRATargets t = resolve_lora_targets(lora.target_modules, cfg);
  const int64_t r = lora.dim, h = cfg.hidden_size, d = cfg.head_dim(), ffn = cfg.ffn_size();
  int64_t per_layer = 0;
  for (const std::string& s : t.qkv) per_layer += r * (h + (s == "q_proj" ? cfg.num_attention_heads : cfg.query_groups()) * d);
  if (t.proj) per_layer += r * (cfg.attention_width() + h);
  per_layer += int64_t(t.fc1.size() + (t.fc1_whole ? 1 : 0)) * r * (h + ffn);
  if (t.fc2) per_layer += r * (ffn + h);
  return per_layer * cfg.num_layers;
}

}  // namespace megacore::model
