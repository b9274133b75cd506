#include "megacore/train/training_state.hpp"

#include <nlohmann/json.hpp>

#include "megacore/core/error.hpp"

namespace megacore::train {

using json = nlohmann::json;

void TrainingState::write(std::map<std::string, std::string>& out) const {
  out["trainer"] = json{{"step", step},
                        {"consumed_samples", consumed_samples},
                        {"scheduler_steps", scheduler_steps},
                        {"loss_avg", loss_avg},
                        {"loss_avg_n", loss_avg_n}}
                       .dump();
  if (loss_scaler)
    out["loss_scaler"] = json{{"scale", loss_scaler->scale},
                              {"growth_tracker", loss_scaler->growth_tracker},
                              {"hysteresis_tracker", loss_scaler->hysteresis_tracker}}
                             .dump();
}

TrainingState TrainingState::read(const std::map<std::string, std::string>& in) {
  TrainingState st;
  const auto it = in.find("trainer");
  MC_CHECK_AS(IOError, it != in.end(),
              "the checkpoint has no 'trainer' entry (step, data position); it was not written by the trainer: load it "
              "as pretrained weights (checkpoint.pretrained_checkpoint) instead of resuming from it");
  try {
    const json t = json::parse(it->second);
    st.step = t.at("step").get<int64_t>();
    st.consumed_samples = t.at("consumed_samples").get<int64_t>();
    st.scheduler_steps = t.at("scheduler_steps").get<int64_t>();
    st.loss_avg = t.value("loss_avg", 0.0);
    st.loss_avg_n = t.value("loss_avg_n", int64_t{0});
    if (const auto s = in.find("loss_scaler"); s != in.end()) {
      const json j = json::parse(s->second);
      st.loss_scaler = optim::LossScalerState{.scale = j.at("scale").get<double>(),
                                              .growth_tracker = j.at("growth_tracker").get<int64_t>(),
                                              .hysteresis_tracker = j.at("hysteresis_tracker").get<int>()};
    }
  } catch (const json::exception& e) {
    raise<IOError>("the checkpoint's 'trainer' / 'loss_scaler' entries are malformed ({}); the checkpoint is "
                "damaged: resume from an earlier one", e.what());
  }
  return st;
}

}  // namespace megacore::train
