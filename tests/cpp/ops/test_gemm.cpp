// GEMM: the CPU (Eigen) path and cuBLASLt against a float64 reference on fresh random inputs.
#include <cmath>
#include <vector>

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#include "megacore/ops/gemm.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/gemm_cuda.hpp"
#endif

using namespace megacore;
using namespace megacore::ops;
using mctest::fresh_seed;

namespace {

struct Case {
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t batch = 0;  // 0: 2-D operands
  bool shared_b = false;  // batched a with one 2-D b
  DType dt = DType::F32;
  DType out = DType::F32;
  float alpha = 1.f, beta = 0.f;
  GemmEpilogue epi = GemmEpilogue::None;
  bool tf32 = false;
};

Shape stored(bool trans, int64_t r, int64_t c, int64_t batch) {
  Shape s = trans ? Shape{c, r} : Shape{r, c};
  if (batch > 0) s.insert(s.begin(), batch);
  return s;
}

double tolerance(const Case& c) {
  if (c.out != DType::F32) return 1e-2;                  // 16-bit output rounding
  if (c.dt != DType::F32) return 1e-4;                   // 16-bit inputs (exact in f64), f32 accumulate
  return c.tf32 ? 2e-3 : 1e-5;
}

bool uses_bias(GemmEpilogue e) { return e == GemmEpilogue::Bias || e == GemmEpilogue::BiasGelu; }
bool is_bgrad(GemmEpilogue e) { return e == GemmEpilogue::BiasGradA || e == GemmEpilogue::BiasGradB; }

void run_case(const Case& c, Device dev) {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed << " ta=" << c.ta << " tb=" << c.tb << " m=" << c.m << " n=" << c.n << " k=" << c.k
                << " batch=" << c.batch << " dt=" << dtype_name(c.dt) << " out=" << dtype_name(c.out)
                << " epi=" << int(c.epi) << " beta=" << c.beta << " on " << dev.str());
  const int64_t nb = std::max<int64_t>(c.batch, 1);
  Tensor a = mctest::randn(stored(c.ta, c.m, c.k, c.batch), c.dt, seed);
  Tensor b = mctest::randn(stored(c.tb, c.k, c.n, c.shared_b ? 0 : c.batch), c.dt, seed + 1);
  Shape oshape = c.batch > 0 ? Shape{c.batch, c.m, c.n} : Shape{c.m, c.n};
  Tensor out0 = mctest::randn(oshape, c.out, seed + 2);  // read when beta != 0
  const int64_t blen = c.epi == GemmEpilogue::BiasGradA ? c.m : c.n;
  Tensor bias = uses_bias(c.epi) ? mctest::randn({blen}, c.out, seed + 3) : mctest::poisoned({blen}, c.out, Device::cpu());

  // Reference in f64 from the (already rounded) stored values.
  std::vector<double> ad = a.to_double_vector(), bd = b.to_double_vector(), cd = out0.to_double_vector();
  const int64_t sa = c.m * c.k, sb = c.shared_b ? 0 : c.k * c.n, sc = c.m * c.n;
  for (int64_t i = 0; i < nb; ++i)
    ref::gemm_f64(c.ta, c.tb, c.m, c.n, c.k, c.alpha, ad.data() + i * sa, bd.data() + i * sb, c.beta,
                  cd.data() + i * sc);
  std::vector<double> bias_ref;
  if (uses_bias(c.epi) || c.epi == GemmEpilogue::Gelu) {
    std::vector<double> bv = uses_bias(c.epi) ? bias.to_double_vector() : std::vector<double>();
    for (int64_t i = 0; i < nb * c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) {
        double& v = cd[size_t(i * c.n + j)];
        if (uses_bias(c.epi)) v += bv[size_t(j)];
        if (c.epi != GemmEpilogue::Bias) v = ref::gelu_tanh(v);
      }
  }
  if (is_bgrad(c.epi)) {
    bias_ref.assign(size_t(blen), 0.0);
    for (int64_t p = 0; p < c.k; ++p)
      for (int64_t i = 0; i < blen; ++i) {
        if (c.epi == GemmEpilogue::BiasGradA) bias_ref[size_t(i)] += c.ta ? ad[size_t(p * c.m + i)] : ad[size_t(i * c.k + p)];
        else bias_ref[size_t(i)] += c.tb ? bd[size_t(i * c.k + p)] : bd[size_t(p * c.n + i)];
      }
  }

