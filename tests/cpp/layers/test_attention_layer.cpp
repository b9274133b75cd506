// Single-process checks of SelfAttention: bad configs are refused with the fix, and at TP = 1 the layer
// equals an independent float64 reference written here with plain loops (fused-QKV row layout, RoPE
// rotate-half with theta and llama3 scaling, causal softmax with the GQA head mapping, output
// projection), whose central-difference gradients check the layer's input and parameter gradients.
//
// Tolerances: the layer runs in f32 (the core attention and RoPE references in f64 inside), so its
// forward agrees with the f64 reference to ~1e-6 relative; the f64 central differences (step 1e-5)
// are accurate to ~1e-9, so gradients are held to 1e-4 relative (f32 GEMM accumulation dominates).
#include <cmath>
#include <numbers>
#include <utility>

#include "megacore/layers/attention.hpp"
#include "megacore/model/transformer_layer.hpp"
#include "layers_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

using layers_test::NoCommCommunicator;  // every collective throws; size 1 is a TP = 1 group

namespace {

Tensor randn(const Shape& shape, uint64_t offset, double std = 1.0) {
  Tensor t = Tensor::empty(shape);
  Generator g(17, offset);
  t.normal_(g, 0.0, std);
  return t;
}

// h32, 4 query heads in 2 KV groups, head_dim 8: small enough for finite differences of every weight.
mdl::TransformerConfig tiny_config() {
  mdl::TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.vocab_size = 64;
  c.max_position_embeddings = 64;
  c.rope_theta = 500.0;
  c.init_method_std = 0.2;  // large enough that the softmax is far from uniform
  return c;
}

// ---- the float64 reference ------------------------------------------------------------------------

struct RefParams {
  std::vector<double> wqkv, bqkv, wo, bo;  // bqkv / bo empty without biases
  std::vector<double> qn, kn;              // qk_layernorm weights [head_dim]; empty without
  double eps = 1e-5;
};

struct RefShape {
  int64_t s, b, h, heads, groups, d, rot;  // rot = 0: no RoPE
  double theta;
  mdl::RopeScaling scaling;
  bool interleaved = false;  // RoPE pairs (2c, 2c+1) instead of (c, c + rot/2)
};

// inv_freq written out from the Llama 3.1 recipe (wavelengths beyond the original context are divided
// by the factor, short ones kept, the band between blended linearly in context / wavelength).
std::vector<double> ref_inv_freq(const RefShape& r) {
  std::vector<double> f(size_t(r.rot / 2));
  for (int64_t i = 0; i < r.rot / 2; ++i) {
    double inv = std::pow(r.theta, -2.0 * double(i) / double(r.rot));
    if (r.scaling.type == mdl::RopeScalingType::Llama3) {
      const double ctx = double(r.scaling.original_max_position_embeddings);
      const double wl = 2 * std::numbers::pi / inv;
      if (wl > ctx / r.scaling.low_freq_factor) {
        inv = inv / r.scaling.factor;
      } else if (wl >= ctx / r.scaling.high_freq_factor) {
        const double a = (ctx / wl - r.scaling.low_freq_factor) / (r.scaling.high_freq_factor - r.scaling.low_freq_factor);
        inv = a * inv + (1 - a) * inv / r.scaling.factor;
      }
    }
    f[size_t(i)] = double(float(inv));  // the layer keeps inv_freq in f32
  }
  return f;
}

// y [s, b, h] of causal GQA self-attention; pos is [b][s].
std::vector<double> ref_attention(const RefShape& r, const RefParams& p, const std::vector<double>& x,
                                  const std::vector<std::vector<int64_t>>& pos) {
  const int64_t S = r.s, B = r.b, h = r.h, H = r.heads, G = r.groups, D = r.d, hpg = H / G;
  const int64_t QKV = (H + 2 * G) * D;
  // Row of the fused weight holding channel c of query head i / of group g's k or v.
  auto q_row = [&](int64_t i, int64_t c) { return (i / hpg) * (hpg + 2) * D + (i % hpg) * D + c; };
  auto k_row = [&](int64_t g, int64_t c) { return g * (hpg + 2) * D + hpg * D + c; };
  auto v_row = [&](int64_t g, int64_t c) { return g * (hpg + 2) * D + (hpg + 1) * D + c; };
  auto proj = [&](int64_t si, int64_t bi, int64_t row) {
    double acc = p.bqkv.empty() ? 0.0 : p.bqkv[size_t(row)];
    for (int64_t e = 0; e < h; ++e) acc += x[size_t((si * B + bi) * h + e)] * p.wqkv[size_t(row * h + e)];
    return acc;
  };
  (void)QKV;
  const std::vector<double> inv = r.rot > 0 ? ref_inv_freq(r) : std::vector<double>{};
  auto rope = [&](std::vector<double>& vec, int64_t position) {
    const int64_t half = r.rot / 2;
    for (int64_t c = 0; c < half; ++c) {
      const double ang = double(float(double(position) * inv[size_t(c)]));  // the angle is formed in f32
      const size_t c1 = size_t(r.interleaved ? 2 * c : c), c2 = size_t(r.interleaved ? 2 * c + 1 : c + half);
      const double a = vec[c1], bb = vec[c2];
      vec[c1] = a * std::cos(ang) - bb * std::sin(ang);
      vec[c2] = bb * std::cos(ang) + a * std::sin(ang);
    }
  };
  // qk_layernorm: RMSNorm of one head's channels, before RoPE.
  auto head_norm = [&](std::vector<double>& t, const std::vector<double>& w) {
    if (w.empty()) return;
    double ms = 0;
    for (double e : t) ms += e * e;
    const double r = 1.0 / std::sqrt(ms / double(t.size()) + p.eps);
    for (size_t c = 0; c < t.size(); ++c) t[c] = t[c] * r * w[c];
  };
  // q[b][i][s][c], k/v[b][g][s][c]
  std::vector<double> q(size_t(B * H * S * D)), k(size_t(B * G * S * D)), v(size_t(B * G * S * D));
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t si = 0; si < S; ++si) {
      for (int64_t i = 0; i < H; ++i) {
        std::vector<double> t(static_cast<size_t>(D));
        for (int64_t c = 0; c < D; ++c) t[size_t(c)] = proj(si, bi, q_row(i, c));
        head_norm(t, p.qn);
        if (r.rot > 0) rope(t, pos[size_t(bi)][size_t(si)]);
        for (int64_t c = 0; c < D; ++c) q[size_t(((bi * H + i) * S + si) * D + c)] = t[size_t(c)];
      }
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> t(static_cast<size_t>(D));
        for (int64_t c = 0; c < D; ++c) t[size_t(c)] = proj(si, bi, k_row(g, c));
        head_norm(t, p.kn);
        if (r.rot > 0) rope(t, pos[size_t(bi)][size_t(si)]);
        for (int64_t c = 0; c < D; ++c) {
          k[size_t(((bi * G + g) * S + si) * D + c)] = t[size_t(c)];
          v[size_t(((bi * G + g) * S + si) * D + c)] = proj(si, bi, v_row(g, c));
        }
      }
    }
  // Causal softmax per (batch, head, query); head i reads KV group i / (H / G).
  std::vector<double> ctx(size_t(S * B * H * D), 0.0);  // [s, b, H·D]
  const double scale = 1.0 / std::sqrt(double(D));
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t i = 0; i < H; ++i) {
      const int64_t g = i / hpg;
      for (int64_t sq = 0; sq < S; ++sq) {
        std::vector<double> sc(size_t(sq + 1));
        double mx = -INFINITY;
        for (int64_t sk = 0; sk <= sq; ++sk) {
          double dot = 0;
          for (int64_t c = 0; c < D; ++c)
            dot += q[size_t(((bi * H + i) * S + sq) * D + c)] * k[size_t(((bi * G + g) * S + sk) * D + c)];
          sc[size_t(sk)] = dot * scale;
          mx = std::max(mx, sc[size_t(sk)]);
        }
        double z = 0;
        for (double& e : sc) z += (e = std::exp(e - mx));
        for (int64_t c = 0; c < D; ++c) {
          double acc = 0;
          for (int64_t sk = 0; sk <= sq; ++sk) acc += sc[size_t(sk)] / z * v[size_t(((bi * G + g) * S + sk) * D + c)];
          ctx[size_t((sq * B + bi) * H * D + i * D + c)] = acc;
        }
      }
    }
  std::vector<double> y(size_t(S * B * h));
  for (int64_t t = 0; t < S * B; ++t)
    for (int64_t o = 0; o < h; ++o) {
      double acc = p.bo.empty() ? 0.0 : p.bo[size_t(o)];
      for (int64_t e = 0; e < H * D; ++e) acc += ctx[size_t(t * H * D + e)] * p.wo[size_t(o * H * D + e)];
      y[size_t(t * h + o)] = acc;
    }
  return y;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central-difference gradient of L = <ref(...), g> with respect to every entry of `which`.
