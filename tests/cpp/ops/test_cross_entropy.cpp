#include "megacore/ops/cross_entropy.hpp"

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/cross_entropy_cuda.hpp"
#endif

using namespace megacore;
using namespace mctest;

namespace {

Tensor random_labels(int64_t n, int64_t v, uint64_t seed, DType dt, int64_t ignore_every = 0) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> l(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) l[size_t(i)] = (ignore_every && i % ignore_every == 1) ? -100 : int64_t(rng() % uint64_t(v));
  return Tensor::from_vector(l, {n}).to(dt);
}

// Fresh random inputs for an n x v fused cross-entropy (labels every third row ignored, a random loss
// mask, grad scale 0.5) and the CPU results the GPU kernels are checked against.
struct CeCase {
  uint64_t seed;
  ops::CrossEntropyOptions o;
  Tensor z, labels, mask, loss, lse, dz;
};
CeCase ce_case_with_cpu_result(int64_t n, int64_t v, DType dt, float smoothing) {
  CeCase c;
  c.seed = fresh_seed();
  c.o.label_smoothing = smoothing;
  c.z = randn({n, v}, dt, c.seed, 0, 2);
  c.labels = random_labels(n, v, c.seed + 1, dt == DType::F32 ? DType::I64 : DType::I32, 3);
  c.mask = randu({n}, DType::F32, c.seed + 2, 0, 1);
  c.loss = Tensor::empty({n}), c.lse = Tensor::empty({n}), c.dz = Tensor::empty({n, v}, dt);
  ops::cross_entropy_fused(c.z, c.labels, c.loss, c.lse, c.dz, 0.5f, c.mask, c.o);
  return c;
}

// Vocabulary-parallel composition on `shards` column blocks, as the TP layer does it (the
// all-reduces are done here by hand).
void sharded_ce(const Tensor& logits, const Tensor& labels, int shards, const Tensor& mask,
                const ops::CrossEntropyOptions& o, Tensor& loss, Tensor& dlogits, float grad_scale) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const Device d = logits.device();
  std::vector<Tensor> parts, mx, se, tg, sl;
  std::vector<int64_t> starts;
  for (int r = 0; r < shards; ++r) {
    const int64_t a = v * r / shards, b = v * (r + 1) / shards;
    starts.push_back(a);
    parts.push_back(logits.slice(1, a, b).contiguous());
    for (auto* vec : {&mx, &se, &tg, &sl}) vec->push_back(Tensor::empty({n}, DType::F32, d));
    ops::cross_entropy_shard_stats(parts[r], labels, a, mx[r], se[r], tg[r], sl[r]);
  }
  // all-reduce MAX
  std::vector<double> g(size_t(n), -INFINITY);
  for (int r = 0; r < shards; ++r) {
    auto m = mx[r].to_double_vector();
    for (int64_t i = 0; i < n; ++i) g[size_t(i)] = std::max(g[size_t(i)], m[size_t(i)]);
  }
  Tensor gmax = Tensor::from_vector(std::vector<float>(g.begin(), g.end()), {n}).to(d);
  std::vector<double> sum_se(size_t(n), 0), sum_tg(size_t(n), 0), sum_sl(size_t(n), 0);
  for (int r = 0; r < shards; ++r) {
    ops::cross_entropy_rescale_sum_exp(mx[r], gmax, se[r]);
    auto a = se[r].to_double_vector(), b = tg[r].to_double_vector(), c = sl[r].to_double_vector();
    for (int64_t i = 0; i < n; ++i) {
      sum_se[size_t(i)] += a[size_t(i)];
      sum_tg[size_t(i)] += b[size_t(i)];
      sum_sl[size_t(i)] += c[size_t(i)];
    }
  }
  auto tf = [&](const std::vector<double>& x) { return Tensor::from_vector(std::vector<float>(x.begin(), x.end()), {n}).to(d); };
  Tensor lse = Tensor::empty({n}, DType::F32, d);
  ops::cross_entropy_loss_from_stats(gmax, tf(sum_se), tf(sum_tg), tf(sum_sl), labels, v, loss, lse, mask, o);
  std::vector<double> dl(size_t(n), grad_scale);
  if (mask.defined()) {
    auto mv = mask.to_double_vector();
    for (int64_t i = 0; i < n; ++i) dl[size_t(i)] *= mv[size_t(i)];
  }
  Tensor dloss = tf(dl);
  for (int r = 0; r < shards; ++r) {
    Tensor dpart = Tensor::empty(parts[r].shape(), logits.dtype(), d);
    ops::cross_entropy_backward(parts[r], labels, lse, dloss, dpart, o, {}, starts[r], v);
    dlogits.slice(1, starts[r], starts[r] + parts[r].size(1)).copy_(dpart);
  }
}

}  // namespace

