// DistributedDataParallel: gradient reduction over the data-parallel (× context-parallel) group, one
// collective per bucket of a ParamAndGradBuffer, started as soon as the bucket is complete.
//
// A step with M micro-batches:
//   ddp.zero_grad();
//   for m in 0..M-1:
//     ddp.set_is_last_microbatch(m == M - 1);   // reduction only on the last one (no_sync before)
//     model.forward(...); model.backward(...);   // the model calls ddp.notify_grad_ready(params) as
//                                                 // parameter groups become final (grad_ready_hook())
//   ddp.finish_grad_sync();                      // launches what was not launched, waits for all
//   optimizer.step(...)
//
// Overlap (`overlap_grad_reduce`): during the last micro-batch's backward, notify_grad_ready marks
// parameters ready; when every parameter of a bucket is ready, the bucket's all-reduce (reduce-scatter
// with use_distributed_optimizer) starts asynchronously — on a separate communication stream after an
// event on the compute stream for CUDA (NCCL), as a non-blocking MPI collective on the host. Buffers
// are laid out in backward order, so buckets complete one after another while backward continues.
// Parameters never notified are still reduced: finish_grad_sync launches every bucket not yet started.
//
// Gradients are averaged over the group (Σ / size). With reduce_dtype BF16 the bucket is cast to bf16
// (scaled by 1/size first), summed in bf16 and cast back — half the bytes, bf16 rounding. With grad_dtype
// BF16 the grad buffer itself is bf16 (the main gradients accumulate in bf16: half the gradient memory)
// and is reduced in place in bf16, scaled by 1/size first. With
// use_distributed_optimizer each rank ends with the reduced gradient of its own shard of each bucket
// (the range [rank·n/size, (rank+1)·n/size) of the bucket) written into the grad buffer; the rest of the
// grad buffer then holds this rank's unreduced gradients and must not be used.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/optim/param_and_grad_buffer.hpp"

