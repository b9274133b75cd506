#include "megacore/optim/distributed_optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include "megacore/core/error.hpp"
#include "megacore/ops/optimizer.hpp"

namespace megacore::optim {

using layers::Parameter;

DistributedOptimizer::DistributedOptimizer(DistributedDataParallel& ddp, const AdamWConfig& cfg,
                                           bool overlap_param_gather)
    : DistributedOptimizer(std::vector<DistributedDataParallel*>{&ddp}, cfg, overlap_param_gather) {}

DistributedOptimizer::DistributedOptimizer(std::vector<DistributedDataParallel*> ddps, const AdamWConfig& cfg,
                                           bool overlap_param_gather)
    : ddps_(std::move(ddps)), cfg_(cfg), overlap_param_gather_(overlap_param_gather) {
  const char* who = "DistributedOptimizer";
  MC_CHECK(!ddps_.empty(), "{}: no DistributedDataParallel given; pass at least the dense one", who);
  for (const DistributedDataParallel* d : ddps_) {
    MC_CHECK(d != nullptr, "{}: a DistributedDataParallel pointer is null", who);
    MC_CHECK(d->config().use_distributed_optimizer,
             "{}: the DistributedDataParallel over '{}' was built with use_distributed_optimizer = false (all-reduce); "
             "set it to true so gradients are reduce-scattered to the ranks that own them",
             who, d->group().name());
    MC_CHECK(d->buffer().device() == ddps_.front()->buffer().device(),
             "{}: the DDPs hold parameters on {} and {}; put every parameter on one device", who,
             ddps_.front()->buffer().device().str(), d->buffer().device().str());
  }
  MC_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1, "{}: betas ({}, {}) must lie in [0, 1)",
           who, cfg.beta1, cfg.beta2);
  MC_CHECK(cfg.eps > 0, "{}: eps = {} must be > 0 (1e-8 is usual)", who, cfg.eps);
  MC_CHECK(cfg.weight_decay >= 0, "{}: weight_decay = {} must be >= 0", who, cfg.weight_decay);
  check_state_dtypes(cfg, who);
  for (size_t k = 0; k < ddps_.size(); ++k) {
    const ParamAndGradBuffer& buf = ddps_[k]->buffer();
    param_base_.push_back(params_.size());
    const std::vector<Parameter*>& ps = buf.parameters();
    const bool expert = !ps.empty() && ps.front()->expert;
    for (const Parameter* p : ps) {
      MC_CHECK(p->expert == expert,
               "{}: the DDP over '{}' holds the {} parameter '{}' and the {} parameter '{}'; dense and expert parameters "
               "are reduced over different groups, so give each its own DDP (split_expert_parameters)",
               who, ddps_[k]->group().name(), expert ? "expert" : "dense", ps.front()->name,
               p->expert ? "expert" : "dense", p->name);
      MC_CHECK(separate_masters() || p->data.dtype() != DType::F16,
               "{}: parameter '{}' is f16, which needs f32 master weights (its range is too small to take the updates "
               "in place); set optim.main_params_dtype = f32 or train in bf16",
               who, p->name);
      for (size_t j = 0; j < k; ++j)
        MC_CHECK(!ddps_[j]->buffer().contains(p), "{}: parameter '{}' is held by two of the DDPs; register it once",
                 who, p->name);
    }
    expert_ddp_.push_back(expert);
    params_.insert(params_.end(), ps.begin(), ps.end());
  }
  for (const Parameter* p : params_) decay_.push_back(!(cfg.no_decay ? cfg.no_decay(*p) : default_no_decay(*p)));
  for (size_t k = 0; k < ddps_.size(); ++k) {
    const DistributedDataParallel& ddp = *ddps_[k];
    const ParamAndGradBuffer& buf = ddp.buffer();
    for (const Bucket& b : buf.buckets()) {
      const size_t slot = slots_.size();
      slots_.push_back({k, b.index});
      const int64_t shard = ddp.shard_size(b.index);
      const int64_t rs = b.offset + ddp.shard_begin(b.index), re = rs + shard;
      for (size_t i : b.params) {
        const ParamLocation& l = buf.location(i);
        const int64_t s = std::max(rs, l.offset), e = std::min(re, l.offset + l.numel);
        if (s < e) segments_.push_back({param_base_[k] + i, k, slot, s - rs, s - l.offset, e - s, s});
      }
      // Masters start as this rank's range of the parameters (padding: zeros), or are that range itself.
      Tensor range = buf.bucket_params(b.index).narrow(0, ddp.shard_begin(b.index), shard);
      if (separate_masters()) {
        Tensor m = Tensor::empty({shard}, DType::F32, buf.device());
        m.copy_(range);
        master_.push_back(m);
      } else {
        master_.push_back(range);
      }
      exp_avg_.push_back(Tensor::zeros({shard}, cfg.exp_avg_dtype, buf.device()));
      exp_avg_sq_.push_back(Tensor::zeros({shard}, cfg.exp_avg_sq_dtype, buf.device()));
    }
  }
  gather_.assign(slots_.size(), nullptr);
  if (ddps_.front()->buffer().device().is_cuda()) synchronize_device(ddps_.front()->buffer().device());
}

