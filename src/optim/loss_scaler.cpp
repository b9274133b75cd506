#include "megacore/optim/loss_scaler.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "megacore/core/error.hpp"

namespace megacore::optim {

DynamicLossScaler::DynamicLossScaler(const LossScalerConfig& cfg) : cfg_(cfg) {
  std::string bad;
  auto need = [&](bool ok, const std::string& msg) {
    if (!ok) bad += "\n  - " + msg;
  };
  need(cfg.initial_scale > 0 && std::isfinite(cfg.initial_scale), "initial_scale must be a finite value > 0 (65536 is usual)");
  need(cfg.growth_factor > 1, "growth_factor must be > 1 (2 is usual)");
  need(cfg.backoff_factor > 0 && cfg.backoff_factor < 1, "backoff_factor must lie in (0, 1) (0.5 is usual)");
  need(cfg.growth_interval >= 1, "growth_interval must be >= 1 (1000 is usual)");
  need(cfg.hysteresis >= 1, "hysteresis must be >= 1 (2 is usual)");
  need(cfg.min_scale > 0, "min_scale must be > 0 (1 is usual)");
  need(cfg.max_scale >= cfg.min_scale, "max_scale must be >= min_scale");
  need(cfg.initial_scale >= cfg.min_scale && cfg.initial_scale <= cfg.max_scale,
       "initial_scale must lie in [min_scale, max_scale]");
  if (!bad.empty()) throw ConfigError("DynamicLossScaler: invalid config:" + bad);
  st_.scale = cfg.initial_scale;
  st_.hysteresis_tracker = cfg.hysteresis;
}

void DynamicLossScaler::update(bool found_inf) {
  if (found_inf) {
    st_.growth_tracker = 0;
    if (--st_.hysteresis_tracker <= 0) {
      st_.scale = std::max(st_.scale * cfg_.backoff_factor, cfg_.min_scale);
      st_.hysteresis_tracker = 0;
    }
    return;
  }
  if (++st_.growth_tracker >= cfg_.growth_interval) {
    st_.growth_tracker = 0;
    st_.hysteresis_tracker = cfg_.hysteresis;
    st_.scale = std::min(st_.scale * cfg_.growth_factor, cfg_.max_scale);
  }
}

void DynamicLossScaler::load_state(const LossScalerState& s) {
  MC_CHECK(s.scale > 0 && std::isfinite(s.scale), "DynamicLossScaler.load_state: scale {} must be finite and > 0",
           s.scale);
  MC_CHECK(s.growth_tracker >= 0 && s.hysteresis_tracker >= 0,
           "DynamicLossScaler.load_state: trackers ({}, {}) must be >= 0", s.growth_tracker, s.hysteresis_tracker);
  st_ = s;
}

namespace {

// Shared logic: n is the norm of main_grad as it is (loss scale and grad_scale included).
template <class Step>
StepResult finish_checked(GradNormResult n, double lr, const CheckedStepOptions& o, Step&& step) {
  const double grad_scale = o.grad_scale * (o.grad_scale_from_values ? o.grad_scale_from_values(n.values) : 1.0);
  MC_CHECK(grad_scale > 0 && std::isfinite(grad_scale), "checked_step: grad_scale {} must be finite and > 0",
           grad_scale);
  StepResult r;
  r.values = std::move(n.values);
  r.lr = lr;
  r.loss_scale = o.scaler ? o.scaler->scale() : 1.0;
  r.found_inf = !n.finite;
  r.grad_norm = n.norm * grad_scale / r.loss_scale;
  if (o.scaler) o.scaler->update(r.found_inf);
  if (r.found_inf && o.skip_nonfinite) {
    r.skipped = true;
    return r;
  }
  if (o.max_norm > 0 && !r.found_inf) r.clip_coef = std::min(1.0, o.max_norm / (r.grad_norm + 1e-6));
  step(float(lr), float(r.clip_coef * grad_scale / r.loss_scale));
  return r;
}

}  // namespace

StepResult checked_step(Optimizer& opt, double lr, const GradNormGroups& groups, const CheckedStepOptions& o) {
  GradNormResult n = global_grad_norm(opt.parameters(), groups);
  return finish_checked(n, lr, o, [&](float l, float gs) { opt.step(l, gs); });
}

StepResult checked_step(DistributedOptimizer& opt, double lr, const GradNormGroups& groups,
                        const CheckedStepOptions& o) {
  GradNormResult n = opt.grad_norm(groups);
  return finish_checked(n, lr, o, [&](float l, float gs) { opt.step(l, gs); });
}

StepResult checked_step(const std::vector<OptimizerPart>& parts, double lr, const GradNormGroups& groups,
                        const CheckedStepOptions& o) {
  MC_CHECK(!parts.empty(), "checked_step: no optimizer parts given");
  std::vector<Tensor> dense, expert;
  Device device = Device::cpu();
  Stream stream;
  for (size_t i = 0; i < parts.size(); ++i) {
    const OptimizerPart& p = parts[i];
    MC_CHECK((p.opt != nullptr) != (p.zero != nullptr),
             "checked_step: optimizer part {} must set exactly one of opt (AdamW/SGD) and zero (ZeRO-1)", i);
    if (p.zero) {
      p.zero->counted_grads(groups, dense, expert);
      if (i == 0) device = p.zero->ddp().buffer().device(), stream = p.zero->ddp().config().compute_stream;
    } else {
      counted_grads(p.opt->parameters(), groups, dense, expert);
      if (i == 0 && !p.opt->parameters().empty()) device = p.opt->parameters().front()->main_grad.device();
    }
  }
  GradNormResult n = combine_grad_norm(dense, expert, groups, device, stream, "checked_step", o.read_along);
  return finish_checked(n, lr, o, [&](float l, float gs) {
    for (const OptimizerPart& p : parts) p.zero ? p.zero->step(l, gs) : p.opt->step(l, gs);
  });
}

}  // namespace megacore::optim
