#include "megacore/ops/activation.hpp"

#include "ops/ops_test_util.hpp"

#if MEGACORE_WITH_CUDA
#include "ops/cuda/activation_cuda.hpp"
#endif

using namespace megacore;
using namespace mctest;

namespace {
constexpr ops::Activation kActs[] = {ops::Activation::GeluErf, ops::Activation::GeluTanh, ops::Activation::Silu};
}

TEST_CASE("activation backward matches finite differences (f64)", "[ops][activation]") {
  for (auto act : kActs) {
    const uint64_t seed = fresh_seed();
    INFO("act " << int(act) << " seed " << seed);
    const int64_t n = 23;
    auto x = rand_vec(n, seed, -4, 4), g = rand_vec(n, seed + 1);
    std::vector<double> y(n), dx(n);
    auto loss = [&](const std::vector<double>& xx) {
      ops::ref::activation_f64(act, false, xx.data(), nullptr, y.data(), n);
      return dot(y, g);
    };
    ops::ref::activation_f64(act, true, x.data(), g.data(), dx.data(), n);
    CHECK(rel_err(dx, numeric_grad(loss, x)) < 1e-8);
  }
  // known values
  double x1 = 1.0, y1 = 0;
  ops::ref::activation_f64(ops::Activation::GeluErf, false, &x1, nullptr, &y1, 1);
  CHECK(y1 == Approx(0.8413447460685429).epsilon(1e-12));
  ops::ref::activation_f64(ops::Activation::Silu, false, &x1, nullptr, &y1, 1);
  CHECK(y1 == Approx(0.7310585786300049).epsilon(1e-12));
}

TEST_CASE("swiglu backward matches finite differences (f64)", "[ops][activation]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t rows = 3, f = 5;
  auto x = rand_vec(rows * 2 * f, seed, -3, 3), g = rand_vec(rows * f, seed + 1);
  std::vector<double> y(rows * f), dx(rows * 2 * f);
  auto loss = [&](const std::vector<double>& xx) {
    ops::ref::swiglu_f64(false, xx.data(), nullptr, y.data(), rows, f);
    return dot(y, g);
  };
  ops::ref::swiglu_f64(true, x.data(), g.data(), dx.data(), rows, f);
  CHECK(rel_err(dx, numeric_grad(loss, x)) < 1e-8);
}

TEST_CASE("activation arguments are validated", "[ops][activation]") {
  Tensor x = Tensor::zeros({4, 6}), y = Tensor::empty({4, 3});
  REQUIRE_NOTHROW(ops::swiglu_forward(x, y));
  Tensor x5 = Tensor::zeros({4, 5});
  REQUIRE_THROWS_WITH(ops::swiglu_forward(x5, y), Catch::Contains("not even"));
  Tensor y4 = Tensor::empty({4, 4});
  REQUIRE_THROWS_WITH(ops::swiglu_forward(x, y4), Catch::Contains("y has shape [4, 4], expected [4, 3]"));
  Tensor yb = Tensor::empty({4, 6}, DType::BF16);
  REQUIRE_THROWS_WITH(ops::gelu_forward(x, yb), Catch::Contains("y has dtype bf16 but x has f32"));
  Tensor xi = Tensor::zeros({4}, DType::I64), yi = Tensor::empty({4}, DType::I64);
  REQUIRE_THROWS_WITH(ops::silu_forward(xi, yi), Catch::Contains("must be f32, bf16 or f16"));
}

