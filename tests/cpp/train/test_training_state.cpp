// TrainingState: what a checkpoint records of the trainer's progress reads back exactly, and a missing or
// damaged entry is an IOError naming the way out.
#include <random>

#include "test_helpers.hpp"
#include "megacore/core/error.hpp"
#include "megacore/train/training_state.hpp"

namespace tr = megacore::train;

TEST_CASE("TrainingState round-trips through a checkpoint's JSON entries", "[train]") {
  std::mt19937_64 rng(std::random_device{}());
  for (bool with_scaler : {false, true}) {
    tr::TrainingState a;
    a.step = int64_t(rng() % 1000000);
    a.consumed_samples = int64_t(rng() % (int64_t(1) << 40));
    a.scheduler_steps = a.step - int64_t(rng() % 7);
    a.loss_avg = std::uniform_real_distribution<double>(0.5, 12.0)(rng);
    a.loss_avg_n = int64_t(rng() % 5000);
    if (with_scaler) a.loss_scaler = megacore::optim::LossScalerState{.scale = 65536.0 / double(1 + rng() % 64),
                                                                      .growth_tracker = int64_t(rng() % 2000),
                                                                      .hysteresis_tracker = int(rng() % 3)};
    std::map<std::string, std::string> json;
    a.write(json);
    CHECK(json.count("loss_scaler") == (with_scaler ? 1u : 0u));
    CHECK(tr::TrainingState::read(json) == a);  // doubles through JSON's shortest round-trip text: exact
  }
}

TEST_CASE("TrainingState refuses a checkpoint without or with a damaged trainer entry", "[train]") {
  std::map<std::string, std::string> none;
  CHECK_THROWS_AS(tr::TrainingState::read(none), megacore::IOError);
  CHECK_THROWS_WITH(tr::TrainingState::read(none), Catch::Contains("checkpoint.pretrained_checkpoint"));
  std::map<std::string, std::string> bad{{"trainer", R"({"step": 3})"}};
  CHECK_THROWS_WITH(tr::TrainingState::read(bad), Catch::Contains("malformed") && Catch::Contains("consumed_samples"));
  // An entry without the loss average keeps its defaults.
  std::map<std::string, std::string> old{{"trainer", R"({"step": 3, "consumed_samples": 24, "scheduler_steps": 3})"}};
  const tr::TrainingState st = tr::TrainingState::read(old);
  CHECK(st.step == 3);
  CHECK(st.loss_avg_n == 0);
}
