// AdamW with bf16 state (optim.main_params_dtype / exp_avg_dtype / exp_avg_sq_dtype = bf16) against an
// independent double-precision reference that rounds every stored value the same way (round to nearest
// even, written here from the bit pattern rather than with megacore's bfloat16 type); the bytes of state;
// resume exactness; converting state between precisions; refused combinations.
//
// Tolerance: the kernel and the reference compute each step in double from the same stored bf16 inputs,
// in a different order of operations, so a stored value can land on the other side of a rounding tie:
// we allow 1 bf16 ulp (2^-8 relative) per element and require at least 97 % of all stored values to be exact.
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>

#include "megacore/ops/optimizer.hpp"
#include "megacore/optim/optimizer.hpp"
#include "ops/ops_test_util.hpp"
#include "optim/optimizer_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::optim;
namespace ly = megacore::layers;

namespace {

// double -> f32 (round to nearest) -> bf16 (round to nearest even on the f32 bits) -> double.
double bf16_round(double x) {
  const float f = float(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return double(r);
}

using optim_test::Model;

// Two bf16 matrices (one decayed, one excluded by name) and an f32 vector (updated in place in f32).
Model make_model(DType grad_dt = DType::F32) {
  Model m;
  m.add("layers.0.linear_fc1.weight", {16, 24}, DType::BF16, 0.0);
  m.add("layers.0.norm_table", {8, 8}, DType::BF16, 1.0);
  m.add("layers.0.linear_fc1.bias", {24}, DType::F32, 2.0);
  for (ly::Parameter* p : m.params) p->main_grad = Tensor::zeros(p->data.shape(), grad_dt);
  return m;
}

double grad_value(size_t i, int t, int64_t k) { return 0.5 * std::sin(1.3 * double(k) + 0.7 * t + double(i)); }

void set_grads(Model& m, int t) {
  for (size_t i = 0; i < m.params.size(); ++i) {
    std::vector<float> g;
    for (int64_t k = 0; k < m.params[i]->data.numel(); ++k) g.push_back(float(grad_value(i, t, k)));
    m.params[i]->main_grad.copy_(Tensor::from_vector(g, m.params[i]->data.shape()));
  }
}

AdamWConfig bf16_config(bool masters_bf16, bool moments_bf16) {
  AdamWConfig c;
  c.beta1 = 0.875f;
  c.beta2 = 0.9375f;
  c.eps = 1e-6f;
  c.weight_decay = 0.25f;
  if (masters_bf16) c.main_params_dtype = DType::BF16;
  if (moments_bf16) c.exp_avg_dtype = c.exp_avg_sq_dtype = DType::BF16;
  return c;
}

// Elements within one bf16 ulp of the reference; counts the compared and the exactly equal ones.
void check_rounded(const std::vector<double>& got, const std::vector<double>& want, const std::string& what,
                   size_t& compared, size_t& exact) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    CHECK(std::abs(got[k] - want[k]) <= std::ldexp(std::abs(want[k]), -8) + 1e-30);
    exact += got[k] == want[k];
  }
  compared += got.size();
}

}  // namespace