template <class F>
std::vector<double> numeric_grad(std::vector<double>& which, const std::vector<double>& g, F&& f) {
  constexpr double kEps = 1e-5;
  std::vector<double> out(which.size());
  for (size_t i = 0; i < which.size(); ++i) {
    const double keep = which[i];
    which[i] = keep + kEps;
    const double lp = dot(f(), g);
    which[i] = keep - kEps;
    const double lm = dot(f(), g);
    which[i] = keep;
    out[i] = (lp - lm) / (2 * kEps);
  }
  return out;
}

RefShape shape_of(const mdl::TransformerConfig& c, int64_t s, int64_t b, int64_t rot) {
  return {s, b, c.hidden_size, c.num_attention_heads, c.query_groups(), c.head_dim(), rot, c.rope_theta, c.rope_scaling};
}

RefParams params_of(ly::SelfAttention& attn) {
  RefParams p;
  p.wqkv = attn.linear_qkv().weight().data.to_double_vector();
  p.wo = attn.linear_proj().weight().data.to_double_vector();
  if (attn.config().add_bias_linear) {
    p.bqkv = attn.linear_qkv().bias().data.to_double_vector();
    p.bo = attn.linear_proj().bias().data.to_double_vector();
  }
  if (attn.q_layernorm()) {
    p.qn = attn.q_layernorm()->weight().data.to_double_vector();
    p.kn = attn.k_layernorm()->weight().data.to_double_vector();
    p.eps = attn.config().norm_eps;
  }
  return p;
}

