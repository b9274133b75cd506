// MoE ops (router, permutation, grouped GEMM) against references written here in f64, on fresh random
// inputs; the GPU cases compare the CUDA kernels with the CPU reference.
#include "megacore/ops/moe.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "megacore/ops/gemm.hpp"
#include <nlohmann/json.hpp>
#include "ops/ops_test_util.hpp"

using namespace megacore;
using namespace mctest;
using ops::RouterScore;
using ops::RouterTopkOptions;

namespace {

// ---- references --------------------------------------------------------------------------------------

std::vector<double> softmax(const std::vector<double>& z) {
  const double mx = *std::max_element(z.begin(), z.end());
  std::vector<double> p(z.size());
  double s = 0;
  for (size_t i = 0; i < z.size(); ++i) s += (p[i] = std::exp(z[i] - mx));
  for (auto& v : p) v /= s;
  return p;
}

double sig(double z) { return 1.0 / (1.0 + std::exp(-z)); }

struct RefRoute {
  std::vector<int> idx;
  std::vector<double> probs;
};

/// The selection score of every expert of one row: the logit without a bias, score + bias with one.
std::vector<double> ref_selection(const std::vector<double>& z, const std::vector<double>& bias,
                                  const RouterTopkOptions& o) {
  if (bias.empty()) return z;
  std::vector<double> s(z.size());
  const bool post = o.score == RouterScore::Softmax && !o.pre_softmax;
  if (post) s = z;
  else if (o.score == RouterScore::Softmax) s = softmax(z);
  else
    for (size_t i = 0; i < z.size(); ++i) s[i] = sig(z[i]);
  for (size_t i = 0; i < z.size(); ++i) s[i] += bias[i];
  return s;
}

// One row: the k best experts by selection score with ties to the lower id (via a sort of all
// experts), and their combine weights.
RefRoute ref_route(const std::vector<double>& z, const std::vector<double>& bias, const RouterTopkOptions& o) {
  const size_t e = z.size();
  std::vector<double> base(e);
  const bool post = o.score == RouterScore::Softmax && !o.pre_softmax;
  if (post) base = z;
  else if (o.score == RouterScore::Softmax) base = softmax(z);
  else
    for (size_t i = 0; i < e; ++i) base[i] = sig(z[i]);
  std::vector<int> order(e);
  std::iota(order.begin(), order.end(), 0);
  const std::vector<double> sel_all = ref_selection(z, bias, o);
  auto sel = [&](int i) { return sel_all[size_t(i)]; };
  std::sort(order.begin(), order.end(), [&](int a, int b) { return sel(a) != sel(b) ? sel(a) > sel(b) : a < b; });
  RefRoute r;
  r.idx.assign(order.begin(), order.begin() + o.topk);
  std::vector<double> chosen;
  for (int i : r.idx) chosen.push_back(base[size_t(i)]);
  if (post) chosen = softmax(chosen);
  if (o.score == RouterScore::Sigmoid && o.topk > 1) {
    const double s = std::accumulate(chosen.begin(), chosen.end(), 0.0);
    for (auto& v : chosen) v /= s + 1e-20;
  }
  for (auto& v : chosen) v *= o.scaling_factor;
  r.probs = chosen;
  return r;
}

// The combine weights of a row for fixed chosen experts, as a function of the logits (for finite
// differences of the backward).
std::vector<double> ref_probs_fixed(const std::vector<double>& z, const std::vector<int>& idx,
                                    const RouterTopkOptions& o) {
  std::vector<double> zb(z);
  RouterTopkOptions oo = o;
  std::vector<double> bias(z.size(), 0.0);
  // A large bias on the chosen experts pins the selection without changing the weights.
  for (size_t j = 0; j < idx.size(); ++j) bias[size_t(idx[j])] = 1e6 * double(idx.size() - j);
  return ref_route(zb, bias, oo).probs;
}

std::vector<double> row(const std::vector<double>& v, int64_t r, int64_t w) {
  return {v.begin() + r * w, v.begin() + (r + 1) * w};
}

double aux_ref(const std::vector<double>& z, int64_t t, int e, RouterScore score, const std::vector<double>& tpe,
               int64_t total, int topk, double coeff) {
  std::vector<double> agg(size_t(e), 0.0);
  for (int64_t r = 0; r < t; ++r) {
    std::vector<double> sc = row(z, r, e);
    if (score == RouterScore::Softmax) {
      sc = softmax(sc);
    } else {
      for (auto& v : sc) v = sig(v);
      const double s = std::accumulate(sc.begin(), sc.end(), 0.0) + 1e-20;
      for (auto& v : sc) v /= s;
    }
    for (int i = 0; i < e; ++i) agg[size_t(i)] += sc[size_t(i)];
  }
  double loss = 0;
  for (int i = 0; i < e; ++i) loss += agg[size_t(i)] * tpe[size_t(i)];
  return loss * coeff * e / (double(total) * double(total) * topk);
}

double z_ref(const std::vector<double>& z, int64_t t, int e, double coeff) {
  double s = 0;
  for (int64_t r = 0; r < t; ++r) {
    const std::vector<double> x = row(z, r, e);
    const double mx = *std::max_element(x.begin(), x.end());
    double se = 0;
    for (double v : x) se += std::exp(v - mx);
    const double lse = mx + std::log(se);
    s += lse * lse;
  }
  return coeff * s / double(t);
}

Tensor f32_from(const std::vector<double>& v, const Shape& shape) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector(f, shape);
}

std::vector<int32_t> i32_vec(const Tensor& t) {
  Tensor c = t.to(Device::cpu());
  return {c.data<int32_t>(), c.data<int32_t>() + c.numel()};
}

// Random routing of t tokens over `e` experts (k distinct each) using only `used` of them, with a
// share of slots dropped (-1).
Tensor random_indices(int64_t t, int k, int e, int used, double drop, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> v(size_t(t * k));
  std::vector<int32_t> pool(static_cast<size_t>(used));
  for (int64_t r = 0; r < t; ++r) {
    // `used` experts spread over [0, e): every other one, so the experts in between have no tokens.
    for (int i = 0; i < used; ++i) pool[size_t(i)] = int32_t((i * e) / used);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < k; ++j) {
      const bool dropped = std::uniform_real_distribution<double>(0, 1)(rng) < drop;
      v[size_t(r * k + j)] = dropped ? -1 : pool[size_t(j)];
    }
  }
  return Tensor::from_vector(v, {t, k});
}

RouterTopkOptions opts(int k, RouterScore sc, bool pre, float scale) {
  RouterTopkOptions o;
  o.topk = k, o.score = sc, o.pre_softmax = pre, o.scaling_factor = scale;
  return o;
}

std::vector<RouterTopkOptions> all_router_options() {
  std::vector<RouterTopkOptions> v;
  for (int k : {1, 2, 4})
    for (float scale : {1.f, 2.5f}) {
      v.push_back(opts(k, RouterScore::Softmax, false, scale));
      v.push_back(opts(k, RouterScore::Softmax, true, scale));
      v.push_back(opts(k, RouterScore::Sigmoid, false, scale));
    }
  return v;
}

std::string describe(const RouterTopkOptions& o, bool bias) {
  return fmt::format("k={} score={} pre_softmax={} scale={} bias={}", o.topk,
                     o.score == RouterScore::Softmax ? "softmax" : "sigmoid", o.pre_softmax, o.scaling_factor, bias);
}

}  // namespace

// ---- router ------------------------------------------------------------------------------------------

