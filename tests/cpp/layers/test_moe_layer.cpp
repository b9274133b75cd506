// MoELayer on one rank: forward and backward against a plain per-token reference written here (f64 loops
// over each token's chosen experts, softmax over the k chosen logits), the router's gradient with the aux
// and z-losses against central finite differences, capacity dropping, the expert bias update, stash/restore.
//
// Tolerances: the layer computes in f32 (the reference in f64 from the same f32 weights), so outputs and
// gradients agree to a relative error of 1e-5; finite differences in f32 with steps 1e-3 and 2e-3 on a smooth
// objective agree to 1e-2.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "moe_test_util.hpp"

using namespace megacore;
using namespace layers_test;
namespace ly = megacore::layers;

namespace {

constexpr int64_t kH = 16, kF = 24, kE = 4, kT = 12;

ly::MoEOptions base_options() {
  ly::MoEOptions o;
  o.num_experts = kE;
  o.topk = 2;
  o.ffn_hidden_size = kF;
  o.init_std = 0.3;  // logits well apart, so finite differences do not flip the top-k choice
  return o;
}

std::vector<double> vec(const Tensor& t) { return t.to_double_vector(); }

Tensor from(const std::vector<double>& v, const Shape& shape) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector(f, shape);
}

double silu(double g) { return g / (1 + std::exp(-g)); }
double dsilu(double g) {
  const double s = 1 / (1 + std::exp(-g));
  return s * (1 + g * (1 - s));
}

// Plain reference of a dropless softmax (top-k then softmax over the k chosen) SwiGLU MoE layer.
struct Reference {
  std::vector<double> y, dx, dwr, dw1, dw2;
  Reference(ly::MoELayer& m, const Tensor& x, const Tensor& dy) {
    const int k = m.options().topk;
    const auto X = vec(x), DY = vec(dy), WR = vec(m.router_weight().data), W1 = vec(m.fc1_weight().data),
               W2 = vec(m.fc2_weight().data);
    y.assign(X.size(), 0), dx.assign(X.size(), 0), dwr.assign(WR.size(), 0), dw1.assign(W1.size(), 0),
        dw2.assign(W2.size(), 0);
    for (int64_t t = 0; t < kT; ++t) {
      const double* xt = &X[size_t(t * kH)];
      std::vector<double> logit(kE, 0);
      for (int64_t e = 0; e < kE; ++e)
        for (int64_t i = 0; i < kH; ++i) logit[size_t(e)] += WR[size_t(e * kH + i)] * xt[i];
      std::vector<int> order(kE);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logit[size_t(a)] > logit[size_t(b)]; });
      std::vector<double> p(static_cast<size_t>(k), 0.0);
      double mx = logit[size_t(order[0])], z = 0;
      for (int j = 0; j < k; ++j) z += p[size_t(j)] = std::exp(logit[size_t(order[size_t(j)])] - mx);
      for (double& v : p) v /= z;
      std::vector<double> dp(static_cast<size_t>(k), 0.0);
      for (int j = 0; j < k; ++j) {
        const int64_t e = order[size_t(j)];
        const double* w1 = &W1[size_t(e * 2 * kF * kH)];
        const double* w2 = &W2[size_t(e * kH * kF)];
        std::vector<double> g(kF, 0), u(kF, 0), a(kF), o(kH, 0);
        for (int64_t f = 0; f < kF; ++f)
          for (int64_t i = 0; i < kH; ++i) g[size_t(f)] += w1[f * kH + i] * xt[i], u[size_t(f)] += w1[(kF + f) * kH + i] * xt[i];
        for (int64_t f = 0; f < kF; ++f) a[size_t(f)] = silu(g[size_t(f)]) * u[size_t(f)];
        for (int64_t i = 0; i < kH; ++i)
          for (int64_t f = 0; f < kF; ++f) o[size_t(i)] += w2[i * kF + f] * a[size_t(f)];
        for (int64_t i = 0; i < kH; ++i) {
          y[size_t(t * kH + i)] += p[size_t(j)] * o[size_t(i)];
          dp[size_t(j)] += DY[size_t(t * kH + i)] * o[size_t(i)];
        }
        // expert backward with do = p · dy
        std::vector<double> da(kF, 0);
        for (int64_t i = 0; i < kH; ++i) {
          const double d = p[size_t(j)] * DY[size_t(t * kH + i)];
          for (int64_t f = 0; f < kF; ++f) {
            da[size_t(f)] += w2[i * kF + f] * d;
            dw2[size_t(e * kH * kF + i * kF + f)] += d * a[size_t(f)];
          }
        }
        for (int64_t f = 0; f < kF; ++f) {
          const double dg = da[size_t(f)] * u[size_t(f)] * dsilu(g[size_t(f)]), du = da[size_t(f)] * silu(g[size_t(f)]);
          for (int64_t i = 0; i < kH; ++i) {
            dx[size_t(t * kH + i)] += w1[f * kH + i] * dg + w1[(kF + f) * kH + i] * du;
            dw1[size_t(e * 2 * kF * kH + f * kH + i)] += dg * xt[i];
            dw1[size_t(e * 2 * kF * kH + (kF + f) * kH + i)] += du * xt[i];
          }
        }
      }
      // softmax over the chosen: dl_j = p_j (dp_j - sum_i p_i dp_i)
      double pdp = 0;
      for (int j = 0; j < k; ++j) pdp += p[size_t(j)] * dp[size_t(j)];
      for (int j = 0; j < k; ++j) {
        const int64_t e = order[size_t(j)];
        const double dl = p[size_t(j)] * (dp[size_t(j)] - pdp);
        for (int64_t i = 0; i < kH; ++i) {
          dx[size_t(t * kH + i)] += dl * WR[size_t(e * kH + i)];
          dwr[size_t(e * kH + i)] += dl * xt[i];
        }
      }
    }
  }
};