// Random q/k norm weights (not the ones they start at), so their gradients and the scaling are exercised.
void randomize_qk_norms(ly::SelfAttention& attn) {
  if (!attn.q_layernorm()) return;
  attn.q_layernorm()->weight().data.copy_(randn(attn.q_layernorm()->weight().data.shape(), 92, 0.5));
  attn.k_layernorm()->weight().data.copy_(randn(attn.k_layernorm()->weight().data.shape(), 93, 0.5));
}

// Non-zero biases, so the forward and the bias gradients are exercised.
void randomize_biases(ly::SelfAttention& attn) {
  if (!attn.config().add_bias_linear) return;
  attn.linear_qkv().bias().data.copy_(randn(attn.linear_qkv().bias().data.shape(), 90, 0.3));
  attn.linear_proj().bias().data.copy_(randn(attn.linear_proj().bias().data.shape(), 91, 0.3));
}

std::vector<std::vector<int64_t>> default_positions(int64_t s, int64_t b) {
  std::vector<std::vector<int64_t>> p(static_cast<size_t>(b), std::vector<int64_t>(static_cast<size_t>(s)));
  for (auto& row : p)
    for (int64_t i = 0; i < s; ++i) row[size_t(i)] = i;
  return p;
}

}  // namespace

TEST_CASE("SelfAttention refuses bad configs and inputs with the fix", "[layers]") {
  NoCommCommunicator tp4(0, 4), tp1(0, 1);
  mdl::TransformerConfig c = tiny_config();  // 2 query groups
  REQUIRE_THROWS_AS(ly::SelfAttention(tp4, mdl::attention_config(c)), ValueError);
  REQUIRE_THROWS_WITH(ly::SelfAttention(tp4, mdl::attention_config(c)),
                      Catch::Contains("2 KV groups do not split over TP 4") && Catch::Contains("divides both"));
  mdl::TransformerConfig odd = c;
  odd.num_query_groups = 3;
  REQUIRE_THROWS_WITH(ly::SelfAttention(tp1, mdl::attention_config(odd)), Catch::Contains("use a group count that divides the heads"));
  mdl::TransformerConfig sp1 = c;
  sp1.sequence_parallel = true;
  REQUIRE_THROWS_WITH(ly::SelfAttention(tp1, mdl::attention_config(sp1)), Catch::Contains("turn sequence_parallel off or raise TP"));
  REQUIRE_THROWS_AS(ly::SelfAttention(tp1, mdl::attention_config(c), {.rotary_percent = 0.3}), ValueError);
  REQUIRE_THROWS_WITH(ly::SelfAttention(tp1, mdl::attention_config(c), {.rotary_percent = 0.3}), Catch::Contains("pick a rotary_percent"));
  REQUIRE_THROWS_WITH(ly::SelfAttention(tp1, mdl::attention_config(c), {.qkv_init_offset = 3, .proj_init_offset = 3}),
                      Catch::Contains("give the two weights different Philox offsets"));

  ly::SelfAttention attn(tp1, mdl::attention_config(c));
  ly::ForwardContext ctx;
  REQUIRE_THROWS_WITH(attn.backward(ctx, randn({4, 1, 32}, 1)), Catch::Contains("call forward with ctx.training = true"));
  REQUIRE_THROWS_WITH(attn.forward(ctx, randn({4, 32}, 1)), Catch::Contains("must be [s, b, hidden]"));
  REQUIRE_THROWS_WITH(attn.forward(ctx, randn({4, 1, 32}, 1), Tensor::zeros({3}, DType::I64)),
                      Catch::Contains("pass [s] = [4] or [b, s] = [1, 4]"));
  REQUIRE_THROWS_WITH(attn.forward(ctx, randn({4, 1, 32}, 1), Tensor::zeros({4})), Catch::Contains("pass integer ids"));
  // TP = 2 splits whole groups: one group (2 query heads + k + v, 4 heads of 8 rows) per rank.
  NoCommCommunicator tp2(1, 2);
  ly::SelfAttention half(tp2, mdl::attention_config(c));
  REQUIRE(half.heads_per_rank() == 2);
  REQUIRE(half.groups_per_rank() == 1);
  REQUIRE(half.linear_qkv().weight().data.shape() == Shape{32, 32});
  REQUIRE(half.linear_proj().weight().data.shape() == Shape{32, 16});
}