TEST_CASE("router top-k matches the reference for every option combination", "[ops][moe]") {
  const int64_t t = 37;
  const int e = 8;
  for (const auto& o : all_router_options())
    for (bool with_bias : {false, true}) {
      const uint64_t seed = fresh_seed();
      INFO(describe(o, with_bias) << " seed " << seed);
      Tensor z = randn({t, e}, DType::F32, seed, 0, 1.5);
      Tensor bias = with_bias ? randn({e}, DType::F32, seed + 1, 0, 0.5) : Tensor();
      Tensor probs = poisoned({t, o.topk}, DType::F32, Device::cpu());
      Tensor idx = poisoned({t, o.topk}, DType::I32, Device::cpu());
      ops::router_topk(z, bias, o, probs, idx);
      const auto zd = z.to_double_vector();
      const auto bd = with_bias ? bias.to_double_vector() : std::vector<double>();
      const auto pd = probs.to_double_vector();
      const auto id = i32_vec(idx);
      for (int64_t r = 0; r < t; ++r) {
        const RefRoute ref = ref_route(row(zd, r, e), bd, o);
        for (int j = 0; j < o.topk; ++j) {
          REQUIRE(id[size_t(r * o.topk + j)] == ref.idx[size_t(j)]);
          REQUIRE(std::abs(pd[size_t(r * o.topk + j)] - ref.probs[size_t(j)]) < 1e-6 * o.scaling_factor);
        }
      }
    }
}

TEST_CASE("router top-k breaks ties toward the lower expert id", "[ops][moe]") {
  Tensor z = Tensor::zeros({3, 6});
  z.data<float>()[6 + 4] = 1.f;  // row 1: expert 4 first, then 0, 1
  Tensor probs = Tensor::empty({3, 3}), idx = Tensor::empty({3, 3}, DType::I32);
  ops::router_topk(z, {}, opts(3, RouterScore::Softmax, true, 1.f), probs, idx);
  CHECK(i32_vec(idx) == std::vector<int32_t>{0, 1, 2, 4, 0, 1, 0, 1, 2});
}

namespace {
// Logits whose scores round to equal values even in f64: the sigmoids of row 0 are all 1 but the last,
// row 1's softmax is [0, 1, 0, 0] and its sigmoids [0, 0.5, 0, 0]. The top-2 by logit is {1, 2} in
// every row; a selection on the rounded scores would take {0, 1} and {1, 0}.
Tensor saturating_logits() {
  return Tensor::from_vector(std::vector<float>{36.9f, 40.f, 38.f, 5.f, -800.f, 0.f, -750.f, -900.f}, {2, 4});
}
}  // namespace

TEST_CASE("router top-k without a bias selects on the logits where the scores saturate", "[ops][moe]") {
  std::vector<Device> devices{Device::cpu()};
  if (cuda_available()) devices.push_back(gpu());
  for (Device d : devices)
    for (auto o : {opts(2, RouterScore::Sigmoid, false, 1.f), opts(2, RouterScore::Softmax, true, 1.f)}) {
      INFO(d.str() << " " << describe(o, false));
      Tensor probs = Tensor::empty({2, 2}, DType::F32, d), idx = Tensor::empty({2, 2}, DType::I32, d);
      ops::router_topk(saturating_logits().to(d), {}, o, probs, idx);
      CHECK(i32_vec(idx) == std::vector<int32_t>{1, 2, 1, 2});
    }
}

TEST_CASE("router top-k backward matches finite differences of the forward", "[ops][moe]") {
  const int64_t t = 9;
  const int e = 8;
  for (const auto& o : all_router_options()) {
    const uint64_t seed = fresh_seed();
    INFO(describe(o, false) << " seed " << seed);
    Tensor z = randn({t, e}, DType::F32, seed, 0, 1.5);
    Tensor probs = Tensor::empty({t, o.topk}), idx = Tensor::empty({t, o.topk}, DType::I32);
    ops::router_topk(z, {}, o, probs, idx);
    Tensor dp = randn({t, o.topk}, DType::F32, seed + 2);
    Tensor init = randn({t, e}, DType::F32, seed + 3);
    Tensor dz = init.clone();
    ops::router_topk_backward(z, idx, dp, o, dz);
    const auto zd = z.to_double_vector(), dpd = dp.to_double_vector(), dzd = dz.to_double_vector(),
               d0 = init.to_double_vector();
    const auto id = i32_vec(idx);
    for (int64_t r = 0; r < t; ++r) {
      const std::vector<int> chosen(id.begin() + r * o.topk, id.begin() + (r + 1) * o.topk);
      const std::vector<double> w = row(dpd, r, o.topk);
      auto f = [&](const std::vector<double>& zr) { return dot(w, ref_probs_fixed(zr, chosen, o)); };
      const std::vector<double> g = numeric_grad(f, row(zd, r, e), 1e-5);
      std::vector<double> got(static_cast<size_t>(e)), want(static_cast<size_t>(e));
      for (int i = 0; i < e; ++i) {
        got[size_t(i)] = dzd[size_t(r * e + i)] - d0[size_t(r * e + i)];  // accumulated on top of init
        want[size_t(i)] = g[size_t(i)];
      }
      for (int i = 0; i < e; ++i) REQUIRE(std::abs(got[size_t(i)] - want[size_t(i)]) < 2e-5 + 1e-4 * std::abs(want[size_t(i)]));
    }
  }
}

TEST_CASE("router capacity keeps each expert's most probable slots", "[ops][moe]") {
  const int64_t t = 64;
  const int e = 4, k = 2;
  for (int64_t cap : {int64_t(1), int64_t(7), int64_t(20), int64_t(200)}) {
    const uint64_t seed = fresh_seed();
    INFO("capacity " << cap << " seed " << seed);
    Tensor z = randn({t, e}, DType::F32, seed);
    Tensor probs = Tensor::empty({t, k}), idx = Tensor::empty({t, k}, DType::I32);
    ops::router_topk(z, {}, opts(k, RouterScore::Softmax, true, 1.f), probs, idx);
    // Some ties: quantised probabilities.
    for (int64_t i = 0; i < t * k; i += 3) probs.data<float>()[i] = std::round(probs.data<float>()[i] * 4) / 4;
    const auto p0 = probs.to_double_vector();
    const auto i0 = i32_vec(idx);
    ops::router_apply_capacity(probs, idx, e, cap);
    const auto p1 = probs.to_double_vector();
    const auto i1 = i32_vec(idx);
    for (int ex = 0; ex < e; ++ex) {
      std::vector<int64_t> slots;
      for (int64_t i = 0; i < t * k; ++i)
        if (i0[size_t(i)] == ex) slots.push_back(i);
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
        return p0[size_t(a)] != p0[size_t(b)] ? p0[size_t(a)] > p0[size_t(b)] : a / k < b / k;
      });
      for (size_t r = 0; r < slots.size(); ++r) {
        const int64_t i = slots[r];
        if (int64_t(r) < cap) {
          REQUIRE(i1[size_t(i)] == ex);
          REQUIRE(p1[size_t(i)] == p0[size_t(i)]);
        } else {
          REQUIRE(i1[size_t(i)] == -1);
          REQUIRE(p1[size_t(i)] == 0.0);
        }
      }
    }
  }
  SECTION("equal probabilities keep the lowest token indices") {
    Tensor idx = Tensor::from_vector(std::vector<int32_t>{1, 1, -1, 1, 1}, {5, 1});
    Tensor probs = Tensor::full({5, 1}, 0.5);
    ops::router_apply_capacity(probs, idx, 2, 2);
    CHECK(i32_vec(idx) == std::vector<int32_t>{1, 1, -1, -1, -1});
    CHECK(probs.to_double_vector() == std::vector<double>{0.5, 0.5, 0.5, 0, 0});
  }
}

