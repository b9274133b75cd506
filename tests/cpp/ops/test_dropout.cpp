#include "megacore/ops/dropout.hpp"

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/dropout_cuda.hpp"
#include "ops/dropout_math.hpp"
#endif

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

#if MEGACORE_WITH_CUDA
TEST_CASE("dropout kernel launch shapes all draw the CPU's mask", "[ops][dropout][gpu]") {
  MC_REQUIRE_GPU();
  const ops::cuda::DropoutTuning shapes[] = {
      {}, {.elems = 4, .unroll = 1, .threads = 256, .blocks_per_sm = 16}, {.elems = 4, .unroll = 2, .threads = 128},
      {.elems = 8, .unroll = 1, .threads = 64}, {.elems = 8, .unroll = 4, .threads = 512},
      {.elems = 8, .unroll = 2, .threads = 256, .blocks_per_sm = 1}};
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t n : {int64_t(5), int64_t(4099), int64_t(100003)}) {
      const uint64_t seed = fresh_seed();
      Tensor x = randn({n}, dt, seed), y = Tensor::empty({n}, dt), m = Tensor::empty({n}, DType::U8);
      ops::dropout_forward(x, y, 0.25f, seed, 7, {}, &m);
      Device d = gpu();
      // A blocking stream: ordered after the default-stream poison fills and copies.
      Stream s = Stream::create(d, /*non_blocking=*/false);
      Tensor gx = x.to(d);
      for (const auto& t : shapes) {
        INFO(dtype_name(dt) << " n " << n << " seed " << seed << " elems " << t.elems << " unroll " << t.unroll
                            << " threads " << t.threads << " blocks_per_sm " << t.blocks_per_sm);
        Tensor gy = poisoned({n}, dt, d), gm = poisoned({n}, DType::U8, d);
        ops::cuda::dropout(dt, gx.data_ptr(), gy.data_ptr(), gm.data<uint8_t>(), n, ops::dropmath::threshold(0.25f),
                           1.f / (1.f - 0.25f), seed, 7, d.index, s.native(), t);
        s.synchronize();
        CHECK(gy.to_double_vector() == y.to_double_vector());
        CHECK(gm.to_double_vector() == m.to_double_vector());
      }
      // Misaligned by one element: the scalar kernel.
      if (n > 1) {
        Tensor gy = poisoned({n}, dt, d), gm = poisoned({n}, DType::U8, d);
        ops::cuda::dropout(dt, static_cast<const char*>(gx.data_ptr()) + dtype_size(dt),
                           static_cast<char*>(gy.data_ptr()) + dtype_size(dt), gm.data<uint8_t>() + 1, n - 1,
                           ops::dropmath::threshold(0.25f), 1.f / (1.f - 0.25f), seed, 7, d.index, s.native(), {});
        s.synchronize();
        const std::vector<double> xv = x.to_double_vector();
        Tensor x1 = Tensor::from_vector(std::vector<float>(xv.begin() + 1, xv.end()), {n - 1}).to(dt);
        Tensor y1 = Tensor::empty({n - 1}, dt), m1 = Tensor::empty({n - 1}, DType::U8);
        ops::dropout_forward(x1, y1, 0.25f, seed, 7, {}, &m1);
        std::vector<double> gyv = gy.to_double_vector(), gmv = gm.to_double_vector();
        CHECK(std::vector<double>(gyv.begin() + 1, gyv.end()) == y1.to_double_vector());
        CHECK(std::vector<double>(gmv.begin() + 1, gmv.end()) == m1.to_double_vector());
      }
    }
  }
}
#endif