  Tensor ad_dev = a.to(dev), bd_dev = b.to(dev);
  Tensor out = c.beta != 0.f ? out0.to(dev).clone() : mctest::poisoned(oshape, c.out, dev);
  Tensor bias_dev = uses_bias(c.epi) ? bias.to(dev) : mctest::poisoned({blen}, c.out, dev);
  GemmOptions o;
  o.trans_a = c.ta, o.trans_b = c.tb, o.alpha = c.alpha, o.beta = c.beta, o.epilogue = c.epi, o.allow_tf32 = c.tf32;
  if (c.epi != GemmEpilogue::None && c.epi != GemmEpilogue::Gelu) o.bias = bias_dev;
  gemm(ad_dev, bd_dev, out, o);
  const double err = mctest::rel_err(out.to_double_vector(), cd);
  INFO("rel err " << err);
  CHECK(err < tolerance(c));
  if (is_bgrad(c.epi)) {
    const double berr = mctest::rel_err(bias_dev.to_double_vector(), bias_ref);
    INFO("bias grad rel err " << berr);
    CHECK(berr < (c.out == DType::F32 ? 1e-5 : 1e-2));
  }
}

std::vector<Case> transposes_and_dtypes() {
  std::vector<Case> cases;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int t = 0; t < 4; ++t) {
      Case c;
      c.ta = t & 1, c.tb = t & 2, c.m = 67, c.n = 45, c.k = 83, c.dt = dt, c.out = dt;
      cases.push_back(c);
    }
  return cases;
}

}  // namespace

TEST_CASE("gemm cpu: all transposes and dtypes against the f64 reference", "[ops][gemm]") {
  for (const Case& c : transposes_and_dtypes()) run_case(c, Device::cpu());
}

TEST_CASE("gemm cpu: alpha, beta accumulation into f32, epilogues, batches", "[ops][gemm]") {
  Case c;
  c.m = 33, c.n = 17, c.k = 29;
  c.dt = DType::BF16, c.out = DType::F32, c.beta = 1.f, c.alpha = 0.5f, c.ta = true;
  run_case(c, Device::cpu());
  for (GemmEpilogue e : {GemmEpilogue::Bias, GemmEpilogue::Gelu, GemmEpilogue::BiasGelu, GemmEpilogue::BiasGradA,
                         GemmEpilogue::BiasGradB}) {
    Case d;
    d.m = 21, d.n = 19, d.k = 40, d.epi = e, d.ta = e == GemmEpilogue::BiasGradA;
    run_case(d, Device::cpu());
  }
  Case bt;
  bt.m = 9, bt.n = 11, bt.k = 13, bt.batch = 3, bt.tb = true;
  run_case(bt, Device::cpu());
  bt.shared_b = true;
  run_case(bt, Device::cpu());
}

TEST_CASE("gemm cpu: a transposed view is taken without a copy", "[ops][gemm]") {
  const uint64_t seed = fresh_seed();
  Tensor a = mctest::randn({40, 30}, DType::F32, seed);  // a^T is [30, 40]
  Tensor b = mctest::randn({40, 20}, DType::F32, seed + 1);
  Tensor via_view = matmul(a.transpose(0, 1), b);
  GemmOptions o;
  o.trans_a = true;
  Tensor via_flag = matmul(a, b, o);
  CHECK(mctest::rel_err_t(via_view, via_flag) == 0.0);
  CHECK(via_view.shape() == Shape{30, 20});
}

TEST_CASE("gemm: bad arguments give clear errors", "[ops][gemm]") {
  Tensor a = Tensor::zeros({4, 5}), b = Tensor::zeros({6, 7}), out = Tensor::zeros({4, 7});
  CHECK_THROWS_WITH(gemm(a, b, out), Catch::Contains("inner dimensions differ"));
  Tensor b16 = Tensor::zeros({5, 7}, DType::BF16);
  CHECK_THROWS_WITH(gemm(a, b16, out), Catch::Contains("same dtype"));
  Tensor b5 = Tensor::zeros({5, 7});
  Tensor bad_out = Tensor::zeros({4, 8});
  CHECK_THROWS_WITH(gemm(a, b5, bad_out), Catch::Contains("expected [4, 7]"));
  GemmOptions o;
  o.epilogue = GemmEpilogue::Bias;
  CHECK_THROWS_WITH(gemm(a, b5, out, o), Catch::Contains("undefined"));
  o.bias = Tensor::zeros({4});
  CHECK_THROWS_WITH(gemm(a, b5, out, o), Catch::Contains("vector of 7 elements"));
  GemmOptions t;
  t.allow_tf32 = true;
  Tensor a16 = Tensor::zeros({4, 5}, DType::BF16), o16 = Tensor::zeros({4, 7}, DType::BF16);
  CHECK_THROWS_WITH(gemm(a16, b16, o16, t), Catch::Contains("tf32"));
  Tensor i32 = Tensor::zeros({4, 5}, DType::I32);
  CHECK_THROWS_WITH(gemm(i32, b5, out), Catch::Contains("must be f32, bf16 or f16"));
  Tensor strided = Tensor::zeros({8, 10}).slice(0, 0, 8, 2).slice(1, 0, 10, 2);  // [4, 5], no unit stride
  CHECK_THROWS_WITH(gemm(strided, b5, out), Catch::Contains("contiguous"));
}

