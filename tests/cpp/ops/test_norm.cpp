#include "megacore/ops/norm.hpp"

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/norm_cuda.hpp"
#endif

using namespace megacore;
using namespace mctest;

TEST_CASE("norm backward matches finite differences (f64)", "[ops][norm]") {
  for (bool layer : {false, true}) {
    INFO("layer=" << layer);
    const int64_t rows = 3, h = 7;
    const uint64_t seed = fresh_seed();
    INFO("seed " << seed);
    auto x = rand_vec(rows * h, seed), w = rand_vec(h, seed + 1, 0.5, 1.5), b = rand_vec(h, seed + 2),
         g = rand_vec(rows * h, seed + 3);
    std::vector<double> y(rows * h), mean(rows), rstd(rows);
    auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww, const std::vector<double>& bb) {
      ops::ref::norm_forward_f64(layer, xx.data(), ww.data(), bb.data(), y.data(), mean.data(), rstd.data(), rows, h,
                                 1e-5);
      return dot(y, g);
    };
    loss(x, w, b);
    std::vector<double> dx(rows * h), dw(h), db(h);
    ops::ref::norm_backward_f64(layer, g.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(), dw.data(),
                                db.data(), rows, h);
    auto ndx = numeric_grad([&](const std::vector<double>& v) { return loss(v, w, b); }, x);
    auto ndw = numeric_grad([&](const std::vector<double>& v) { return loss(x, v, b); }, w);
    auto ndb = numeric_grad([&](const std::vector<double>& v) { return loss(x, w, v); }, b);
    CHECK(rel_err(dx, ndx) < 1e-7);
    CHECK(rel_err(dw, ndw) < 1e-7);
    if (layer) CHECK(rel_err(db, ndb) < 1e-7);
  }
}

TEST_CASE("norm CPU path: residual fusion and accumulation", "[ops][norm]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t rows = 4, h = 9;
  Tensor x = randn({rows, h}, DType::F32, seed), r = randn({rows, h}, DType::F32, seed + 1);
  Tensor w = randn({h}, DType::F32, seed + 2, 1.0, 0.1), b = randn({h}, DType::F32, seed + 3);
  Tensor y = Tensor::empty({rows, h}), ro = Tensor::empty({rows, h}), mean = Tensor::empty({rows}),
         rstd = Tensor::empty({rows});
  ops::layernorm_forward_residual(x, r, w, b, y, ro, mean, rstd, 1e-5f);
  auto xv = x.to_double_vector(), rv = r.to_double_vector(), rov = ro.to_double_vector();
  for (size_t i = 0; i < xv.size(); ++i) REQUIRE(rov[i] == double(float(xv[i] + rv[i])));
  Tensor y2 = Tensor::empty({rows, h}), m2 = Tensor::empty({rows}), s2 = Tensor::empty({rows});
  ops::layernorm_forward(ro, w, b, y2, m2, s2, 1e-5f);
  REQUIRE(y.to_double_vector() == y2.to_double_vector());

  // accumulate adds to what dweight held
  Tensor dy = randn({rows, h}, DType::F32, seed + 4), dx = Tensor::empty({rows, h});
  Tensor dw0 = Tensor::empty({h}), db0 = Tensor::empty({h});
  ops::layernorm_backward(dy, ro, w, mean, rstd, dx, dw0, db0);
  Tensor dw1 = Tensor::full({h}, 2.0), db1 = Tensor::full({h}, -1.0);
  ops::layernorm_backward(dy, ro, w, mean, rstd, dx, dw1, db1, {}, true);
  auto a0 = dw0.to_double_vector(), a1 = dw1.to_double_vector(), c0 = db0.to_double_vector(), c1 = db1.to_double_vector();
  for (int64_t j = 0; j < h; ++j) {
    REQUIRE(a1[j] == Approx(a0[j] + 2.0).margin(1e-5));  // f32 sums near 1: absolute tolerance
    REQUIRE(c1[j] == Approx(c0[j] - 1.0).margin(1e-5));
  }
  // residual backward adds the incoming residual gradient
  Tensor dres = randn({rows, h}, DType::F32, seed + 5), dx2 = Tensor::empty({rows, h});
  ops::layernorm_backward_residual(dy, dres, ro, w, mean, rstd, dx2, dw0, db0);
  auto d1 = dx.to_double_vector(), d2 = dx2.to_double_vector(), dr = dres.to_double_vector();
  for (size_t i = 0; i < d1.size(); ++i) REQUIRE(d2[i] == Approx(d1[i] + dr[i]).margin(1e-6));
}

