#include "megacore/model/memory.hpp"

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
    const double head_terms = tokens * ((heads * d + 2 * groups * d) + heads * d + fc1_out + f) * a / t;
    const double lse = recompute == RecomputeGranularity::Selective ? 0 : tokens * heads * 4 / t;
    e.replicated = sequence_parallel ? 0 : seq_terms;
    e.sharded = head_terms + lse + (sequence_parallel ? seq_terms / t : 0);
  }
  e.total = e.replicated + e.sharded;
  return e;
}

}  // namespace megacore::model