TEST_CASE("cross-entropy gradient matches finite differences (f64)", "[ops][cross_entropy]") {
  for (double eps : {0.0, 0.1}) {
    const uint64_t seed = fresh_seed();
    INFO("smoothing " << eps << " seed " << seed);
    const int64_t n = 4, v = 7;
    auto z = rand_vec(n * v, seed, -3, 3), dloss = rand_vec(n, seed + 1, 0.5, 1.5);
    std::vector<int64_t> labels{3, -100, 0, 6};
    std::vector<double> loss(n), dz(n * v);
    auto f = [&](const std::vector<double>& zz) {
      ops::ref::cross_entropy_f64(zz.data(), labels.data(), nullptr, loss.data(), nullptr, n, v, eps, -100);
      return dot(loss, dloss);
    };
    ops::ref::cross_entropy_f64(z.data(), labels.data(), dloss.data(), loss.data(), dz.data(), n, v, eps, -100);
    CHECK(loss[1] == 0.0);
    CHECK(rel_err(dz, numeric_grad(f, z)) < 1e-8);
  }
}

TEST_CASE("cross-entropy CPU: fused equals forward + backward equals the vocab-parallel pieces", "[ops][cross_entropy]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t n = 13, v = 50;
  ops::CrossEntropyOptions o;
  o.label_smoothing = 0.1f;
  Tensor z = randn({n, v}, DType::F32, seed, 0, 3), labels = random_labels(n, v, seed + 1, DType::I64, 4);
  Tensor mask = randu({n}, DType::F32, seed + 2, 0, 1);
  Tensor loss = Tensor::empty({n}), lse = Tensor::empty({n}), dz = Tensor::empty({n, v});
  ops::cross_entropy_fused(z, labels, loss, lse, dz, 0.25f, mask, o);
  Tensor loss2 = Tensor::empty({n}), lse2 = Tensor::empty({n}), dz2 = Tensor::empty({n, v});
  ops::cross_entropy_forward(z, labels, loss2, lse2, mask, o);
  auto mv = mask.to_double_vector();
  std::vector<float> dl(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) dl[size_t(i)] = float(0.25 * mv[size_t(i)]);
  ops::cross_entropy_backward(z, labels, lse2, Tensor::from_vector(dl, {n}), dz2, o);
  CHECK(rel_err_t(loss2, loss) < 1e-6);
  CHECK(rel_err_t(dz2, dz) < 1e-6);
  Tensor loss3 = Tensor::empty({n}), dz3 = Tensor::empty({n, v});
  sharded_ce(z, labels, 3, mask, o, loss3, dz3, 0.25f);
  CHECK(rel_err_t(loss3, loss) < 1e-6);
  CHECK(rel_err_t(dz3, dz) < 1e-6);
  // in place: the gradient over the logits
  Tensor zc = z.clone();
  ops::cross_entropy_fused(zc, labels, loss2, lse2, zc, 0.25f, mask, o);
  CHECK(rel_err_t(zc, dz) == 0.0);
}

TEST_CASE("cross-entropy arguments are validated", "[ops][cross_entropy]") {
  Tensor z = Tensor::zeros({4, 10}), loss = Tensor::empty({4}), lse = Tensor::empty({4}), dz = Tensor::empty({4, 10});
  Tensor labels = Tensor::from_vector(std::vector<int32_t>{1, 2, -100, 9}, {4});
  REQUIRE_NOTHROW(ops::cross_entropy_fused(z, labels, loss, lse, dz, 1.f));
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{1, 2, 10, 9}, {4});
  REQUIRE_THROWS_WITH(ops::cross_entropy_fused(z, bad, loss, lse, dz, 1.f), Catch::Contains("outside the vocabulary"));
  Tensor l3 = Tensor::from_vector(std::vector<int32_t>{1, 2, 3}, {3});
  REQUIRE_THROWS_WITH(ops::cross_entropy_forward(z, l3, loss, lse), Catch::Contains("labels has 3 elements"));
  Tensor z3 = Tensor::zeros({2, 2, 10});
  REQUIRE_THROWS_WITH(ops::cross_entropy_forward(z3, labels, loss, lse), Catch::Contains("[tokens, vocab]"));
  Tensor lossb = Tensor::empty({4}, DType::BF16);
  REQUIRE_THROWS_WITH(ops::cross_entropy_forward(z, labels, lossb, lse), Catch::Contains("loss has dtype bf16"));
  ops::CrossEntropyOptions o;
  o.label_smoothing = 1.0f;
  REQUIRE_THROWS_WITH(ops::cross_entropy_forward(z, labels, loss, lse, {}, o), Catch::Contains("label_smoothing"));
  Tensor dl = Tensor::zeros({4});
  REQUIRE_THROWS_WITH(ops::cross_entropy_backward(z, labels, lse, dl, dz, {}, {}, 5, 12), Catch::Contains("shard"));
}