TEST_CASE("router aux loss and z-loss match their formulas and finite differences", "[ops][moe]") {
  const int64_t t = 11;
  const int e = 6, topk = 2;
  const int64_t total = 3 * t;  // as if the counts were summed over a group of 3 ranks
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {
    const uint64_t seed = fresh_seed();
    INFO("score " << (score == RouterScore::Softmax ? "softmax" : "sigmoid") << " seed " << seed);
    Tensor z = randn({t, e}, DType::F32, seed, 0, 2);
    Tensor tpe = randu({e}, DType::F32, seed + 1, 0, 12);
    const auto zd = z.to_double_vector(), nd = tpe.to_double_vector();
    const float coeff = 0.01f;
    Tensor loss = poisoned({1}, DType::F32, Device::cpu());
    ops::router_aux_loss(z, score, tpe, total, topk, coeff, loss);
    const double want = aux_ref(zd, t, e, score, nd, total, topk, coeff);
    CHECK(std::abs(loss.item() - want) < 1e-6 * std::abs(want));
    // The gradient is small (about coeff / T); so is what it accumulates onto, so f32 keeps its digits.
    Tensor init = randn({t, e}, DType::F32, seed + 2, 0, 1e-6);
    Tensor dz = init.clone();
    const float dloss = 1.7f;
    ops::router_aux_loss_backward(z, score, tpe, total, topk, coeff, dloss, dz);
    const auto g = numeric_grad([&](const std::vector<double>& x) { return dloss * aux_ref(x, t, e, score, nd, total,
                                                                                           topk, coeff); },
                                zd, 1e-4);
    const auto dzd = dz.to_double_vector(), d0 = init.to_double_vector();
    std::vector<double> got(dzd.size());
    for (size_t i = 0; i < got.size(); ++i) got[i] = dzd[i] - d0[i];
    CHECK(rel_err(got, g) < 1e-4);
  }
  const uint64_t seed = fresh_seed();
  INFO("z-loss seed " << seed);
  Tensor z = randn({t, e}, DType::F32, seed, 0, 3);
  const auto zd = z.to_double_vector();
  Tensor loss = poisoned({1}, DType::F32, Device::cpu());
  ops::router_z_loss(z, 1e-3f, loss);
  const double want = z_ref(zd, t, e, 1e-3);
  CHECK(std::abs(loss.item() - want) < 1e-6 * want);
  Tensor dz = Tensor::zeros({t, e});
  ops::router_z_loss_backward(z, 1e-3f, 0.5f, dz);
  const auto g = numeric_grad([&](const std::vector<double>& x) { return 0.5 * z_ref(x, t, e, 1e-3); }, zd, 1e-4);
  CHECK(rel_err(dz.to_double_vector(), g) < 1e-4);
}

// ---- permutation -------------------------------------------------------------------------------------

namespace {

// Checks the permute map against the contract and returns the host counts.
std::vector<int64_t> check_permute_map(const Tensor& idx_dev, int e, Tensor& row_map) {
  const int64_t t = idx_dev.size(0);
  const int k = int(idx_dev.size(1));
  const Device d = idx_dev.device();
  row_map = poisoned({t, k}, DType::I32, d);
  Tensor counts = poisoned({e}, DType::I64, d);
  ops::moe_permute_map(idx_dev, e, row_map, counts);
  Tensor c = counts.to(Device::cpu());
  std::vector<int64_t> cnt(c.data<int64_t>(), c.data<int64_t>() + e);
  const auto idx = i32_vec(idx_dev), map = i32_vec(row_map);
  // Reference: expert-major, then token, then j.
  int32_t next = 0;
  for (int ex = 0; ex < e; ++ex) {
    int64_t n = 0;
    for (int64_t i = 0; i < t * k; ++i)
      if (idx[size_t(i)] == ex) {
        REQUIRE(map[size_t(i)] == next++);
        ++n;
      }
    REQUIRE(cnt[size_t(ex)] == n);
  }
  for (int64_t i = 0; i < t * k; ++i)
    if (idx[size_t(i)] < 0) REQUIRE(map[size_t(i)] == -1);
  return cnt;
}

struct PermCase {
  const char* name;
  int used;     // experts that receive tokens
  double drop;  // share of dropped slots
};

}  // namespace

TEST_CASE("router random logits: standard normal, keyed by the global token index", "[ops][moe]") {
  // Rows drawn from first_token = 5 are rows 5.. of a draw from 0 (a token's scores do not depend on where its
  // rank's rows start); another offset gives other values; the values are standard normal (mean and variance
  // of 40k draws within 5 standard errors).
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t t = 5000, e = 8;
  Tensor all = Tensor::empty({t, e}), tail = Tensor::empty({t - 5, e}), other = Tensor::empty({t, e});
  ops::router_random_logits(all, seed, 3, 0);
  ops::router_random_logits(tail, seed, 3, 5);
  ops::router_random_logits(other, seed, 4, 0);
  REQUIRE(tail.to_double_vector() == all.narrow(0, 5, t - 5).contiguous().to_double_vector());
  const std::vector<double> v = all.to_double_vector(), w = other.to_double_vector();
  double mean = 0, var = 0;
  int64_t same = 0;
  for (size_t i = 0; i < v.size(); ++i) mean += v[i], same += v[i] == w[i];
  mean /= double(v.size());
  for (double x : v) var += (x - mean) * (x - mean);
  var /= double(v.size());
  CHECK(same < 10);
  CHECK(std::abs(mean) < 5.0 / std::sqrt(double(v.size())));
  CHECK(std::abs(var - 1.0) < 5.0 * std::sqrt(2.0 / double(v.size())));
  Tensor bad = Tensor::empty({t, e}, DType::BF16);
  REQUIRE_THROWS_AS(ops::router_random_logits(bad, seed, 0, 0), ValueError);
  REQUIRE_THROWS_AS(ops::router_random_logits(all, seed, 0, -1), ValueError);
}