Tensor DistributedOptimizer::grad_of(const Segment& s) const {
  const ParamAndGradBuffer& buf = buffer_of(s);
  return buf.grad_buffer(buf.location(s.param - param_base_[s.ddp]).group).narrow(0, s.buf_off, s.len);
}

DistributedOptimizer::~DistributedOptimizer() {
  for (auto& w : gather_)
    if (w) try {
        w->wait();
      } catch (...) {
      }
}

void DistributedOptimizer::step(float lr, float grad_scale, const Tensor& grad_scale_tensor) {
  order_param_gather();
  gather_deferred();
  ++step_;
  struct Group {
    std::vector<Tensor> g, w, m, v, out;
  };
  std::map<std::pair<bool, int>, Group> groups;
  for (const Segment& s : segments_) {
    const ParamAndGradBuffer& buf = buffer_of(s);
    const ParamLocation& l = buf.location(s.param - param_base_[s.ddp]);
    Group& gr = groups[{decay_[s.param], int(buf.group_dtype(l.group))}];
    gr.g.push_back(grad_of(s));
    gr.w.push_back(master_[s.slot].narrow(0, s.shard_off, s.len));
    gr.m.push_back(exp_avg_[s.slot].narrow(0, s.shard_off, s.len));
    gr.v.push_back(exp_avg_sq_[s.slot].narrow(0, s.shard_off, s.len));
    if (separate_masters()) gr.out.push_back(buf.param_buffer(l.group).narrow(0, s.buf_off, s.len));
  }
  const Stream& cs = compute_stream();
  for (auto& [key, gr] : groups)
    ops::multi_tensor_adamw(gr.g, gr.w, gr.m, gr.v, gr.out, adamw_hyper(cfg_, lr, key.first, step_, grad_scale),
                            grad_scale_tensor, cs);
  start_param_gather(defer_separate_);
  if (!overlap_param_gather_) order_param_gather();
}

void DistributedOptimizer::set_deferred_gather(bool on) {
  MC_CHECK(!on || separate_masters(),
           "DistributedOptimizer: deferred gathers need f32 master weights (this rank's range of the param buffer is "
           "rewritten by whoever gathers the deferred buckets); set optim.main_params_dtype = f32");
  if (!on) gather_deferred();
  defer_separate_ = on;
}

std::vector<DistributedOptimizer::DeferredBucket> DistributedOptimizer::take_deferred_gather() {
  std::vector<DeferredBucket> out;
  for (size_t slot : deferred_) out.push_back({ddps_[slots_[slot].ddp], slots_[slot].bucket});
  deferred_.clear();
  return out;
}

void DistributedOptimizer::gather_deferred() {
  if (deferred_.empty()) return;
  const Stream& cs = compute_stream();
  for (size_t slot : deferred_) {
    const DistributedDataParallel& ddp = *ddps_[slots_[slot].ddp];
    const int b = slots_[slot].bucket;
    Tensor full = ddp.buffer().bucket_params(b);
    Tensor mine = full.narrow(0, ddp.shard_begin(b), ddp.shard_size(b));
    if (full.device().is_cuda()) ddp.comm_stream().wait(cs);
    ddp.group().all_gather(mine, full, ddp.comm_stream())->wait_on(cs);
  }
  deferred_.clear();
}

void DistributedOptimizer::order_param_gather() {
  for (auto& w : gather_)
    if (w) {
      w->wait_on(compute_stream());
      w = nullptr;
    }
  gemm_margin_.release();
}