TEST_CASE("fuse_qkv_weight and split_qkv_weight are inverse and follow the grouped layout", "[layers]") {
  // 4 heads in 2 groups, head_dim 2, 3 input features: rows of group 0 are q0, q1, k0, v0.
  Tensor wq = randn({8, 3}, 1), wk = randn({4, 3}, 2), wv = randn({4, 3}, 3);
  Tensor f = ly::fuse_qkv_weight(wq, wk, wv, 4, 2);
  REQUIRE(f.shape() == Shape{16, 3});
  REQUIRE(f.narrow(0, 0, 4).contiguous().to_double_vector() == wq.narrow(0, 0, 4).contiguous().to_double_vector());
  REQUIRE(f.narrow(0, 4, 2).contiguous().to_double_vector() == wk.narrow(0, 0, 2).contiguous().to_double_vector());
  REQUIRE(f.narrow(0, 6, 2).contiguous().to_double_vector() == wv.narrow(0, 0, 2).contiguous().to_double_vector());
  REQUIRE(f.narrow(0, 8, 4).contiguous().to_double_vector() == wq.narrow(0, 4, 4).contiguous().to_double_vector());
  auto parts = ly::split_qkv_weight(f, 4, 2);
  REQUIRE(parts[0].to_double_vector() == wq.to_double_vector());
  REQUIRE(parts[1].to_double_vector() == wk.to_double_vector());
  REQUIRE(parts[2].to_double_vector() == wv.to_double_vector());
  REQUIRE_THROWS_WITH(ly::fuse_qkv_weight(wq, wk, wv, 4, 3), Catch::Contains("must be a positive multiple of groups"));
}