TEST_CASE("permute and unpermute round-trip with empty experts, one expert and dropped slots", "[ops][moe]") {
  const int64_t t = 29, h = 24;
  const int e = 8, k = 2;
  for (PermCase pc : {PermCase{"spread", 8, 0.0}, PermCase{"half the experts empty", 4, 0.0},
                      PermCase{"dropped slots", 8, 0.3}, PermCase{"one expert", 1, 0.0}})
    for (DType dt : {DType::F32, DType::BF16}) {
      const int kk = pc.used == 1 ? 1 : k;
      const uint64_t seed = fresh_seed();
      INFO(pc.name << " " << dtype_name(dt) << " seed " << seed);
      Tensor idx = random_indices(t, kk, e, pc.used, pc.drop, seed);
      Tensor map;
      const auto cnt = check_permute_map(idx, e, map);
      const int64_t n = std::accumulate(cnt.begin(), cnt.end(), int64_t{0});
      Tensor x = randn({t, h}, dt, seed + 1);
      Tensor perm = poisoned({n, h}, dt, Device::cpu());
      ops::moe_permute(x, map, perm);
      const auto xd = x.to_double_vector(), pd = perm.to_double_vector();
      const auto m = i32_vec(map);
      for (int64_t i = 0; i < t * kk; ++i)
        if (m[size_t(i)] >= 0)
          for (int64_t c = 0; c < h; ++c) REQUIRE(pd[size_t(m[size_t(i)] * h + c)] == xd[size_t((i / kk) * h + c)]);
      // Combine with probabilities: y = sum of the kept weights times x.
      Tensor probs = randu({t, kk}, DType::F32, seed + 2, 0.1, 1);
      const auto wd = probs.to_double_vector();
      Tensor y = poisoned({t, h}, dt, Device::cpu());
      ops::moe_unpermute(perm, map, probs, y);
      Tensor y1 = poisoned({t, h}, dt, Device::cpu());
      ops::moe_unpermute(perm, map, {}, y1);
      std::vector<double> want(size_t(t * h)), want1(size_t(t * h));
      for (int64_t r = 0; r < t; ++r) {
        double ws = 0, w1 = 0;
        for (int j = 0; j < kk; ++j)
          if (m[size_t(r * kk + j)] >= 0) ws += wd[size_t(r * kk + j)], w1 += 1;
        for (int64_t c = 0; c < h; ++c) {
          want[size_t(r * h + c)] = ws * xd[size_t(r * h + c)];
          want1[size_t(r * h + c)] = w1 * xd[size_t(r * h + c)];
        }
      }
      CHECK(rel_err(y.to_double_vector(), want) < tol_for(dt) / 4);
      CHECK(rel_err(y1.to_double_vector(), want1) < tol_for(dt) / 4);

      // Backward of the combine: dpermuted = w dy at each kept slot's row, dprobs = <dy, permuted row>.
      Tensor dy = randn({t, h}, dt, seed + 3);
      Tensor dperm = poisoned({n, h}, dt, Device::cpu()), dprobs = poisoned({t, kk}, DType::F32, Device::cpu());
      ops::moe_unpermute_backward(dy, perm, map, probs, dperm, dprobs);
      const auto dyd = dy.to_double_vector();
      std::vector<double> wdp(size_t(n * h), 0.0), wdpr(size_t(t * kk), 0.0);
      for (int64_t i = 0; i < t * kk; ++i) {
        const int32_t r = m[size_t(i)];
        if (r < 0) continue;
        for (int64_t c = 0; c < h; ++c) {
          wdp[size_t(r * h + c)] = wd[size_t(i)] * dyd[size_t((i / kk) * h + c)];
          wdpr[size_t(i)] += dyd[size_t((i / kk) * h + c)] * pd[size_t(r * h + c)];
        }
      }
      CHECK(rel_err(dperm.to_double_vector(), wdp) < tol_for(dt) / 4);
      CHECK(rel_err(dprobs.to_double_vector(), wdpr) < 1e-6);

      // A buffer with spare rows (capacity-padded): rows no slot maps to come back zero.
      Tensor perm_pad = randn({n + 2, h}, dt, seed + 4), dperm_pad = poisoned({n + 2, h}, dt, Device::cpu());
      ops::moe_unpermute_backward(dy, perm_pad, map, probs, dperm_pad, dprobs);
      const auto dpp = dperm_pad.to_double_vector();
      CHECK(std::vector<double>(dpp.begin() + n * h, dpp.end()) == std::vector<double>(size_t(2 * h), 0.0));
    }
}

// ---- grouped GEMM ------------------------------------------------------------------------------------

namespace {

struct GroupedCase {
  std::vector<int64_t> sizes;
  int64_t m, k;
};

// References for one grouped case: y = x w_g^T, dx = dy w_g, dw_g = beta dw0_g + dy_g^T x_g (f64).
void check_grouped(const GroupedCase& gc, DType dt, Device d, double tol) {
  const int64_t g = int64_t(gc.sizes.size());
  const int64_t n = std::accumulate(gc.sizes.begin(), gc.sizes.end(), int64_t{0});
  const uint64_t seed = fresh_seed();
  INFO(dtype_name(dt) << " on " << d.str() << " groups " << g << " rows " << n << " seed " << seed);
  Tensor x = randn({n, gc.k}, dt, seed, 0, 1, d), w = randn({g, gc.m, gc.k}, dt, seed + 1, 0, 1, d);
  Tensor dy = randn({n, gc.m}, dt, seed + 2, 0, 1, d);
  Tensor dw0 = randn({g, gc.m, gc.k}, DType::F32, seed + 3, 0, 1, d);  // the f32 main grad
  const auto xd = x.to_double_vector(), wd = w.to_double_vector(), dyd = dy.to_double_vector(),
             dw0d = dw0.to_double_vector();

  Tensor y = poisoned({n, gc.m}, dt, d), dx = poisoned({n, gc.k}, dt, d);
  ops::grouped_gemm_forward(x, w, gc.sizes, y);
  ops::grouped_gemm_dgrad(dy, w, gc.sizes, dx);
  std::vector<double> yr(size_t(n * gc.m)), dxr(size_t(n * gc.k));
  int64_t off = 0;
  for (int64_t e = 0; e < g; ++e) {
    const int64_t r = gc.sizes[size_t(e)];
    if (r > 0) {
      ops::ref::gemm_f64(false, true, r, gc.m, gc.k, 1, xd.data() + off * gc.k, wd.data() + e * gc.m * gc.k, 0,
                         yr.data() + off * gc.m);
      ops::ref::gemm_f64(false, false, r, gc.k, gc.m, 1, dyd.data() + off * gc.m, wd.data() + e * gc.m * gc.k, 0,
                         dxr.data() + off * gc.k);
    }
    off += r;
  }
  CHECK(rel_err(y.to_double_vector(), yr) < tol);
  CHECK(rel_err(dx.to_double_vector(), dxr) < tol);
  for (float beta : {0.f, 1.f, 0.5f}) {
    INFO("beta " << beta);
    Tensor dw = dw0.clone();
    ops::grouped_gemm_wgrad(dy, x, gc.sizes, dw, beta);
    std::vector<double> dwr(dw0d);
    off = 0;
    for (int64_t e = 0; e < g; ++e) {
      const int64_t r = gc.sizes[size_t(e)];
      double* c = dwr.data() + e * gc.m * gc.k;
      if (r > 0) {
        ops::ref::gemm_f64(true, false, gc.m, gc.k, r, 1, dyd.data() + off * gc.m, xd.data() + off * gc.k, beta, c);
      } else {
        for (int64_t i = 0; i < gc.m * gc.k; ++i) c[i] *= beta;
      }
      off += r;
    }
    CHECK(rel_err(dw.to_double_vector(), dwr) < tol);
  }
}

std::vector<GroupedCase> grouped_cases() {
  return {GroupedCase{{5, 0, 17, 3}, 12, 20}, GroupedCase{{0, 0, 33, 0}, 8, 16}, GroupedCase{{0, 0, 0}, 4, 8},
          GroupedCase{{9, 9, 9, 9, 9, 9, 9, 9}, 24, 8}};
}

}  // namespace

namespace {

// A random dispatcher layout: `chunks` blocks of ep · el counts (about a quarter 0, the rest below max_rows),
// pad_rows = the largest block's rows + extra_pad.
struct SortCase {
  std::vector<int64_t> layout;
  int64_t chunks, el, pad;
};
SortCase sort_case(int64_t chunks, int64_t ep, int64_t el, int64_t max_rows, int64_t extra_pad, uint64_t seed) {
  const int64_t e = ep * el;
  Tensor u = Tensor::empty({chunks * e});
  Generator g(seed, 0);
  u.uniform_(g);
  SortCase c{{}, chunks, el, 0};
  for (double x : u.to_double_vector()) c.layout.push_back(x < 0.25 ? 0 : int64_t(x * double(max_rows)));
  for (int64_t k = 0; k < chunks; ++k)
    c.pad = std::max(c.pad, std::accumulate(c.layout.begin() + k * e, c.layout.begin() + (k + 1) * e, int64_t{0}));
  c.pad += extra_pad;
  return c;
}

// Reference: every received row as (local expert, chunk, position in the chunk), sorted; row r of the received
// buffer goes to its rank in that order.
std::vector<int32_t> sort_map_reference(const std::vector<int64_t>& lay, int64_t chunks, int64_t el, int64_t pad) {
  const auto e = int64_t(lay.size()) / chunks;
  std::vector<std::array<int64_t, 3>> rows;  // (expert, chunk, buffer row)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t row = c * pad;
    for (int64_t i = 0; i < e; ++i)
      for (int64_t r = 0; r < lay[size_t(c * e + i)]; ++r) rows.push_back({i % el, c, row++});
  }
  std::sort(rows.begin(), rows.end());
  std::vector<int32_t> map(size_t(chunks * pad), -1);
  for (size_t k = 0; k < rows.size(); ++k) map[size_t(rows[k][2])] = int32_t(k);
  return map;
}

}  // namespace

