#include "megacore/optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include "megacore/core/error.hpp"
#include "megacore/ops/optimizer.hpp"

namespace megacore::optim {

ops::AdamWHyper adamw_hyper(const AdamWConfig& cfg, float lr, bool decay, int64_t step, float grad_scale) {
  ops::AdamWHyper h;
  h.lr = lr;
  h.beta1 = cfg.beta1;
  h.beta2 = cfg.beta2;
  h.eps = cfg.eps;
  h.weight_decay = decay ? cfg.weight_decay : 0.f;
  h.step = step;
  h.grad_scale = grad_scale;
  return h;
}

using layers::Parameter;

bool default_no_decay(const Parameter& p) {
  return p.data.dim() == 1 || p.name.find("norm") != std::string::npos || p.name.find("bias") != std::string::npos;
}

namespace {

// An f32 copy that never shares storage with the parameter, also when the parameter is f32.
Tensor f32_copy(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), DType::F32, t.device());
  out.copy_(t);
  return out;
}

}  // namespace

void check_state_dtypes(const AdamWConfig& cfg, const char* who) {
  for (const auto& [name, dt] : {std::pair{"main_params_dtype", cfg.main_params_dtype},
                                 std::pair{"exp_avg_dtype", cfg.exp_avg_dtype},
                                 std::pair{"exp_avg_sq_dtype", cfg.exp_avg_sq_dtype}})
    MC_CHECK(dt == DType::F32 || dt == DType::BF16, "{}: {} is {}; use f32 or bf16", who, name, dtype_name(dt));
}

Optimizer::Optimizer(std::vector<Parameter*> params, bool separate_masters)
    : params_(std::move(params)), separate_masters_(separate_masters) {
  std::unordered_map<const Parameter*, size_t> seen;
  std::unordered_map<const void*, size_t> seen_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter* p = params_[i];
    MC_CHECK(p != nullptr, "optimizer: parameter {} is null", i);
    auto [it, fresh] = seen.emplace(p, i);
    MC_CHECK(fresh, "optimizer: parameter '{}' is listed twice (positions {} and {}); list each parameter once",
             p->name, it->second, i);
    MC_CHECK(p->data.defined() && p->data.is_contiguous(),
             "optimizer: parameter '{}' needs a defined, contiguous data tensor", p->name);
    MC_CHECK(p->main_grad.defined() && (p->main_grad.dtype() == DType::F32 || p->main_grad.dtype() == DType::BF16) &&
                 p->main_grad.is_contiguous() && p->main_grad.shape() == p->data.shape() &&
                 p->main_grad.device() == p->data.device(),
             "optimizer: parameter '{}' needs a contiguous f32 main_grad (or bf16: bf16 main grads) of its data's "
             "shape and device",
             p->name);
    MC_CHECK(separate_masters_ || p->data.dtype() != DType::F16,
             "optimizer: parameter '{}' is f16, which needs f32 master weights (its range is too small to take the "
             "updates in place); set optim.main_params_dtype = f32 or train in bf16",
             p->name);
    auto [git, gfresh] = seen_grad.emplace(p->main_grad.data_ptr(), i);
    MC_CHECK(gfresh,
             "optimizer: parameters '{}' and '{}' share one main_grad (a tied weight?); list the shared weight once",
             params_[git->second]->name, p->name);
    master_.push_back(separate_masters_ ? f32_copy(p->data) : p->data);
  }
}

int64_t Optimizer::state_bytes() const {
  int64_t n = 0;
  for (const NamedTensor& t : state()) {
    const bool is_param = std::any_of(params_.begin(), params_.end(), [&](const Parameter* p) {
      return p->data.data_ptr() == t.tensor.data_ptr();
    });
    if (!is_param) n += t.tensor.nbytes();
  }
  return n;
}

void Optimizer::init_decay(const NoDecayRule& rule) {
  decay_.clear();
  for (const Parameter* p : params_) decay_.push_back(!(rule ? rule(*p) : default_no_decay(*p)));
}

void Optimizer::zero_grad() {
  for (Parameter* p : params_) p->main_grad.zero_();
}

void Optimizer::write_back() {
  if (!separate_masters_) return;  // the masters are the parameters
  for (size_t i = 0; i < params_.size(); ++i) params_[i]->data.copy_(master_[i]);
}

void Optimizer::load_state(const std::vector<NamedTensor>& st, int64_t step_count) {
  MC_CHECK(step_count >= 0, "optimizer load_state: step count {} must be >= 0", step_count);
  const std::vector<NamedTensor> mine = state();
  MC_CHECK(st.size() == mine.size(),
           "optimizer load_state: got {} state tensors, this optimizer has {}; the state is from a different "
           "optimizer or parameter list",
           st.size(), mine.size());
  // Check everything before changing anything, so a bad state leaves the optimizer as it was.
  for (size_t i = 0; i < st.size(); ++i) {
    MC_CHECK(st[i].name == mine[i].name, "optimizer load_state: entry {} is '{}', expected '{}'", i, st[i].name,
             mine[i].name);
    MC_CHECK(st[i].tensor.shape() == mine[i].tensor.shape(),
             "optimizer load_state: '{}' has shape {}, expected {} (a different parallel layout?)", st[i].name,
             shape_str(st[i].tensor.shape()), shape_str(mine[i].tensor.shape()));
  }
  for (size_t i = 0; i < st.size(); ++i) {
    Tensor dst = mine[i].tensor;  // a view of the live state
    dst.copy_(st[i].tensor);
  }
  step_ = step_count;
  write_back();
}