TEST_CASE("cross-entropy CUDA kernels match the CPU reference", "[ops][cross_entropy][gpu]") {
  MC_REQUIRE_GPU();
  struct Case { int64_t n, v; };
  for (Case c : {Case{37, 1000}, Case{5, 32003}, Case{9, 50304}, Case{3, 128256}}) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      for (float eps : {0.f, 0.1f}) {
        auto [seed, o, z, labels, mask, loss, lse, dz] = ce_case_with_cpu_result(c.n, c.v, dt, eps);
        INFO("n " << c.n << " v " << c.v << " " << dtype_name(dt) << " smoothing " << eps << " seed " << seed);
        Device g = gpu();
        Tensor gz = z.to(g), gl = labels.to(g), gm = mask.to(g);
        Tensor gloss = poisoned({c.n}, DType::F32, g), glse = poisoned({c.n}, DType::F32, g),
               gdz = poisoned({c.n, c.v}, dt, g);
        ops::cross_entropy_fused(gz, gl, gloss, glse, gdz, 0.5f, gm, o);
        CHECK(rel_err_t(gloss, loss) < 1e-5);
        CHECK(rel_err_t(glse, lse) < 1e-6);
        CHECK(rel_err_t(gdz, dz) < tol_for(dt));
        // forward + backward, in place
        Tensor gloss2 = poisoned({c.n}, DType::F32, g), glse2 = poisoned({c.n}, DType::F32, g);
        ops::cross_entropy_forward(gz, gl, gloss2, glse2, gm, o);
        CHECK(rel_err_t(gloss2, loss) < 1e-5);
        auto mv = mask.to_double_vector();
        std::vector<float> dl(static_cast<size_t>(c.n));
        for (int64_t i = 0; i < c.n; ++i) dl[size_t(i)] = float(0.5 * mv[size_t(i)]);
        ops::cross_entropy_backward(gz, gl, glse2, Tensor::from_vector(dl, {c.n}).to(g), gz, o);
        CHECK(rel_err_t(gz, dz) < tol_for(dt));
        // vocab-parallel pieces on the GPU
        Tensor gloss3 = poisoned({c.n}, DType::F32, g), gdz3 = poisoned({c.n, c.v}, dt, g);
        sharded_ce(z.to(g), gl, 2, gm, o, gloss3, gdz3, 0.5f);
        CHECK(rel_err_t(gloss3, loss) < 1e-5);
        CHECK(rel_err_t(gdz3, dz) < tol_for(dt));
      }
    }
  }
}

TEST_CASE("cross-entropy on the GPU marks out-of-range labels with NaN", "[ops][cross_entropy][gpu]") {
  MC_REQUIRE_GPU();
  Device g = gpu();
  Tensor z = randn({2, 16}, DType::F32, fresh_seed(), 0, 1, g);
  Tensor labels = Tensor::from_vector(std::vector<int32_t>{3, 16}, {2}).to(g);
  Tensor loss = Tensor::empty({2}, DType::F32, g), lse;
  ops::cross_entropy_forward(z, labels, loss, lse);
  auto l = loss.to_double_vector();
  CHECK(std::isfinite(l[0]));
  CHECK(std::isnan(l[1]));
}