TEST_CASE("activation CUDA kernels match the CPU reference", "[ops][activation][gpu]") {
  MC_REQUIRE_GPU();
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t n : {int64_t(1), int64_t(37), int64_t(4096), int64_t(100003)}) {
      for (int64_t skew : {int64_t(0), int64_t(1)}) {  // skew 1: not 16-byte aligned
        for (auto act : kActs) {
          const uint64_t seed = fresh_seed();
          INFO(dtype_name(dt) << " n " << n << " skew " << skew << " act " << int(act) << " seed " << seed);
          Tensor x = randn({n}, dt, seed, 0, 2.5), dy = randn({n}, dt, seed + 1);
          Tensor y = Tensor::empty({n}, dt), dx = Tensor::empty({n}, dt);
          ops::activation_forward(act, x, y);
          ops::activation_backward(act, dy, x, dx);
          Device g = gpu();
          Tensor gxb = Tensor::empty({n + skew}, dt, g), gyb = poisoned({n + skew}, dt, g),
                 gdxb = poisoned({n + skew}, dt, g);
          Tensor gx = gxb.slice(0, skew, n + skew), gy = gyb.slice(0, skew, n + skew), gdx = gdxb.slice(0, skew, n + skew);
          gx.copy_(x);
          Tensor gdy = dy.to(g);
          ops::activation_forward(act, gx, gy);
          ops::activation_backward(act, gdy, gx, gdx);
          CHECK(rel_err_t(gy, y) < tol_for(dt));
          CHECK(rel_err_t(gdx, dx) < tol_for(dt));
        }
      }
    }
    for (int64_t f : {int64_t(7), int64_t(64), int64_t(1000), int64_t(2816)}) {
      const uint64_t seed = fresh_seed();
      INFO("swiglu " << dtype_name(dt) << " f " << f << " seed " << seed);
      const int64_t rows = 19;
      Tensor x = randn({rows, 2 * f}, dt, seed), dy = randn({rows, f}, dt, seed + 1);
      Tensor y = Tensor::empty({rows, f}, dt), dx = Tensor::empty({rows, 2 * f}, dt);
      ops::swiglu_forward(x, y);
      ops::swiglu_backward(dy, x, dx);
      Device g = gpu();
      Tensor gx = x.to(g), gdy = dy.to(g), gy = poisoned({rows, f}, dt, g), gdx = poisoned({rows, 2 * f}, dt, g);
      ops::swiglu_forward(gx, gy);
      ops::swiglu_backward(gdy, gx, gdx);
      CHECK(rel_err_t(gy, y) < tol_for(dt));
      CHECK(rel_err_t(gdx, dx) < tol_for(dt));
    }
  }
}

#if MEGACORE_WITH_CUDA
TEST_CASE("activation gpu: every launch shape gives the default's bits", "[ops][activation][gpu]") {
  MC_REQUIRE_GPU();
  const Device g = gpu();
  const ops::cuda::ActTuning shapes[] = {{.unroll = 2}, {.unroll = 4}, {.unroll = 4, .blocks_per_sm = 1},
                                         {.unroll = 1, .blocks_per_sm = 0}, {.unroll = 2, .blocks_per_sm = 0},
                                         {.unroll = 4, .threads = 128, .blocks_per_sm = 0},
                                         {.unroll = 2, .threads = 512, .blocks_per_sm = 4}};
  for (DType dt : {DType::BF16, DType::F32}) {
    for (int64_t n : {int64_t(8), int64_t(1001), int64_t(1) << 20, (int64_t(1) << 20) + 13}) {
      const uint64_t seed = fresh_seed();
      INFO(dtype_name(dt) << " n " << n << " seed " << seed);
      Tensor x = randn({n}, dt, seed, 0, 2.5, g), dy = randn({n}, dt, seed + 1, 0, 1, g);
      Tensor y0 = poisoned({n}, dt, g), dx0 = poisoned({n}, dt, g);
      const auto act = ops::actmath::Act::GeluTanh;
      ops::cuda::activation(dt, act, x.data_ptr(), nullptr, y0.data_ptr(), n, g.index, nullptr);
      ops::cuda::activation(dt, act, x.data_ptr(), dy.data_ptr(), dx0.data_ptr(), n, g.index, nullptr);
      const std::vector<double> ry = y0.to_double_vector(), rdx = dx0.to_double_vector();
      for (const auto& tu : shapes) {
        INFO("unroll " << tu.unroll << " threads " << tu.threads << " blocks_per_sm " << tu.blocks_per_sm);
        Tensor y = poisoned({n}, dt, g), dx = poisoned({n}, dt, g);
        ops::cuda::activation(dt, act, x.data_ptr(), nullptr, y.data_ptr(), n, g.index, nullptr, tu);
        ops::cuda::activation(dt, act, x.data_ptr(), dy.data_ptr(), dx.data_ptr(), n, g.index, nullptr, tu);
        CHECK(y.to_double_vector() == ry);
        CHECK(dx.to_double_vector() == rdx);
      }
    }
  }
  CHECK_THROWS_WITH(ops::cuda::activation(DType::BF16, ops::actmath::Act::Silu, nullptr, nullptr, nullptr, 0, g.index,
                                          nullptr, ops::cuda::ActTuning{.threads = 100}),
                    Catch::Contains("multiple of 32"));
}
#endif