void DistributedOptimizer::start_param_gather(bool defer) {
  const DistributedDataParallel& first = *ddps_.front();
  const bool cuda = first.buffer().device().is_cuda();
  // Buckets are laid out in backward order, so the first layers' parameters sit in the last bucket.
  // The gathers run one after another on the communication stream: start them in forward order, so the
  // forward's first layers wait only for their own gather, not for all of them.
  for (size_t slot = slots_.size(); slot-- > 0;) {
    const DistributedDataParallel& ddp = *ddps_[slots_[slot].ddp];
    comm::Communicator& dp = ddp.group();
    if (dp.size() == 1) continue;
    if (cuda) ddp.comm_stream().wait(first.config().compute_stream);
    if (cuda && overlap_param_gather_ && first.config().gemm_sm_margin > 0 && !gemm_margin_.active())
      gemm_margin_ = ops::GemmSmMarginRequest(first.buffer().device().index, first.config().gemm_sm_margin);
    const int b = slots_[slot].bucket;
    if (defer && ddp.buffer().buckets()[size_t(b)].separate) {
      deferred_.push_back(slot);
      continue;
    }
    Tensor full = ddp.buffer().bucket_params(b);
    Tensor mine = full.narrow(0, ddp.shard_begin(b), ddp.shard_size(b));
    gather_[slot] = dp.all_gather(mine, full, ddp.comm_stream());
  }
}

void DistributedOptimizer::wait_param_gather(const std::vector<Parameter*>& params) {
  const Stream& cs = compute_stream();
  for (const Parameter* p : params) {
    size_t k = 0;
    while (k + 1 < ddps_.size() && !ddps_[k]->buffer().contains(p)) ++k;
    const int bucket = ddps_[k]->buffer().location(p).bucket;  // ValueError when no DDP holds it
    size_t slot = 0;
    while (slots_[slot].ddp != k || slots_[slot].bucket != bucket) ++slot;
    comm::WorkPtr& w = gather_[slot];
    if (w) {
      w->wait_on(cs);
      w = nullptr;
    }
  }
  if (gemm_margin_.active() && !param_gather_pending()) gemm_margin_.release();
}

void DistributedOptimizer::finish_param_gather() {
  gather_deferred();
  for (auto& w : gather_)
    if (w) {
      w->wait();
      w = nullptr;
    }
  gemm_margin_.release();
}

bool DistributedOptimizer::param_gather_pending() const {
  return std::any_of(gather_.begin(), gather_.end(), [](const comm::WorkPtr& w) { return w != nullptr; });
}

int64_t DistributedOptimizer::shard_numel() const {
  int64_t n = 0;
  for (const Tensor& m : master_) n += m.numel();
  return n;
}

int64_t DistributedOptimizer::state_bytes() const {
  int64_t n = 0;
  for (size_t slot = 0; slot < slots_.size(); ++slot) {
    if (separate_masters()) n += master_[slot].nbytes();
    n += exp_avg_[slot].nbytes() + exp_avg_sq_[slot].nbytes();
  }
  return n;
}

DType DistributedOptimizer::master_dtype(size_t i) const {
  return separate_masters() ? DType::F32 : params_.at(i)->data.dtype();
}

GradNormResult DistributedOptimizer::grad_norm(const GradNormGroups& groups) const {
  std::vector<Tensor> dense, expert;
  counted_grads(groups, dense, expert);
  return combine_grad_norm(dense, expert, groups, ddps_.front()->buffer().device(), compute_stream(),
                           "DistributedOptimizer.grad_norm");
}