TEST_CASE("moe_sort_map orders received rows by local expert, padding -1", "[ops][moe]") {
  struct Case {
    int64_t chunks, ep, el, max_rows;
  };
  for (Case c : {Case{1, 1, 4, 9}, Case{1, 4, 2, 7}, Case{2, 2, 3, 5}, Case{4, 2, 1, 6}, Case{2, 4, 4, 0}}) {
    const uint64_t seed = fresh_seed();
    INFO("chunks " << c.chunks << " EP " << c.ep << " local experts " << c.el << " seed " << seed);
    // Padding rows past the largest chunk too.
    const SortCase sc = sort_case(c.chunks, c.ep, c.el, c.max_rows, int64_t(seed % 3), seed);
    Tensor map = Tensor::empty({c.chunks * sc.pad, 1}, DType::I32);
    ops::moe_sort_map(Tensor::from_vector(sc.layout, {int64_t(sc.layout.size())}), c.el, sc.pad, map);
    CHECK(i32_vec(map) == sort_map_reference(sc.layout, c.chunks, c.el, sc.pad));
  }
  Tensor lay = Tensor::from_vector(std::vector<int64_t>{3, 1, 2, 0}, {4});
  Tensor small = Tensor::empty({2, 1}, DType::I32), wrong = Tensor::empty({7, 1}, DType::I32);
  Tensor six = Tensor::empty({6, 1}, DType::I32);
  REQUIRE_THROWS_WITH(ops::moe_sort_map(lay, 2, 2, small),
                      Catch::Contains("chunk 0 holds 6 rows, more than pad_rows 2"));
  REQUIRE_THROWS_WITH(ops::moe_sort_map(lay, 2, 4, wrong), Catch::Contains("map has 7 rows"));
  REQUIRE_THROWS_WITH(ops::moe_sort_map(lay, 3, 6, six), Catch::Contains("not a multiple of 3 local experts"));
}

TEST_CASE("grouped GEMM matches per-group products, groups of 0 rows included", "[ops][moe]") {
  for (const auto& gc : grouped_cases())
    for (DType dt : {DType::F32, DType::BF16}) check_grouped(gc, dt, Device::cpu(), dt == DType::F32 ? 1e-5 : 1e-2);
}

// ---- bad input ---------------------------------------------------------------------------------------

TEST_CASE("MoE ops refuse bad input with the problem named", "[ops][moe]") {
  Tensor z = randn({4, 6}, DType::F32, 1);
  Tensor p2 = Tensor::empty({4, 2}), i2 = Tensor::empty({4, 2}, DType::I32);
  REQUIRE_THROWS_WITH(ops::router_topk(z, {}, opts(7, RouterScore::Softmax, false, 1), p2, i2),
                      Catch::Contains("topk 7 is larger than the number of experts 6"));
  REQUIRE_THROWS_WITH(ops::router_topk(z, {}, opts(0, RouterScore::Softmax, false, 1), p2, i2),
                      Catch::Contains("topk is 0; it must be at least 1"));
  REQUIRE_THROWS_WITH(ops::router_topk(z, {}, opts(3, RouterScore::Softmax, false, 1), p2, i2),
                      Catch::Contains("probs has shape [4, 2], expected [4, 3]"));
  REQUIRE_THROWS_WITH(ops::router_topk(z, Tensor::zeros({5}), opts(2, RouterScore::Softmax, false, 1), p2, i2),
                      Catch::Contains("expert_bias has shape [5], expected [6]"));
  Tensor i2_f32 = Tensor::empty({4, 2});
  REQUIRE_THROWS_AS(ops::router_topk(z, {}, opts(2, RouterScore::Softmax, false, 1), p2, i2_f32), ValueError);

  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 6, 3, 4, -1, 5}, {4, 2});
  Tensor map = Tensor::empty({4, 2}, DType::I32), cnt = Tensor::empty({6}, DType::I64);
  REQUIRE_THROWS_AS(ops::moe_permute_map(bad, 6, map, cnt), ValueError);
  REQUIRE_THROWS_WITH(ops::moe_permute_map(bad, 6, map, cnt), Catch::Contains("indices[1, 1] = 6 is outside [-1, 6)"));
  Tensor dz = Tensor::zeros({4, 6});
  REQUIRE_THROWS_WITH(ops::router_topk_backward(z, bad, p2, opts(2, RouterScore::Softmax, false, 1), dz),
                      Catch::Contains("is outside [0, 6)"));
  REQUIRE_THROWS_WITH(ops::router_apply_capacity(p2, i2, 6, 0), Catch::Contains("capacity is 0"));

  Tensor x = randn({4, 8}, DType::F32, 2), w = randn({3, 5, 8}, DType::F32, 3), y = Tensor::empty({4, 5});
  const std::vector<int64_t> wrong_sum{1, 1, 1}, wrong_count{2, 2};
  REQUIRE_THROWS_WITH(ops::grouped_gemm_forward(x, w, wrong_sum, y),
                      Catch::Contains("group sizes sum to 3 but the input has 4 rows"));
  REQUIRE_THROWS_WITH(ops::grouped_gemm_forward(x, w, wrong_count, y), Catch::Contains("2 group sizes for 3"));
  const std::vector<int64_t> ok{1, 2, 1};
  Tensor w_bad = randn({3, 5, 7}, DType::F32, 4);
  REQUIRE_THROWS_AS(ops::grouped_gemm_forward(x, w_bad, ok, y), ValueError);
  Tensor dw_bad = Tensor::empty({3, 5, 9});
  REQUIRE_THROWS_AS(ops::grouped_gemm_wgrad(y, x, ok, dw_bad), ValueError);
  Tensor perm_small = Tensor::empty({2, 8});
  Tensor good = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 3, 4, -1, 5}, {4, 2});
  ops::moe_permute_map(good, 6, map, cnt);
  REQUIRE_THROWS_WITH(ops::moe_permute(x, map, perm_small), Catch::Contains("is outside [-1, 2)"));
}

