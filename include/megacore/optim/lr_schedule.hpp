// Learning-rate schedules: linear warmup, then constant, linear, cosine or WSD (warmup-stable-decay)
// decay down to min_lr.
//
// Steps count completed optimizer steps from 0, as Megatron-Core's OptimizerParamScheduler does:
// the lr used by optimizer step k (k = 0, 1, ...) is lr_at(k). With warmup the first step therefore
// runs at warmup_init_lr (0 by default), and the peak lr is reached at step warmup_steps.
//
//   step <= warmup_steps (and warmup_steps > 0):  warmup_init_lr + (lr - warmup_init_lr) · step / warmup_steps
//   step >  decay_steps:                          min_lr (Constant: lr)
//   otherwise, with r = (step - warmup_steps) / (decay_steps - warmup_steps):
//     Constant  lr
//     Linear    min_lr + (lr - min_lr) · (1 - r)
//     Cosine    min_lr + (lr - min_lr) · (1 + cos(π r)) / 2
//     WSD       lr until step decay_steps - wsd_decay_steps, then over the last wsd_decay_steps, with
//               q = (step - (decay_steps - wsd_decay_steps)) / wsd_decay_steps, the factor
//               1 - q (Linear), (1 + cos(π q)) / 2 (Cosine), 1 - sqrt(q) (MinusSqrt) between min_lr and lr.
#pragma once

#include <cstdint>
#include <string_view>

#include "megacore/core/fields.hpp"

namespace megacore::optim {

enum class LRDecayStyle { Constant, Linear, Cosine, WSD };
/// Shape of the final annealing phase of a WSD schedule.
enum class WSDDecayShape { Linear, Cosine, MinusSqrt };

std::string_view lr_decay_style_name(LRDecayStyle s);
/// Inverse of lr_decay_style_name ("constant", "linear", "cosine", "wsd"); ValueError listing the names.
LRDecayStyle lr_decay_style_from_name(std::string_view name);
std::string_view wsd_decay_shape_name(WSDDecayShape s);

struct LRScheduleConfig {
  double lr = 1e-3;              ///< peak learning rate
  double min_lr = 0.0;           ///< floor reached at decay_steps
  double warmup_init_lr = 0.0;   ///< lr at step 0 when warming up
  int64_t warmup_steps = 0;      ///< linear warmup length (0 = none)
  int64_t decay_steps = 0;       ///< step at which decay ends, warmup included (ignored by Constant)
  LRDecayStyle style = LRDecayStyle::Cosine;
  int64_t wsd_decay_steps = 0;   ///< WSD: length of the final annealing phase
  WSDDecayShape wsd_shape = WSDDecayShape::Linear;
};

/// Throws ConfigError listing every problem with the config and how to fix it.
void validate(const LRScheduleConfig& cfg);

/// The learning rate for optimizer step `step` (0-based), per the formulas above. No validation.
double lr_at(const LRScheduleConfig& cfg, int64_t step);

/// A schedule with its position, so a run can resume exactly (num_steps is all of its state).
class LRScheduler {
 public:
  /// Validates the config (ConfigError).
  explicit LRScheduler(const LRScheduleConfig& cfg);
  /// The lr for the next optimizer step.
  double lr() const { return lr_at(cfg_, num_steps_); }
  /// Advances by one optimizer step; returns the lr for the step after it.
  double step();
  int64_t num_steps() const { return num_steps_; }
  /// For checkpoint resume; ValueError when negative.
  void set_num_steps(int64_t n);
  const LRScheduleConfig& config() const { return cfg_; }

 private:
  LRScheduleConfig cfg_;
  int64_t num_steps_ = 0;
};

}  // namespace megacore::optim

namespace megacore {
template <>
struct EnumNames<optim::LRDecayStyle> {
  static constexpr std::array values{std::pair{optim::LRDecayStyle::Constant, std::string_view{"constant"}},
                                     std::pair{optim::LRDecayStyle::Linear, std::string_view{"linear"}},
                                     std::pair{optim::LRDecayStyle::Cosine, std::string_view{"cosine"}},
                                     std::pair{optim::LRDecayStyle::WSD, std::string_view{"wsd"}}};
};
}  // namespace megacore