TEST_CASE("norm arguments are validated", "[ops][norm]") {
  Tensor x = Tensor::zeros({4, 8}), w = Tensor::zeros({8}), y = Tensor::empty({4, 8}), rstd = Tensor::empty({4});
  Tensor mean = Tensor::empty({4}), b = Tensor::zeros({8});
  REQUIRE_NOTHROW(ops::rmsnorm_forward(x, w, y, rstd, 1e-5f));
  Tensor w7 = Tensor::zeros({7});
  REQUIRE_THROWS_WITH(ops::rmsnorm_forward(x, w7, y, rstd, 1e-5f), Catch::Contains("weight has shape [7], expected [8]"));
  Tensor wb = Tensor::zeros({8}, DType::BF16);
  REQUIRE_THROWS_WITH(ops::rmsnorm_forward(x, wb, y, rstd, 1e-5f), Catch::Contains("dtype"));
  Tensor r3 = Tensor::empty({3});
  REQUIRE_THROWS_WITH(ops::rmsnorm_forward(x, w, y, r3, 1e-5f), Catch::Contains("rstd has 3 elements"));
  Tensor xt = Tensor::zeros({8, 4}).transpose(0, 1);
  REQUIRE_THROWS_WITH(ops::rmsnorm_forward(xt, w, y, rstd, 1e-5f), Catch::Contains("not contiguous"));
  Tensor xi = Tensor::zeros({4, 8}, DType::I32);
  REQUIRE_THROWS_WITH(ops::layernorm_forward(xi, w, b, y, mean, rstd, 1e-5f), Catch::Contains("must be f32, bf16 or f16"));
  Tensor rb = Tensor::empty({4}, DType::BF16);
  REQUIRE_THROWS_WITH(ops::layernorm_forward(x, w, b, y, mean, rb, 1e-5f), Catch::Contains("rstd has dtype bf16"));
  REQUIRE_THROWS_AS(ops::rmsnorm_forward(x, w, y, rstd, -1.f), ValueError);
  Tensor dx = Tensor::empty({4, 8}), dw = Tensor::empty({8}), dy = Tensor::zeros({4, 9});
  REQUIRE_THROWS_WITH(ops::rmsnorm_backward(dy, x, w, rstd, dx, dw), Catch::Contains("dy has shape [4, 9]"));
  // The fused residual sum needs its own buffer (the kernels read x/residual while it is written).
  Tensor res = Tensor::zeros({4, 8}), rout = Tensor::empty({4, 8});
  REQUIRE_NOTHROW(ops::rmsnorm_forward_residual(x, res, w, y, rout, rstd, 1e-5f));
  REQUIRE_THROWS_WITH(ops::rmsnorm_forward_residual(x, res, w, y, x, rstd, 1e-5f),
                      Catch::Contains("residual_out must not share memory with x or residual"));
  Tensor big = Tensor::zeros({8, 8});
  Tensor lower = big.slice(0, 2, 6), upper = big.slice(0, 0, 4);  // rows 2-5 and 0-3: overlapping views
  REQUIRE_THROWS_WITH(ops::layernorm_forward_residual(x, lower, w, b, y, upper, mean, rstd, 1e-5f),
                      Catch::Contains("must not share memory"));
  Tensor top = big.slice(0, 0, 4);
  REQUIRE_NOTHROW(ops::layernorm_forward_residual(x, big.slice(0, 4, 8), w, b, y, top, mean, rstd, 1e-5f));
}

