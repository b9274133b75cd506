// DistributedOptimizer (ZeRO-1): AdamW whose master weights and moments are sharded over the
// data-parallel group. The state's precision follows AdamWConfig (f32 masters and moments by default;
// main_params_dtype = BF16: no masters, this rank's range of the param buffer is updated in place before
// the all-gather; exp_avg_dtype / exp_avg_sq_dtype = BF16: bf16 moments).
//
// It works on a DistributedDataParallel built with use_distributed_optimizer = true. Each bucket of
// the ParamAndGradBuffer (length n, a multiple of DP) is split evenly: DP rank r owns the contiguous
// range [r·n/DP, (r+1)·n/DP) of every bucket and keeps f32 master weights, exp_avg and exp_avg_sq for
// that range only, so optimizer state per rank is ≈ 1/DP of AdamW's (state_bytes()). A step:
//   ddp.finish_grad_sync()     reduce-scatter: this rank's range of the grad buffer holds the averaged grads
//   opt.step(lr)               AdamW on the owned range (the same multi-tensor kernel and no-decay rule as
//                              AdamW; a parameter cut by a shard boundary is updated piecewise), writing the
//                              new weights into the param buffer, then one all-gather per bucket (in the
//                              params' dtype) so every rank has all weights again.
// With overlap_param_gather the all-gathers are only started by step(); call wait_param_gather(params)
// before a forward first reads those parameters (bucket by bucket, in forward order, so the gather of
// later buckets overlaps the forward of earlier layers) or finish_param_gather() to wait for all.
// step() itself finishes outstanding gathers first.
//
// Deferred gathers (set_deferred_gather): step() leaves the buckets of separate parameters
// (Bucket::separate) ungathered — only this rank's range of them is up to date — and marks them pending;
// the caller takes them (take_deferred_gather) and gathers them itself, e.g. as FP8 codes
// (optim/fp8_param_gather.hpp). Whatever is left pending is gathered in the params' dtype by
// finish_param_gather() and by the next step(), so a reader of the parameters never sees stale ranges.
//
// Mixture of experts: dense and expert parameters are reduced over different groups (DP × CP and
// expert-DP), so they live in two DistributedDataParallels, and one DistributedOptimizer takes both: each
// DDP's buckets are sharded over that DDP's own group (ranks of one expert-DP group own disjoint ranges of
// the expert buffer), the AdamW update covers both in one launch per dtype, and the gradient norm adds the
// expert part summed over GradNormGroups::expert_reduce to the dense part (see grad_clip.hpp). Use
// split_expert_parameters() to divide a model's parameters and expert_grad_ready_hook() to route the
// model's grad-ready notifications to the DDP that holds each parameter.
//
// Checkpoints: state()/load_state() are this rank's shards plus a layout record (DP size, rank,
// buckets), valid only for the same layout; gathered_state()/load_gathered_state() exchange per-
// parameter full (TP-local) tensors named as AdamW::state() does, so a checkpoint can be resharded
// to another DP size or read into a plain AdamW.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "megacore/optim/distributed_data_parallel.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/optim/optimizer.hpp"

namespace megacore::optim {

class DistributedOptimizer {
 public:
  /// `ddp` (use_distributed_optimizer = true, else ValueError) must outlive the optimizer. The master
  /// weights start as this rank's range of the current parameters.
  explicit DistributedOptimizer(DistributedDataParallel& ddp, const AdamWConfig& cfg = {},
                                bool overlap_param_gather = false);
  /// Over several DDPs (normally the dense one over DP × CP and the expert one over expert-DP), each
  /// sharded over its own group; all must use use_distributed_optimizer, hold parameters on one device,
  /// and each hold only dense or only expert parameters (Parameter::expert), else ValueError. The first
  /// DDP's compute stream and gemm_sm_margin apply. parameters() lists the DDPs' parameters in order.
  explicit DistributedOptimizer(std::vector<DistributedDataParallel*> ddps, const AdamWConfig& cfg = {},
                                bool overlap_param_gather = false);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  /// One AdamW step on this rank's shard (after ddp.finish_grad_sync()), then the param all-gather
  /// (waited for unless overlap_param_gather). Gradients are multiplied by grad_scale and, when given,
  /// by the f32 [1] device tensor grad_scale_tensor. Collective over the DP group.
  void step(float lr, float grad_scale = 1.f, const Tensor& grad_scale_tensor = {});
  /// Zeroes the gradients (every DDP's grad buffer).
  void zero_grad() {
    for (DistributedDataParallel* d : ddps_) d->zero_grad();
  }
  int64_t step_count() const { return step_; }