void DistributedOptimizer::counted_grads(const GradNormGroups& groups, std::vector<Tensor>& dense,
                                         std::vector<Tensor>& expert) const {
  const char* who = "DistributedOptimizer.grad_norm";
  MC_CHECK(groups.tp_rank >= 0 && groups.expert_tp_rank >= 0, "{}: tp_rank {} and expert_tp_rank {} must be >= 0", who,
           groups.tp_rank, groups.expert_tp_rank);
  for (size_t k = 0; k < ddps_.size(); ++k)
    MC_CHECK(!expert_ddp_[k] || !groups.expert_reduce.empty() || groups.reduce.empty(),
             "{}: the DDP over '{}' holds expert parameters but GradNormGroups has no expert_reduce groups, so their "
             "norm would be summed over the dense groups; build the groups with grad_norm_groups(grid, "
             "/*grads_sharded_over_dp=*/true, /*experts=*/true) on every rank",
             who, ddps_[k]->group().name());
  for (size_t k = 0; k < ddps_.size(); ++k) {
    comm::Communicator& dp = ddps_[k]->group();
    // Expert gradients are summed over expert_reduce when given, else with the dense ones.
    const bool expert = expert_ddp_[k] && !groups.expert_reduce.empty();
    const std::vector<comm::Communicator*>& reduce = expert ? groups.expert_reduce : groups.reduce;
    if (dp.size() > 1)
      MC_CHECK(std::find(reduce.begin(), reduce.end(), &dp) != reduce.end(),
               "{}: gradients are sharded over the {}data-parallel group '{}', but it is not among the {} groups, so "
               "each rank would see only its shard's norm; use grad_norm_groups(grid, /*grads_sharded_over_dp=*/true{}) "
               "with the same group DDP was built on",
               who, expert ? "expert-" : "", dp.name(), expert ? "expert_reduce" : "reduce",
               expert ? ", /*experts=*/true" : "");
  }
  for (const Segment& s : segments_) {
    const Parameter& p = *params_[s.param];
    if (!counts_in_grad_norm(p, groups)) continue;
    (expert_ddp_[s.ddp] ? expert : dense).push_back(grad_of(s));
  }
}

GradNormResult DistributedOptimizer::clip_grad_norm(double max_norm, const GradNormGroups& groups) {
  GradNormResult r = grad_norm(groups);
  if (!r.finite || max_norm <= 0) return r;
  r.clip_coef = std::min(1.0, max_norm / (r.norm + 1e-6));
  if (r.clip_coef < 1.0) {
    std::vector<Tensor> grads;
    for (const Segment& s : segments_) grads.push_back(grad_of(s));
    ops::multi_tensor_scale(grads, grads, float(r.clip_coef), {}, compute_stream());
  }
  return r;
}

// ---- state ------------------------------------------------------------------------------------

// Per DDP: group size and rank, its buckets and its parameters' places (the first DDP's group first, so
// the message for another DP layout can name it).
std::vector<int64_t> DistributedOptimizer::layout() const {
  std::vector<int64_t> l;
  for (const DistributedDataParallel* d : ddps_) {
    const ParamAndGradBuffer& buf = d->buffer();
    l.push_back(d->group().size());
    l.push_back(d->group().rank());
    l.push_back(int64_t(buf.buckets().size()));
    for (const Bucket& b : buf.buckets()) {
      l.push_back(b.group);
      l.push_back(b.offset);
      l.push_back(b.numel);
    }
    l.push_back(int64_t(buf.parameters().size()));
    for (size_t i = 0; i < buf.parameters().size(); ++i) {
      l.push_back(buf.location(i).offset);
      l.push_back(buf.location(i).numel);
    }
  }
  return l;
}

std::vector<NamedTensor> DistributedOptimizer::state() const {
  std::vector<NamedTensor> out;
  const std::vector<int64_t> l = layout();
  out.push_back({"layout", Tensor::from_vector<int64_t>(l, {int64_t(l.size())})});
  for (size_t b = 0; b < master_.size(); ++b) {
    const std::string n = "bucket" + std::to_string(b);
    out.push_back({n + ".master", master_[b]});
    out.push_back({n + ".exp_avg", exp_avg_[b]});
    out.push_back({n + ".exp_avg_sq", exp_avg_sq_[b]});
  }
  return out;
}

