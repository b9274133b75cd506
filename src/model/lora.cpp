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
    if (n == "down_proj" || n == "linear_fc2" || n == "w2") t.fc2 = true;
    if (n == "gate_proj" || n == "up_proj") add_unique(t.fc1, n);
    if (n == "w1") add_unique(t.fc1, "gate_proj");
    if (n == "w3") add_unique(t.fc1, "up_proj");
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
    if (!has(valid, n) && n != "router" && n != "gate")
      out.push_back(fmt::format("peft.target_modules: unknown module '{}'; valid names are: {}", n, valid_list));
  if (cfg.activation != ActivationType::SwiGLU)
    for (const char* n : {"gate_proj", "up_proj"})
      if (has(lora.target_modules, n))
        out.push_back(fmt::format("peft.target_modules: '{}' needs a SwiGLU MLP but this model's MLP is GELU; target "
                                  "linear_fc1 instead", n));
  for (const char* n : {"router", "gate"})
    if (has(lora.target_modules, n))
      out.push_back(fmt::format("peft.target_modules: '{}' names the MoE router, which stays frozen and never gets a "
                                "LoRA adapter; drop it (the experts' targets are gate_proj/up_proj/down_proj or w1/w3/w2)",
                                n));
  if (cfg.activation != ActivationType::SwiGLU)
    for (const char* n : {"w1", "w3"})
      if (has(lora.target_modules, n))
        out.push_back(fmt::format("peft.target_modules: '{}' needs SwiGLU experts but this model's MLP is GELU; target "
                                  "linear_fc1 instead", n));
  if (!cfg.is_moe())
    for (const char* n : {"w1", "w2", "w3"})
      if (has(lora.target_modules, n))
        out.push_back(fmt::format("peft.target_modules: '{}' is a Mixtral expert linear but this model has no MoE "
                                  "layers; target gate_proj/up_proj/down_proj", n));
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
  const int64_t h = cfg.hidden_size, d = cfg.head_dim();
  std::vector<std::pair<std::string, int64_t>> dims;
  for (const std::string& s : t.qkv)
    dims.emplace_back(s, std::min(h, (s == "q_proj" ? cfg.num_attention_heads : cfg.query_groups()) * d));
  if (t.proj) dims.emplace_back("o_proj", std::min(cfg.attention_width(), h));
  // The MLP widths the MLP targets reach: the dense MLP, the routed experts', the shared expert's.
  std::vector<std::pair<std::string, int64_t>> widths;
  bool dense = false;
  for (int64_t i = 0; i < cfg.num_layers; ++i) dense = dense || !cfg.is_moe_layer(i);
  if (dense) widths.emplace_back("", cfg.ffn_size());
  if (cfg.is_moe()) widths.emplace_back("the experts' ", cfg.moe_ffn_size());
  if (cfg.is_moe() && cfg.moe_shared_expert_size > 0) widths.emplace_back("the shared expert's ", cfg.moe_shared_expert_size);
  for (const auto& [who, ffn] : widths) {
    for (const std::string& s : t.fc1) dims.emplace_back(who + s, std::min(h, ffn));
    if (t.fc1_whole) dims.emplace_back(who + "linear_fc1", std::min(h, ffn));
    if (t.fc2) dims.emplace_back(who + "down_proj", std::min(ffn, h));
  }
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
  const int64_t r = lora.dim, h = cfg.hidden_size, d = cfg.head_dim();
  int64_t attention = 0;
  for (const std::string& s : t.qkv) attention += r * (h + (s == "q_proj" ? cfg.num_attention_heads : cfg.query_groups()) * d);
  if (t.proj) attention += r * (cfg.attention_width() + h);
  // The adapters of one MLP of FFN width `ffn`.
  auto mlp = [&](int64_t ffn) {
    return int64_t(t.fc1.size() + (t.fc1_whole ? 1 : 0)) * r * (h + ffn) + (t.fc2 ? r * (ffn + h) : 0);
  };
  int64_t total = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    total += attention;
    if (!cfg.is_moe_layer(i)) {
      total += mlp(cfg.ffn_size());
    } else {
      total += cfg.num_moe_experts * mlp(cfg.moe_ffn_size());
      if (cfg.moe_shared_expert_size > 0) total += mlp(cfg.moe_shared_expert_size);
    }
  }
  return total;
}

}  // namespace megacore::model
