// FP8 training of a GPT model chunk: which linears run in FP8, and their scaling state.
//
// FP8 applies to the dense TP linears of the transformer layers (QKV, output projection, FC1, FC2, and a
// MoE layer's shared expert); the embedding, norms, attention's softmax, the routed experts and the output
// layer stay in the model's dtype. The first and last `bf16_layers` transformer layers (global indices)
// can be kept in the model's dtype too.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "megacore/layers/fp8.hpp"
#include "megacore/model/gpt_model.hpp"

namespace megacore::model {

/// One linear of the chunk with its module path ("layers.3.self_attention.linear_qkv").
struct NamedLinear {
  std::string name;
  int64_t global_layer = 0;
  layers::ParallelLinearBase* linear = nullptr;
};
/// The chunk's dense TP linears in layer order.
std::vector<NamedLinear> transformer_linears(GPTModel& m);

/// Enables FP8 with `recipe` on every linear of transformer_linears(m) outside the first and last
/// `bf16_layers` of cfg.num_layers; returns how many run in FP8 (the others log why once).
int64_t enable_fp8(GPTModel& m, const layers::Fp8Recipe& recipe, int64_t bf16_layers = 0);

/// Once per optimizer step, before the first micro-batch: every FP8 linear's begin_step (amaxes reduced over
/// each layer's TP group, one all-reduce per layer with delayed scaling).
void fp8_begin_step(GPTModel& m, const Stream& s = {});
/// The same for the chunks of a pipeline stage with one all-reduce in all (layers::fp8_begin_step): the
/// delayed-scaling amaxes of every FP8 linear are reduced together over `amax_group`, which must contain the
/// TP group (the trainer passes the stage's TP × CP × DP group, so data-parallel replicas agree on the scales).
void fp8_begin_step(const std::vector<GPTModel*>& chunks, comm::Communicator& amax_group, const Stream& s = {});

/// Every FP8 linear's weight with its scaling state, in transformer_linears order (ZeRO-1's FP8 parameter
/// gather, optim/fp8_param_gather.hpp: the layers kept in bf16 are not among them).
std::vector<std::pair<layers::Parameter*, layers::Fp8LinearState*>> fp8_weights(GPTModel& m);

/// Every FP8 linear's scaling state, named "<linear>.fp8.<amax_history|scale|scale_inv|counts>" (the
/// tensors themselves: a checkpoint saves them, load copies into them).
std::vector<std::pair<std::string, Tensor>> fp8_state(GPTModel& m);

/// Per FP8 linear: the saturated and flushed-to-zero element counts of its input, weight and output
/// gradient casts so far (reads the device counters: one host synchronisation).
struct Fp8LayerCounts {
  std::string name;
  int64_t saturated[3] = {0, 0, 0};  ///< input, weight, output gradient
  int64_t flushed[3] = {0, 0, 0};
};
std::vector<Fp8LayerCounts> fp8_counts(GPTModel& m);

}  // namespace megacore::model