TEST_CASE("AdamW with bf16 moments and bf16 weights updated in place equals a reference rounding the same way",
          "[optim][bf16_states]") {
  for (const auto& [masters_bf16, moments_bf16, grad_dt] :
       {std::tuple{true, true, DType::BF16}, std::tuple{true, false, DType::F32}, std::tuple{false, true, DType::F32}}) {
    INFO("bf16 masters " << masters_bf16 << ", bf16 moments " << moments_bf16 << ", grads " << dtype_name(grad_dt));
    Model m = make_model(grad_dt);
    const AdamWConfig cfg = bf16_config(masters_bf16, moments_bf16);
    AdamW opt(m.params, cfg);
    const std::vector<bool> decay{true, false, false};
    // The reference state: weights as stored (bf16 parameters, or f32 masters), moments as stored.
    std::vector<std::vector<double>> w, mom, var;
    for (ly::Parameter* p : m.params) {
      w.push_back(p->data.to(DType::F32).to_double_vector());
      mom.emplace_back(size_t(p->data.numel()), 0.0);
      var.emplace_back(size_t(p->data.numel()), 0.0);
    }
    const double b1 = cfg.beta1, b2 = cfg.beta2, eps = cfg.eps, wd = cfg.weight_decay;
    size_t compared = 0, exact = 0;
    for (int t = 1; t <= 6; ++t) {
      const double lr = 0.01 * t;
      set_grads(m, t);
      opt.step(float(lr));
      for (size_t i = 0; i < w.size(); ++i) {
        const bool w_bf16 = masters_bf16 && m.params[i]->data.dtype() == DType::BF16;
        for (size_t k = 0; k < w[i].size(); ++k) {
          double g = double(float(grad_value(i, t, int64_t(k))));
          if (grad_dt == DType::BF16) g = bf16_round(g);
          const double mv = b1 * mom[i][k] + (1 - b1) * g, vv = b2 * var[i][k] + (1 - b2) * g * g;
          const double mh = mv / (1 - std::pow(b1, t)), vh = vv / (1 - std::pow(b2, t));
          const double nw = w[i][k] - lr * (mh / (std::sqrt(vh) + eps) + (decay[i] ? wd : 0.0) * w[i][k]);
          w[i][k] = w_bf16 ? bf16_round(nw) : double(float(nw));
          mom[i][k] = moments_bf16 ? bf16_round(mv) : double(float(mv));
          var[i][k] = moments_bf16 ? bf16_round(vv) : double(float(vv));
        }
        INFO("step " << t << " " << m.params[i]->name);
        check_rounded(opt.master(i).to_double_vector(), w[i], "weights", compared, exact);
        check_rounded(opt.exp_avg(i).to_double_vector(), mom[i], "exp_avg", compared, exact);
        check_rounded(opt.exp_avg_sq(i).to_double_vector(), var[i], "exp_avg_sq", compared, exact);
        // Where the weights are updated in place the parameter is the master; else it is the master rounded.
        if (masters_bf16) CHECK(opt.master(i).data_ptr() == m.params[i]->data.data_ptr());
        CHECK(m.params[i]->data.to_double_vector() == opt.master(i).to(m.params[i]->data.dtype()).to_double_vector());
        // The reference follows the optimizer's stored state, so rounding differences do not accumulate.
        w[i] = opt.master(i).to_double_vector();
        mom[i] = opt.exp_avg(i).to_double_vector();
        var[i] = opt.exp_avg_sq(i).to_double_vector();
      }
    }
    INFO(exact << " of " << compared << " stored values exact");
    CHECK(double(exact) >= 0.97 * double(compared));
  }
}

TEST_CASE("bf16 optimizer state takes the predicted bytes: 12 -> 4 bytes per bf16 parameter", "[optim][bf16_states]") {
  Model m = make_model();
  int64_t n16 = 0, n32 = 0;
  for (ly::Parameter* p : m.params) (p->data.dtype() == DType::BF16 ? n16 : n32) += p->data.numel();
  AdamW f32(m.params, bf16_config(false, false));
  Model m2 = make_model();
  AdamW b16(m2.params, bf16_config(true, true));
  // Counted from the state tensors themselves: those that are not a parameter's own storage.
  auto counted = [](const AdamW& o, const Model& mm) {
    int64_t bytes = 0;
    for (const NamedTensor& t : o.state()) {
      bool param = false;
      for (const ly::Parameter* p : mm.params) param |= p->data.data_ptr() == t.tensor.data_ptr();
      if (!param) bytes += t.tensor.numel() * dtype_size(t.tensor.dtype());
    }
    return bytes;
  };
  CHECK(counted(f32, m) == 12 * (n16 + n32));
  CHECK(f32.state_bytes() == 12 * (n16 + n32));
  // bf16: no masters (f32 parameters are updated in place too), bf16 moments.
  CHECK(counted(b16, m2) == 4 * (n16 + n32));
  CHECK(b16.state_bytes() == 4 * (n16 + n32));
}

