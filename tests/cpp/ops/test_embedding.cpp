#include "megacore/ops/embedding.hpp"

#include "ops/ops_test_util.hpp"

using namespace megacore;
using namespace mctest;

namespace {
Tensor random_ids(int64_t n, int64_t lo, int64_t hi, uint64_t seed, DType dt) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (auto& e : v) e = lo + int64_t(rng() % uint64_t(hi - lo));
  return Tensor::from_vector(v, {n}).to(dt);
}
}  // namespace

TEST_CASE("embedding CPU lookup, shard masking and backward", "[ops][embedding]") {
  Tensor w = Tensor::from_vector(std::vector<float>{0, 1, 10, 11, 20, 21}, {3, 2});
  Tensor ids = Tensor::from_vector(std::vector<int32_t>{2, 0, 2}, {3});
  Tensor out = Tensor::empty({3, 2});
  ops::embedding_forward(w, ids, out);
  REQUIRE(out.to_double_vector() == std::vector<double>{20, 21, 0, 1, 20, 21});
  // as the shard [1, 4) of a larger vocabulary: id 0 is elsewhere (zero row), ids 2 -> local row 1
  ops::embedding_forward(w, ids, out, 1);
  REQUIRE(out.to_double_vector() == std::vector<double>{10, 11, 0, 0, 10, 11});
  Tensor g = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2});
  Tensor dw = Tensor::full({3, 2}, 100.0);
  ops::embedding_backward(g, ids, dw);
  REQUIRE(dw.to_double_vector() == std::vector<double>{3, 4, 0, 0, 6, 8});
  ops::embedding_backward(g, ids, dw, true);
  REQUIRE(dw.to_double_vector() == std::vector<double>{6, 8, 0, 0, 12, 16});
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{3}, {1});
  Tensor o1 = Tensor::empty({1, 2});
  REQUIRE_THROWS_WITH(ops::embedding_forward(w, bad, o1), Catch::Contains("outside the table"));
  Tensor fid = Tensor::zeros({3});
  REQUIRE_THROWS_WITH(ops::embedding_forward(w, fid, out), Catch::Contains("must be i32 or i64"));
  Tensor o3 = Tensor::empty({3, 3});
  REQUIRE_THROWS_WITH(ops::embedding_forward(w, ids, o3), Catch::Contains("out has shape [3, 3], expected [3, 2]"));
}

TEST_CASE("embedding CUDA kernels match the CPU reference and are deterministic", "[ops][embedding][gpu]") {
  MC_REQUIRE_GPU();
  struct Case { int64_t n, v, h, start; };
  for (Case c : {Case{37, 11, 5, -1}, Case{1000, 50, 64, -1}, Case{4099, 1000, 1024, -1}, Case{777, 300, 96, 100}}) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      const uint64_t seed = fresh_seed();
      INFO("n " << c.n << " v " << c.v << " h " << c.h << " start " << c.start << " " << dtype_name(dt) << " seed " << seed);
      const int64_t lo = c.start < 0 ? 0 : 0, hi = c.start < 0 ? c.v : c.start + c.v + 200;  // shard: some ids outside
      Tensor ids = random_ids(c.n, lo, hi, seed, dt == DType::F32 ? DType::I64 : DType::I32);
      Tensor w = randn({c.v, c.h}, dt, seed + 1), g = randn({c.n, c.h}, dt, seed + 2);
      Tensor out = Tensor::empty({c.n, c.h}, dt), dw = randn({c.v, c.h}, DType::F32, seed + 3);
      Tensor dw_init = dw.clone();
      ops::embedding_forward(w, ids, out, c.start);
      ops::embedding_backward(g, ids, dw, true, c.start);
      Device d = gpu();
      Tensor gw = w.to(d), gids = ids.to(d), gg = g.to(d), gout = poisoned({c.n, c.h}, dt, d), gdw = dw_init.to(d);
      ops::embedding_forward(gw, gids, gout, c.start);
      ops::embedding_backward(gg, gids, gdw, true, c.start);
      CHECK(rel_err_t(gout, out) == 0.0);
      CHECK(rel_err_t(gdw, dw) < 1e-6);
      Tensor gdw2 = poisoned({c.v, c.h}, DType::F32, d), gdw3 = poisoned({c.v, c.h}, DType::F32, d);
      ops::embedding_backward(gg, gids, gdw2, false, c.start);
      ops::embedding_backward(gg, gids, gdw3, false, c.start);
      CHECK(gdw2.to_double_vector() == gdw3.to_double_vector());
    }
  }
}