TEST_CASE("gemm gpu: all transposes and dtypes, odd sizes, poisoned outputs", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  for (const Case& c : transposes_and_dtypes()) run_case(c, mctest::gpu());
  Case tf;
  tf.m = 130, tf.n = 70, tf.k = 250, tf.tf32 = true, tf.tb = true;
  run_case(tf, mctest::gpu());
  Case big;  // an LLM-like shape (y = x W^T)
  big.m = 512, big.n = 768, big.k = 1024, big.tb = true, big.dt = big.out = DType::BF16;
  run_case(big, mctest::gpu());
}

TEST_CASE("gemm gpu: bf16 inputs accumulated into f32 main grads (beta = 1)", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  for (DType dt : {DType::BF16, DType::F16}) {
    Case c;
    c.ta = true, c.m = 96, c.n = 80, c.k = 200, c.dt = dt, c.out = DType::F32, c.beta = 1.f;
    run_case(c, mctest::gpu());
  }
}

TEST_CASE("gemm gpu: bias, GELU and bias-gradient epilogues", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  for (DType dt : {DType::F32, DType::BF16})
    for (GemmEpilogue e : {GemmEpilogue::Bias, GemmEpilogue::Gelu, GemmEpilogue::BiasGelu, GemmEpilogue::BiasGradA,
                           GemmEpilogue::BiasGradB}) {
      for (int t = 0; t < 4; ++t) {
        Case c;
        c.m = 72, c.n = 56, c.k = 136, c.dt = dt, c.out = dt, c.epi = e, c.ta = t & 1, c.tb = t & 2;
        run_case(c, mctest::gpu());
      }
    }
}

TEST_CASE("gemm gpu: strided-batched, shared operand, and gemm_batched", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  for (int t = 0; t < 4; ++t) {
    Case c;
    c.batch = 3, c.m = 40, c.n = 24, c.k = 56, c.ta = t & 1, c.tb = t & 2, c.dt = c.out = DType::BF16;
    run_case(c, mctest::gpu());
    c.shared_b = true;
    run_case(c, mctest::gpu());
  }
  Case bias;
  bias.batch = 2, bias.m = 16, bias.n = 32, bias.k = 48, bias.epi = GemmEpilogue::Bias;
  run_case(bias, mctest::gpu());

  const uint64_t seed = fresh_seed();
  std::vector<Tensor> as, bs, outs;
  for (int i = 0; i < 3; ++i) {
    as.push_back(mctest::randn({24, 40}, DType::BF16, seed + i, 0, 1, mctest::gpu()));
    bs.push_back(mctest::randn({40, 16}, DType::BF16, seed + 10 + i, 0, 1, mctest::gpu()));
    outs.push_back(mctest::poisoned({24, 16}, DType::BF16, mctest::gpu()));
  }
  gemm_batched(as, bs, outs);
  for (int i = 0; i < 3; ++i) {
    Tensor want = matmul(as[size_t(i)].to(Device::cpu()), bs[size_t(i)].to(Device::cpu()));
    CHECK(mctest::rel_err_t(outs[size_t(i)], want) < 1e-2);
  }
}

TEST_CASE("gemm gpu: the same shape twice gives identical results on another stream", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  Tensor a = mctest::randn({256, 384}, DType::BF16, seed, 0, 1, mctest::gpu());
  Tensor b = mctest::randn({384, 128}, DType::BF16, seed + 1, 0, 1, mctest::gpu());
  Tensor first = matmul(a, b);
  Stream s = Stream::create(mctest::gpu());
  Tensor second = matmul(a, b, {}, s);
  s.synchronize();
  CHECK(first.to_double_vector() == second.to_double_vector());
}