TEST_CASE("norm CUDA kernels match the CPU reference", "[ops][norm][gpu]") {
  MC_REQUIRE_GPU();
  struct Case { int64_t rows, h; };
  // 37: generic kernel; 256..8192: row in registers; 12288: forward in registers, backward generic.
  for (Case c : {Case{5, 37}, Case{67, 256}, Case{33, 1000}, Case{9, 5000}, Case{7, 8192}, Case{3, 12288}}) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      for (bool layer : {false, true}) {
        for (bool fused : {false, true}) {
          const uint64_t seed = fresh_seed();
          INFO("rows " << c.rows << " h " << c.h << " dtype " << dtype_name(dt) << " layer " << layer << " fused "
                       << fused << " seed " << seed);
          const Shape sh{c.rows, c.h};
          Tensor x = randn(sh, dt, seed, 0.3, 1.0), res = randn(sh, dt, seed + 1);
          Tensor w = randn({c.h}, dt, seed + 2, 1.0, 0.2), b = randn({c.h}, dt, seed + 3, 0.0, 0.5);
          Tensor dy = randn(sh, dt, seed + 4), dres = randn(sh, dt, seed + 5);
          Tensor dw_init = randn({c.h}, DType::F32, seed + 6);
          // CPU reference
          Tensor y = Tensor::empty(sh, dt), ro = Tensor::empty(sh, dt), mean = Tensor::empty({c.rows}),
                 rstd = Tensor::empty({c.rows});
          Tensor db_init = randn({c.h}, DType::F32, seed + 7);
          Tensor dx = Tensor::empty(sh, dt), dw = dw_init.clone(), db = db_init.clone();
          // GPU
          Device g = gpu();
          // A blocking stream: ordered after the default-stream poison fills and copies.
          Stream s = Stream::create(g, /*non_blocking=*/false);
          Tensor gx = x.to(g), gres = res.to(g), gw = w.to(g), gb = b.to(g), gdy = dy.to(g), gdres = dres.to(g);
          Tensor gy = poisoned(sh, dt, g), gro = poisoned(sh, dt, g), gmean = poisoned({c.rows}, DType::F32, g),
                 grstd = poisoned({c.rows}, DType::F32, g), gdx = poisoned(sh, dt, g), gdw = dw_init.to(g),
                 gdb = db_init.to(g);  // accumulated into
          if (layer) {
            if (fused) {
              ops::layernorm_forward_residual(x, res, w, b, y, ro, mean, rstd, 1e-5f);
              ops::layernorm_forward_residual(gx, gres, gw, gb, gy, gro, gmean, grstd, 1e-5f, s);
              ops::layernorm_backward_residual(dy, dres, ro, w, mean, rstd, dx, dw, db, {}, true);
              ops::layernorm_backward_residual(gdy, gdres, gro, gw, gmean, grstd, gdx, gdw, gdb, s, true);
            } else {
              ops::layernorm_forward(x, w, b, y, mean, rstd, 1e-5f);
              ops::layernorm_forward(gx, gw, gb, gy, gmean, grstd, 1e-5f, s);
              ops::layernorm_backward(dy, x, w, mean, rstd, dx, dw, db, {}, true);
              ops::layernorm_backward(gdy, gx, gw, gmean, grstd, gdx, gdw, gdb, s, true);
            }
          } else {
            if (fused) {
              ops::rmsnorm_forward_residual(x, res, w, y, ro, rstd, 1e-5f);
              ops::rmsnorm_forward_residual(gx, gres, gw, gy, gro, grstd, 1e-5f, s);
              ops::rmsnorm_backward_residual(dy, dres, ro, w, rstd, dx, dw, {}, true);
              ops::rmsnorm_backward_residual(gdy, gdres, gro, gw, grstd, gdx, gdw, s, true);
            } else {
              ops::rmsnorm_forward(x, w, y, rstd, 1e-5f);
              ops::rmsnorm_forward(gx, gw, gy, grstd, 1e-5f, s);
              ops::rmsnorm_backward(dy, x, w, rstd, dx, dw, {}, true);
              ops::rmsnorm_backward(gdy, gx, gw, grstd, gdx, gdw, s, true);
            }
          }
          s.synchronize();
          const double tol = tol_for(dt);
          CHECK(rel_err_t(gy, y) < tol);
          CHECK(rel_err_t(grstd, rstd) < 1e-5);
          if (layer) CHECK(rel_err_t(gmean, mean) < 1e-5);
          if (fused) CHECK(rel_err_t(gro, ro) == 0.0);
          CHECK(rel_err_t(gdx, dx) < tol);
          CHECK(rel_err_t(gdw, dw) < 1e-4);
          if (layer) CHECK(rel_err_t(gdb, db) < 1e-4);
        }
      }
    }
  }
}