TEST_CASE("SelfAttention at TP = 1 equals a float64 reference", "[layers]") {
  NoCommCommunicator tp1(0, 1);
  const int64_t s = 6, b = 2;
  struct Case {
    const char* name;
    bool bias, rope, llama3, given_positions;
    double rotary_percent;
    bool interleaved = false;
  };
  for (const Case& cs : {Case{"llama (RoPE, theta 500)", false, true, false, false, 1.0},
                         Case{"llama3 scaling, per-sample position ids", false, true, true, true, 1.0},
                         Case{"partial rotary 0.5 with biases", true, true, false, false, 0.5},
                         Case{"interleaved partial rotary 0.5, llama3 scaling", false, true, true, true, 0.5, true},
                         Case{"gpt2 (learned positions, biases)", true, false, false, false, 1.0}}) {
    INFO(cs.name);
    mdl::TransformerConfig c = tiny_config();
    c.add_bias_linear = cs.bias;
    if (!cs.rope) c.position_embedding = mdl::PositionEmbeddingType::Learned;
    if (cs.llama3) {
      // Original context 64: with theta 500 and head_dim 8 the four wavelengths (6.3, 30, 140, 660) fall in
      // the kept, blended, scaled and scaled bands.
      c.rope_scaling = {.type = mdl::RopeScalingType::Llama3, .factor = 8, .low_freq_factor = 1,
                        .high_freq_factor = 4, .original_max_position_embeddings = 64};
    }
    ly::SelfAttention attn(tp1, mdl::attention_config(c),
                           {.rotary_percent = cs.rotary_percent, .rotary_interleaved = cs.interleaved});
    randomize_biases(attn);
    REQUIRE(attn.rotary_dim() == (cs.rope ? int64_t(8 * cs.rotary_percent) : 0));
    const Tensor x = randn({s, b, c.hidden_size}, 5);
    auto pos = default_positions(s, b);
    Tensor pos_ids;
    if (cs.given_positions) {
      std::vector<int32_t> flat;
      for (int64_t j = 0; j < b; ++j)
        for (int64_t i = 0; i < s; ++i) flat.push_back(int32_t(pos[size_t(j)][size_t(i)] = 3 + 7 * j + 2 * i));
      pos_ids = Tensor::from_vector(flat, {b, s});
    }
    ly::ForwardContext ctx;
    Tensor y = attn.forward(ctx, x, pos_ids);
    REQUIRE(y.shape() == Shape{s, b, c.hidden_size});
    RefShape rs = shape_of(c, s, b, attn.rotary_dim());
    rs.interleaved = cs.interleaved;
    const auto want = ref_attention(rs, params_of(attn), x.to_double_vector(), pos);
    CHECK(mctest::rel_err(y.to_double_vector(), want) <= 2e-6);
  }
}

TEST_CASE("SelfAttention gradients match central differences of the float64 reference", "[layers]") {
  NoCommCommunicator tp1(0, 1);
  const int64_t s = 5, b = 2;
  for (auto [bias, il] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
    INFO("bias " << bias << " interleaved RoPE " << il);
    mdl::TransformerConfig c = tiny_config();
    c.add_bias_linear = bias;
    c.rope_scaling = {.type = mdl::RopeScalingType::Llama3, .factor = 4, .low_freq_factor = 1, .high_freq_factor = 4,
                      .original_max_position_embeddings = 64};
    ly::SelfAttention attn(tp1, mdl::attention_config(c), {.rotary_interleaved = il});
    randomize_biases(attn);
    const Tensor x = randn({s, b, c.hidden_size}, 6), g = randn({s, b, c.hidden_size}, 7);
    ly::ForwardContext ctx;
    attn.forward(ctx, x);
    Tensor dx = attn.backward(ctx, g);

    RefShape rs = shape_of(c, s, b, attn.rotary_dim());
    rs.interleaved = il;
    RefParams p = params_of(attn);
    std::vector<double> xd = x.to_double_vector();
    const std::vector<double> gd = g.to_double_vector();
    const auto pos = default_positions(s, b);
    auto f = [&] { return ref_attention(rs, p, xd, pos); };
    CHECK(mctest::rel_err(dx.to_double_vector(), numeric_grad(xd, gd, f)) <= 1e-4);
    CHECK(mctest::rel_err(attn.linear_qkv().weight().main_grad.to_double_vector(), numeric_grad(p.wqkv, gd, f)) <= 1e-4);
    CHECK(mctest::rel_err(attn.linear_proj().weight().main_grad.to_double_vector(), numeric_grad(p.wo, gd, f)) <= 1e-4);
    if (bias) {
      CHECK(mctest::rel_err(attn.linear_qkv().bias().main_grad.to_double_vector(), numeric_grad(p.bqkv, gd, f)) <= 1e-4);
      CHECK(mctest::rel_err(attn.linear_proj().bias().main_grad.to_double_vector(), numeric_grad(p.bo, gd, f)) <= 1e-4);
    }
  }
}

