#include "megacore/ops/rope.hpp"

#include <numbers>

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/rope_cuda.hpp"
#endif

using namespace megacore;
using namespace mctest;

TEST_CASE("rope backward matches finite differences (f64)", "[ops][rope]") {
  const int64_t tokens = 3, heads = 2, d = 10;
  for (bool il : {false, true}) {
    for (int64_t rot : {int64_t(10), int64_t(6)}) {
      const uint64_t seed = fresh_seed();
      INFO("interleaved " << il << " rot " << rot << " seed " << seed);
      auto x = rand_vec(tokens * heads * d, seed), g = rand_vec(tokens * heads * d, seed + 1);
      auto inv = rand_vec(rot / 2, seed + 2, 0.01, 1.0);
      std::vector<int64_t> pos{5, 0, 17};
      std::vector<double> y(x.size()), dx(x.size());
      auto loss = [&](const std::vector<double>& xx) {
        ops::ref::rope_f64(xx.data(), pos.data(), inv.data(), y.data(), tokens, heads, d, rot, il, false);
        return dot(y, g);
      };
      ops::ref::rope_f64(g.data(), pos.data(), inv.data(), dx.data(), tokens, heads, d, rot, il, true);
      CHECK(rel_err(dx, numeric_grad(loss, x)) < 1e-8);
    }
  }
}

TEST_CASE("rope inverse frequencies, Llama-3 scaling and packed positions", "[ops][rope]") {
  ops::RopeConfig cfg;
  cfg.rotary_dim = 128;
  cfg.theta = 500000;
  auto plain = ops::rope_inv_freq(cfg).to_double_vector();
  REQUIRE(plain.size() == 64);
  REQUIRE(plain[0] == 1.0);
  REQUIRE(plain[1] == Approx(std::pow(500000.0, -2.0 / 128)).epsilon(1e-6));
  cfg.scaling.type = ops::RopeScaling::Type::Llama3;
  auto scaled = ops::rope_inv_freq(cfg).to_double_vector();
  for (size_t i = 0; i < 64; ++i) {
    const double wavelen = 2 * std::numbers::pi / plain[i];
    if (wavelen < 8192.0 / 4) REQUIRE(scaled[i] == plain[i]);                          // high frequencies kept
    else if (wavelen > 8192.0) REQUIRE(scaled[i] == Approx(plain[i] / 8).epsilon(1e-6));  // low ones divided
    else REQUIRE((scaled[i] <= plain[i] && scaled[i] >= plain[i] / 8 * (1 - 1e-6)));
  }
  Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 3, 3, 5}, {4});
  REQUIRE(ops::rope_positions_from_cu_seqlens(cu).to_double_vector() == std::vector<double>{0, 1, 2, 0, 1});
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 3, 2}, {3});
  REQUIRE_THROWS_WITH(ops::rope_positions_from_cu_seqlens(bad), Catch::Contains("non-decreasing"));
}

TEST_CASE("rope arguments are validated", "[ops][rope]") {
  Tensor x = Tensor::zeros({4, 2, 8}), y = Tensor::empty({4, 2, 8});
  Tensor pos = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3}, {4});
  ops::RopeConfig cfg;
  cfg.rotary_dim = 8;
  Tensor inv = ops::rope_inv_freq(cfg);
  REQUIRE_NOTHROW(ops::rope_forward(x, pos, inv, y, false));
  Tensor pos3 = Tensor::from_vector(std::vector<int32_t>{0, 1, 2}, {3});
  REQUIRE_THROWS_WITH(ops::rope_forward(x, pos3, inv, y, false), Catch::Contains("one position id per token"));
  Tensor posf = Tensor::zeros({4});
  REQUIRE_THROWS_WITH(ops::rope_forward(x, posf, inv, y, false), Catch::Contains("must be i32 or i64"));
  cfg.rotary_dim = 10;
  Tensor inv10 = ops::rope_inv_freq(cfg);
  REQUIRE_THROWS_WITH(ops::rope_forward(x, pos, inv10, y, false), Catch::Contains("rotary_dim"));
  Tensor x2 = Tensor::zeros({4, 8});
  REQUIRE_THROWS_WITH(ops::rope_forward(x2, pos, inv, y, false), Catch::Contains("[..., heads, head_dim]"));
  cfg.rotary_dim = 7;
  REQUIRE_THROWS_AS(ops::rope_inv_freq(cfg), ValueError);
}