TEST_CASE("gemm: SM-margin requests, the largest held is in force", "[ops][gemm]") {
  const int dev = 7;  // a registry entry only: no device is touched
  REQUIRE(gemm_sm_margin(dev) == 0);
  {
    GemmSmMarginRequest a(dev, 16);
    CHECK(gemm_sm_margin(dev) == 16);
    {
      GemmSmMarginRequest b(dev, 24), c(dev, 8);
      CHECK(gemm_sm_margin(dev) == 24);
      b.release();
      CHECK(!b.active());
      CHECK(gemm_sm_margin(dev) == 16);
      GemmSmMarginRequest d = std::move(c);  // moved-from c no longer holds anything
      CHECK(!c.active());
      CHECK(d.active());
      a.release();
      CHECK(gemm_sm_margin(dev) == 8);
    }
    CHECK(gemm_sm_margin(dev) == 0);
    GemmSmMarginRequest e(dev, 4);
    e = GemmSmMarginRequest(dev, 12);  // assignment releases the old request
    CHECK(gemm_sm_margin(dev) == 12);
  }
  CHECK(gemm_sm_margin(dev) == 0);
  CHECK(gemm_sm_margin(dev + 1) == 0);
  CHECK_THROWS_WITH(GemmSmMarginRequest(dev, -1), Catch::Contains("must be >= 0"));
  CHECK_THROWS_WITH(GemmSmMarginRequest(64, 8), Catch::Contains("out of range"));
}

TEST_CASE("gemm gpu: products planned for fewer SMs (an SM margin) give the same results", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  for (int margin : {16, 100}) {
    GemmSmMarginRequest hold(mctest::gpu().index, margin);
    REQUIRE(gemm_sm_margin(mctest::gpu().index) == margin);
    for (const Case& c : transposes_and_dtypes()) run_case(c, mctest::gpu());
    Case big;  // many output tiles: the persistent kernel loops over more tiles per CTA
    big.m = 1024, big.n = 1536, big.k = 512, big.tb = true, big.dt = big.out = DType::BF16;
    run_case(big, mctest::gpu());
    Case acc;
    acc.ta = true, acc.m = 384, acc.n = 640, acc.k = 256, acc.dt = DType::BF16, acc.out = DType::F32, acc.beta = 1.f;
    run_case(acc, mctest::gpu());
  }
}

namespace {
// Sets an autotuning policy for one test and restores the previous one.
struct AutotuneScope {
  GemmAutotune saved = gemm_autotune();
  explicit AutotuneScope(const GemmAutotune& p) { set_gemm_autotune(p); }
  ~AutotuneScope() { set_gemm_autotune(saved); }
};
}  // namespace

TEST_CASE("gemm: the autotuning policy is checked", "[ops][gemm]") {
  const GemmAutotune saved = gemm_autotune();
  GemmAutotune bad;
  bad.candidates = 1;
  CHECK_THROWS_WITH(set_gemm_autotune(bad), Catch::Contains("candidates must be in [2, 32]"));
  bad.candidates = 33;
  CHECK_THROWS_WITH(set_gemm_autotune(bad), Catch::Contains("candidates must be in [2, 32]"));
  bad.candidates = 4, bad.min_gflop = -1.0;
  CHECK_THROWS_WITH(set_gemm_autotune(bad), Catch::Contains("min_gflop must be >= 0"));
  GemmAutotune good;
  good.enabled = false, good.min_gflop = 3.5, good.candidates = 5;
  {
    AutotuneScope scope(good);
    CHECK(!gemm_autotune().enabled);
    CHECK(gemm_autotune().min_gflop == 3.5);
    CHECK(gemm_autotune().candidates == 5);
  }
  CHECK(gemm_autotune().enabled == saved.enabled);
  CHECK(gemm_autotune().candidates == saved.candidates);
  // The CPU path ignores the policy: same numbers with it on for every size.
  GemmAutotune all;
  all.min_gflop = 0.0;
  AutotuneScope scope(all);
  for (const Case& c : transposes_and_dtypes()) run_case(c, Device::cpu());
}

TEST_CASE("gemm gpu: autotuned plans (every size timed) against the f64 reference", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  GemmAutotune all;
  all.min_gflop = 0.0, all.candidates = 16;
  AutotuneScope scope(all);
  for (const Case& c : transposes_and_dtypes()) run_case(c, mctest::gpu());
  for (GemmEpilogue e : {GemmEpilogue::Bias, GemmEpilogue::BiasGelu, GemmEpilogue::BiasGradA, GemmEpilogue::BiasGradB}) {
    Case c;
    c.m = 136, c.n = 72, c.k = 200, c.dt = c.out = DType::BF16, c.epi = e, c.tb = true;
    run_case(c, mctest::gpu());
  }
  Case acc;  // beta = 1 is never timed (the output is read): the heuristic's choice
  acc.ta = true, acc.m = 384, acc.n = 640, acc.k = 256, acc.dt = DType::BF16, acc.out = DType::F32, acc.beta = 1.f;
  run_case(acc, mctest::gpu());
  for (int t = 0; t < 4; ++t) {
    Case big;
    big.m = 1032, big.n = 1544, big.k = 776, big.ta = t & 1, big.tb = t & 2, big.dt = big.out = DType::BF16;
    run_case(big, mctest::gpu());
  }
}