// Qwen3's q_norm / k_norm: each query and key head RMS-normalised (with its own weight) before RoPE.
TEST_CASE("SelfAttention with qk_layernorm equals the float64 reference, gradients included", "[layers]") {
  NoCommCommunicator tp1(0, 1);
  const int64_t s = 5, b = 2;
  for (bool rope : {true, false}) {
    INFO("RoPE " << rope);
    mdl::TransformerConfig c = tiny_config();
    c.qk_layernorm = true;
    c.norm_eps = 1e-6;
    if (!rope) c.position_embedding = mdl::PositionEmbeddingType::Learned;
    ly::SelfAttention attn(tp1, mdl::attention_config(c));
    REQUIRE(attn.q_layernorm() != nullptr);
    REQUIRE(attn.parameters().size() == 4);  // qkv, q norm, k norm, proj
    randomize_qk_norms(attn);
    const Tensor x = randn({s, b, c.hidden_size}, 8), g = randn({s, b, c.hidden_size}, 9);
    ly::ForwardContext ctx;
    Tensor y = attn.forward(ctx, x);
    Tensor dx = attn.backward(ctx, g);
    RefShape rs = shape_of(c, s, b, attn.rotary_dim());
    RefParams p = params_of(attn);
    std::vector<double> xd = x.to_double_vector();
    const std::vector<double> gd = g.to_double_vector();
    const auto pos = default_positions(s, b);
    auto f = [&] { return ref_attention(rs, p, xd, pos); };
    CHECK(mctest::rel_err(y.to_double_vector(), f()) <= 2e-6);
    CHECK(mctest::rel_err(dx.to_double_vector(), numeric_grad(xd, gd, f)) <= 1e-4);
    CHECK(mctest::rel_err(attn.linear_qkv().weight().main_grad.to_double_vector(), numeric_grad(p.wqkv, gd, f)) <= 1e-4);
    CHECK(mctest::rel_err(attn.linear_proj().weight().main_grad.to_double_vector(), numeric_grad(p.wo, gd, f)) <= 1e-4);
    CHECK(mctest::rel_err(attn.q_layernorm()->weight().main_grad.to_double_vector(), numeric_grad(p.qn, gd, f)) <= 1e-4);
    CHECK(mctest::rel_err(attn.k_layernorm()->weight().main_grad.to_double_vector(), numeric_grad(p.kn, gd, f)) <= 1e-4);
  }
  // A LayerNorm model cannot take RMSNorm head norms: refused with the fix.
  mdl::TransformerConfig c = tiny_config();
  c.qk_layernorm = true;
  c.normalization = mdl::NormType::LayerNorm;
  CHECK_THROWS_AS(mdl::validate(c), ConfigError);
  CHECK_THROWS_WITH(mdl::validate(c), Catch::Contains("set normalization = RMSNorm or qk_layernorm = false"));
}

TEST_CASE("SelfAttention selective recompute gives bit-identical results", "[layers]") {
  NoCommCommunicator tp1(0, 1);
  const int64_t s = 7, b = 3;
  std::vector<std::vector<double>> results[2];
  for (int mode = 0; mode < 2; ++mode) {
    mdl::TransformerConfig c = tiny_config();
    c.add_bias_linear = true;
    c.recompute_granularity = mode ? mdl::RecomputeGranularity::Selective : mdl::RecomputeGranularity::None;
    ly::SelfAttention attn(tp1, mdl::attention_config(c));
    REQUIRE(attn.recompute_core_attention() == (mode == 1));
    randomize_biases(attn);
    ly::ForwardContext ctx;
    // Two micro-batches accumulate into main_grad in both modes.
    std::vector<double> dxs;
    Tensor y;
    for (int micro = 0; micro < 2; ++micro) {
      y = attn.forward(ctx, randn({s, b, c.hidden_size}, 10 + micro));
      Tensor dx = attn.backward(ctx, randn({s, b, c.hidden_size}, 20 + micro));
      for (double v : dx.to_double_vector()) dxs.push_back(v);
    }
    results[mode].push_back(y.to_double_vector());
    results[mode].push_back(dxs);
    for (ly::Parameter* p : attn.parameters()) results[mode].push_back(p->main_grad.to_double_vector());
    REQUIRE(attn.parameters().size() == 4);
  }
  REQUIRE(results[0].size() == results[1].size());
  for (size_t i = 0; i < results[0].size(); ++i) {
    INFO("result " << i);
    REQUIRE(results[0][i] == results[1][i]);
  }
}