TEST_CASE("grouped GEMM path: auto takes the grouped launch for groups of little work only", "[ops][moe]") {
  using P = ops::GroupedGemmPath;
  const int64_t lim = ops::kGroupedGemmMaxMeanMacs, k = 1024;  // k multiply-adds per row: lim / k rows per group
  const std::vector<int64_t> small(64, 128), large(8, 1024), none(4, 0);
  // Empty groups do not count: the mean is over the groups with rows.
  const std::vector<int64_t> below{0, lim / k - 1, 0, lim / k}, at{0, lim / k, 0, lim / k};
  CHECK(ops::grouped_gemm_choice(P::Auto, small, k) == P::Grouped);
  CHECK(ops::grouped_gemm_choice(P::Auto, large, k * k) == P::Loop);
  CHECK(ops::grouped_gemm_choice(P::Auto, below, k) == P::Grouped);
  CHECK(ops::grouped_gemm_choice(P::Auto, at, k) == P::Loop);
  CHECK(ops::grouped_gemm_choice(P::Auto, none, k) == P::Loop);
  // The same rows decide differently with the width of the product.
  CHECK(ops::grouped_gemm_choice(P::Auto, small, lim / 256) == P::Grouped);
  CHECK(ops::grouped_gemm_choice(P::Auto, small, lim / 64) == P::Loop);
  CHECK(ops::grouped_gemm_choice(P::Loop, small, k) == P::Loop);
  CHECK(ops::grouped_gemm_choice(P::Grouped, large, k) == P::Grouped);
  CHECK(ops::grouped_gemm_choice(P::Grouped, small, k, false) == P::Loop);  // no cuBLAS grouped kernel

  // Where the Hopper kernel does not run, Sm90 falls back to Auto's cuBLAS choice.
  CHECK(ops::grouped_gemm_choice(P::Sm90, small, k) == P::Grouped);
  CHECK(ops::grouped_gemm_choice(P::Sm90, large, k * k) == P::Loop);
  CHECK_FALSE(ops::grouped_gemm_sm90_available(Device::cpu()));

  for (P p : {P::Auto, P::Loop, P::Grouped, P::Sm90})
    CHECK(ops::parse_grouped_gemm_path(ops::grouped_gemm_path_name(p)) == p);
  REQUIRE_THROWS_AS(ops::parse_grouped_gemm_path("fast"), ConfigError);
  REQUIRE_THROWS_WITH(
      ops::parse_grouped_gemm_path("Loop"),
      Catch::Contains("MEGACORE_MOE_GEMM is 'Loop'; the grouped GEMM path is auto, loop, grouped or sm90"));

  const P before = ops::grouped_gemm_path();
  ops::set_grouped_gemm_path(P::Grouped);
  CHECK(ops::grouped_gemm_path() == P::Grouped);
  ops::set_grouped_gemm_path(before);

  // The loop's CUDA streams: 1 to 16, or 0 for the default (wgrad on its own count, forward and dgrad on one).
  const int streams = ops::grouped_gemm_loop_streams();
  CHECK((streams >= 0 && streams <= 16));
  REQUIRE_THROWS_WITH(ops::set_grouped_gemm_loop_streams(-1), Catch::Contains("1 to 16 CUDA streams"));
  REQUIRE_THROWS_AS(ops::set_grouped_gemm_loop_streams(17), ConfigError);
  ops::set_grouped_gemm_loop_streams(0);
  CHECK(ops::grouped_gemm_loop_streams_for(true) == ops::kGroupedGemmWgradStreams);
  CHECK(ops::grouped_gemm_loop_streams_for(false) == 1);
  ops::set_grouped_gemm_loop_streams(3);
  CHECK(ops::grouped_gemm_loop_streams() == 3);
  CHECK(ops::grouped_gemm_loop_streams_for(false) == 3);
  ops::set_grouped_gemm_loop_streams(streams);
}

// The auto rule against the measured benchmark: every shape of benchmarks/results/moe_gemm_NVIDIA_H200.json
// (Mixtral, 1.1B-MoE and fine-grained 64/128-expert layers; fc1/fc2 forward, dgrad, wgrad; even and
// imbalanced routing) must get the faster of the grouped launch and the loop, except where the two were
// within 5 % of each other.
TEST_CASE("grouped GEMM auto rule picks the faster measured path on every H200 shape", "[ops][moe]") {
  const char* root = std::getenv("MEGACORE_SOURCE_DIR");
  const std::filesystem::path rel = "benchmarks/results/moe_gemm_NVIDIA_H200.json";
  std::filesystem::path file = root ? std::filesystem::path(root) / rel : rel;
  for (std::filesystem::path d = std::filesystem::current_path(); !root && !std::filesystem::exists(file) &&
                                                                  d.has_relative_path();
       d = d.parent_path())
    file = d / rel;
  INFO("set MEGACORE_SOURCE_DIR to the source tree; looked for " << file.string());
  std::ifstream in(file);
  REQUIRE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);
  using P = ops::GroupedGemmPath;
  int decided = 0, close = 0, grouped_wins = 0;
  for (const nlohmann::json& r : j.at("rows")) {
    const std::string op = r.at("op");
    const bool fc1 = op.rfind("fc1", 0) == 0, wgrad = op.find("wgrad") != std::string::npos;
    const int64_t ffn = r.at("ffn"), hidden = r.at("hidden");
    const int64_t macs = (fc1 ? 2 * ffn : ffn) * hidden;
    const std::vector<int64_t> sizes = r.at("group_sizes").get<std::vector<int64_t>>();
    const double g = r.at("grouped_ms"), l = r.at("loop_ms");
    const P choice = ops::grouped_gemm_choice(P::Auto, sizes, macs, !wgrad);
    INFO(r.at("model").get<std::string>() << " " << op << " rows " << r.at("rows") << " " << r.at("split")
                                          << ": grouped " << g << " ms, loop " << l << " ms");
    if (std::abs(g / l - 1) <= 0.05) {
      ++close;
      continue;
    }
    ++decided;
    grouped_wins += g < l;
    CHECK(choice == (g < l ? P::Grouped : P::Loop));
  }
  // The file holds both kinds of shapes, so the rule was tested on each side of its bound.
  CHECK(decided >= 100);
  CHECK(grouped_wins >= 20);
  CHECK(decided - grouped_wins >= 20);
}

// ---- CUDA vs the CPU reference -----------------------------------------------------------------------

namespace {
// Two experts whose f64 selection scores lie this close may be ordered differently by the CUDA
// router (f32 score + bias) and the CPU (f64): |s_a - s_b| <= kSelectionTol * max(1, |s_b|).
constexpr double kSelectionTol = 1e-6;

// CUDA top-k (pg, ig) against the CPU's (p, i). Without a bias both select on the logits: identical
// choice. With one, slot j may hold a different expert only where the two experts' f64 selection
// scores are within kSelectionTol (the j-th largest of two vectors that differ by at most d per entry
// differ by at most d); such a row's probs are checked against the f64 reference for the experts CUDA
// chose, every other row against the CPU's.
void check_gpu_topk(const Tensor& z, const Tensor& bias, const RouterTopkOptions& o, const Tensor& p,
                    const Tensor& i, const Tensor& pg, const Tensor& ig) {
  const int64_t t = z.size(0);
  const int e = int(z.size(1)), k = o.topk;
  const auto ic = i32_vec(i), igc = i32_vec(ig);
  if (!bias.defined()) {
    CHECK(igc == ic);
    CHECK(rel_err_t(pg, p) < 1e-5);
    return;
  }
  const auto zd = z.to_double_vector(), bd = bias.to_double_vector();
  Tensor expect = p.clone();
  int64_t differing_rows = 0;
  for (int64_t r = 0; r < t; ++r) {
    const std::vector<int32_t> gpu_row(igc.begin() + r * k, igc.begin() + (r + 1) * k);
    const std::vector<int32_t> cpu_row(ic.begin() + r * k, ic.begin() + (r + 1) * k);
    if (gpu_row == cpu_row) continue;
    ++differing_rows;
    const std::vector<double> sel = ref_selection(row(zd, r, e), bd, o);
    std::vector<int> chosen;
    for (int j = 0; j < k; ++j) {
      const int a = gpu_row[size_t(j)], b = cpu_row[size_t(j)];
      INFO("row " << r << " slot " << j << ": CUDA chose " << a << ", CPU " << b);
      REQUIRE((a >= 0 && a < e));
      REQUIRE(std::find(chosen.begin(), chosen.end(), a) == chosen.end());
      CHECK(std::abs(sel[size_t(a)] - sel[size_t(b)]) <= kSelectionTol * std::max(1.0, std::abs(sel[size_t(b)])));
      chosen.push_back(a);
    }
    const std::vector<double> pr = ref_probs_fixed(row(zd, r, e), chosen, o);
    for (int j = 0; j < k; ++j) expect.data<float>()[r * k + j] = float(pr[size_t(j)]);
  }
  INFO(differing_rows << " of " << t << " rows ordered differently within the tolerance");
  CHECK(rel_err_t(pg, expect) < 1e-5);
}
}  // namespace