namespace megacore::optim {

struct DDPConfig {
  /// Elements per bucket; 0 = default_bucket_size(group size).
  int64_t bucket_size = 0;
  /// Start each bucket's reduction when notify_grad_ready has marked all its parameters ready during
  /// the last micro-batch; false: everything is reduced in finish_grad_sync.
  bool overlap_grad_reduce = true;
  /// Reduce-scatter instead of all-reduce (for DistributedOptimizer, ZeRO-1).
  bool use_distributed_optimizer = false;
  /// F32 or BF16 (the dtype of the collective for an f32 grad buffer; a bf16 one is always reduced in bf16).
  DType reduce_dtype = DType::F32;
  /// The grad buffer's (main gradients') dtype: F32 or BF16 (BufferConfig::grad_dtype).
  DType grad_dtype = DType::F32;
  /// Divide the sum by the group size (gradients averaged over DP × CP).
  bool average = true;
  /// With `average`: divide the sum by this many ranks instead of the group's size; 0 = the group's size.
  /// A DDP of MoE expert parameters over expert-DP passes DP × CP, as Megatron-Core scales them: each EP
  /// rank's experts already summed the gradients of the tokens all EP ranks sent them, so the sum over
  /// expert-DP divided by DP × CP is the gradient of the global mean loss, like the dense parameters'.
  int average_size = 0;
  /// Alignment of parameters in the buffer (elements).
  int64_t param_align = 64;
  /// The stream the model computes on (CUDA); the communication stream waits for it before each launch.
  Stream compute_stream;
  /// CUDA priority of DDP's communication stream (0 = normal; negative = higher, down to the device's
  /// greatest, see cudaDeviceGetStreamPriorityRange): a higher one lets the reduction kernels take SMs
  /// as soon as backward kernels free them.
  int comm_stream_priority = 0;
  /// CUDA: SMs the GEMMs leave free while a reduction may run beside them (ops::GemmSmMarginRequest),
  /// from the first bucket started during backward until finish_grad_sync — and, with
  /// DistributedOptimizer's overlap_param_gather, while the parameter all-gathers overlap the next
  /// forward. Set it to about the CTAs NCCL uses (CommOptions::nccl_max_ctas caps them): cuBLASLt's
  /// persistent kernels then fit beside the collective instead of waiting for its SMs. 0 = off.
  int gemm_sm_margin = 0;
  /// Parameter objects aliasing a registered one (e.g. &model.output_layer().weight() when embeddings
  /// are tied), re-pointed along with it.
  std::vector<layers::Parameter*> shared_copies;
  /// Parameters kept in buckets of their own (BufferConfig::separate): the FP8 linears' weights when ZeRO-1
  /// gathers them as FP8 codes (optim/fp8_param_gather.hpp).
  std::vector<const layers::Parameter*> separate_params;
};

/// One bucket reduction as it was started (for overlap checks and profiles).
struct BucketLaunch {
  int bucket = 0;
  std::chrono::steady_clock::time_point time;
  bool from_notify = false;  ///< started by notify_grad_ready (overlapped), not by finish_grad_sync
};

class DistributedDataParallel {
 public:
  /// Builds its own ParamAndGradBuffer over `params` (padded for dp_cp.size()). `params` and `dp_cp`
  /// must outlive it.
  DistributedDataParallel(std::vector<layers::Parameter*> params, comm::Communicator& dp_cp,
                          const DDPConfig& cfg = {});
  /// Uses an existing buffer (which must outlive it). With use_distributed_optimizer every bucket must
  /// divide by dp_cp.size() (ValueError saying to build the buffer with dp_size = the group size).
  DistributedDataParallel(ParamAndGradBuffer& buffer, comm::Communicator& dp_cp, const DDPConfig& cfg = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Whether the coming backward is the last micro-batch of the step (default true). While false,
  /// notify_grad_ready only checks its arguments (no_sync).
  void set_is_last_microbatch(bool last) { is_last_microbatch_ = last; }
  bool is_last_microbatch() const { return is_last_microbatch_; }

  /// Marks the parameters' gradients final for this step (call during backward, in any grouping).
  /// ValueError for a parameter not registered, or one whose bucket's reduction already started.
  void notify_grad_ready(const std::vector<layers::Parameter*>& params);
  /// A callable for GPTModel::set_grad_ready_callback (calls notify_grad_ready).
  std::function<void(const std::vector<layers::Parameter*>&)> grad_ready_hook();
  /// Starts every bucket not yet started, waits for all (CommError on failure or timeout) and readies
  /// the next step. After it the gradients are reduced (see the header comment for ZeRO).
  void finish_grad_sync();
  /// Zeroes the grad buffer (all micro-batches accumulate into it).
  void zero_grad();

  ParamAndGradBuffer& buffer() { return *buffer_; }
  const ParamAndGradBuffer& buffer() const { return *buffer_; }
  comm::Communicator& group() const { return dp_; }
  const DDPConfig& config() const { return cfg_; }
  /// The communication stream (CUDA; the host stream on CPU).
  const Stream& comm_stream() const { return comm_stream_; }
  /// This rank's shard [begin, begin + size) of bucket b, relative to the bucket start.
  int64_t shard_size(int b) const;
  int64_t shard_begin(int b) const { return shard_size(b) * dp_.rank(); }

  /// The launches of the last finished step (or the current one), in launch order.
  const std::vector<BucketLaunch>& launches() const { return launches_; }
  /// Seconds finish_grad_sync spent launching the rest and waiting (last step): the exposed part of the
  /// reduction.
  double last_wait_seconds() const { return last_wait_s_; }

 private:
  void init();
  void launch(int b, bool from_notify);
  void poll();

  std::unique_ptr<ParamAndGradBuffer> owned_;
  ParamAndGradBuffer* buffer_ = nullptr;
  comm::Communicator& dp_;
  DDPConfig cfg_;
  Stream comm_stream_;
  bool is_last_microbatch_ = true;
  std::vector<int> pending_;           // per bucket: parameters not yet ready
  std::vector<char> ready_;            // per parameter
  std::vector<char> launched_;         // per bucket
  std::vector<comm::WorkPtr> work_;    // per bucket (null: nothing to wait for)
  std::vector<Tensor> staging_;        // per bucket: bf16 copy of the bucket (BF16 reduction)
  std::vector<Tensor> shard_out_;      // per bucket: reduce-scatter output
  std::vector<BucketLaunch> launches_;
  ops::GemmSmMarginRequest gemm_margin_;  // held while overlapped reductions may run (gemm_sm_margin)
  double last_wait_s_ = 0;
  bool step_open_ = false;
};

}  // namespace megacore::optim
