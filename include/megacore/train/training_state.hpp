// TrainingState: the trainer's own progress — step, data position, LR schedule position, the f16 loss
// scaler and the loss-spike detector's moving average — saved with every checkpoint beside the model and
// optimizer state, so a resumed run continues exactly.
//
// In a checkpoint it is the JSON entry "trainer" ({"step", "consumed_samples", "scheduler_steps",
// "loss_avg", "loss_avg_n"}) and, when a loss scaler is in use, "loss_scaler" ({"scale", "growth_tracker",
// "hysteresis_tracker"}). Entries a checkpoint lacks keep their defaults (loss_avg, the scaler).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "megacore/optim/loss_scaler.hpp"

namespace megacore::train {

struct TrainingState {
  int64_t step = 0;              ///< optimizer steps taken
  int64_t consumed_samples = 0;  ///< global samples the data loader has handed out
  int64_t scheduler_steps = 0;   ///< the LR scheduler's position
  std::optional<optim::LossScalerState> loss_scaler;  ///< f16 dynamic loss scaling only
  double loss_avg = 0;     ///< moving average of finite losses (trainer.loss_spike_factor)
  int64_t loss_avg_n = 0;  ///< losses in that average

  /// Adds the "trainer" (and "loss_scaler") entries to a checkpoint's JSON map.
  void write(std::map<std::string, std::string>& json) const;
  /// Reads them back; IOError naming the entry when "trainer" is missing or malformed.
  static TrainingState read(const std::map<std::string, std::string>& json);

  bool operator==(const TrainingState&) const = default;
};

}  // namespace megacore::train