TEST_CASE("CUDA router kernels match the CPU reference", "[ops][moe][gpu]") {
  MC_REQUIRE_GPU();
  const int64_t t = 1000;
  for (int e : {8, 64, 256})
    for (auto o : all_router_options())
      for (bool with_bias : {false, true}) {
        if (o.topk > e) continue;
        if (e == 256) o.topk = 8;
        const uint64_t seed = fresh_seed();
        INFO("E=" << e << " " << describe(o, with_bias) << " seed " << seed);
        Tensor z = randn({t, e}, DType::F32, seed, 0, 1.5);
        Tensor bias = with_bias ? randn({e}, DType::F32, seed + 1, 0, 0.5) : Tensor();
        Tensor p = Tensor::empty({t, o.topk}), i = Tensor::empty({t, o.topk}, DType::I32);
        ops::router_topk(z, bias, o, p, i);
        Tensor pg = poisoned({t, o.topk}, DType::F32, gpu()), ig = poisoned({t, o.topk}, DType::I32, gpu());
        ops::router_topk(z.to(gpu()), with_bias ? bias.to(gpu()) : Tensor(), o, pg, ig);
        check_gpu_topk(z, bias, o, p, i, pg, ig);
        Tensor dp = randn({t, o.topk}, DType::F32, seed + 2), dz0 = randn({t, e}, DType::F32, seed + 3);
        Tensor dz = dz0.clone(), dzg = dz0.to(gpu());
        ops::router_topk_backward(z, i, dp, o, dz);
        ops::router_topk_backward(z.to(gpu()), i.to(gpu()), dp.to(gpu()), o, dzg);
        CHECK(rel_err_t(dzg, dz) < 1e-5);
      }
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {
    const uint64_t seed = fresh_seed();
    INFO("aux/z seed " << seed);
    const int e = 64;
    Tensor z = randn({t, e}, DType::F32, seed, 0, 2), n = randu({e}, DType::F32, seed + 1, 0, 100);
    Tensor l = Tensor::empty({1}), lg = poisoned({1}, DType::F32, gpu());
    ops::router_aux_loss(z, score, n, 2 * t, 2, 0.01f, l);
    ops::router_aux_loss(z.to(gpu()), score, n.to(gpu()), 2 * t, 2, 0.01f, lg);
    CHECK(std::abs(lg.to(Device::cpu()).item() - l.item()) < 1e-5 * std::abs(l.item()));
    Tensor dz = Tensor::zeros({t, e}), dzg = Tensor::zeros({t, e}, DType::F32, gpu());
    ops::router_aux_loss_backward(z, score, n, 2 * t, 2, 0.01f, 3.f, dz);
    ops::router_aux_loss_backward(z.to(gpu()), score, n.to(gpu()), 2 * t, 2, 0.01f, 3.f, dzg);
    CHECK(rel_err_t(dzg, dz) < 1e-5);
    ops::router_z_loss(z, 1e-3f, l);
    ops::router_z_loss(z.to(gpu()), 1e-3f, lg);
    CHECK(std::abs(lg.to(Device::cpu()).item() - l.item()) < 1e-5 * std::abs(l.item()));
    ops::router_z_loss_backward(z, 1e-3f, 2.f, dz);
    ops::router_z_loss_backward(z.to(gpu()), 1e-3f, 2.f, dzg);
    CHECK(rel_err_t(dzg, dz) < 1e-5);
  }
}

TEST_CASE("CUDA router random logits equal the CPU draw bit for bit", "[ops][moe][gpu]") {
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  for (int64_t first : {int64_t{0}, int64_t{12345}}) {
    Tensor c = Tensor::empty({3000, 64});
    Tensor g = poisoned({3000, 64}, DType::F32, gpu());
    ops::router_random_logits(c, seed, 77, first);
    ops::router_random_logits(g, seed, 77, first);
    REQUIRE(g.to(Device::cpu()).to_double_vector() == c.to_double_vector());
  }
}

TEST_CASE("CUDA capacity and permutation match the CPU reference", "[ops][moe][gpu]") {
  MC_REQUIRE_GPU();
  const int64_t t = 3000;
  const int e = 16, k = 4;
  // h 512: 16-byte vectors; h 518 (rows of 1036 / 2072 bytes): the narrow copies.
  for (int64_t h : {int64_t(512), int64_t(518)})
  for (PermCase pc : {PermCase{"spread", 16, 0.0}, PermCase{"half the experts empty", 8, 0.0},
                      PermCase{"dropped slots", 16, 0.3}})
    for (DType dt : {DType::F32, DType::BF16}) {
      const uint64_t seed = fresh_seed();
      INFO(pc.name << " " << dtype_name(dt) << " h " << h << " seed " << seed);
      Tensor idx = random_indices(t, k, e, pc.used, pc.drop, seed);
      Tensor map_g;
      const auto cnt = check_permute_map(idx.to(gpu()), e, map_g);
      Tensor map = Tensor::empty({t, k}, DType::I32), cnt_c = Tensor::empty({e}, DType::I64);
      ops::moe_permute_map(idx, e, map, cnt_c);
      REQUIRE(i32_vec(map_g) == i32_vec(map));
      const int64_t n = std::accumulate(cnt.begin(), cnt.end(), int64_t{0});
      Tensor x = randn({t, h}, dt, seed + 1);
      Tensor perm = Tensor::empty({n, h}, dt), perm_g = poisoned({n, h}, dt, gpu());
      ops::moe_permute(x, map, perm);
      ops::moe_permute(x.to(gpu()), map_g, perm_g);
      CHECK(rel_err_t(perm_g, perm) == 0.0);
      Tensor probs = randu({t, k}, DType::F32, seed + 2, 0, 1);
      for (bool with_probs : {true, false}) {
        Tensor y = Tensor::empty({t, h}, dt), y_g = poisoned({t, h}, dt, gpu());
        ops::moe_unpermute(perm, map, with_probs ? probs : Tensor(), y);
        ops::moe_unpermute(perm_g, map_g, with_probs ? probs.to(gpu()) : Tensor(), y_g);
        CHECK(rel_err_t(y_g, y) < (dt == DType::F32 ? 1e-6 : 4e-3));
      }
      Tensor dy = randn({t, h}, dt, seed + 3);
      Tensor dp = Tensor::empty({n, h}, dt), dpr = Tensor::empty({t, k});
      Tensor dp_g = poisoned({n, h}, dt, gpu()), dpr_g = poisoned({t, k}, DType::F32, gpu());
      ops::moe_unpermute_backward(dy, perm, map, probs, dp, dpr);
      ops::moe_unpermute_backward(dy.to(gpu()), perm_g, map_g, probs.to(gpu()), dp_g, dpr_g);
      CHECK(rel_err_t(dp_g, dp) < (dt == DType::F32 ? 1e-6 : 4e-3));
      CHECK(rel_err_t(dpr_g, dpr) < 1e-5);
    }
  for (int64_t cap : {int64_t(1), int64_t(100), int64_t(700), int64_t(5000)}) {
    const uint64_t seed = fresh_seed();
    INFO("capacity " << cap << " seed " << seed);
    Tensor z = randn({t, e}, DType::F32, seed);
    Tensor p = Tensor::empty({t, k}), i = Tensor::empty({t, k}, DType::I32);
    ops::router_topk(z, {}, opts(k, RouterScore::Softmax, true, 1.f), p, i);
    for (int64_t s = 0; s < t * k; s += 5) p.data<float>()[s] = std::round(p.data<float>()[s] * 8) / 8;  // ties
    Tensor pg = p.to(gpu()), ig = i.to(gpu());
    ops::router_apply_capacity(p, i, e, cap);
    ops::router_apply_capacity(pg, ig, e, cap);
    CHECK(i32_vec(ig) == i32_vec(i));
    CHECK(pg.to(Device::cpu()).to_double_vector() == p.to_double_vector());
  }
  // An out-of-range index shows in the counts (all -1) on the GPU.
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 9, 1, 2}, {2, 2}).to(gpu());
  Tensor map = Tensor::empty({2, 2}, DType::I32, gpu()), cnt = Tensor::empty({4}, DType::I64, gpu());
  ops::moe_permute_map(bad, 4, map, cnt);
  CHECK(cnt.to(Device::cpu()).to_double_vector() == std::vector<double>{-1, -1, -1, -1});
}