  /// Global gradient norm over the shards: each rank counts its owned range (TP-replicated parameters
  /// on TP rank 0 only, `groups.skip` honoured), summed over groups.reduce, which must contain the DDP
  /// group when DP > 1 (grad_norm_groups(grid, /*grads_sharded_over_dp=*/true); ValueError otherwise).
  /// An expert DDP's ranges are summed over groups.expert_reduce, which must then contain its group.
  GradNormResult grad_norm(const GradNormGroups& groups) const;
  /// The owned gradient ranges this rank counts in grad_norm, appended to `dense` or `expert` (with
  /// grad_norm's checks of `groups`), for a norm over several optimizers (checked_step over parts).
  void counted_grads(const GradNormGroups& groups, std::vector<Tensor>& dense, std::vector<Tensor>& expert) const;
  /// grad_norm, then, when finite and above max_norm (> 0), scales this rank's owned gradients by clip_coef.
  GradNormResult clip_grad_norm(double max_norm, const GradNormGroups& groups);

  /// Orders the compute stream (DDPConfig::compute_stream) after the param all-gathers of the buckets
  /// holding these parameters, without blocking the host (no-op when none pending): the host keeps
  /// enqueuing the forward while the gathers run. A gather that fails or times out is reported by the
  /// NCCL watchdog, which aborts the communicator, and by the next operation on it (CommError).
  void wait_param_gather(const std::vector<layers::Parameter*>& params);
  /// Waits (on the host) for every pending param all-gather: before the host reads the parameters.
  void finish_param_gather();
  bool param_gather_pending() const;

  /// With `on`, step() defers the all-gather of the separate buckets (see the header comment). Needs f32
  /// master weights (the caller may rewrite this rank's range of the param buffer), else ValueError.
  void set_deferred_gather(bool on);
  bool deferred_gather() const { return defer_separate_; }
  /// One bucket whose all-gather step() deferred.
  struct DeferredBucket {
    DistributedDataParallel* ddp;
    int bucket;
  };
  /// The buckets the last step() left ungathered (none with DP = 1, where there is nothing to gather),
  /// no longer pending: the caller gathers them now, on every rank of their DDP's group.
  std::vector<DeferredBucket> take_deferred_gather();
  bool deferred_gather_pending() const { return !deferred_.empty(); }

  /// Bytes of optimizer state on this rank: master weights (when separate), exp_avg, exp_avg_sq, at their
  /// dtypes, shard only.
  int64_t state_bytes() const;
  /// Whether the master weights are f32 copies (false: this rank's range of the param buffer itself).
  bool separate_masters() const { return cfg_.main_params_dtype == DType::F32; }
  /// Dtype of parameters()[i]'s master weights (f32, or the parameter's own dtype without separate masters);
  /// the moments' are config().exp_avg_dtype / exp_avg_sq_dtype.
  DType master_dtype(size_t i) const;
  /// Elements this rank owns (padding included).
  int64_t shard_numel() const;

  /// This rank's shards ("bucket<b>.master", ".exp_avg", ".exp_avg_sq", views of the live state) and
  /// "layout" (i64: DP size, DP rank, buckets and parameter offsets). Not collective.
  std::vector<NamedTensor> state() const;
  /// Restores state() of an optimizer with exactly this layout; ValueError naming the difference (a
  /// different DP size or bucket layout: use gathered_state / load_gathered_state to reshard).
  void load_state(const std::vector<NamedTensor>& state, int64_t step_count);
  /// Collective over DP: per parameter, in parameters() order, "<param>.master", "<param>.exp_avg",
  /// "<param>.exp_avg_sq" as full TP-local tensors of the parameter's shape (on its device, in the
  /// state's dtypes) — the names, shapes and order of AdamW::state().
  std::vector<NamedTensor> gathered_state() const;
  /// Collective over DP: keeps this rank's range of each tensor (names and shapes must match
  /// gathered_state() exactly, ValueError naming the first difference), sets the step count and
  /// writes the master weights into the parameters (all-gathered).
  void load_gathered_state(const std::vector<NamedTensor>& state, int64_t step_count);