TEST_CASE("rope CUDA kernel matches the CPU reference", "[ops][rope][gpu]") {
  MC_REQUIRE_GPU();
  struct Case { int64_t tokens, heads, d, rot; };
  for (Case c : {Case{37, 3, 64, 64}, Case{129, 8, 128, 128}, Case{33, 5, 128, 64}, Case{17, 3, 10, 6},
                 Case{11, 2, 9, 4}}) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      for (bool il : {false, true}) {
        for (bool bwd : {false, true}) {
          const uint64_t seed = fresh_seed();
          INFO("tokens " << c.tokens << " heads " << c.heads << " d " << c.d << " rot " << c.rot << " " << dtype_name(dt)
                         << " interleaved " << il << " backward " << bwd << " seed " << seed);
          ops::RopeConfig cfg;
          cfg.rotary_dim = c.rot;
          cfg.theta = 500000;
          cfg.scaling.type = ops::RopeScaling::Type::Llama3;
          const Shape sh{c.tokens, c.heads, c.d};
          Tensor x = randn(sh, dt, seed);
          // packed sequences: positions restart, and reach large values
          std::vector<int64_t> pv(static_cast<size_t>(c.tokens));
          for (int64_t t = 0; t < c.tokens; ++t) pv[size_t(t)] = t < c.tokens / 2 ? t * 997 : t - c.tokens / 2;
          Tensor pos = Tensor::from_vector(pv, {c.tokens});
          if (dt == DType::BF16) pos = pos.to(DType::I32);
          Tensor inv = ops::rope_inv_freq(cfg);
          Tensor y = Tensor::empty(sh, dt);
          Device g = gpu();
          Tensor gx = x.to(g), gy = poisoned(sh, dt, g), gpos = pos.to(g), ginv = inv.to(g);
          if (bwd) {
            ops::rope_backward(x, pos, inv, y, il);
            ops::rope_backward(gx, gpos, ginv, gy, il);
          } else {
            ops::rope_forward(x, pos, inv, y, il);
            ops::rope_forward(gx, gpos, ginv, gy, il);
          }
          CHECK(rel_err_t(gy, y) < tol_for(dt));
          // in place gives the same
          ops::rope_forward(gx, gpos, ginv, gx, il);
          if (!bwd) CHECK(rel_err_t(gx, y) < tol_for(dt));
        }
      }
    }
  }
}

#if MEGACORE_WITH_CUDA
TEST_CASE("rope kernel launch shapes all match the CPU reference", "[ops][rope][gpu]") {
  MC_REQUIRE_GPU();
  const ops::cuda::RopeTuning shapes[] = {{},
                                          {.threads = 128, .head_chunk = 0, .unroll = 1},
                                          {.threads = 128, .head_chunk = 0, .unroll = 4},
                                          {.threads = 64, .head_chunk = 3, .unroll = 2},
                                          {.threads = 256, .head_chunk = 4, .unroll = 4},
                                          {.threads = 32, .head_chunk = 1, .unroll = 1}};
  struct Case { int64_t tokens, heads, d, rot; };
  for (Case c : {Case{37, 11, 128, 128}, Case{33, 5, 64, 32}, Case{17, 7, 10, 6}}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      for (bool il : {false, true}) {
        const uint64_t seed = fresh_seed();
        ops::RopeConfig cfg;
        cfg.rotary_dim = c.rot;
        const Shape sh{c.tokens, c.heads, c.d};
        Tensor x = randn(sh, dt, seed);
        std::vector<int32_t> pv(static_cast<size_t>(c.tokens));
        for (int64_t t = 0; t < c.tokens; ++t) pv[size_t(t)] = int32_t(t * 131);
        Tensor pos = Tensor::from_vector(pv, {c.tokens});
        Tensor inv = ops::rope_inv_freq(cfg);
        Tensor y = Tensor::empty(sh, dt);
        ops::rope_forward(x, pos, inv, y, il);
        Device g = gpu();
        // A blocking stream: ordered after the default-stream poison fills and copies.
        Stream s = Stream::create(g, /*non_blocking=*/false);
        Tensor gx = x.to(g), gpos = pos.to(g), ginv = inv.to(g);
        for (const auto& t : shapes) {
          INFO("tokens " << c.tokens << " heads " << c.heads << " d " << c.d << " rot " << c.rot << " "
                         << dtype_name(dt) << " interleaved " << il << " seed " << seed << " threads " << t.threads
                         << " head_chunk " << t.head_chunk << " unroll " << t.unroll);
          Tensor gy = poisoned(sh, dt, g);
          ops::cuda::RopeArgs a;
          a.x = gx.data_ptr();
          a.y = gy.data_ptr();
          a.positions = gpos.data_ptr();
          a.positions_i64 = false;
          a.inv_freq = ginv.data<float>();
          a.tokens = c.tokens;
          a.heads = c.heads;
          a.head_dim = c.d;
          a.rotary_dim = c.rot;
          a.interleaved = il;
          a.tuning = t;
          ops::cuda::rope(dt, a, g.index, s.native());
          s.synchronize();
          CHECK(rel_err_t(gy, y) < tol_for(dt));
        }
      }
    }
  }
}
#endif