TEST_CASE("CUDA moe_sort_map matches the CPU op", "[ops][moe][gpu]") {
  MC_REQUIRE_GPU();
  struct Case {
    int64_t chunks, ep, el, max_rows;
  };
  for (Case c : {Case{1, 8, 1, 3000}, Case{2, 4, 8, 900}, Case{8, 8, 32, 40}, Case{1, 1, 256, 100}, Case{2, 2, 2, 0}}) {
    const uint64_t seed = fresh_seed();
    INFO("chunks " << c.chunks << " EP " << c.ep << " local experts " << c.el << " seed " << seed);
    const SortCase sc = sort_case(c.chunks, c.ep, c.el, c.max_rows, 5, seed);
    const int64_t pad = sc.pad;
    Tensor lt = Tensor::from_vector(sc.layout, {int64_t(sc.layout.size())});
    Tensor map = Tensor::empty({c.chunks * pad, 1}, DType::I32);
    Tensor map_g = poisoned({c.chunks * pad, 1}, DType::I32, gpu());
    ops::moe_sort_map(lt, c.el, pad, map);
    ops::moe_sort_map(lt.to(gpu()), c.el, pad, map_g);
    CHECK(i32_vec(map_g) == i32_vec(map));
  }
}

TEST_CASE("CUDA grouped GEMM matches the f64 per-group reference", "[ops][moe][gpu]") {
  MC_REQUIRE_GPU();
  std::vector<GroupedCase> cases = grouped_cases();
  cases.push_back(GroupedCase{{300, 0, 1000, 17, 0, 555, 128, 1}, 256, 192});
  // Many small groups (Auto's grouped launch) next to the large ones (its loop).
  cases.push_back(GroupedCase{std::vector<int64_t>(40, 24), 128, 64});
  // The Hopper kernel's edges: partial 128-row / 64-deep tiles, groups ending inside a k-block (wgrad),
  // 0-row groups, several tiles per CTA (more tiles than the 132 SMs), features multiple of 8 but not of 64.
  // (The last one averages 558 rows per group: its wgrad takes the TMA epilogue for beta 0 and 1.)
  cases.push_back(GroupedCase{{100, 0, 257, 1, 64, 130}, 200, 136});
  cases.push_back(GroupedCase{std::vector<int64_t>(64, 40), 264, 136});  // 192 forward tiles, 384 wgrad tiles
  cases.push_back(GroupedCase{{700, 0, 1500, 33}, 136, 72});
  // Forward/dgrad tails of 1-64 rows as 64 x 256 tiles (268 rows per group on average), dgrad's 328 columns in
  // three n-tiles (the last wide tile half past them), one tail of 88 rows kept as a 128-row tile.
  cases.push_back(GroupedCase{{300, 0, 520, 290, 129, 40, 600}, 200, 328});
  // Both sides of the wide-tail bound (tails of 63, 64 and 65 rows past whole tiles; 65 stays a 128-row tile) and a
  // wide launch whose forward output has one 128-column n-tile (M = 120: each wide tile's second half lies past it).
  cases.push_back(GroupedCase{{0, 257, 319, 320, 321, 1, 600, 130, 700}, 120, 256});
  const ops::GroupedGemmPath before = ops::grouped_gemm_path();
  const int streams = ops::grouped_gemm_loop_streams();
  const bool hopper = ops::grouped_gemm_sm90_available(gpu());
  for (auto path : {ops::GroupedGemmPath::Loop, ops::GroupedGemmPath::Grouped, ops::GroupedGemmPath::Auto,
                    ops::GroupedGemmPath::Sm90})
    for (int k : {1, 3}) {  // the loop on the caller's stream and on three side streams
      INFO("path " << ops::grouped_gemm_path_name(path) << ", loop streams " << k << ", Hopper kernel " << hopper);
      ops::set_grouped_gemm_path(path);
      ops::set_grouped_gemm_loop_streams(k);
      for (const auto& gc : cases)
        for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
          const int64_t launched = ops::grouped_gemm_sm90_launches();
          check_grouped(gc, dt, gpu(), dt == DType::F32 ? 1e-5 : 1e-2);
          // bf16 with features a multiple of 8 runs on the Hopper kernel under auto and sm90 (where available).
          const bool sm90 = hopper && dt == DType::BF16 && gc.m % 8 == 0 && gc.k % 8 == 0 &&
                            (path == ops::GroupedGemmPath::Auto || path == ops::GroupedGemmPath::Sm90);
          CHECK((ops::grouped_gemm_sm90_launches() > launched) == sm90);
        }
    }
  // Auto's wgrad takes the Hopper kernel at any size (a group of 1 row, empty groups, 1024+ rows) into f32 with beta 1
  // and 0; with every group empty dw is still scaled by beta.
  if (hopper) {
    ops::set_grouped_gemm_path(ops::GroupedGemmPath::Auto);
    for (const std::vector<int64_t>& sizes :
         {std::vector<int64_t>{1, 0, 3}, std::vector<int64_t>{1023, 1024}, std::vector<int64_t>{0, 0}}) {
      const int64_t n = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
      const bool any = n > 0;
      Tensor dy = randn({std::max<int64_t>(n, 1), 64}, DType::BF16, fresh_seed(), 0, 1, gpu()).narrow(0, 0, n);
      Tensor x = randn({std::max<int64_t>(n, 1), 32}, DType::BF16, 7, 0, 1, gpu()).narrow(0, 0, n);
      for (float beta : {1.f, 0.f}) {
        Tensor dw = Tensor::full({int64_t(sizes.size()), 64, 32}, 2.0, DType::F32, gpu());
        const int64_t launched = ops::grouped_gemm_sm90_launches();
        ops::grouped_gemm_wgrad(dy, x, sizes, dw, beta);
        CHECK(ops::grouped_gemm_sm90_launches() == launched + (any ? 1 : 0));  // no rows: nothing launched
        if (!any) CHECK(dw.to(Device::cpu()).to_double_vector() == std::vector<double>(size_t(2 * 64 * 32), 2.0 * beta));
      }
    }
  }
  ops::set_grouped_gemm_path(before);
  ops::set_grouped_gemm_loop_streams(streams);
}