TEST_CASE("norm weight gradients are bit-identical from run to run", "[ops][norm][gpu]") {
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  Device g = gpu();
  const Shape sh{2049, 1024};
  Tensor x = randn(sh, DType::BF16, seed, 0, 1, g), dy = randn(sh, DType::BF16, seed + 1, 0, 1, g);
  Tensor w = randn({1024}, DType::BF16, seed + 2, 1, 0.1, g);
  Tensor y = Tensor::empty(sh, DType::BF16, g), rstd = Tensor::empty({2049}, DType::F32, g);
  ops::rmsnorm_forward(x, w, y, rstd, 1e-6f);
  Tensor dx = Tensor::empty(sh, DType::BF16, g), dw1 = Tensor::empty({1024}, DType::F32, g),
         dw2 = Tensor::empty({1024}, DType::F32, g);
  ops::rmsnorm_backward(dy, x, w, rstd, dx, dw1);
  ops::rmsnorm_backward(dy, x, w, rstd, dx, dw2);
  REQUIRE(dw1.to_double_vector() == dw2.to_double_vector());
}

#if MEGACORE_WITH_CUDA
TEST_CASE("norm backward launch shapes all match the CPU reference", "[ops][norm][gpu]") {
  MC_REQUIRE_GPU();
  using NT = ops::cuda::NormTuning;
  // Every bench_norm backward variant (NT{} is the default: 4 vectors, shared-memory sums in 512-thread
  // blocks, 16-byte finalize), the register sums (LayerNorm's default fallback: 2 vectors) and both finalizes.
  const NT shapes[] = {NT{},
                       NT{.bwd_finalize = 0},
                       NT{.bwd_smem_acc = false, .bwd_finalize = 0},
                       NT{.bwd_smem_acc = false},
                       NT{.bwd_vecs = 2, .bwd_smem_acc = false},
                       NT{.bwd_vecs = 4, .bwd_smem_acc = false},
                       NT{.bwd_vecs = 0, .min_block = 512, .bwd_smem_acc = false},
                       NT{.bwd_vecs = 1, .min_block = 256, .bwd_threads_per_sm = 0, .bwd_smem_acc = false},
                       NT{.bwd_vecs = 2, .min_block = 512, .bwd_prefetch = true, .bwd_smem_acc = false},
                       NT{.bwd_vecs = 2, .bwd_prefetch = true, .bwd_smem_acc = false, .bwd_finalize = 0},
                       NT{.bwd_vecs = 2, .bwd_smem_acc = false, .bwd_finalize = 0},
                       NT{.fwd_vecs = 1, .bwd_vecs = 1, .bwd_prefetch = true, .bwd_smem_acc = false,
                          .bwd_finalize = 0},
                       // shared-memory sums (at h 8192 LayerNorm's 4-vector sums need 64 KiB)
                       NT{.bwd_vecs = 2},
                       NT{.bwd_vecs = 2, .bwd_prefetch = true},
                       NT{.bwd_vecs = 1},
                       NT{.bwd_vecs = 1, .min_block = 512, .bwd_prefetch = true, .bwd_finalize = 0},
                       // fewer, larger partial rows
                       NT{.min_block = 256},
                       NT{.min_block = 512},
                       NT{.min_block = 256, .bwd_threads_per_sm = 0},
                       NT{.min_block = 512, .bwd_threads_per_sm = 0},
                       NT{.bwd_threads_per_sm = 768},
                       NT{.bwd_vecs = 2, .min_block = 256, .bwd_threads_per_sm = 0},
                       NT{.bwd_vecs = 4, .bwd_min_block = 128},
                       NT{.bwd_min_block = 512},
                       // one row group a block, and several with their own barriers
                       NT{.bwd_vecs = 2, .bwd_min_block = 128},
                       NT{.bwd_vecs = 4, .bwd_min_block = 256},
                       NT{.bwd_vecs = 2, .bwd_min_block = 512},
                       NT{.bwd_pdl = false}};
  struct Case { int64_t rows, h; };
  // 256 and 512: several row groups per block; 1029 rows: the last pass of the
  // persistent grid has dead row groups. 37 and 1002: generic kernel, and rows that are not whole float4s
  // take the scalar finalize even when bwd_finalize = 1. 1000 and 2056: rows in registers whose last
  // vectors leave some threads of the group without columns. 8192: the largest shared-memory sums.
  for (Case c : {Case{67, 256}, Case{33, 1000}, Case{301, 4096}, Case{5, 37}, Case{19, 1002}, Case{41, 2056},
                 Case{7, 8192}, Case{1029, 512}}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      for (bool layer : {false, true}) {
        const uint64_t seed = fresh_seed();
        const Shape sh{c.rows, c.h};
        Tensor x = randn(sh, dt, seed, 0.3, 1.0), w = randn({c.h}, dt, seed + 2, 1.0, 0.2);
        Tensor b = randn({c.h}, dt, seed + 3, 0.0, 0.5), dy = randn(sh, dt, seed + 4);
        Tensor dw_init = randn({c.h}, DType::F32, seed + 6), db_init = randn({c.h}, DType::F32, seed + 7);
        Tensor y = Tensor::empty(sh, dt), mean = Tensor::empty({c.rows}), rstd = Tensor::empty({c.rows});
        Tensor dx = Tensor::empty(sh, dt), dw = dw_init.clone(), db = db_init.clone();
        if (layer) {
          ops::layernorm_forward(x, w, b, y, mean, rstd, 1e-5f);
          ops::layernorm_backward(dy, x, w, mean, rstd, dx, dw, db, {}, true);
        } else {
          ops::rmsnorm_forward(x, w, y, rstd, 1e-5f);
          ops::rmsnorm_backward(dy, x, w, rstd, dx, dw, {}, true);
        }
        Device g = gpu();
        // A blocking stream: ordered after the default-stream poison fills and copies.
        Stream s = Stream::create(g, /*non_blocking=*/false);
        Tensor gx = x.to(g), gw = w.to(g), gdy = dy.to(g), gmean = mean.to(g), grstd = rstd.to(g);
        // One backward on the test's stream with a workspace sized for these arguments.
        auto run = [&](const ops::cuda::NormBackwardArgs& args) {
          const size_t ws_bytes = ops::cuda::norm_backward_workspace_bytes(args, dt, g.index);
          Tensor ws = Tensor::empty({int64_t(ws_bytes / 4 + 1)}, DType::F32, g);
          ops::cuda::norm_backward(dt, args, ws.data_ptr(), g.index, s.native());
          s.synchronize();
        };
        for (const auto& t : shapes) {
          INFO("rows " << c.rows << " h " << c.h << " " << dtype_name(dt) << " layer " << layer << " seed " << seed
                       << " bwd_vecs " << t.bwd_vecs << " min_block " << t.min_block
                       << " prefetch " << t.bwd_prefetch << " threads_per_sm " << t.bwd_threads_per_sm
                       << " smem_acc " << t.bwd_smem_acc << " finalize "
                       << t.bwd_finalize);
          Tensor gdx = poisoned(sh, dt, g), gdw = dw_init.to(g), gdb = db_init.to(g);
          ops::cuda::NormBackwardArgs a;
          a.layer = layer;
          a.dy = gdy.data_ptr();
          a.x = gx.data_ptr();
          a.w = gw.data_ptr();
          a.mean = layer ? gmean.data<float>() : nullptr;
          a.rstd = grstd.data<float>();
          a.dx = gdx.data_ptr();
          a.dw = gdw.data_ptr();
          a.db = layer ? gdb.data_ptr() : nullptr;
          a.accumulate = true;
          a.rows = c.rows;
          a.h = c.h;
          a.tuning = t;
          run(a);
          CHECK(rel_err_t(gdx, dx) < tol_for(dt));
          CHECK(rel_err_t(gdw, dw) < 1e-4);
          if (layer) CHECK(rel_err_t(gdb, db) < 1e-4);
          // A second run gives bit-identical weight/bias gradients (fixed summation order).
          Tensor gdw2 = dw_init.to(g), gdb2 = db_init.to(g);
          a.dw = gdw2.data_ptr();
          a.db = layer ? gdb2.data_ptr() : nullptr;
          run(a);
          CHECK(gdw2.to_double_vector() == gdw.to_double_vector());
          if (layer) CHECK(gdb2.to_double_vector() == gdb.to_double_vector());
          {
            // bf16 weight/bias gradients (every finalize converts and accumulates in the gradient's
            // dtype), outputs poisoned where not accumulated
            Tensor gdw4 = dw_init.to(DType::BF16).to(g), gdb4 = db_init.to(DType::BF16).to(g);
            Tensor gdw5 = poisoned({c.h}, DType::BF16, g);
            a.dw = gdw4.data_ptr();
            a.dw_dtype = DType::BF16;
            a.db = layer ? gdb4.data_ptr() : nullptr;
            a.db_dtype = DType::BF16;
            run(a);
            a.dw = gdw5.data_ptr();
            a.db = nullptr;
            a.accumulate = false;
            run(a);
            CHECK(rel_err_t(gdw4, dw) < 1e-2);
            if (layer) CHECK(rel_err_t(gdb4, db) < 1e-2);
            // without accumulation: dw - dw_init of the reference
            std::vector<double> want = dw.to_double_vector(), init = dw_init.to_double_vector();
            for (size_t i = 0; i < want.size(); ++i) want[i] -= init[i];
            CHECK(rel_err(gdw5.to_double_vector(), want) < 1e-2);
            a.dw_dtype = DType::F32;
            a.db_dtype = DType::F32;
            a.accumulate = true;
          }
          if (layer) {
            // LayerNorm without a bias gradient: the same dw (its own workspace size), db untouched.
            Tensor gdw3 = dw_init.to(g), gdb3 = db_init.to(g);
            a.dw = gdw3.data_ptr();
            a.db = nullptr;
            run(a);
            CHECK(rel_err_t(gdw3, dw) < 1e-4);
            CHECK(gdb3.to_double_vector() == db_init.to_double_vector());
          }
        }
      }
    }
  }
}
#endif

