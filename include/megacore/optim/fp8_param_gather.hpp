// FP8 all-gather of the FP8 linears' weights under ZeRO-1 (Megatron's --fp8-param-gather;
// trainer.fp8_param_gather, docs/fp8.md).
//
// ZeRO-1 all-gathers the updated parameters over DP after every step. The FP8 linears only read their
// weights as E4M3 codes (cast once per step), so their bf16 weights need not travel: the DDP keeps those
// weights in buckets of their own (DDPConfig::separate_params), DistributedOptimizer::step() leaves those
// buckets ungathered (set_deferred_gather), and at the next step's start, once fp8_begin_step has set this
// step's weight scales, fp8_param_gather
//   1. (current scaling, or a delayed weight scale not yet seeded) reduces the amaxes of the pieces each
//      rank owns over `amax_group` (one all-reduce for all weights) and sets the weight scales from them;
//   2. casts this rank's range of each deferred bucket to E4M3, parameter piece by piece with that
//      parameter's weight scale (a shard boundary may cut a parameter), recording the pieces' amaxes into
//      the weight slots' history (the next step's reduction over TP × CP × DP gives the full weight's amax)
//      and their saturation counts (each rank counts its own pieces);
//   3. all-gathers the codes, one byte per element instead of two;
//   4. gives every FP8 linear its codes as its cached FP8 weight (a view; the transpose is built from it) and
//      rewrites its bf16 parameter on every rank, the owner included, as the codes dequantized, so all ranks
//      hold the same bf16 weights (what a bf16 fallback product of that layer reads during the step).
// The cast sees the same bf16 values and the same scale as the FP8 linear's own cast of its full weight, so
// the codes, and the training run, are the same bit for bit as without the option. Before anything else
// reads the parameters (evaluation, a checkpoint, export), DistributedOptimizer::finish_param_gather()
// gathers whatever is still deferred in bf16, so those see the optimizer's bf16 weights.
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/layers/fp8.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/optim/distributed_optimizer.hpp"

namespace megacore::optim {

/// An FP8 linear's weight and its scaling state.
struct Fp8Weight {
  layers::Parameter* param = nullptr;
  layers::Fp8LinearState* state = nullptr;
};

/// What one fp8_param_gather moved.
struct Fp8GatherStats {
  int64_t buckets = 0;   ///< deferred buckets gathered as codes
  int64_t weights = 0;   ///< FP8 weights in them
  int64_t elements = 0;  ///< elements gathered (the buckets' padded lengths)
  int64_t bytes = 0;     ///< bytes of the gathered buffers (one per element)
};

/// Gathers the buckets opt.step() deferred as FP8 codes (see the header comment); a no-op returning zeros when
/// none are pending (the first step, DP = 1, or after finish_param_gather()). Call after fp8_begin_step and
/// before the forward. `weights` lists every FP8 weight of the stage in the same order on every rank of
/// `amax_group` (the stage's TP × CP × DP group); each deferred bucket must hold only weights listed there
/// (ValueError otherwise). Collective over each deferred bucket's DP group and, when a scale needs the full
/// weight's amax, over `amax_group`.
Fp8GatherStats fp8_param_gather(DistributedOptimizer& opt, const std::vector<Fp8Weight>& weights,
                                comm::Communicator& amax_group, const Stream& s = {});

}  // namespace megacore::optim
