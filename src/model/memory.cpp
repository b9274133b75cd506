#include "megacore/model/memory.hpp"

#include <algorithm>

namespace megacore::model {

ActivationEstimate activation_bytes_per_layer(const TransformerConfig& cfg, int64_t seq_len, int64_t micro_batch,
                                              int tp_size, bool sequence_parallel, int act_bytes,
                                              RecomputeGranularity recompute) {
  const double tokens = double(seq_len) * double(micro_batch), t = tp_size, a = act_bytes;
  const double h = double(cfg.hidden_size), d = double(cfg.head_dim()), heads = double(cfg.num_attention_heads);
  const double groups = double(cfg.query_groups()), f = double(cfg.ffn_size());
  const double fc1_out = cfg.activation == ActivationType::SwiGLU ? 2 * f : f;
  const double stats = cfg.normalization == NormType::LayerNorm ? 4.0 * 4 : 2.0 * 4;  // f32 per token, both norms
  ActivationEstimate e;
  if (recompute == RecomputeGranularity::Full) {  // only the layer input is kept (its output is the next input)
    e.replicated = sequence_parallel ? 0 : tokens * h * a;
    e.sharded = sequence_parallel ? tokens * h * a / t : 0;
  } else {
    // h-sized tensors on the sequence: QKV input, residual, MLP norm output, layer output, norm statistics.
    const double seq_terms = tokens * (4 * h * a + stats);
    // qk_layernorm keeps the un-normalised q and k heads (the norms' inputs) and their f32 statistics too.
    const double qk_norm = cfg.qk_layernorm ? tokens * ((heads + groups) * d * a + (heads + groups) * 4) / t : 0;
    const double head_terms = tokens * ((heads * d + 2 * groups * d) + heads * d + fc1_out + f) * a / t + qk_norm;
    const double lse = recompute == RecomputeGranularity::Selective ? 0 : tokens * heads * 4 / t;
    e.replicated = sequence_parallel ? 0 : seq_terms;
    e.sharded = head_terms + lse + (sequence_parallel ? seq_terms / t : 0);
  }
  e.total = e.replicated + e.sharded;
  return e;
}

MoEActivationEstimate moe_activation_bytes_per_layer(const TransformerConfig& cfg, int64_t seq_len, int64_t micro_batch,
                                                     int tp_size, bool sequence_parallel, int act_bytes,
                                                     RecomputeGranularity recompute, int expert_tp_size) {
  const ActivationEstimate dense =
      activation_bytes_per_layer(cfg, seq_len, micro_batch, tp_size, sequence_parallel, act_bytes, recompute);
  MoEActivationEstimate e;
  const double tokens = double(seq_len) * double(micro_batch), t = tp_size, a = act_bytes, h = double(cfg.hidden_size);
  const double k = double(cfg.moe_router_topk), experts = double(cfg.num_moe_experts), etp = expert_tp_size;
  const double routed = tokens / t;  // each TP rank routes its share
  const double load = cfg.moe_expert_capacity_factor > 0 ? cfg.moe_expert_capacity_factor : 1.0;
  const double sent = routed * k * std::min(1.0, load), recv = routed * k * load;
  e.dispatch = (sent + recv + (etp > 1 ? recv * etp : 0)) * h * a;
  if (recompute == RecomputeGranularity::Full) {
    e.saved = dense.total;
    return e;
  }
  const bool swiglu = cfg.activation == ActivationType::SwiGLU;
  const double f = double(cfg.ffn_size()), fe = double(cfg.moe_ffn_size()), fs = double(cfg.moe_shared_expert_size);
  const double mlp = tokens * ((swiglu ? 2 * f : f) + f) * a / t;  // the dense MLP's fc1 output and fc2 input
  const double router = routed * experts * 4 + 3 * routed * k * 4;
  const double experts_b = recv * etp * h * a + recv * ((swiglu ? 2 * fe : fe) + fe) * a + recv * etp * 4;
  const double combine = sent * h * a + (t > 1 && !sequence_parallel ? routed * h * a : 0);
  const double shared = tokens * ((swiglu ? 2 * fs : fs) + fs) * a / t;
  e.saved = dense.total - mlp + router + experts_b + combine + shared;
  return e;
}

}  // namespace megacore::model
