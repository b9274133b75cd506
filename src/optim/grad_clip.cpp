#include "megacore/optim/grad_clip.hpp"

#include <cmath>
#include <unordered_map>

#include "megacore/core/error.hpp"
#include "megacore/ops/optimizer.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace megacore::optim {

using layers::Parameter;

GradNormGroups grad_norm_groups(const parallel::ProcessGrid& grid, bool grads_sharded_over_dp) {
  GradNormGroups g;
  g.tp_rank = grid.tp_rank();
  g.reduce.push_back(&grid.mp());
  if (grads_sharded_over_dp) g.reduce.push_back(&grid.dp_cp());
  return g;
}

GradNormResult global_grad_norm(const std::vector<Parameter*>& params, const GradNormGroups& groups) {
  MC_CHECK(groups.tp_rank >= 0, "global_grad_norm: tp_rank {} must be >= 0", groups.tp_rank);
  std::unordered_map<const void*, const Parameter*> seen;
  std::vector<Tensor> counted;
  // The device of the first parameter, also when this rank counts none (an NCCL group needs the sum
  // on the device).
  const Device device = params.empty() ? Device::cpu() : params.front()->main_grad.device();
  for (const Parameter* p : params) {
    MC_CHECK(p != nullptr, "global_grad_norm: a parameter pointer is null");
    MC_CHECK(p->main_grad.defined(), "global_grad_norm: parameter '{}' has no main_grad", p->name);
    auto [it, fresh] = seen.emplace(p->main_grad.data_ptr(), p);
    MC_CHECK(fresh,
             "global_grad_norm: '{}' and '{}' share one gradient and would be counted twice; list it once",
             it->second->name, p->name);
    if (p->partition_dim < 0 && groups.tp_rank != 0) continue;  // identical on every TP rank
    if (groups.skip && groups.skip(*p)) continue;
    MC_CHECK(p->main_grad.device() == device, "global_grad_norm: parameter '{}' is on another device than '{}'",
             p->name, params.front()->name);
    counted.push_back(p->main_grad.is_contiguous() ? p->main_grad : p->main_grad.contiguous());
  }
  // Sum of squares on the parameters' device, so an NCCL group can reduce it without a host round-trip.
  Tensor sq = Tensor::zeros({1}, DType::F32, device);
  if (!counted.empty()) {
    Tensor norm = Tensor::empty({1}, DType::F32, device);
    ops::multi_tensor_l2norm(counted, norm);
    ops::multi_tensor_scale({norm}, {sq}, 1.f, norm);  // norm² (the scale tensor is the norm itself)
  }
  for (comm::Communicator* c : groups.reduce) {
    MC_CHECK(c != nullptr, "global_grad_norm: a reduce group is null");
    if (c->size() > 1) c->all_reduce(sq, comm::ReduceOp::Sum)->wait();
  }
  GradNormResult r;
  const double total = sq.item();
  r.norm = std::sqrt(total);
  r.finite = std::isfinite(r.norm);
  return r;
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