#if MEGACORE_WITH_CUDA
TEST_CASE("norm forward launch shapes all match the CPU reference", "[ops][norm][gpu]") {
  MC_REQUIRE_GPU();
  using NT = ops::cuda::NormTuning;
  // every fwd_vecs of bench_norm's variants, with short rows sharing small and large blocks
  const NT shapes[] = {NT{}, NT{.fwd_vecs = 4}, NT{.fwd_vecs = 2}, NT{.fwd_vecs = 1},
                       NT{.fwd_vecs = 8, .min_block = 512}, NT{.fwd_vecs = 4, .min_block = 512}};
  struct Case { int64_t rows, h; };
  for (Case c : {Case{67, 256}, Case{33, 1000}, Case{301, 4096}, Case{5, 37}, Case{41, 2056}, Case{9, 8192}}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      for (bool layer : {false, true}) {
        const uint64_t seed = fresh_seed();
        const Shape sh{c.rows, c.h};
        Tensor x = randn(sh, dt, seed, 0.3, 1.0), w = randn({c.h}, dt, seed + 2, 1.0, 0.2);
        Tensor b = randn({c.h}, dt, seed + 3, 0.0, 0.5);
        Tensor y = Tensor::empty(sh, dt), mean = Tensor::empty({c.rows}), rstd = Tensor::empty({c.rows});
        if (layer) ops::layernorm_forward(x, w, b, y, mean, rstd, 1e-5f);
        else ops::rmsnorm_forward(x, w, y, rstd, 1e-5f);
        Device g = gpu();
        // A blocking stream: ordered after the default-stream poison fills and copies.
        Stream s = Stream::create(g, /*non_blocking=*/false);
        Tensor gx = x.to(g), gw = w.to(g), gb = b.to(g);
        for (const auto& t : shapes) {
          INFO("rows " << c.rows << " h " << c.h << " " << dtype_name(dt) << " layer " << layer << " seed " << seed
                       << " fwd_vecs " << t.fwd_vecs << " min_block " << t.min_block);
          Tensor gy = poisoned(sh, dt, g), gmean = poisoned({c.rows}, DType::F32, g),
                 grstd = poisoned({c.rows}, DType::F32, g);
          ops::cuda::NormForwardArgs a;
          a.layer = layer;
          a.x = gx.data_ptr();
          a.w = gw.data_ptr();
          a.b = layer ? gb.data_ptr() : nullptr;
          a.y = gy.data_ptr();
          a.mean = layer ? gmean.data<float>() : nullptr;
          a.rstd = grstd.data<float>();
          a.rows = c.rows;
          a.h = c.h;
          a.eps = 1e-5f;
          a.tuning = t;
          ops::cuda::norm_forward(dt, a, g.index, s.native());
          s.synchronize();
          CHECK(rel_err_t(gy, y) < tol_for(dt));
          CHECK(rel_err_t(grstd, rstd) < 1e-5);
          if (layer) CHECK(rel_err_t(gmean, mean) < 1e-5);
        }
      }
    }
  }
}
#endif