#if MEGACORE_WITH_CUDA
TEST_CASE("cross-entropy launch shapes all match the CPU reference", "[ops][cross_entropy][gpu]") {
  MC_REQUIRE_GPU();
  using ops::cuda::CeTuning;
  // The default, the two-pass kernel's first shape and every row-on-chip cluster size; a shape whose
  // row slice does not fit (or a vocabulary that is not a multiple of 16 bytes) runs the two-pass kernel.
  const CeTuning shapes[] = {{},
                             {.unroll = 1, .l2_fraction = 0.5f},
                             {.cluster = 1},
                             {.threads = 64, .cluster = 1},
                             {.cluster = 2},
                             {.threads = 256, .cluster = 4},
                             {.threads = 128, .cluster = 8}};
  // 16: with 4 or 8 CTAs some hold no columns; 296: the last CTA's slice is shorter; 32003: odd. 1000 rows
  // of 2056 and 300 of 32000: more rows than clusters resident at once.
  struct Case { int64_t n, v; };
  for (Case c : {Case{7, 16}, Case{37, 296}, Case{5, 32003}, Case{9, 50304}, Case{3, 128256}, Case{1000, 2056},
                 Case{300, 32000}}) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      for (float eps : {0.f, 0.1f}) {
        auto [seed, o, z, labels, mask, loss, lse, dz] = ce_case_with_cpu_result(c.n, c.v, dt, eps);
        Device g = gpu();
        // A blocking stream: ordered after the default-stream poison fills and copies.
        Stream s = Stream::create(g, /*non_blocking=*/false);
        Tensor gz = z.to(g), gl = labels.to(g), gm = mask.to(g);
        for (const CeTuning& t : shapes) {
          for (bool in_place : {false, true}) {
            INFO("n " << c.n << " v " << c.v << " " << dtype_name(dt) << " smoothing " << eps << " seed " << seed
                      << " threads " << t.threads << " unroll " << t.unroll << " cluster " << t.cluster
                      << " in place " << in_place);
            Tensor gloss = poisoned({c.n}, DType::F32, g), glse = poisoned({c.n}, DType::F32, g);
            Tensor gdz = in_place ? z.to(g) : poisoned({c.n, c.v}, dt, g);
            ops::cuda::CeArgs a;
            a.mode = ops::cuda::CeMode::Fused;
            a.logits = in_place ? gdz.data_ptr() : gz.data_ptr();
            a.dlogits = gdz.data_ptr();
            a.labels = gl.data_ptr();
            a.labels_i64 = gl.dtype() == DType::I64;
            a.loss_mask = gm.data<float>();
            a.loss = gloss.data<float>();
            a.lse_out = glse.data<float>();
            a.n = c.n;
            a.v = c.v;
            a.vocab_total = c.v;
            a.grad_scale = 0.5f;
            a.label_smoothing = eps;
            a.ignore_index = o.ignore_index;
            a.tuning = t;
            ops::cuda::cross_entropy(dt, a, g.index, s.native());
            s.synchronize();
            CHECK(rel_err_t(gloss, loss) < 1e-5);
            CHECK(rel_err_t(glse, lse) < 1e-6);
            CHECK(rel_err_t(gdz, dz) < tol_for(dt));
          }
        }
      }
    }
  }
}

TEST_CASE("cross-entropy row-on-chip kernel takes the shapes it should", "[ops][cross_entropy][gpu]") {
  MC_REQUIRE_GPU();
  const int dev = gpu().index;
  alignas(16) static char buf[32];  // only the pointers' alignment is looked at
  ops::cuda::CeArgs a;
  a.logits = buf;
  a.dlogits = buf;
  a.v = 128256;
  a.tuning.cluster = 2;
  CHECK(ops::cuda::ce_row_on_chip(DType::BF16, a, dev));   // 125.3 KiB per CTA
  CHECK_FALSE(ops::cuda::ce_row_on_chip(DType::F32, a, dev));  // 250.5 KiB per CTA
  a.tuning.cluster = 4;
  CHECK(ops::cuda::ce_row_on_chip(DType::F32, a, dev));
  a.tuning.cluster = 0;
  CHECK_FALSE(ops::cuda::ce_row_on_chip(DType::BF16, a, dev));
  a.tuning.cluster = 1;
  a.v = 32000;
  CHECK(ops::cuda::ce_row_on_chip(DType::BF16, a, dev));
  a.v = 32003;
  CHECK_FALSE(ops::cuda::ce_row_on_chip(DType::BF16, a, dev));
  a.v = 32000;
  a.dlogits = buf + 2;
  CHECK_FALSE(ops::cuda::ce_row_on_chip(DType::BF16, a, dev));
  a.dlogits = buf;
  a.mode = ops::cuda::CeMode::Forward;
  CHECK_FALSE(ops::cuda::ce_row_on_chip(DType::BF16, a, dev));
}
#endif