void DistributedOptimizer::load_state(const std::vector<NamedTensor>& st, int64_t step_count) {
  const char* who = "DistributedOptimizer.load_state";
  MC_CHECK(step_count >= 0, "{}: step count {} must be >= 0", who, step_count);
  MC_CHECK(!st.empty() && st[0].name == "layout" && st[0].tensor.dtype() == DType::I64,
           "{}: the state does not start with its 'layout' record; pass what DistributedOptimizer::state() returned "
           "(for per-parameter tensors use load_gathered_state)",
           who);
  const std::vector<int64_t> mine = layout();
  std::vector<int64_t> theirs;
  for (double v : st[0].tensor.to_double_vector()) theirs.push_back(int64_t(v));
  MC_CHECK(theirs.size() >= 2 && theirs[0] == mine[0] && theirs[1] == mine[1],
           "{}: the state was saved by DP rank {} of {}, but this optimizer is DP rank {} of {}; sharded state only "
           "loads into the same layout — save gathered_state() and load it with load_gathered_state() to reshard",
           who, theirs.size() >= 2 ? theirs[1] : -1, theirs.size() >= 2 ? theirs[0] : -1, mine[1], mine[0]);
  MC_CHECK(theirs == mine,
           "{}: the state's bucket layout differs from this optimizer's (another bucket size, parameter list, "
           "alignment or expert-DP layout); build DDP with the same config, or go through "
           "gathered_state()/load_gathered_state()",
           who);
  const std::vector<NamedTensor> cur = state();
  MC_CHECK(st.size() == cur.size(), "{}: got {} entries, expected {}", who, st.size(), cur.size());
  for (size_t i = 1; i < st.size(); ++i) {
    MC_CHECK(st[i].name == cur[i].name, "{}: entry {} is '{}', expected '{}'", who, i, st[i].name, cur[i].name);
    MC_CHECK(st[i].tensor.numel() == cur[i].tensor.numel(), "{}: '{}' has {} elements, expected {}", who, st[i].name,
             st[i].tensor.numel(), cur[i].tensor.numel());
  }
  finish_param_gather();
  for (size_t i = 1; i < st.size(); ++i) {
    Tensor dst = cur[i].tensor;
    dst.copy_(st[i].tensor.contiguous().view({-1}));
  }
  step_ = step_count;
  write_masters_to_params();
}

std::vector<NamedTensor> DistributedOptimizer::gathered_state() const {
  // Full per-bucket copies of each kind, then per-parameter views cloned out.
  std::vector<std::vector<Tensor>> full(3);
  const std::vector<Tensor>* kinds[3] = {&master_, &exp_avg_, &exp_avg_sq_};
  const Stream& cs = compute_stream();
  for (int k = 0; k < 3; ++k)
    for (size_t slot = 0; slot < slots_.size(); ++slot) {
      const DistributedDataParallel& ddp = *ddps_[slots_[slot].ddp];
      comm::Communicator& dp = ddp.group();
      const Tensor& shard = (*kinds[k])[slot];
      Tensor f = Tensor::empty({ddp.buffer().buckets()[size_t(slots_[slot].bucket)].numel}, shard.dtype(),
                               ddp.buffer().device(), cs);
      if (dp.size() == 1) f.copy_(shard, cs);
      else dp.all_gather(shard, f, cs)->wait();
      full[size_t(k)].push_back(f);
    }
  static const char* suffix[3] = {".master", ".exp_avg", ".exp_avg_sq"};
  std::vector<NamedTensor> out;
  size_t slot_base = 0;
  for (size_t d = 0; d < ddps_.size(); ++d) {
    const ParamAndGradBuffer& buf = ddps_[d]->buffer();
    for (size_t i = 0; i < buf.parameters().size(); ++i) {
      const Parameter& p = *buf.parameters()[i];
      const ParamLocation& l = buf.location(i);
      const Bucket& b = buf.buckets()[size_t(l.bucket)];
      const Tensor* f[3] = {&full[0][slot_base + size_t(l.bucket)], &full[1][slot_base + size_t(l.bucket)],
                            &full[2][slot_base + size_t(l.bucket)]};
      for (int k = 0; k < 3; ++k)
        out.push_back({p.name + suffix[k], f[k]->narrow(0, l.offset - b.offset, l.numel).view(p.data.shape()).clone(cs)});
    }
    slot_base += buf.buckets().size();
  }
  return out;
}