void require_close_v(const Tensor& got, const std::vector<double>& want, double tol, const char* what) {
  INFO(what);
  REQUIRE(size_t(got.numel()) == want.size());
  REQUIRE(mctest::rel_err(got.to_double_vector(), want) <= tol);
}

}  // namespace

TEST_CASE("MoELayer forward and backward equal a per-token reference over the chosen experts", "[layers][moe]") {
  SoloMoEGroups solo;
  ly::MoELayer m(solo.groups(), kH, base_options());
  REQUIRE(m.num_local_experts() == kE);
  const Tensor x = randn({kT / 2, 2, kH}, 1), dy = randn({kT / 2, 2, kH}, 2);
  ly::ForwardContext ctx;
  Tensor y = m.forward(ctx, x);
  REQUIRE(y.shape() == x.shape());
  Tensor dx = m.backward(ctx, dy);
  const Reference ref(m, x, dy);
  require_close_v(y, ref.y, 1e-5, "y");
  require_close_v(dx, ref.dx, 1e-5, "dx");
  require_close_v(m.router_weight().main_grad, ref.dwr, 1e-5, "router grad");
  require_close_v(m.fc1_weight().main_grad, ref.dw1, 1e-5, "fc1 grad");
  require_close_v(m.fc2_weight().main_grad, ref.dw2, 1e-5, "fc2 grad");
  // Every token counted twice (top-2), and the expert parameters are marked for expert-DP reduction.
  const auto& tpe = m.tokens_per_expert();
  REQUIRE(std::accumulate(tpe.begin(), tpe.end(), int64_t{0}) == 2 * kT);
  REQUIRE(m.load_imbalance() >= 1.0);
  REQUIRE(m.fc1_weight().expert);
  REQUIRE(m.fc1_weight().num_experts == kE);
  REQUIRE_FALSE(m.router_weight().expert);
  // One backward per forward.
  REQUIRE_THROWS_WITH(m.backward(ctx, dy), Catch::Contains("call forward with ctx.training = true"));
}

