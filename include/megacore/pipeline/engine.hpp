// PipelineEngine: runs one training step of a pipeline-parallel GPTModel — the forward and backward
// of every micro-batch on this rank's model chunks — by executing rank_schedule() op by op.
//
// Each rank holds VP model chunks (model::GPTModel built with the layer_indices / pre_process /
// post_process of its (pp_rank, chunk) in a PipelineLayout). The engine walks the rank's op list:
// Forward runs chunk.forward_stage and stashes its activations (layers::ActivationStash) keyed by
// (micro-batch, chunk); Backward restores them and runs chunk.backward_stage; the send/receive ops move
// activations and their gradients with StageP2P (p2p.hpp). The shapes exchanged are agreed before the
// first op: every micro-batch of a step has the same [b, s] (checked across the pipeline group), so the
// hidden states are GPTModel::activation_shape(b, s) — the sequence-parallel shard with SP.
//
// Loss weighting (exact token-weighted mean over all micro-batches and all DP ranks): at step start the
// engine counts each micro-batch's loss tokens (model::count_loss_tokens) and all-reduces the step's
// total N over the optional DP group. Micro-batch i's mean-loss gradient is scaled by
// tokens_i · DP / N, so that after the usual DP *average* of the gradients every parameter holds the
// gradient of Σ_tokens loss / N, the global per-token mean (the same as one model seeing the whole
// global batch). The reported loss is that same global mean, Σ_i loss_i · tokens_i / N summed over DP,
// computed on the last stage and broadcast over the pipeline group, so every rank returns it.
//
// Tied embeddings: after the schedule (all sends done) the chunks holding the tied weight sum its
// gradient over the optional embedding group (GPTModel::allreduce_tied_embedding_grads).
//
// The model's grad-ready callback fires inside every backward as usual; before_backward tells a DDP
// which backward is the last one of a chunk in this step (the one whose callbacks should start the
// DP reduction).
//
// Timing: busy time is the time spent in Forward/Backward compute (host clock on CPU; CUDA events on
// the compute stream on GPUs); the rest of the step (waiting for peers, transfers, loss bookkeeping)
// is idle. StepResult reports the measured idle fraction next to theoretical_bubble_fraction().
#pragma once

#include <array>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/pipeline/layout.hpp"
#include "megacore/pipeline/schedule.hpp"

