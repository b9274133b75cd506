// LR schedules against their closed forms at the key steps: start, mid-warmup, end of warmup, mid-decay,
// end of decay, past the end; WSD's stable phase and annealing; validation messages.
#include <cmath>
#include <numbers>

#include "megacore/optim/lr_schedule.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::optim;

namespace {

LRScheduleConfig base(LRDecayStyle style) {
  LRScheduleConfig c;
  c.lr = 3e-4;
  c.min_lr = 3e-5;
  c.warmup_steps = 10;
  c.decay_steps = 110;
  c.style = style;
  return c;
}

}  // namespace

TEST_CASE("LR warmup is linear from warmup_init_lr to lr", "[optim]") {
  for (LRDecayStyle s : {LRDecayStyle::Constant, LRDecayStyle::Linear, LRDecayStyle::Cosine}) {
    LRScheduleConfig c = base(s);
    c.warmup_init_lr = 1e-5;
    INFO(lr_decay_style_name(s));
    CHECK(lr_at(c, 0) == Approx(1e-5).epsilon(1e-12));
    CHECK(lr_at(c, 4) == Approx(1e-5 + (3e-4 - 1e-5) * 0.4).epsilon(1e-12));
    CHECK(lr_at(c, 10) == Approx(3e-4).epsilon(1e-12));
  }
}

TEST_CASE("LR constant, linear and cosine decay match their closed forms", "[optim]") {
  const double lr = 3e-4, mn = 3e-5;
  LRScheduleConfig c = base(LRDecayStyle::Constant);
  CHECK(lr_at(c, 11) == lr);
  CHECK(lr_at(c, 1000) == lr);

  c = base(LRDecayStyle::Linear);
  CHECK(lr_at(c, 35) == Approx(mn + (lr - mn) * 0.75).epsilon(1e-12));  // r = 25 / 100
  CHECK(lr_at(c, 60) == Approx((lr + mn) / 2).epsilon(1e-12));
  CHECK(lr_at(c, 110) == Approx(mn).epsilon(1e-12));
  CHECK(lr_at(c, 111) == mn);

  c = base(LRDecayStyle::Cosine);
  const double pi = std::numbers::pi;
  CHECK(lr_at(c, 35) == Approx(mn + (lr - mn) * 0.5 * (1 + std::cos(pi * 0.25))).epsilon(1e-12));
  CHECK(lr_at(c, 60) == Approx((lr + mn) / 2).epsilon(1e-12));
  CHECK(lr_at(c, 110) == Approx(mn).epsilon(1e-12));
  CHECK(lr_at(c, 5000) == mn);

  // No warmup: step 0 is already the peak.
  c.warmup_steps = 0;
  CHECK(lr_at(c, 0) == Approx(lr).epsilon(1e-12));
}

TEST_CASE("LR WSD holds lr, then anneals over the last wsd_decay_steps", "[optim]") {
  const double lr = 3e-4, mn = 3e-5;
  LRScheduleConfig c = base(LRDecayStyle::WSD);
  c.wsd_decay_steps = 20;  // anneal over steps (90, 110]
  for (WSDDecayShape shape : {WSDDecayShape::Linear, WSDDecayShape::Cosine, WSDDecayShape::MinusSqrt}) {
    c.wsd_shape = shape;
    INFO(wsd_decay_shape_name(shape));
    CHECK(lr_at(c, 5) == Approx(lr / 2).epsilon(1e-12));
    CHECK(lr_at(c, 11) == lr);
    CHECK(lr_at(c, 90) == lr);
    const double q = 0.25;  // step 95
    const double coeff = shape == WSDDecayShape::Linear   ? 1 - q
                         : shape == WSDDecayShape::Cosine ? 0.5 * (1 + std::cos(std::numbers::pi * q))
                                                          : 1 - std::sqrt(q);
    CHECK(lr_at(c, 95) == Approx(mn + (lr - mn) * coeff).epsilon(1e-12));
    CHECK(lr_at(c, 110) == Approx(mn).epsilon(1e-12));
    CHECK(lr_at(c, 200) == mn);
  }
}

TEST_CASE("LRScheduler steps and resumes", "[optim]") {
  LRScheduler s(base(LRDecayStyle::Cosine));
  CHECK(s.lr() == 0.0);
  for (int i = 0; i < 10; ++i) s.step();
  CHECK(s.num_steps() == 10);
  CHECK(s.lr() == Approx(3e-4).epsilon(1e-12));
  LRScheduler r(base(LRDecayStyle::Cosine));
  r.set_num_steps(60);
  CHECK(r.lr() == lr_at(s.config(), 60));
  CHECK(r.step() == lr_at(s.config(), 61));
  REQUIRE_THROWS_AS(r.set_num_steps(-1), ValueError);
}

TEST_CASE("LR schedule validation names the fix", "[optim]") {
  LRScheduleConfig c = base(LRDecayStyle::Cosine);
  c.warmup_steps = 200;
  REQUIRE_THROWS_WITH(LRScheduler(c), Catch::Contains("warmup_steps 200 >= decay_steps 110"));
  REQUIRE_THROWS_AS(LRScheduler(c), ConfigError);
  c = base(LRDecayStyle::Linear);
  c.min_lr = 1e-3;
  REQUIRE_THROWS_WITH(validate(c), Catch::Contains("min_lr 0.001 > lr 0.0003: lower min_lr"));
  c = base(LRDecayStyle::Cosine);
  c.decay_steps = 0;
  REQUIRE_THROWS_WITH(validate(c), Catch::Contains("set decay_steps"));
  c = base(LRDecayStyle::WSD);
  REQUIRE_THROWS_WITH(validate(c), Catch::Contains("wsd_decay_steps = 0"));
  c.wsd_decay_steps = 101;
  REQUIRE_THROWS_WITH(validate(c), Catch::Contains("wsd_decay_steps 101 > decay_steps - warmup_steps = 100"));
  // Several problems are all listed.
  c = base(LRDecayStyle::Linear);
  c.lr = -1;
  c.warmup_steps = -2;
  try {
    validate(c);
    FAIL("no error");
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    CHECK(m.find("lr = -1") != std::string::npos);
    CHECK(m.find("warmup_steps = -2") != std::string::npos);
  }
  // Constant needs no decay_steps.
  c = base(LRDecayStyle::Constant);
  c.decay_steps = 0;
  CHECK_NOTHROW(validate(c));
  CHECK(lr_decay_style_from_name("wsd") == LRDecayStyle::WSD);
  REQUIRE_THROWS_WITH(lr_decay_style_from_name("cos"), Catch::Contains("constant, linear, cosine, wsd"));
}
