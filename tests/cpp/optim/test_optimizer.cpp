// AdamW and SGD against a hand-written double-precision reference over several steps: weight-decay
// exclusion (1-D, "norm", "bias"), bias correction, grad_scale, bf16 write-back of the f32 master
// weights; state save/restore; bad input.
//
// Betas are powers-of-two fractions (exact in f32), so the f32 kernel differs from the f64 reference
// only by f32 rounding over four steps; we hold each element to 2e-6 relative + 1e-8 absolute.
#include <cmath>
#include <memory>

#include "megacore/optim/optimizer.hpp"
#include "optim/optimizer_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::optim;
namespace ly = megacore::layers;

namespace {

using optim_test::Model;

Model make_model(double offset = 0.0) {
  Model m;
  m.add("layers.0.linear_fc1.weight", {3, 4}, DType::BF16, offset + 0.0);  // decayed, bf16 write-back
  m.add("layers.0.linear_fc1.bias", {4}, DType::F32, offset + 1.0);        // 1-D and "bias"
  m.add("final_layernorm.weight", {4}, DType::F32, offset + 2.0);          // 1-D and "norm"
  m.add("layers.0.qk_norm_table", {2, 2}, DType::F32, offset + 3.0);       // 2-D, excluded by name
  m.add("output_layer.weight", {2, 3}, DType::F32, offset + 4.0);          // decayed, f32
  return m;
}

// The gradient of parameter i at step t (1-based), element k, as the f32 value the optimizer sees.
float grad_value(size_t i, int t, int64_t k) { return float(0.5 * std::sin(1.3 * double(k) + 0.7 * t + double(i))); }

void set_grads(Model& m, int t) {
  for (size_t i = 0; i < m.params.size(); ++i) {
    float* g = m.params[i]->main_grad.data<float>();
    for (int64_t k = 0; k < m.params[i]->main_grad.numel(); ++k) g[k] = grad_value(i, t, k);
  }
}

std::vector<std::vector<double>> initial(const Model& m) {
  std::vector<std::vector<double>> w;
  for (const ly::Parameter* p : m.params) w.push_back(p->data.to_double_vector());
  return w;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  for (size_t k = 0; k < got.size(); ++k) CHECK(std::abs(got[k] - want[k]) <= 2e-6 * std::abs(want[k]) + 1e-8);
}

// Master weights close to the reference; parameters exactly the master rounded to their dtype.
void check_state(const Optimizer& opt, const Model& m, const std::vector<std::vector<double>>& ref) {
  for (size_t i = 0; i < m.params.size(); ++i) {
    check_close(opt.master(i).to_double_vector(), ref[i], m.params[i]->name + " master");
    const Tensor rounded = opt.master(i).to(m.params[i]->data.dtype());
    CHECK(m.params[i]->data.to_double_vector() == rounded.to_double_vector());
  }
}

}  // namespace

TEST_CASE("AdamW equals a double-precision reference (decay exclusion, bias correction, bf16 write-back)",
          "[optim]") {
  for (bool custom_rule : {false, true}) {
    INFO("custom no-decay rule " << custom_rule);
    Model m = make_model();
    AdamWConfig cfg;
    cfg.beta1 = 0.875f;
    cfg.beta2 = 0.9375f;
    cfg.eps = 1e-6f;
    cfg.weight_decay = 0.25f;
    if (custom_rule) cfg.no_decay = [](const ly::Parameter&) { return false; };  // decay everything
    AdamW opt(m.params, cfg);
    const std::vector<bool> want_decay = custom_rule ? std::vector<bool>(5, true)
                                                     : std::vector<bool>{true, false, false, false, true};
    for (size_t i = 0; i < m.params.size(); ++i) CHECK(opt.decays(i) == want_decay[i]);

    std::vector<std::vector<double>> w = initial(m), mom(w.size()), var(w.size());
    for (size_t i = 0; i < w.size(); ++i) mom[i] = var[i] = std::vector<double>(w[i].size(), 0.0);
    const double b1 = cfg.beta1, b2 = cfg.beta2, eps = cfg.eps, wd = cfg.weight_decay;
    for (int t = 1; t <= 4; ++t) {
      const double lr = 0.01 * t, scale = t == 3 ? 0.5 : 1.0;  // a scaled step (clip coefficient)
      set_grads(m, t);
      opt.step(float(lr), float(scale));
      for (size_t i = 0; i < w.size(); ++i)
        for (size_t k = 0; k < w[i].size(); ++k) {
          const double g = double(grad_value(i, t, int64_t(k))) * scale;
          mom[i][k] = b1 * mom[i][k] + (1 - b1) * g;
          var[i][k] = b2 * var[i][k] + (1 - b2) * g * g;
          const double mh = mom[i][k] / (1 - std::pow(b1, t)), vh = var[i][k] / (1 - std::pow(b2, t));
          w[i][k] -= lr * (mh / (std::sqrt(vh) + eps) + (want_decay[i] ? wd : 0.0) * w[i][k]);
        }
      INFO("step " << t);
      CHECK(opt.step_count() == t);
      check_state(opt, m, w);
      for (size_t i = 0; i < w.size(); ++i) {
        check_close(opt.exp_avg(i).to_double_vector(), mom[i], m.params[i]->name + " exp_avg");
        check_close(opt.exp_avg_sq(i).to_double_vector(), var[i], m.params[i]->name + " exp_avg_sq");
      }
    }
  }
}

