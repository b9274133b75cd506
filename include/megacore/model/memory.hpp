// Analytic memory estimates for training a GPTModel: saved activations per layer, counted tensor by
// tensor the way Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models",
// 2022) count them for GPT, but for the layer megacore actually runs (pre-norm, fused QKV with GQA,
// fused attention that keeps O and its log-sum-exp instead of the s×s scores, SwiGLU or GELU MLP, no
// dropout), plus the per-rank weight, gradient and optimizer bytes `megacore plan` prints.
//
// Per layer and token, with activations of `act_bytes` bytes each (Korthikanti's 34·s·b·h for GPT with
// a 4h MLP and dropout is the same count for that architecture):
//   input norm input x        h              (the previous layer's output; counted once, as "output" below)
//   QKV GEMM input            h              (norm output; with SP only this rank's chunk)
//   Q, K, V after RoPE        heads·d + 2·groups·d
//   attention output O        heads·d        (kept by the output projection for its weight gradient)
//   attention LSE             heads, f32     (dropped by selective recompute)
//   residual stream x + a     h              (the fused second norm's input)
//   MLP norm output           h              (fc1's input)
//   fc1 output                2·ffn (SwiGLU) or ffn
//   fc2 input                 ffn
//   layer output              h
//   norm statistics           2 × f32 (RMSNorm rstd; LayerNorm adds the mean)
// Under TP the per-head and per-ffn terms are divided by t; with sequence parallelism every term is.
#pragma once

#include <cstdint>

#include "megacore/model/transformer_config.hpp"

namespace megacore::model {

struct ActivationEstimate {
  double replicated = 0;  ///< bytes per layer not divided by TP (h-sized tensors without SP)
  double sharded = 0;     ///< bytes per layer already divided by TP
  double total = 0;       ///< bytes per layer on one rank
};

/// Saved-activation bytes of one transformer layer on one TP rank for a micro-batch of
/// `micro_batch` sequences of `seq_len` tokens (the CP-local length under context parallelism).
ActivationEstimate activation_bytes_per_layer(const TransformerConfig& cfg, int64_t seq_len, int64_t micro_batch,
                                              int tp_size, bool sequence_parallel, int act_bytes,
                                              RecomputeGranularity recompute);

}  // namespace megacore::model
