// ForwardContext: what a module's forward/backward needs beyond its inputs.
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::layers {

/// Passed to every forward(ctx, x) and backward(ctx, dy). Modules keep their own saved activations;
/// the context only says where and how to run.
struct ForwardContext {
  /// Stream all compute and collectives are issued on (host stream for CPU tensors).
  Stream stream;
  /// When false, forward saves nothing and backward is refused (evaluation / inference).
  bool training = true;
  /// The loss-token count of the micro-batch (model::count_loss_tokens of its labels and mask) when the
  /// caller already has it, e.g. the pipeline engine; negative: the model counts them itself, which for
  /// labels on a GPU is a device-to-host read (the host waits for the forward queued so far).
  double loss_tokens = -1.0;
  /// Packed rows (several sequences per row, the DataLoader's Batch): i32 cumulative boundaries over the
  /// flattened [b * s] tokens (row-major: row 0's tokens first), on the model's device, and the longest
  /// segment. When defined, self-attention attends within segments only (ops' packed attention). The
  /// positions that restart at each segment go to the model as position_ids (GPTModel takes them from
  /// `position_ids` here: [b, s] integer ids).
  Tensor cu_seqlens;
  int64_t max_seqlen = 0;
  Tensor position_ids;
  /// Full activation recompute (TransformerLayer): the first forward runs with training = false and
  /// Discarded (stochastic parts such as LoRA dropout still apply, nothing is saved); backward reruns it
  /// with Replay, and Philox-based dropout reuses the first pass's draws.
  enum class RecomputePass { None, Discarded, Replay };
  RecomputePass recompute_pass = RecomputePass::None;
};

}  // namespace megacore::layers