TEST_CASE("SGD with momentum (plain and Nesterov) equals a double-precision reference", "[optim]") {
  for (bool nesterov : {false, true}) {
    INFO("nesterov " << nesterov);
    Model m = make_model();
    SGDConfig cfg;
    cfg.momentum = 0.875f;
    cfg.dampening = nesterov ? 0.f : 0.25f;
    cfg.nesterov = nesterov;
    cfg.weight_decay = 0.125f;
    SGD opt(m.params, cfg);
    std::vector<std::vector<double>> w = initial(m), buf(w.size());
    for (int t = 1; t <= 4; ++t) {
      const double lr = 0.05, scale = t == 2 ? 0.5 : 1.0;
      set_grads(m, t);
      opt.step(float(lr), float(scale));
      for (size_t i = 0; i < w.size(); ++i) {
        if (t == 1) buf[i].assign(w[i].size(), 0.0);
        for (size_t k = 0; k < w[i].size(); ++k) {
          double d = double(grad_value(i, t, int64_t(k))) * scale + (opt.decays(i) ? cfg.weight_decay : 0.0) * w[i][k];
          buf[i][k] = t == 1 ? d : cfg.momentum * buf[i][k] + (1 - cfg.dampening) * d;
          d = nesterov ? d + cfg.momentum * buf[i][k] : buf[i][k];
          w[i][k] -= lr * d;
        }
      }
      INFO("step " << t);
      check_state(opt, m, w);
      for (size_t i = 0; i < w.size(); ++i)
        check_close(opt.momentum_buffer(i).to_double_vector(), buf[i], m.params[i]->name + " momentum");
    }
  }
}

TEST_CASE("Optimizer state round-trips: a restored optimizer continues identically", "[optim]") {
  Model a = make_model(), b = make_model(0.5);  // b starts elsewhere; load_state must overwrite it
  AdamW oa(a.params), ob(b.params);
  for (int t = 1; t <= 2; ++t) {
    set_grads(a, t);
    oa.step(1e-2f);
  }
  std::vector<NamedTensor> saved;
  for (const NamedTensor& nt : oa.state()) saved.push_back({nt.name, nt.tensor.clone()});
  CHECK(saved.size() == 3 * a.params.size());
  CHECK(saved[0].name == "layers.0.linear_fc1.weight.master");
  CHECK(saved[2].name == "layers.0.linear_fc1.weight.exp_avg_sq");
  ob.load_state(saved, oa.step_count());
  CHECK(ob.step_count() == 2);
  for (size_t i = 0; i < a.params.size(); ++i)
    CHECK(b.params[i]->data.to_double_vector() == a.params[i]->data.to_double_vector());
  set_grads(a, 3);
  set_grads(b, 3);
  oa.step(1e-2f);
  ob.step(1e-2f);
  for (size_t i = 0; i < a.params.size(); ++i) {
    CHECK(ob.master(i).to_double_vector() == oa.master(i).to_double_vector());
    CHECK(b.params[i]->data.to_double_vector() == a.params[i]->data.to_double_vector());
  }

  // A state for another layout is refused before anything changes.
  std::vector<NamedTensor> bad = saved;
  bad[3].tensor = Tensor::zeros({5});
  const std::vector<double> before = ob.master(0).to_double_vector();
  REQUIRE_THROWS_WITH(ob.load_state(bad, 2), Catch::Contains("has shape [5], expected [4]"));
  CHECK(ob.master(0).to_double_vector() == before);
  bad = saved;
  bad[1].name = "x.exp_avg";
  REQUIRE_THROWS_WITH(ob.load_state(bad, 2), Catch::Contains("expected 'layers.0.linear_fc1.weight.exp_avg'"));
  SGD sgd(b.params);
  REQUIRE_THROWS_WITH(sgd.load_state(saved, 2), Catch::Contains("different optimizer or parameter list"));
}

TEST_CASE("Optimizer rejects duplicate and malformed parameters", "[optim]") {
  Model m = make_model();
  std::vector<ly::Parameter*> dup = m.params;
  dup.push_back(m.params[1]);
  REQUIRE_THROWS_WITH(AdamW(dup), Catch::Contains("'layers.0.linear_fc1.bias' is listed twice"));
  ly::Parameter tied = *m.params[0];  // shares the main_grad storage: a tied weight listed twice
  tied.name = "tied_copy";
  std::vector<ly::Parameter*> with_tied = m.params;
  with_tied.push_back(&tied);
  REQUIRE_THROWS_WITH(AdamW(with_tied), Catch::Contains("share one main_grad"));
  m.params[2]->main_grad = Tensor::zeros({3});
  REQUIRE_THROWS_WITH(SGD(m.params), Catch::Contains("'final_layernorm.weight' needs a contiguous f32 main_grad"));
  REQUIRE_THROWS_WITH(AdamW(make_model().params, AdamWConfig{.eps = 0.f}), Catch::Contains("eps"));
}

TEST_CASE("Optimizer zero_grad clears every main_grad", "[optim]") {
  Model m = make_model();
  set_grads(m, 1);
  AdamW opt(m.params);
  opt.zero_grad();
  for (ly::Parameter* p : m.params)
    for (double g : p->main_grad.to_double_vector()) CHECK(g == 0.0);
}