TEST_CASE("MoELayer router gradient with aux and z-losses matches finite differences", "[layers][moe]") {
  SoloMoEGroups solo;
  for (bool sigmoid : {false, true}) {
    INFO("sigmoid " << sigmoid);
    ly::MoEOptions o = base_options();
    o.aux_loss_coeff = 0.5f;
    o.z_loss_coeff = 0.1f;
    o.score = sigmoid ? ly::MoERouterScore::Sigmoid : ly::MoERouterScore::Softmax;
    ly::MoELayer m(solo.groups(), kH, o);
    const Tensor x = randn({kT, kH}, 3), dy = randn({kT, kH}, 4);
    ly::ForwardContext ctx;
    // L = <y, dy> + aux + z; its router gradient is what backward accumulates.
    auto objective = [&]() {
      ly::ForwardContext ev;
      ev.training = false;
      const auto y = vec(m.forward(ev, x)), d = vec(dy);
      double l = 0;
      for (size_t i = 0; i < y.size(); ++i) l += y[i] * d[i];
      return l + m.aux_loss().item() + m.z_loss().item();
    };
    m.forward(ctx, x);
    REQUIRE(m.aux_loss().item() > 0);
    REQUIRE(m.z_loss().item() > 0);
    m.backward(ctx, dy);
    const std::vector<double> grad = vec(m.router_weight().main_grad);
    Tensor& w = m.router_weight().data;
    // Central differences at two steps; an entry whose perturbation changes some token's top-k choice (the
    // objective jumps) gives two disagreeing estimates and is left out. Most entries are smooth.
    auto central = [&](int64_t i, double eps) {
      const float w0 = w.data<float>()[i];
      w.data<float>()[i] = float(w0 + eps);
      const double lp = objective();
      w.data<float>()[i] = float(w0 - eps);
      const double lm = objective();
      w.data<float>()[i] = w0;
      return (lp - lm) / (2 * eps);
    };
    std::vector<double> fd, an;
    int64_t tried = 0;
    for (int64_t i = 0; i < w.numel(); i += 3, ++tried) {
      const double a = central(i, 2e-3), b = central(i, 1e-3);
      if (std::abs(a - b) > 1e-2 * (std::abs(b) + 1e-2)) continue;
      fd.push_back(b);
      an.push_back(grad[size_t(i)]);
    }
    REQUIRE(fd.size() * 4 >= size_t(tried) * 3);
    for (size_t i = 0; i < an.size(); ++i) UNSCOPED_INFO(an[i] << " vs " << fd[i]);
    REQUIRE(mctest::rel_err(an, fd) <= 1e-2);
  }
}

TEST_CASE("MoELayer capacity drops the least probable slots beyond each expert's capacity", "[layers][moe]") {
  SoloMoEGroups solo;
  ly::MoEOptions o = base_options();
  o.capacity_factor = 0.5;  // ceil(0.5 · 12 · 2 / 4) = 3 slots per expert, 12 of 24 kept at most
  ly::MoELayer dropping(solo.groups(), kH, o);
  ly::MoELayer dropless(solo.groups(), kH, base_options());
  const Tensor x = randn({kT, kH}, 5);
  ly::ForwardContext ev;
  ev.training = false;
  const auto a = vec(dropping.forward(ev, x)), b = vec(dropless.forward(ev, x));
  // Same weights; some token's output lost a slot, and the counts before dropping are the same.
  REQUIRE(dropping.tokens_per_expert() == dropless.tokens_per_expert());
  REQUIRE(a != b);
  // With a capacity no expert can exceed, nothing is dropped.
  o.capacity_factor = double(kE);
  ly::MoELayer roomy(solo.groups(), kH, o);
  require_close_v(roomy.forward(ev, x), b, 1e-6, "capacity E (nothing dropped)");
}

TEST_CASE("MoELayer expert bias steers selection and moves towards even load", "[layers][moe]") {
  SoloMoEGroups solo;
  ly::MoEOptions o = base_options();
  o.enable_expert_bias = true;
  o.expert_bias_update_rate = 0.25f;
  ly::MoELayer m(solo.groups(), kH, o);
  // Every token to experts 3 and 1: the bias selects, it does not weight.
  Tensor bias = Tensor::from_vector(std::vector<float>{0, 50, 0, 100}, {kE});
  m.expert_bias().copy_(bias);
  const Tensor x = randn({kT, kH}, 6);
  ly::ForwardContext ctx;
  m.forward(ctx, x);
  REQUIRE(m.tokens_per_expert() == std::vector<int64_t>{0, kT, 0, kT});
  REQUIRE(m.load_imbalance() == 2.0);
  m.backward(ctx, randn({kT, kH}, 7));
  REQUIRE(vec(m.fc1_weight().main_grad.select(0, 0)) == std::vector<double>(size_t(2 * kF * kH), 0.0));
  m.update_expert_bias(solo.c);
  // mean load 6: experts 0 and 2 below (bias +rate), 1 and 3 above (−rate).
  REQUIRE(vec(m.expert_bias()) == std::vector<double>{0.25, 49.75, 0.25, 99.75});
}