namespace megacore::pipeline {

/// One micro-batch: tokens and labels i32/i64 [b, s], optional f32 loss_mask [b, s] (host tensors are
/// fine on any device: the model moves what it needs).
class StageP2P;

struct MicroBatch {
  Tensor tokens, labels, loss_mask;
  /// Packed rows (optional, from the DataLoader's Batch): segment boundaries (i32, over the flattened
  /// [b * s] tokens, on the model's device), the longest segment and the restarting positions [b, s]; every
  /// stage's attention and RoPE use them (layers::ForwardContext).
  Tensor cu_seqlens, position_ids;
  int64_t max_seqlen = 0;
  /// The micro-batch's loss-token count (model::count_loss_tokens of labels and mask) when the caller knows
  /// it on the host (the DataLoader's Batch::loss_tokens); < 0: the engine counts it from the labels, a
  /// device→host read when they live on a GPU.
  double loss_tokens = -1;
};

struct PipelineEngineOptions {
  /// Data-parallel group for the token count (loss weighting); nullptr = no DP (DP = 1).
  comm::Communicator* dp = nullptr;
  /// Embedding group (first and last stage) for tied-embedding gradients; nullptr = do not sum them
  /// (the caller does it, or the model is untied). Required when the model is tied and PP > 1.
  comm::Communicator* embedding = nullptr;
  /// Record the executed ops in StepResult::executed (tests, debugging).
  bool record_ops = false;
  /// Called before each Backward with (chunk, micro-batch, is the chunk's last backward of the step).
  std::function<void(int chunk, int64_t microbatch, bool last)> before_backward;
  /// No host sync in step() (with every MicroBatch::loss_tokens given): the loss and the token count stay
  /// on the device (StepResult::device_sums) and backward weights micro-batch i by
  /// loss_tokens_i / StepResult::nominal_tokens instead of / the global token count, so the caller
  /// multiplies the gradients by nominal_tokens / device_sums[1] once it reads the sums (the trainer does it
  /// through checked_step's grad_scale, in the step's one read). StepResult::loss, tokens and (on GPUs)
  /// busy_seconds are then 0.
  bool defer_reads = false;
};

struct StepResult {
  /// Global per-token mean loss over all micro-batches and DP ranks (the same on every rank).
  double loss = 0;
  /// Tokens counted over all micro-batches and DP ranks (the denominator).
  double tokens = 0;
  double step_seconds = 0;
  double busy_seconds = 0;  ///< compute (Forward/Backward) time on this rank
  double idle_seconds = 0;  ///< step_seconds − busy_seconds
  double idle_fraction = 0;
  double theoretical_bubble = 0;  ///< theoretical_bubble_fraction() of the schedule
  int64_t max_in_flight = 0;      ///< most micro-batch forwards stashed at once on this rank
  std::vector<Op> executed;       ///< with record_ops
  /// f32 [2] on the model's device, ordered on the step's stream, the same on every rank:
  /// [Σ loss_i · tokens_i, Σ tokens_i] over micro-batches and DP ranks (what `loss` is read from).
  Tensor device_sums;
  /// With defer_reads: the constant backward divided by in place of the token count (DP × m × b × s).
  double nominal_tokens = 0;
};

class PipelineEngine {
 public:
  /// `pp` (the pipeline group), `layout` and the chunks must outlive the engine. chunks[c] is this rank's
  /// model chunk c (VP of them). Validated before anything runs (ConfigError naming the fix): layout
  /// sizes vs pp.size() and chunks.size(), every chunk's layer_indices / pre_process / post_process
  /// against the layout, one config for all chunks, and the embedding group for tied PP > 1 models.
  /// On CUDA the constructor is collective over `pp` (it builds the point-to-point channels, p2p.hpp).
  PipelineEngine(comm::Communicator& pp, const PipelineLayout& layout, std::vector<model::GPTModel*> chunks,
                 const PipelineEngineOptions& options = {});
  ~PipelineEngine();

  /// One step over micro_batches (the same list on every rank of the pipeline; its size is the number
  /// of micro-batches m, which must suit the schedule — ConfigError otherwise). Accumulates main_grads
  /// (call zero_grad before); does not reduce over DP. Throws CommError when a peer stage fails or hangs
  /// past the communicator's timeout. `loss_scale` multiplies every loss gradient (f16 dynamic loss scaling:
  /// the gradients then carry that factor; the reported loss does not).
  StepResult step(const layers::ForwardContext& ctx, const std::vector<MicroBatch>& micro_batches,
                  float loss_scale = 1.f);

  /// One forward of the whole model on one micro-batch with nothing saved (evaluation, generation): every
  /// virtual stage in model order (stage v on pipeline rank v % PP, chunk v / PP), the hidden states passed
  /// on over the pipeline group. Collective over the pipeline group. On the rank holding the last stage
  /// returns the mean loss of the micro-batch and sets *loss_tokens to its token count (as the model counted
  /// it, GPTModel::last_loss_tokens); elsewhere returns an undefined tensor. ctx.training must be false.
  Tensor forward_only(const layers::ForwardContext& ctx, const MicroBatch& mb, double* loss_tokens = nullptr);
  /// The schedule a step with m micro-batches runs.
  ScheduleConfig schedule_config(int64_t m) const;
  int pp_rank() const { return pp_.rank(); }

 private:
  comm::Communicator& pp_;
  const PipelineLayout& layout_;
  std::vector<model::GPTModel*> chunks_;
  PipelineEngineOptions opts_;
  std::unique_ptr<StageP2P> p2p_;
  /// The (b, s, m) the pipeline stages last agreed on: agreed again only when this rank's changes.
  std::array<int64_t, 3> agreed_shape_{-1, -1, -1};
};

}  // namespace megacore::pipeline