TEST_CASE("gemm gpu: an autotuned plan gives the heuristic plan's bits", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  // Only single-pass candidates are timed, so any choice sums in the same order: the bits must not
  // change, whichever kernel wins (ranks that time differently still agree).
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  struct S { int64_t m, n, k; bool ta, tb; };
  for (const S& s : {S{2048, 3584, 1024, false, false}, S{2048, 1536, 3584, false, true}, S{1024, 3584, 2048, true, false}}) {
    Tensor a = mctest::randn(s.ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, DType::BF16, seed, 0, 1, mctest::gpu());
    Tensor b = mctest::randn(s.tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, DType::BF16, seed + 1, 0, 1, mctest::gpu());
    GemmOptions o;
    o.trans_a = s.ta, o.trans_b = s.tb;
    GemmAutotune off;
    off.enabled = false;
    Tensor want;
    {
      AutotuneScope scope(off);
      want = matmul(a, b, o);
    }
    GemmAutotune on;
    on.min_gflop = 0.0, on.candidates = 32;
    AutotuneScope scope(on);
    Tensor got = matmul(a, b, o);
    INFO("m=" << s.m << " n=" << s.n << " k=" << s.k << " ta=" << s.ta << " tb=" << s.tb);
#if MEGACORE_WITH_CUDA
    INFO("plans re-chosen so far: " << ops::cuda::gemm_autotuned_plan_count());
#endif
    CHECK(got.to_double_vector() == want.to_double_vector());
  }
}

namespace {

// out = alpha · a bᵀ + beta · c with c a column range of a wider matrix (its own row stride), 2-D and
// batched over column blocks (a shared 2-D a), against the product accumulated into a contiguous copy of c.
void check_separate_c(Device d, DType dt, double tol) {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed << " dtype " << dtype_name(dt));
  const int64_t m = 19, k = 8, wide = 40;
  Tensor a = mctest::randn({m, k}, dt, seed, 0, 1, d);
  Tensor z = mctest::randn({m, wide}, dt, seed + 1, 0, 1, d);
  GemmOptions o;
  o.trans_b = true;
  o.alpha = 0.75f;
  o.beta = 1.f;
  {  // 2-D: columns [5, 17) of z
    Tensor b = mctest::randn({12, k}, dt, seed + 2, 0, 1, d);
    Tensor want = z.narrow(1, 5, 12).contiguous();
    gemm(a, b, want, o, {});
    Tensor out = mctest::poisoned({m, 12}, dt, d);
    o.c = z.narrow(1, 5, 12);
    gemm(a, b, out, o, {});
    CHECK(mctest::rel_err_t(out, want) < tol);
  }
  {  // batched: 3 blocks of width 10 (block stride 12) starting at column 2 of z, into the same layout of y
    Tensor b = mctest::randn({3, 10, k}, dt, seed + 3, 0, 1, d);
    Tensor c3(z.storage(), {3, m, 10}, {12, wide, 1}, dt, z.offset() + 2);
    Tensor y = mctest::poisoned({m, 36}, dt, d);
    Tensor out3(y.storage(), {3, m, 10}, {12, 36, 1}, dt, y.offset());
    o.c = c3;
    gemm(a, b, out3, o, {});
    Tensor want = c3.contiguous();
    o.c = Tensor();
    gemm(a, b, want, o, {});
    CHECK(mctest::rel_err_t(out3.contiguous(), want) < tol);
  }
  o.c = mctest::randn({m, 11}, dt, seed, 0, 1, d);
  Tensor out = Tensor::empty({m, 12}, dt, d);
  Tensor b = mctest::randn({12, k}, dt, seed + 2, 0, 1, d);
  CHECK_THROWS_WITH(gemm(a, b, out, o, {}), Catch::Contains("opts.c"));
}

}  // namespace

TEST_CASE("gemm cpu: a separate beta source (opts.c), strided and batched", "[ops][gemm]") {
  check_separate_c(Device::cpu(), DType::F32, 1e-6);
  check_separate_c(Device::cpu(), DType::BF16, 1e-2);
}

TEST_CASE("gemm gpu: a separate beta source (opts.c), strided and batched", "[ops][gemm][gpu]") {
  MC_REQUIRE_GPU();
  check_separate_c(mctest::gpu(), DType::BF16, 1e-2);
  check_separate_c(mctest::gpu(), DType::F32, 3e-3);
}
