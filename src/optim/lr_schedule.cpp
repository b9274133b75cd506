#include "megacore/optim/lr_schedule.hpp"

#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "megacore/core/error.hpp"

namespace megacore::optim {

std::string_view lr_decay_style_name(LRDecayStyle s) {
  switch (s) {
    case LRDecayStyle::Constant: return "constant";
    case LRDecayStyle::Linear: return "linear";
    case LRDecayStyle::Cosine: return "cosine";
    case LRDecayStyle::WSD: return "wsd";
  }
  return "?";
}

LRDecayStyle lr_decay_style_from_name(std::string_view name) {
  for (LRDecayStyle s : {LRDecayStyle::Constant, LRDecayStyle::Linear, LRDecayStyle::Cosine, LRDecayStyle::WSD})
    if (lr_decay_style_name(s) == name) return s;
  raise<ValueError>("unknown lr decay style '{}': use one of constant, linear, cosine, wsd", name);
}

std::string_view wsd_decay_shape_name(WSDDecayShape s) {
  switch (s) {
    case WSDDecayShape::Linear: return "linear";
    case WSDDecayShape::Cosine: return "cosine";
    case WSDDecayShape::MinusSqrt: return "minus_sqrt";
  }
  return "?";
}

void validate(const LRScheduleConfig& c) {
  std::vector<std::string> bad;
  auto finite_nonneg = [&](double v, const char* name) {
    if (!std::isfinite(v) || v < 0) bad.push_back(fmt::format("{} = {} must be finite and >= 0", name, v));
  };
  finite_nonneg(c.lr, "lr");
  finite_nonneg(c.min_lr, "min_lr");
  finite_nonneg(c.warmup_init_lr, "warmup_init_lr");
  if (c.min_lr > c.lr) bad.push_back(fmt::format("min_lr {} > lr {}: lower min_lr to at most lr", c.min_lr, c.lr));
  if (c.warmup_init_lr > c.lr)
    bad.push_back(fmt::format("warmup_init_lr {} > lr {}: warmup must rise, lower warmup_init_lr", c.warmup_init_lr, c.lr));
  if (c.warmup_steps < 0) bad.push_back(fmt::format("warmup_steps = {} is negative: use 0 for no warmup", c.warmup_steps));
  if (c.style != LRDecayStyle::Constant) {
    if (c.decay_steps <= 0)
      bad.push_back(fmt::format("decay_steps = {} with {} decay: set decay_steps to the step where decay ends "
                                "(usually the total number of training steps)",
                                c.decay_steps, lr_decay_style_name(c.style)));
    else if (c.warmup_steps >= c.decay_steps)
      bad.push_back(fmt::format("warmup_steps {} >= decay_steps {}: decay_steps counts warmup too, so raise it "
                                "above warmup_steps or shorten the warmup",
                                c.warmup_steps, c.decay_steps));
  }
  if (c.style == LRDecayStyle::WSD) {
    const int64_t room = c.decay_steps - std::max<int64_t>(c.warmup_steps, 0);
    if (c.wsd_decay_steps <= 0)
      bad.push_back(fmt::format("wsd_decay_steps = {}: WSD needs a final annealing phase of at least 1 step",
                                c.wsd_decay_steps));
    else if (c.decay_steps > 0 && c.wsd_decay_steps > room)
      bad.push_back(fmt::format("wsd_decay_steps {} > decay_steps - warmup_steps = {}: the annealing phase must fit "
                                "after the warmup; shorten it or raise decay_steps",
                                c.wsd_decay_steps, room));
  }
  if (bad.empty()) return;
  std::string msg = "invalid LR schedule:";
  for (const std::string& b : bad) msg += "\n  - " + b;
  throw ConfigError(msg);
}

double lr_at(const LRScheduleConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps)
    return c.warmup_init_lr + (c.lr - c.warmup_init_lr) * double(step) / double(c.warmup_steps);
  if (c.style == LRDecayStyle::Constant) return c.lr;
  if (step > c.decay_steps) return c.min_lr;
  const double pi = std::numbers::pi;
  double coeff = 1.0;
  if (c.style == LRDecayStyle::WSD) {
    const int64_t anneal_start = c.decay_steps - c.wsd_decay_steps;
    if (step > anneal_start) {
      const double q = double(step - anneal_start) / double(c.wsd_decay_steps);
      switch (c.wsd_shape) {
        case WSDDecayShape::Linear: coeff = 1.0 - q; break;
        case WSDDecayShape::Cosine: coeff = 0.5 * (1.0 + std::cos(pi * q)); break;
        case WSDDecayShape::MinusSqrt: coeff = 1.0 - std::sqrt(q); break;
      }
    }
  } else {
    const double r = double(step - c.warmup_steps) / double(c.decay_steps - c.warmup_steps);
    coeff = c.style == LRDecayStyle::Linear ? 1.0 - r : 0.5 * (1.0 + std::cos(pi * r));
  }
  return c.min_lr + coeff * (c.lr - c.min_lr);
}

LRScheduler::LRScheduler(const LRScheduleConfig& cfg) : cfg_(cfg) { validate(cfg_); }

double LRScheduler::step() {
  ++num_steps_;
  return lr();
}

void LRScheduler::set_num_steps(int64_t n) {
  MC_CHECK(n >= 0, "LRScheduler::set_num_steps({}): the step count must be >= 0", n);
  num_steps_ = n;
}

}  // namespace megacore::optim
