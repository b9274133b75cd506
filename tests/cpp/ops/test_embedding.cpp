#include "megacore/ops/embedding.hpp"

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/embedding_cuda.hpp"
#endif

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

#if MEGACORE_WITH_CUDA
TEST_CASE("embedding backward launch shapes all match the CPU reference", "[ops][embedding][gpu]") {
  MC_REQUIRE_GPU();
  const ops::cuda::EmbeddingTuning shapes[] = {{},
                                               {.vector = false},
                                               {.threads = 32, .unroll = 1, .sort = 0},
                                               {.threads = 64, .unroll = 4, .sort = 0},
                                               {.threads = 128, .unroll = 2, .sort = 0},
                                               {.sort = 0},
                                               {.threads = 32, .unroll = 1, .sort = 1},
                                               {.threads = 128, .unroll = 4, .sort = 1},
                                               {.threads = 64, .unroll = 2, .sort = 2},
                                               {.vector = false, .sort = 1}};  // element kernel: radix sort
  // {4099, 3, 264}: runs of about 1366 tokens, longer than any block (the counting sort's in-order walk);
  // {999, 37, 1000}: runs of about 27 (ranked in shared memory, or walked with 32 threads).
  struct Case { int64_t n, v, h; };
  for (Case c : {Case{1000, 50, 64}, Case{999, 37, 1000}, Case{300, 2000, 2056}, Case{100, 20, 37},
                 Case{4099, 3, 264}, Case{1, 5, 8}}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      for (bool acc : {false, true}) {
        const uint64_t seed = fresh_seed();
        Tensor ids = random_ids(c.n, 0, c.v, seed, DType::I32);
        Tensor g = randn({c.n, c.h}, dt, seed + 2), dw_init = randn({c.v, c.h}, DType::F32, seed + 3);
        Tensor dw = dw_init.clone();
        ops::embedding_backward(g, ids, dw, acc);
        Device d = gpu();
        // A blocking stream: ordered after the default-stream poison fills and copies.
        Stream s = Stream::create(d, /*non_blocking=*/false);
        Tensor gg = g.to(d), gids = ids.to(d);
        const size_t ws_bytes = ops::cuda::embedding_backward_workspace_bytes(c.n, c.v, d.index);
        Tensor ws = Tensor::empty({int64_t(ws_bytes / 4 + 1)}, DType::F32, d);
        for (const auto& t : shapes) {
          INFO("n " << c.n << " v " << c.v << " h " << c.h << " " << dtype_name(dt) << " accumulate " << acc
                    << " seed " << seed << " vector " << t.vector << " threads " << t.threads << " unroll "
                    << t.unroll << " sort " << t.sort);
          Tensor gdw = acc ? dw_init.to(d) : poisoned({c.v, c.h}, DType::F32, d);
          ops::cuda::embedding_backward(dt, DType::F32, gg.data_ptr(), gids.data_ptr(), false, gdw.data_ptr(), c.n, c.v,
                                        c.h, -1, acc, ws.data_ptr(), ws_bytes, d.index, s.native(), t);
          s.synchronize();
          CHECK(rel_err_t(gdw, dw) < 1e-6);
          // Every shape adds a row's gradients in token order: the same bits as the default, every run.
          Tensor gdw_def = acc ? dw_init.to(d) : poisoned({c.v, c.h}, DType::F32, d);
          ops::cuda::embedding_backward(dt, DType::F32, gg.data_ptr(), gids.data_ptr(), false, gdw_def.data_ptr(), c.n,
                                        c.v, c.h, -1, acc, ws.data_ptr(), ws_bytes, d.index, s.native(), {});
          s.synchronize();
          CHECK(gdw.to_double_vector() == gdw_def.to_double_vector());
        }
      }
    }
  }
}
#endif
