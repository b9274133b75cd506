#include "megacore/optim/distributed_data_parallel.hpp"

#include "megacore/core/error.hpp"
#include "megacore/ops/optimizer.hpp"

namespace megacore::optim {

using layers::Parameter;

DistributedDataParallel::DistributedDataParallel(std::vector<Parameter*> params, comm::Communicator& dp_cp,
                                                 const DDPConfig& cfg)
    : dp_(dp_cp), cfg_(cfg) {
  BufferConfig bc;
  bc.bucket_size = cfg.bucket_size;
  bc.dp_size = dp_cp.size();
  bc.param_align = cfg.param_align;
  bc.grad_dtype = cfg.grad_dtype;
  bc.separate = cfg.separate_params;
  owned_ = std::make_unique<ParamAndGradBuffer>(std::move(params), bc, cfg.shared_copies);
  buffer_ = owned_.get();
  init();
}

DistributedDataParallel::DistributedDataParallel(ParamAndGradBuffer& buffer, comm::Communicator& dp_cp,
                                                 const DDPConfig& cfg)
    : buffer_(&buffer), dp_(dp_cp), cfg_(cfg) {
  MC_CHECK(cfg.shared_copies.empty(),
           "DistributedDataParallel: shared_copies are registered when the buffer is built; pass them to the "
           "ParamAndGradBuffer constructor instead");
  init();
}

DistributedDataParallel::~DistributedDataParallel() {
  // Never leave a collective writing into freed buffers: wait quietly for whatever is in flight.
  for (auto& w : work_)
    if (w) try {
        w->wait();
      } catch (...) {
      }
}

void DistributedDataParallel::init() {
  const char* who = "DistributedDataParallel";
  MC_CHECK(cfg_.gemm_sm_margin >= 0, "{}: gemm_sm_margin must be >= 0 (SMs left to the reduction), got {}", who,
           cfg_.gemm_sm_margin);
  MC_CHECK(cfg_.average_size >= 0, "{}: average_size must be >= 1 (0 = the group's size), got {}", who,
           cfg_.average_size);
  MC_CHECK(cfg_.reduce_dtype == DType::F32 || cfg_.reduce_dtype == DType::BF16,
           "{}: reduce_dtype {} is not supported; use f32 or bf16", who, dtype_name(cfg_.reduce_dtype));
  const int n = dp_.size();
  if (cfg_.use_distributed_optimizer)
    for (const Bucket& b : buffer_->buckets())
      MC_CHECK(b.numel % n == 0,
               "{}: bucket {} has {} elements, which the data-parallel group of {} ranks does not divide, so it cannot "
               "be reduce-scattered; build the buffer with BufferConfig::dp_size = {} (or let DDP build it)",
               who, b.index, b.numel, n, n);
  const Device d = buffer_->device();
  if (d.is_cuda()) {
    comm_stream_ = Stream::create(d, /*non_blocking=*/true, cfg_.comm_stream_priority);
    if (cfg_.compute_stream.device() != d) cfg_.compute_stream = Stream::default_stream(d);
  } else {
    MC_CHECK(cfg_.compute_stream.device().is_cpu(), "{}: compute_stream is on {} but the parameters are on the CPU", who,
             cfg_.compute_stream.device().str());
  }
  const size_t nb = buffer_->buckets().size();
  pending_.assign(nb, 0);
  launched_.assign(nb, 0);
  work_.assign(nb, nullptr);
  staging_.assign(nb, Tensor());
  shard_out_.assign(nb, Tensor());
  ready_.assign(buffer_->parameters().size(), 0);
  for (const Bucket& b : buffer_->buckets()) pending_[size_t(b.index)] = int(b.params.size());
}

int64_t DistributedDataParallel::shard_size(int b) const {
  return buffer_->buckets().at(size_t(b)).numel / dp_.size();
}

void DistributedDataParallel::poll() {
  for (auto& w : work_)
    if (w) (void)w->is_completed();  // drives MPI progress; failures surface in wait()
}

void DistributedDataParallel::launch(int b, bool from_notify) {
  if (!step_open_) {
    launches_.clear();
    step_open_ = true;
  }
  launched_[size_t(b)] = 1;
  launches_.push_back({b, std::chrono::steady_clock::now(), from_notify});
  const int n = dp_.size();
  const int divisor = cfg_.average_size > 0 ? cfg_.average_size : n;
  if (n == 1) {
    if (cfg_.average && divisor != 1)
      ops::multi_tensor_scale({buffer_->bucket_grads(b)}, {buffer_->bucket_grads(b)}, 1.f / float(divisor), {},
                              cfg_.compute_stream);
    return;
  }
  const bool cuda = buffer_->device().is_cuda();
  if (cuda && from_notify && cfg_.gemm_sm_margin > 0 && !gemm_margin_.active())
    gemm_margin_ = ops::GemmSmMarginRequest(buffer_->device().index, cfg_.gemm_sm_margin);
  if (cuda) comm_stream_.wait(cfg_.compute_stream);
  Tensor src = buffer_->bucket_grads(b);
  comm::ReduceOp op = cfg_.average && divisor == n ? comm::ReduceOp::Avg : comm::ReduceOp::Sum;
  if (src.dtype() == DType::BF16) {
    // A bf16 grad buffer: scaled in place, then summed in bf16 (as the bf16 staging copy below is).
    if (cfg_.average) ops::multi_tensor_scale({src}, {src}, 1.f / float(divisor), {}, comm_stream_);
    op = comm::ReduceOp::Sum;
  } else if (cfg_.reduce_dtype == DType::BF16) {
    Tensor& st = staging_[size_t(b)];
    if (!st.defined()) st = Tensor::empty({src.numel()}, DType::BF16, src.device(), comm_stream_);
    ops::multi_tensor_scale({src}, {st}, cfg_.average ? 1.f / float(divisor) : 1.f, {}, comm_stream_);
    src = st;
    op = comm::ReduceOp::Sum;
  } else if (cfg_.average && divisor != n) {
    // Scaled before the sum (in place: this rank's unreduced gradients are not used after the reduction).
    ops::multi_tensor_scale({src}, {src}, 1.f / float(divisor), {}, comm_stream_);
  }
  if (cfg_.use_distributed_optimizer) {
    Tensor& out = shard_out_[size_t(b)];
    if (!out.defined()) out = Tensor::empty({shard_size(b)}, src.dtype(), src.device(), comm_stream_);
    work_[size_t(b)] = dp_.reduce_scatter(src, out, op, comm_stream_);
  } else {
    work_[size_t(b)] = dp_.all_reduce(src, op, comm_stream_);
  }
}

void DistributedDataParallel::notify_grad_ready(const std::vector<Parameter*>& params) {
  const bool active = is_last_microbatch_ && cfg_.overlap_grad_reduce;
  for (Parameter* p : params) {
    const size_t i = buffer_->index_of(p);  // ValueError when not registered
    if (!active) continue;
    const int b = buffer_->location(i).bucket;
    if (ready_[i]) {
      MC_CHECK(!launched_[size_t(b)],
               "DistributedDataParallel.notify_grad_ready: '{}' was notified again after its bucket's reduction "
               "started; its gradient changed after being reduced (notify each parameter once, when it is final)",
               p->name);
      continue;
    }
    ready_[i] = 1;
    if (--pending_[size_t(b)] == 0) launch(b, true);
  }
  poll();
}

std::function<void(const std::vector<Parameter*>&)> DistributedDataParallel::grad_ready_hook() {
  return [this](const std::vector<Parameter*>& ps) { notify_grad_ready(ps); };
}

void DistributedDataParallel::finish_grad_sync() {
  const auto t0 = std::chrono::steady_clock::now();
  gemm_margin_.release();  // backward is enqueued: no product is left to run beside the reduction
  const size_t nb = buffer_->buckets().size();
  for (size_t b = 0; b < nb; ++b)
    if (!launched_[b]) launch(int(b), false);
  // Stream-ordered: the reductions ran on comm_stream_, where the copies below and the compute stream's
  // wait follow them (MPI finishes them here, on the host).
  for (auto& w : work_)
    if (w) w->wait_on(comm_stream_);
  const int n = dp_.size();
  const bool cuda = buffer_->device().is_cuda();
  if (n > 1) {
    for (size_t b = 0; b < nb; ++b) {
      Tensor grads = buffer_->bucket_grads(int(b));
      if (cfg_.use_distributed_optimizer) {
        Tensor dst = grads.narrow(0, shard_begin(int(b)), shard_size(int(b)));
        ops::multi_tensor_scale({shard_out_[b]}, {dst}, 1.f, {}, comm_stream_);
      } else if (cfg_.reduce_dtype == DType::BF16 && grads.dtype() != DType::BF16) {
        ops::multi_tensor_scale({staging_[b]}, {grads}, 1.f, {}, comm_stream_);
      }
    }
    if (cuda) cfg_.compute_stream.wait(comm_stream_);
  }
  for (auto& w : work_) w = nullptr;
  launched_.assign(nb, 0);
  ready_.assign(ready_.size(), 0);
  for (const Bucket& b : buffer_->buckets()) pending_[size_t(b.index)] = int(b.params.size());
  step_open_ = false;
  last_wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void DistributedDataParallel::zero_grad() { buffer_->zero_grads(cfg_.compute_stream); }

}  // namespace megacore::optim