TEST_CASE("AdamW with bf16 state resumes exactly, and converts state saved at the other precision",
          "[optim][bf16_states]") {
  Model a = make_model(DType::BF16), b = make_model(DType::BF16);
  AdamW oa(a.params, bf16_config(true, true));
  for (int t = 1; t <= 3; ++t) {
    set_grads(a, t);
    oa.step(0.01f);
  }
  std::vector<NamedTensor> saved;
  for (const NamedTensor& t : oa.state()) saved.push_back({t.name, t.tensor.clone()});
  AdamW ob(b.params, bf16_config(true, true));
  ob.load_state(saved, oa.step_count());
  for (size_t i = 0; i < a.params.size(); ++i)
    CHECK(b.params[i]->data.to_double_vector() == a.params[i]->data.to_double_vector());
  for (int t = 4; t <= 6; ++t) {
    set_grads(a, t);
    set_grads(b, t);
    oa.step(0.01f);
    ob.step(0.01f);
  }
  for (size_t i = 0; i < a.params.size(); ++i) {
    CHECK(b.params[i]->data.to_double_vector() == a.params[i]->data.to_double_vector());
    CHECK(ob.exp_avg_sq(i).to_double_vector() == oa.exp_avg_sq(i).to_double_vector());
  }

  // f32 state into a bf16-state optimizer: each tensor rounded; and back into f32: exact.
  Model c = make_model(), d = make_model(), e = make_model();
  AdamW oc(c.params, bf16_config(false, false));
  for (int t = 1; t <= 2; ++t) {
    set_grads(c, t);
    oc.step(0.01f);
  }
  AdamW od(d.params, bf16_config(true, true));
  od.load_state(oc.state(), oc.step_count());
  CHECK(od.step_count() == 2);
  for (size_t i = 0; i < c.params.size(); ++i) {
    CHECK(d.params[i]->data.to_double_vector() == c.params[i]->data.to_double_vector());
    CHECK(od.exp_avg(i).to_double_vector() == oc.exp_avg(i).to(od.exp_avg(i).dtype()).to_double_vector());
  }
  AdamW oe(e.params, bf16_config(false, false));
  oe.load_state(od.state(), od.step_count());
  for (size_t i = 0; i < c.params.size(); ++i) {
    CHECK(oe.master(i).to_double_vector() == od.master(i).to_double_vector());
    CHECK(oe.exp_avg_sq(i).to_double_vector() == od.exp_avg_sq(i).to_double_vector());
  }
}

TEST_CASE("bf16 optimizer state refuses f16 parameters and unsupported dtypes", "[optim][bf16_states]") {
  Model m;
  m.add("w", {4, 4}, DType::F16, 0.0);
  REQUIRE_THROWS_WITH(AdamW(m.params, bf16_config(true, false)), Catch::Contains("main_params_dtype = f32"));
  AdamWConfig c;
  c.exp_avg_dtype = DType::F16;
  Model n = make_model();
  REQUIRE_THROWS_WITH(AdamW(n.params, c), Catch::Contains("exp_avg_dtype"));
}