TEST_CASE("MoELayer forced load balancing spreads tokens evenly whatever the router learned", "[layers][moe]") {
  // 4096 tokens, 8 experts, top-2. The expert bias sends every token to experts 3 and 1 under learned routing
  // (imbalance 4); forced routing ignores it: max/mean tokens per expert < 1.3 (the binomial spread is about
  // 1.05 here). The router weight gets no gradient from routing; the experts train.
  SoloMoEGroups solo;
  ly::MoEOptions o = base_options();
  o.num_experts = 8;
  o.enable_expert_bias = true;
  const int64_t t = 4096;
  const Tensor x = randn({t, kH}, 21), dy = randn({t, kH}, 22);
  std::vector<float> b(8, 0.f);
  b[3] = 100.f, b[1] = 50.f;
  ly::ForwardContext ctx;
  ly::MoELayer learned(solo.groups(), kH, o);
  learned.expert_bias().copy_(Tensor::from_vector(b, {8}));
  learned.forward(ctx, x);
  REQUIRE(learned.load_imbalance() == 4.0);

  o.force_load_balancing = true;
  ly::MoELayer forced(solo.groups(), kH, o), again(solo.groups(), kH, o);
  forced.expert_bias().copy_(Tensor::from_vector(b, {8}));
  forced.set_routing_step(3);
  const Tensor y = forced.forward(ctx, x);
  INFO("forced imbalance " << forced.load_imbalance());
  CHECK(forced.load_imbalance() < 1.3);
  const std::vector<int64_t> tpe = forced.tokens_per_expert();
  REQUIRE(std::accumulate(tpe.begin(), tpe.end(), int64_t{0}) == 2 * t);
  forced.backward(ctx, dy);
  REQUIRE(vec(forced.router_weight().main_grad) == std::vector<double>(size_t(8 * kH), 0.0));
  const std::vector<double> g2 = vec(forced.fc2_weight().main_grad);
  CHECK(std::count(g2.begin(), g2.end(), 0.0) == 0);

  // Reproducible from (seed, step, replica); the next forward, another step or another replica draws afresh.
  again.set_routing_step(3);
  REQUIRE(vec(again.forward(ctx, x)) == vec(y));
  REQUIRE(again.tokens_per_expert() == tpe);
  again.forward(ctx, x);
  CHECK(again.tokens_per_expert() != tpe);
  again.set_routing_step(4);
  again.forward(ctx, x);
  CHECK(again.tokens_per_expert() != tpe);
  again.set_routing_step(3, 1);
  again.forward(ctx, x);
  CHECK(again.tokens_per_expert() != tpe);

  // Full recompute: the replay routes as its discarded first pass did, also with another micro-batch's forward
  // (stashed around it) in between; the next forward draws afresh.
  using RP = ly::ForwardContext::RecomputePass;
  ly::ForwardContext first, replay;
  first.training = false, first.recompute_pass = RP::Discarded;
  replay.recompute_pass = RP::Replay;
  again.set_routing_step(5);
  const std::vector<double> y0 = vec(again.forward(first, x));
  const std::vector<int64_t> tpe0 = again.tokens_per_expert();
  ly::ActivationStash st;
  again.stash_activations(st);
  again.forward(first, x);
  CHECK(again.tokens_per_expert() != tpe0);
  again.restore_activations(st);
  REQUIRE(vec(again.forward(replay, x)) == y0);
  REQUIRE(again.tokens_per_expert() == tpe0);
}