void DistributedOptimizer::load_gathered_state(const std::vector<NamedTensor>& st, int64_t step_count) {
  const char* who = "DistributedOptimizer.load_gathered_state";
  MC_CHECK(step_count >= 0, "{}: step count {} must be >= 0", who, step_count);
  const size_t np = params_.size();
  MC_CHECK(st.size() == 3 * np,
           "{}: got {} state tensors, expected {} (master, exp_avg, exp_avg_sq for each of {} parameters); the state is "
           "from a different optimizer or parameter list",
           who, st.size(), 3 * np, np);
  static const char* suffix[3] = {".master", ".exp_avg", ".exp_avg_sq"};
  // Check everything before changing anything.
  for (size_t i = 0; i < np; ++i) {
    const Parameter& p = *params_[i];
    for (int k = 0; k < 3; ++k) {
      const NamedTensor& t = st[3 * i + size_t(k)];
      MC_CHECK(t.name == p.name + suffix[k], "{}: entry {} is '{}', expected '{}'", who, 3 * i + size_t(k), t.name,
               p.name + suffix[k]);
      MC_CHECK(t.tensor.defined() && t.tensor.shape() == p.data.shape(),
               "{}: '{}' has shape {}, but the parameter is {} on this rank (a different TP layout? reshard the "
               "checkpoint for this layout)",
               who, t.name, t.tensor.defined() ? shape_str(t.tensor.shape()) : std::string("undefined"),
               shape_str(p.data.shape()));
    }
  }
  finish_param_gather();
  const std::vector<Tensor>* kinds[3] = {&master_, &exp_avg_, &exp_avg_sq_};
  for (const Segment& s : segments_)
    for (int k = 0; k < 3; ++k) {
      Tensor dst = (*kinds[k])[s.slot].narrow(0, s.shard_off, s.len);
      dst.copy_(st[3 * s.param + size_t(k)].tensor.contiguous().view({-1}).narrow(0, s.param_off, s.len));
    }
  step_ = step_count;
  write_masters_to_params();
}

std::vector<DistributedOptimizer::OwnedRange> DistributedOptimizer::owned_ranges() const {
  std::vector<OwnedRange> out;
  out.reserve(segments_.size());
  for (const Segment& s : segments_) {
    const size_t b = s.slot;
    out.push_back({s.param, s.param_off, s.len, master_[b].narrow(0, s.shard_off, s.len),
                   exp_avg_[b].narrow(0, s.shard_off, s.len), exp_avg_sq_[b].narrow(0, s.shard_off, s.len)});
  }
  std::stable_sort(out.begin(), out.end(), [](const OwnedRange& a, const OwnedRange& b) {
    return a.param != b.param ? a.param < b.param : a.param_offset < b.param_offset;
  });
  return out;
}

void DistributedOptimizer::finish_load(int64_t step_count) {
  MC_CHECK(step_count >= 0, "DistributedOptimizer.finish_load: step count {} must be >= 0", step_count);
  finish_param_gather();
  step_ = step_count;
  write_masters_to_params();
}

void DistributedOptimizer::write_masters_to_params() {
  const Device dev = ddps_.front()->buffer().device();
  // The state was copied in on the legacy default stream (loads are rare: a full sync is fine).
  if (dev.is_cuda()) synchronize_device(dev);
  for (const Segment& s : segments_) {
    if (!separate_masters()) break;  // the masters are the param buffer's own ranges
    const ParamAndGradBuffer& buf = buffer_of(s);
    Tensor dst = buf.param_buffer(buf.location(s.param - param_base_[s.ddp]).group).narrow(0, s.buf_off, s.len);
    dst.copy_(master_[s.slot].narrow(0, s.shard_off, s.len), compute_stream());
  }
  start_param_gather();
  finish_param_gather();
}

ExpertSplit split_expert_parameters(const std::vector<Parameter*>& params) {
  ExpertSplit out;
  for (Parameter* p : params) {
    MC_CHECK(p != nullptr, "split_expert_parameters: a parameter pointer is null");
    (p->expert ? out.expert : out.dense).push_back(p);
  }
  return out;
}

std::function<void(const std::vector<Parameter*>&)> grad_ready_hook(std::vector<DistributedDataParallel*> ddps) {
  MC_CHECK(!ddps.empty(), "grad_ready_hook: no DistributedDataParallel given");
  return [ddps](const std::vector<Parameter*>& ps) {
    std::vector<std::vector<Parameter*>> per(ddps.size());
    for (Parameter* p : ps) {
      size_t k = 0;
      while (k + 1 < ddps.size() && !ddps[k]->buffer().contains(p)) ++k;
      per[k].push_back(p);  // the last DDP reports one that none holds (ValueError naming it)
    }
    for (size_t k = 0; k < ddps.size(); ++k)
      if (!per[k].empty()) ddps[k]->notify_grad_ready(per[k]);
  };
}

}  // namespace megacore::optim