// The CUDA kernel's bf16 variants (bf16 weights updated in place, bf16 moments, either dtype of gradients)
// against the CPU reference on fresh random inputs, in several launches (sizes around the 64 Ki chunk and a
// misaligned view). Both compute from the same stored inputs (CUDA in f32, CPU in f64) and round to nearest
// even, so stored values agree within one bf16 ulp (a value near a rounding boundary may round either way) plus
// the f32 arithmetic's error, which is relative to the terms summed, not to the result: where the update nearly
// cancels the old weight (lr · m / sqrt(v) with v near 0 against w), the result is small and its ulp is below
// that error. The bound adds 2^-20 of the terms' magnitude (|old| + |new − old| for w, |m| + |g| for m, |v| + g²
// for v): eight f32 epsilons.
TEST_CASE("AdamW bf16-state CUDA kernels match the CPU reference", "[optim][bf16_states][gpu]") {
  MC_REQUIRE_GPU();
  using mctest::fresh_seed, mctest::randn, mctest::randu;
  const Device d = mctest::gpu();
  const std::vector<int64_t> sizes{1, 7, 65536, 65537, 300001};
  for (const auto& [wdt, mdt, gdt] : {std::tuple{DType::BF16, DType::BF16, DType::BF16},
                                      std::tuple{DType::BF16, DType::F32, DType::F32},
                                      std::tuple{DType::F32, DType::BF16, DType::BF16}}) {
    const uint64_t seed = fresh_seed();
    INFO("weights " << dtype_name(wdt) << " moments " << dtype_name(mdt) << " grads " << dtype_name(gdt) << " seed "
                    << seed);
    std::vector<Tensor> g, w, m, v, gg, gw, gm, gv;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t n = sizes[i] + (i == 4 ? 1 : 0);
      // The last tensors are views starting one element in: misaligned for the kernel's vector accesses.
      auto add = [&](std::vector<Tensor>& host, std::vector<Tensor>& dev, const Tensor& full) {
        host.push_back(i == 4 ? full.narrow(0, 1, n - 1) : full);
        dev.push_back(i == 4 ? full.to(d).narrow(0, 1, n - 1) : full.to(d));
      };
      add(g, gg, randn({n}, gdt, seed + 10 * i));
      add(w, gw, randn({n}, wdt, seed + 10 * i + 1));
      add(m, gm, randn({n}, mdt, seed + 10 * i + 2, 0, 0.1));
      add(v, gv, randu({n}, mdt, seed + 10 * i + 3, 0, 0.01));
    }
    ops::AdamWHyper h;
    h.lr = 3e-3f;
    h.beta2 = 0.95f;
    h.step = 3;
    std::vector<std::vector<double>> w0, m0, v0, g0;  // the inputs, before the CPU update overwrites them
    for (size_t i = 0; i < sizes.size(); ++i) {
      w0.push_back(w[i].to_double_vector()), m0.push_back(m[i].to_double_vector());
      v0.push_back(v[i].to_double_vector()), g0.push_back(g[i].to_double_vector());
    }
    ops::multi_tensor_adamw(g, w, m, v, {}, h);
    ops::multi_tensor_adamw(gg, gw, gm, gv, {}, h);
    synchronize_device(d);
    for (size_t i = 0; i < sizes.size(); ++i)
      for (int which = 0; which < 3; ++which) {
        const Tensor& cpu = which == 0 ? w[i] : which == 1 ? m[i] : v[i];
        const Tensor& dev = which == 0 ? gw[i] : which == 1 ? gm[i] : gv[i];
        const std::vector<double> a = cpu.to_double_vector(), b = dev.to(Device::cpu()).to_double_vector();
        // One bf16 ulp of the larger of the two values (8 significant bits: x = f·2^e, f in [0.5, 1) → 2^(e-8)).
        auto ulp = [](double x) {
          int e = 0;
          std::frexp(x, &e);
          return std::ldexp(1.0, e - 8);
        };
        size_t bad = 0, worst = 0, over_ulp = 0;
        double worst_excess = -1;
        for (size_t k = 0; k < a.size(); ++k) {
          const double one_ulp = std::max(ulp(a[k]), ulp(b[k])) * (1 + 1e-9) + 1e-30;
          over_ulp += std::abs(a[k] - b[k]) > one_ulp;
          const double gk = g0[i][k];
          const double terms = which == 0   ? std::abs(w0[i][k]) + std::abs(a[k] - w0[i][k])
                               : which == 1 ? std::abs(m0[i][k]) + std::abs(gk)
                                            : std::abs(v0[i][k]) + gk * gk;
          const double tol = one_ulp + std::ldexp(terms, -20);
          const double excess = std::abs(a[k] - b[k]) / tol;
          bad += excess > 1;
          if (excess > worst_excess) worst_excess = excess, worst = k;
        }
        INFO((which == 0 ? "w" : which == 1 ? "m" : "v") << "[" << worst << "] of tensor " << i << ": cpu " << a[worst]
                                                        << ", cuda " << b[worst] << ", inputs w " << w0[i][worst] << " m "
                                                        << m0[i][worst] << " v " << v0[i][worst] << " g " << g0[i][worst]
                                                        << " (elements beyond one ulp: " << over_ulp << ")");
        CHECK(bad == 0);
      }
  }
}
