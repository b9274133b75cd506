#include "megacore/optim/grad_clip.hpp"

#include <cmath>
#include <unordered_map>

#include "megacore/core/error.hpp"
#include "megacore/core/host_sync.hpp"
#include "megacore/ops/optimizer.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace megacore::optim {

using layers::Parameter;

GradNormGroups grad_norm_groups(const parallel::ProcessGrid& grid, bool grads_sharded_over_dp, bool experts) {
  GradNormGroups g;
  g.tp_rank = grid.tp_rank();
  g.reduce.push_back(&grid.mp());
  if (grads_sharded_over_dp) g.reduce.push_back(&grid.dp_cp());
  if (experts) {
    g.expert_tp_rank = grid.layout().expert_tp_rank(grid.rank());
    g.expert_reduce.push_back(&grid.group(parallel::GroupKind::TpEpPp));
    if (grads_sharded_over_dp) g.expert_reduce.push_back(&grid.expert_dp());
  }
  return g;
}

bool counts_in_grad_norm(const Parameter& p, const GradNormGroups& groups) {
  if (p.partition_dim < 0 && (p.expert ? groups.expert_tp_rank : groups.tp_rank) != 0) return false;  // a copy
  return !(groups.skip && groups.skip(p));
}

namespace {

// Σ‖t‖² of the tensors as a [1] f32 tensor on `device` (0 when there are none).
Tensor sum_of_squares(const std::vector<Tensor>& ts, Device device, const Stream& s) {
  Tensor sq = Tensor::zeros({1}, DType::F32, device, s);
  if (ts.empty()) return sq;
  Tensor norm = Tensor::empty({1}, DType::F32, device, s);
  ops::multi_tensor_l2norm(ts, norm, s);
  ops::multi_tensor_scale({norm}, {sq}, 1.f, norm, s);  // norm² (the scale tensor is the norm itself)
  return sq;
}

void all_reduce_over(Tensor& sq, const std::vector<comm::Communicator*>& groups, const Stream& s, const char* who) {
  for (comm::Communicator* c : groups) {
    MC_CHECK(c != nullptr, "{}: a reduce group is null", who);
    if (c->size() > 1) c->all_reduce(sq, comm::ReduceOp::Sum, s)->wait_on(s);
  }
}

}  // namespace

GradNormResult combine_grad_norm(const std::vector<Tensor>& dense, const std::vector<Tensor>& expert,
                                 const GradNormGroups& groups, Device device, const Stream& s, const char* who,
                                 const std::vector<Tensor>& read_along) {
  const bool apart = !groups.expert_reduce.empty();
  // Without expert groups the expert part can only be right where nothing is reduced (one process).
  MC_CHECK(apart || expert.empty() || groups.reduce.empty(),
           "{}: expert parameters are present but GradNormGroups has no expert_reduce groups, so their norm would be "
           "summed over the dense groups (wrong under EP, expert-TP or expert-DP); build the groups with "
           "grad_norm_groups(grid, sharded, /*experts=*/true) on every rank",
           who);
  std::vector<Tensor> together = dense;
  if (!apart) together.insert(together.end(), expert.begin(), expert.end());
  Tensor sq = sum_of_squares(together, device, s);
  all_reduce_over(sq, groups.reduce, s, who);
  // [dense Σ‖g‖², expert Σ‖g‖², read_along...] packed on the device and read back at once.
  const int64_t n = 2 + int64_t(read_along.size());
  Tensor pack = Tensor::zeros({n}, DType::F32, device, s);
  pack.narrow(0, 0, 1).copy_(sq, s);
  if (apart) {
    Tensor esq = sum_of_squares(expert, device, s);
    all_reduce_over(esq, groups.expert_reduce, s, who);
    pack.narrow(0, 1, 1).copy_(esq, s);
  }
  for (size_t i = 0; i < read_along.size(); ++i) {
    const Tensor& t = read_along[i];
    MC_CHECK(t.defined() && t.numel() == 1 && t.device() == device,
             "{}: read_along tensor {} must be one element on {}", who, i, device.str());
    pack.narrow(0, 2 + int64_t(i), 1).copy_(t.view({1}), s);
  }
  const std::vector<double> h = read_to_host(pack, s, "grad_norm").to_double_vector();
  const double total = h[0] + h[1];
  GradNormResult r;
  r.values.assign(h.begin() + 2, h.end());
  r.norm = std::sqrt(total);
  r.finite = std::isfinite(r.norm);
  return r;
}

void counted_grads(const std::vector<Parameter*>& params, const GradNormGroups& groups, std::vector<Tensor>& dense,
                   std::vector<Tensor>& expert) {
  MC_CHECK(groups.tp_rank >= 0 && groups.expert_tp_rank >= 0, "global_grad_norm: tp_rank {} and expert_tp_rank {} "
           "must be >= 0", groups.tp_rank, groups.expert_tp_rank);
  std::unordered_map<const void*, const Parameter*> seen;
  for (const Parameter* p : params) {
    MC_CHECK(p != nullptr, "global_grad_norm: a parameter pointer is null");
    MC_CHECK(p->main_grad.defined(), "global_grad_norm: parameter '{}' has no main_grad", p->name);
    auto [it, fresh] = seen.emplace(p->main_grad.data_ptr(), p);
    MC_CHECK(fresh,
             "global_grad_norm: '{}' and '{}' share one gradient and would be counted twice; list it once",
             it->second->name, p->name);
    if (!counts_in_grad_norm(*p, groups)) continue;
    MC_CHECK(p->main_grad.device() == params.front()->main_grad.device(),
             "global_grad_norm: parameter '{}' is on another device than '{}'", p->name, params.front()->name);
    (p->expert ? expert : dense).push_back(p->main_grad.is_contiguous() ? p->main_grad : p->main_grad.contiguous());
  }
}

GradNormResult global_grad_norm(const std::vector<Parameter*>& params, const GradNormGroups& groups) {
  std::vector<Tensor> dense, expert;
  counted_grads(params, groups, dense, expert);
  // Sums of squares on the parameters' device (also when this rank counts none), so an NCCL group can reduce
  // them without a host round-trip.
  const Device device = params.empty() ? Device::cpu() : params.front()->main_grad.device();
  return combine_grad_norm(dense, expert, groups, device, Stream(), "global_grad_norm");
}

GradNormResult clip_grad_norm(const std::vector<Parameter*>& params, double max_norm, const GradNormGroups& groups) {
  GradNormResult r = global_grad_norm(params, groups);
  if (!r.finite || max_norm <= 0) return r;
  r.clip_coef = std::min(1.0, max_norm / (r.norm + 1e-6));
  if (r.clip_coef < 1.0) {
    std::vector<Tensor> grads;
    for (Parameter* p : params) grads.push_back(p->main_grad);
    ops::multi_tensor_scale(grads, grads, float(r.clip_coef));
  }
  return r;
}

}  // namespace megacore::optim
