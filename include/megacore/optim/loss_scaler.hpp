// Dynamic loss scaling for f16 training, and one guarded optimizer step that puts scaling, NaN/Inf
// detection, clipping and skip-on-overflow together.
//
// DynamicLossScaler follows Megatron-Core's DynamicGradScaler: the loss (its gradient) is multiplied
// by scale() before backward. After backward, a non-finite gradient norm means overflow: the step is
// skipped, and after `hysteresis` overflows (counted since the last growth) the scale is multiplied by
// backoff_factor (never below min_scale). After growth_interval finite steps in a row the scale is
// multiplied by growth_factor (never above max_scale) and the hysteresis budget is restored.
//
// checked_step(): norm of the (scaled) gradients over the model-parallel (and, for ZeRO, DP) groups
// → found_inf when not finite → skip (and back off) or: true norm = norm · grad_scale / loss scale,
// clip coefficient from the true norm, and one optimizer step with
// grad_scale = clip_coef · grad_scale / loss scale. The result says what
// happened; the caller advances its LR schedule only when !skipped.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/optim/optimizer.hpp"

namespace megacore::optim {

struct LossScalerConfig {
  double initial_scale = 65536.0;  ///< 2^16
  double growth_factor = 2.0;      ///< > 1
  double backoff_factor = 0.5;     ///< in (0, 1)
  int64_t growth_interval = 1000;  ///< finite steps in a row before the scale grows (>= 1)
  int hysteresis = 2;              ///< overflows tolerated before backing off (>= 1)
  double min_scale = 1.0;          ///< > 0
  double max_scale = 16777216.0;   ///< 2^24
};

/// Everything a DynamicLossScaler needs to resume exactly.
struct LossScalerState {
  double scale = 0;
  int64_t growth_tracker = 0;  ///< finite steps since the last overflow or growth
  int hysteresis_tracker = 0;  ///< overflows still tolerated before a back-off
  bool operator==(const LossScalerState&) const = default;
};

class DynamicLossScaler {
 public:
  /// ConfigError listing every problem with the config.
  explicit DynamicLossScaler(const LossScalerConfig& cfg = {});
  double scale() const { return st_.scale; }
  double inv_scale() const { return 1.0 / st_.scale; }
  /// Records one step's overflow check and adjusts the scale.
  void update(bool found_inf);
  const LossScalerState& state() const { return st_; }
  /// ValueError for a non-positive scale or negative trackers.
  void load_state(const LossScalerState& s);
  const LossScalerConfig& config() const { return cfg_; }

 private:
  LossScalerConfig cfg_;
  LossScalerState st_;
};

struct StepResult {
  bool skipped = false;     ///< no update was made (non-finite gradients)
  bool found_inf = false;   ///< a gradient held NaN or Inf (an overflow when loss scaling)
  double grad_norm = 0.0;   ///< global norm of the unscaled gradients (NaN/Inf when found_inf)
  double clip_coef = 1.0;   ///< applied through grad_scale (1 when not clipped or skipped)
  double loss_scale = 1.0;  ///< the scale the gradients carried (1 without a scaler)
  double lr = 0.0;
  std::vector<double> values;  ///< host values of CheckedStepOptions::read_along (parts overload)
};

struct CheckedStepOptions {
  double max_norm = 0.0;               ///< clip to this global norm; <= 0: no clipping
  /// The optimizer uses main_grad × grad_scale / loss scale (e.g. 1 / micro-batches when each
  /// micro-batch's mean loss was backpropagated); the reported norm and the clipping are of that.
  double grad_scale = 1.0;
  DynamicLossScaler* scaler = nullptr; ///< gradients carry scaler->scale(); updated after the check
  bool skip_nonfinite = true;          ///< false: step even with NaN/Inf (reported in found_inf)
  /// One-element f32 device tensors read in the norm's one device→host copy (the parts overload), so a
  /// step that needs device values on the host (the loss) pays one host sync in all.
  std::vector<Tensor> read_along;
  /// When set, called with those values after the read; grad_scale is multiplied by what it returns (a
  /// normalisation only the device knows before the read, e.g. a token count summed over ranks).
  std::function<double(const std::vector<double>&)> grad_scale_from_values;
};

/// For a replicated-grad optimizer (AdamW/SGD after DDP all-reduce or without DP): the norm over
/// opt.parameters() with `groups` (normally grad_norm_groups(grid)). Collective over groups.reduce.
StepResult checked_step(Optimizer& opt, double lr, const GradNormGroups& groups, const CheckedStepOptions& o = {});
/// For ZeRO-1: the norm over this rank's shards, summed over groups.reduce (which must hold the DP group).
StepResult checked_step(DistributedOptimizer& opt, double lr, const GradNormGroups& groups,
                        const CheckedStepOptions& o = {});

/// One optimizer of a step over several parameter groups (MoE: the dense group and the expert group, each
/// with its own DDP and optimizer): exactly one of the two is set.
struct OptimizerPart {
  Optimizer* opt = nullptr;
  DistributedOptimizer* zero = nullptr;
};
/// Megatron-Core's chained optimizer: one norm over every part's counted gradients (as each part's own
/// checked_step would count them; dense and expert parts summed over their groups, see grad_clip.hpp), so
/// one found-inf decision and one clip coefficient for all, then every part steps. Collective over the
/// groups in `groups` and, for ZeRO parts, their DDP groups. ValueError for an empty list or a part with
/// neither or both optimizers set.
StepResult checked_step(const std::vector<OptimizerPart>& parts, double lr, const GradNormGroups& groups,
                        const CheckedStepOptions& o = {});

}  // namespace megacore::optim