  /// The part of one parameter this rank owns: elements [param_offset, param_offset + numel) of the
  /// flattened (TP-local) parameter, and 1-D views of the live state for them (write into the views, then
  /// call finish_load). Every element of every parameter is owned by exactly one rank of the DDP group.
  struct OwnedRange {
    size_t param;  ///< index in parameters()
    int64_t param_offset;
    int64_t numel;
    Tensor master, exp_avg, exp_avg_sq;
  };
  /// This rank's owned ranges, in parameter order (a parameter cut by a shard boundary has several).
  /// Not collective: this is what a checkpoint writes per rank (checkpoint::shard_zero_state).
  std::vector<OwnedRange> owned_ranges() const;
  /// After the state was written into owned_ranges()' views: sets the step count and writes the master
  /// weights into the parameters (all-gathered). Collective over DP.
  void finish_load(int64_t step_count);

  /// Every DDP's parameters, DDP by DDP (each in its buffer's order).
  const std::vector<layers::Parameter*>& parameters() const { return params_; }
  bool decays(size_t i) const { return decay_[i]; }
  const AdamWConfig& config() const { return cfg_; }
  /// The first DDP (the dense one).
  DistributedDataParallel& ddp() const { return *ddps_.front(); }
  const std::vector<DistributedDataParallel*>& ddps() const { return ddps_; }

 private:
  /// The intersection of one parameter with this rank's shard of one bucket.
  struct Segment {
    size_t param;       // index in params_
    size_t ddp;         // index in ddps_
    size_t slot;        // index of (ddp, bucket) in slots_ (and the state tensors)
    int64_t shard_off;  // offset in the bucket's shard (and its state tensors)
    int64_t param_off;  // offset in the flattened parameter
    int64_t len;
    int64_t buf_off;    // offset in the group's buffers
  };
  /// One bucket of one DDP.
  struct Slot {
    size_t ddp;
    int bucket;
  };
  /// With `defer`, the separate buckets are left to take_deferred_gather().
  void start_param_gather(bool defer = false);
  /// All-gathers the deferred buckets in the params' dtype and waits.
  void gather_deferred();
  /// Orders the compute stream after every pending param all-gather without blocking the host.
  void order_param_gather();
  void write_masters_to_params();
  std::vector<int64_t> layout() const;
  const ParamAndGradBuffer& buffer_of(const Segment& s) const { return ddps_[s.ddp]->buffer(); }
  Tensor grad_of(const Segment& s) const;
  const Stream& compute_stream() const { return ddps_.front()->config().compute_stream; }

  std::vector<DistributedDataParallel*> ddps_;
  std::vector<layers::Parameter*> params_;
  std::vector<size_t> param_base_;  // per DDP: index of its first parameter in params_
  std::vector<bool> expert_ddp_;    // per DDP: holds expert parameters
  AdamWConfig cfg_;
  bool overlap_param_gather_;
  std::vector<bool> decay_;
  std::vector<Segment> segments_;
  std::vector<Slot> slots_;
  std::vector<Tensor> master_, exp_avg_, exp_avg_sq_;  // per slot, shard length
  std::vector<comm::WorkPtr> gather_;                   // per slot
  bool defer_separate_ = false;
  std::vector<size_t> deferred_;                        // slots whose gather step() deferred
  ops::GemmSmMarginRequest gemm_margin_;  // held while overlapped gathers run (DDPConfig::gemm_sm_margin)
  int64_t step_ = 0;
};

/// Dense and expert parameters (Parameter::expert) of a list, each in the list's order.
struct ExpertSplit {
  std::vector<layers::Parameter*> dense, expert;
};
ExpertSplit split_expert_parameters(const std::vector<layers::Parameter*>& params);

/// A grad-ready callback (for GPTModel::set_grad_ready_callback) that hands each parameter to the DDP
/// whose buffer holds it (ValueError for one held by none). The DDPs must outlive the callback.
std::function<void(const std::vector<layers::Parameter*>&)> grad_ready_hook(
    std::vector<DistributedDataParallel*> ddps);

}  // namespace megacore::optim