TEST_CASE("MoELayer forced routing: combine weights are the softmax of the chosen random scores", "[layers][moe]") {
  // With one expert per token (top-1, softmax after top-k) every weight is 1, so the output is exactly that
  // expert's FFN: each token's output must equal exactly one expert's (a learned-routing layer whose bias picks
  // that expert), and the experts found must add up to the forced layer's token counts.
  SoloMoEGroups solo;
  ly::MoEOptions o = base_options();
  o.topk = 1;
  o.force_load_balancing = true;
  const Tensor x = randn({kT, kH}, 31);
  ly::ForwardContext ctx;
  ly::MoELayer forced(solo.groups(), kH, o);
  const std::vector<double> y = vec(forced.forward(ctx, x));
  const std::vector<int64_t> tpe = forced.tokens_per_expert();
  // Per token: the expert forced routing chose, recovered by running each token alone through one-hot biases.
  o.force_load_balancing = false;
  o.enable_expert_bias = true;
  ly::MoELayer single(solo.groups(), kH, o);
  std::vector<int64_t> counted(kE, 0);
  for (int64_t t = 0; t < kT; ++t) {
    const Tensor xt = x.narrow(0, t, 1).contiguous();
    int matched = 0;
    for (int64_t e = 0; e < kE; ++e) {
      std::vector<float> b(kE, 0.f);
      b[size_t(e)] = 1000.f;
      single.expert_bias().copy_(Tensor::from_vector(b, {kE}));
      const std::vector<double> ye = vec(single.forward(ctx, xt));
      if (mctest::rel_err(ye, std::vector<double>(y.begin() + t * kH, y.begin() + (t + 1) * kH)) < 1e-4)
        ++matched, ++counted[size_t(e)];
    }
    REQUIRE(matched == 1);
  }
  REQUIRE(counted == tpe);
}

TEST_CASE("MoELayer stash and restore keep one micro-batch's state while another runs", "[layers][moe]") {
  SoloMoEGroups solo;
  ly::MoEOptions o = base_options();
  o.shared_expert_size = 8;
  ly::MoELayer a(solo.groups(), kH, o), b(solo.groups(), kH, o);
  const Tensor x1 = randn({kT, kH}, 8), x2 = randn({kT, kH}, 9), dy = randn({kT, kH}, 10);
  ly::ForwardContext ctx;
  a.forward(ctx, x1);
  a.backward(ctx, dy);
  b.forward(ctx, x1);
  ly::ActivationStash st;
  b.stash_activations(st);
  ly::ForwardContext ev;
  ev.training = false;
  b.forward(ev, x2);
  b.restore_activations(st);
  REQUIRE(st.empty());
  b.backward(ctx, dy);
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    INFO(a.parameters()[i]->name);
    require_equal(b.parameters()[i]->main_grad, a.parameters()[i]->main_grad, "grad");
  }
  REQUIRE(a.parameters().back()->name.starts_with("shared_expert."));
}

TEST_CASE("MoELayer refuses layouts it cannot split, naming the fix", "[layers][moe]") {
  SoloMoEGroups solo;
  NoCommCommunicator ep3(0, 3);
  ly::MoEOptions o = base_options();
  REQUIRE_THROWS_WITH(ly::MoELayer({&solo.c, &ep3, &solo.c, nullptr}, kH, o),
                      Catch::Contains("num_experts 4 is not divisible by the EP size 3"));
  NoCommCommunicator etp5(0, 5);
  REQUIRE_THROWS_WITH(ly::MoELayer({&solo.c, &solo.c, &etp5, nullptr}, kH, o),
                      Catch::Contains("ffn_hidden_size 24 is not divisible by the expert-TP size 5"));
  o.topk = 5;
  REQUIRE_THROWS_WITH(ly::MoELayer(solo.groups(), kH, o), Catch::Contains("topk 5 must be in [1, num_experts = 4]"));
  o.topk = 2;
  o.dispatcher = ly::MoETokenDispatcher::AllGather;
  REQUIRE_THROWS_WITH(ly::MoELayer({&solo.c, &solo.c, &solo.c, nullptr}, kH, o), Catch::Contains("tp_ep"));
}

namespace {

// The router's balancing losses written out on their own, in f64, from the layer's weights: the switch aux loss
// coeff·E/(T²k)·Σ_e n_e Σ_t softmax(z_t)_e with n_e the tokens whose k largest logits include e (held fixed, as
// in the layer: the counts are not differentiated), plus the z-loss coeff_z · mean_t logsumexp(z_t)².
struct RouterLossReference {
  std::vector<double> x, n;
  int64_t t, h, e;
  int k;
  double aux_coeff, z_coeff;

