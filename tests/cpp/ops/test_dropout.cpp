#include "megacore/ops/dropout.hpp"

#include "ops/ops_test_util.hpp"

using namespace megacore;
using namespace mctest;

TEST_CASE("dropout CPU: rate, scaling, reproducible mask, backward", "[ops][dropout]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t n = 100003;
  Tensor x = randn({n}, DType::F32, seed, 1, 0.1), y = Tensor::empty({n}), mask = Tensor::empty({n}, DType::U8);
  ops::dropout_forward(x, y, 0.3f, seed, 7, {}, &mask);
  auto xv = x.to_double_vector(), yv = y.to_double_vector(), mv = mask.to_double_vector();
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    kept += int64_t(mv[size_t(i)]);
    REQUIRE(yv[size_t(i)] == (mv[size_t(i)] ? double(float(float(xv[size_t(i)]) * (1.f / 0.7f))) : 0.0));
  }
  CHECK(std::abs(double(kept) / n - 0.7) < 0.01);
  Tensor dx = Tensor::empty({n});
  ops::dropout_backward(x, dx, 0.3f, seed, 7);
  REQUIRE(dx.to_double_vector() == yv);  // same (seed, offset): same mask
  Tensor y2 = Tensor::empty({n});
  ops::dropout_forward(x, y2, 0.3f, seed, 8);
  CHECK(y2.to_double_vector() != yv);  // another offset: another mask
  ops::dropout_forward(x, y2, 0.f, seed, 8);
  CHECK(y2.to_double_vector() == xv);
  REQUIRE_THROWS_WITH(ops::dropout_forward(x, y2, 1.f, seed, 8), Catch::Contains("p must be in [0, 1)"));
}

TEST_CASE("dropout on the GPU draws the CPU's mask", "[ops][dropout][gpu]") {
  MC_REQUIRE_GPU();
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t n : {int64_t(1), int64_t(4099), int64_t(1 << 20)}) {
      const uint64_t seed = fresh_seed();
      INFO(dtype_name(dt) << " n " << n << " seed " << seed);
      Tensor x = randn({n}, dt, seed), y = Tensor::empty({n}, dt), m = Tensor::empty({n}, DType::U8);
      ops::dropout_forward(x, y, 0.1f, seed, 3, {}, &m);
      Device d = gpu();
      Tensor gx = x.to(d), gy = poisoned({n}, dt, d), gm = poisoned({n}, DType::U8, d), gdx = poisoned({n}, dt, d);
      ops::dropout_forward(gx, gy, 0.1f, seed, 3, {}, &gm);
      ops::dropout_backward(gx, gdx, 0.1f, seed, 3);
      CHECK(gy.to_double_vector() == y.to_double_vector());
      CHECK(gm.to_double_vector() == m.to_double_vector());
      CHECK(gdx.to_double_vector() == y.to_double_vector());
    }
  }
}
