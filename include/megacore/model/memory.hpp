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
// Full recompute keeps only the layer input (h, divided by t under SP). Block recompute (full recompute of
// only the first N layers of a chunk, TransformerBlockOptions::recompute_num_layers) is counted per layer:
// those N layers at Full, the others at None (they keep everything, LSE included), as `megacore plan` does.
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

/// A MoE layer (layers::MoELayer in place of the MLP) on one rank: `saved` the bytes kept for backward,
/// `dispatch` the dispatcher's transient buffers during its forward (freed before the next layer runs;
/// count them once, not per layer or micro-batch).
///
/// Saved, besides the attention and norm terms of the dense count (activation_bytes_per_layer without
/// its fc1 output and fc2 input): with T tokens routed on this rank (s·b, divided by TP when TP > 1: with
/// or without SP each TP rank routes its share), k = top-k, E experts, F the expert FFN width, expert-TP
/// `etp`, N = T·k dispatched rows and R = T·k·load rows received by this rank's experts:
///   router logits             T·E, f32
///   top-k probs, indices, row map  3·T·k × 4 bytes
///   expert inputs (sorted)    R·etp rows of h (expert-TP gathers every shard's rows)
///   fc1 output                R·2F (SwiGLU) or R·F   (each of R·etp rows holds fc1/etp)
///   activation (fc2 input)    R·F
///   sort map                  R·etp × 4 bytes
///   expert outputs            N rows of h (the combine's input)
///   routed tokens copy        T rows of h when TP > 1 without SP (the split of the replicated input)
///   shared expert             its fc1 output and activation, as a dense MLP of that width over TP
/// load = 1 for dropless routing (the expected rows with balanced experts; a rank can receive up to EP
/// times more under full imbalance); with a capacity factor c > 0 the rows a rank receives are at most
/// E·ceil(c·T·k/E) ≈ c·T·k, so load = c (and N ≤ T·k). Full recompute keeps only the layer input, as for
/// a dense layer.
/// Dispatch (transient): the permuted tokens (N rows of h), the all-to-all receive buffer (R rows) and,
/// with etp > 1, the expert-TP gathered rows (R·etp).
struct MoEActivationEstimate {
  double saved = 0;
  double dispatch = 0;
};
MoEActivationEstimate moe_activation_bytes_per_layer(const TransformerConfig& cfg, int64_t seq_len, int64_t micro_batch,
                                                     int tp_size, bool sequence_parallel, int act_bytes,
                                                     RecomputeGranularity recompute, int expert_tp_size = 1);

}  // namespace megacore::model