  RouterLossReference(const Tensor& xt, const std::vector<double>& w, int64_t experts, int topk, double aux, double z)
      : x(xt.to_double_vector()), t(xt.size(0)), h(xt.size(1)), e(experts), k(topk), aux_coeff(aux), z_coeff(z) {
    n.assign(size_t(e), 0.0);
    for (int64_t r = 0; r < t; ++r) {
      const std::vector<double> z = logits(w, r);
      std::vector<int64_t> order(static_cast<size_t>(e));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[size_t(a)] > z[size_t(b)]; });
      for (int j = 0; j < k; ++j) n[size_t(order[size_t(j)])] += 1;
    }
  }
  std::vector<double> logits(const std::vector<double>& w, int64_t r) const {
    std::vector<double> z(size_t(e), 0.0);
    for (int64_t i = 0; i < e; ++i)
      for (int64_t c = 0; c < h; ++c) z[size_t(i)] += w[size_t(i * h + c)] * x[size_t(r * h + c)];
    return z;
  }
  double loss(const std::vector<double>& w) const {
    double aux = 0, zl = 0;
    for (int64_t r = 0; r < t; ++r) {
      const std::vector<double> z = logits(w, r);
      const double mx = *std::max_element(z.begin(), z.end());
      double s = 0;
      for (double v : z) s += std::exp(v - mx);
      for (int64_t i = 0; i < e; ++i) aux += n[size_t(i)] * std::exp(z[size_t(i)] - mx) / s;
      const double lse = mx + std::log(s);
      zl += lse * lse;
    }
    return aux_coeff * double(e) / (double(t) * double(t) * k) * aux + z_coeff * zl / double(t);
  }
  // Central differences (f64, step 1e-6) of loss() in every router weight.
  std::vector<double> weight_grad(std::vector<double> w) const {
    std::vector<double> g(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      const double w0 = w[i];
      w[i] = w0 + 1e-6;
      const double lp = loss(w);
      w[i] = w0 - 1e-6;
      const double lm = loss(w);
      w[i] = w0;
      g[i] = (lp - lm) / 2e-6;
    }
    return g;
  }
};

}  // namespace

TEST_CASE("MoELayer balancing losses alone: router gradient equals f64 finite differences, scaled per micro-batch",
          "[layers][moe]") {
  SoloMoEGroups solo;
  // aux only, z only, both; the router init of a real model (std 0.02) and a wider one.
  for (auto [aux, z, std] : {std::tuple{1e-2, 0.0, 0.02}, std::tuple{0.0, 1e-3, 0.02}, std::tuple{1.0, 0.1, 0.3}}) {
    INFO("aux " << aux << " z " << z << " init std " << std);
    ly::MoEOptions o = base_options();
    o.num_experts = 8;
    o.aux_loss_coeff = float(aux);
    o.z_loss_coeff = float(z);
    o.init_std = std;
    ly::MoELayer m(solo.groups(), kH, o);
    const std::vector<double> w = vec(m.router_weight().data);
    // Two micro-batches of gradient accumulation: the trainer scales the losses' gradients by 1 / micro-batches.
    const Tensor x1 = randn({kT, kH}, 5), x2 = randn({kT, kH}, 6), dy = Tensor::zeros({kT, kH});
    const RouterLossReference r1(x1, w, 8, 2, aux, z), r2(x2, w, 8, 2, aux, z);
    m.set_aux_loss_grad_scale(0.5f);
    ly::ForwardContext ctx;
    std::vector<double> want(w.size(), 0.0);
    for (auto [x, ref] : {std::pair{&x1, &r1}, std::pair{&x2, &r2}}) {
      m.forward(ctx, *x);
      // The layer's loss values are the reference's (no LM loss: dy = 0, so the router learns from them alone).
      const double want_loss = ref->loss(w);
      REQUIRE(std::abs(m.aux_loss().item() + m.z_loss().item() - want_loss) <= 1e-5 * want_loss);
      m.backward(ctx, dy);
      const std::vector<double> g = ref->weight_grad(w);
      for (size_t i = 0; i < g.size(); ++i) want[i] += 0.5 * g[i];
    }
    require_close_v(m.router_weight().main_grad, want, 1e-4, "router grad from the balancing losses");
    // The experts learn nothing from them.
    REQUIRE(vec(m.fc1_weight().main_grad) == std::vector<double>(size_t(m.fc1_weight().main_grad.numel()), 0.0));
  }
}