// ---- AdamW ------------------------------------------------------------------------------------

AdamW::AdamW(std::vector<Parameter*> params, const AdamWConfig& cfg)
    : Optimizer(std::move(params), cfg.main_params_dtype == DType::F32), cfg_(cfg) {
  check_state_dtypes(cfg, "AdamW");
  MC_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1,
           "AdamW: betas ({}, {}) must lie in [0, 1)", cfg.beta1, cfg.beta2);
  MC_CHECK(cfg.eps > 0, "AdamW: eps = {} must be > 0 (1e-8 is usual)", cfg.eps);
  MC_CHECK(cfg.weight_decay >= 0, "AdamW: weight_decay = {} must be >= 0", cfg.weight_decay);
  init_decay(cfg.no_decay);
  for (const Tensor& m : master_) {
    exp_avg_.push_back(Tensor::zeros(m.shape(), cfg.exp_avg_dtype, m.device()));
    exp_avg_sq_.push_back(Tensor::zeros(m.shape(), cfg.exp_avg_sq_dtype, m.device()));
  }
}

void AdamW::step(float lr, float grad_scale, const Tensor& grad_scale_tensor) {
  ++step_;
  // One multi-tensor launch per (weight decay, parameter dtype): the kernel takes one set of
  // hyper-parameters and one output dtype per call.
  struct Group {
    std::vector<Tensor> g, w, m, v, out;
  };
  std::map<std::pair<bool, int>, Group> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    Group& gr = groups[{decay_[i], int(params_[i]->data.dtype())}];
    gr.g.push_back(params_[i]->main_grad);
    gr.w.push_back(master_[i]);
    gr.m.push_back(exp_avg_[i]);
    gr.v.push_back(exp_avg_sq_[i]);
    if (separate_masters_) gr.out.push_back(params_[i]->data);
  }
  for (auto& [key, gr] : groups)
    ops::multi_tensor_adamw(gr.g, gr.w, gr.m, gr.v, gr.out, adamw_hyper(cfg_, lr, key.first, step_, grad_scale),
                            grad_scale_tensor);
}

std::vector<NamedTensor> AdamW::state() const {
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i]->name;
    out.push_back({n + ".master", master_[i]});
    out.push_back({n + ".exp_avg", exp_avg_[i]});
    out.push_back({n + ".exp_avg_sq", exp_avg_sq_[i]});
  }
  return out;
}

// ---- SGD --------------------------------------------------------------------------------------

SGD::SGD(std::vector<Parameter*> params, const SGDConfig& cfg) : Optimizer(std::move(params)), cfg_(cfg) {
  MC_CHECK(cfg.momentum >= 0 && cfg.dampening >= 0 && cfg.weight_decay >= 0,
           "SGD: momentum {}, dampening {} and weight_decay {} must be >= 0", cfg.momentum, cfg.dampening,
           cfg.weight_decay);
  MC_CHECK(!cfg.nesterov || (cfg.momentum > 0 && cfg.dampening == 0),
           "SGD: nesterov needs momentum > 0 and dampening 0 (got momentum {}, dampening {})", cfg.momentum,
           cfg.dampening);
  init_decay(cfg.no_decay);
  for (size_t i = 0; i < params_.size(); ++i)
    momentum_.push_back(Tensor::zeros(master_[i].shape(), DType::F32, master_[i].device()));
}

void SGD::step(float lr, float grad_scale, const Tensor& grad_scale_tensor) {
  const bool first = step_ == 0;
  ++step_;
  // One multi-tensor launch per (weight decay, parameter dtype), as AdamW.
  struct Group {
    std::vector<Tensor> g, w, m, out;
  };
  std::map<std::pair<bool, int>, Group> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    Group& gr = groups[{decay_[i], int(params_[i]->data.dtype())}];
    gr.g.push_back(params_[i]->main_grad);
    gr.w.push_back(master_[i]);
    gr.m.push_back(momentum_[i]);
    gr.out.push_back(params_[i]->data);
  }
  for (auto& [key, gr] : groups) {
    ops::SGDHyper h;
    h.lr = lr;
    h.momentum = cfg_.momentum;
    h.dampening = cfg_.dampening;
    h.nesterov = cfg_.nesterov;
    h.weight_decay = key.first ? cfg_.weight_decay : 0.f;
    h.first_step = first;
    h.grad_scale = grad_scale;
    ops::multi_tensor_sgd(gr.g, gr.w, gr.m, gr.out, h, grad_scale_tensor);
  }
}

std::vector<NamedTensor> SGD::state() const {
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i]->name;
    out.push_back({n + ".master", master_[i]});
    out.push_back({n + ".momentum_buffer", momentum_[i]});
  }
  return out;
}

}  // namespace megacore::optim
