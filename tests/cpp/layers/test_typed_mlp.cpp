// layers::TypedMLP with an activation policy the library does not compile (a user functor), against a
// float64 reference on fresh random inputs; the library's own functors against ops' references.
//
// Tolerances (||a - b|| / ||b||): f32 GEMMs accumulate in f32 (Eigen), so the f32 layer agrees with the
// f64 reference to 1e-5; bf16 parameters and activations round every stored value to 8 bits of
// mantissa, so 3e-2.
#include <random>

#include "megacore/layers/typed_mlp.hpp"
#include "megacore/ops/activation.hpp"
#include "megacore/ops/gemm.hpp"
#include "test_helpers.hpp"
#include "typed_functors.hpp"

using namespace megacore;
namespace ly = megacore::layers;

namespace {

// A user policy (tests/cpp/typed_functors.hpp): not one of ops::fn, so TypedMLP<T, Square> is instantiated from
// the header here.
using mctest::Square;

// c[m, n] = sum_k a[m, k] b[n, k] (a @ b^T), all f64 row-major.
std::vector<double> mm_bt(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n, int64_t k) {
  std::vector<double> c(size_t(m * n));
  ops::ref::gemm_f64(false, true, m, n, k, 1.0, a.data(), b.data(), 0.0, c.data());
  return c;
}
std::vector<double> mm(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n, int64_t k,
                       bool trans_a = false) {
  std::vector<double> c(size_t(m * n));
  ops::ref::gemm_f64(trans_a, false, m, n, k, 1.0, a.data(), b.data(), 0.0, c.data());
  return c;
}

// The layer on `device` (host tensors in and out; on CUDA the user functor runs in the kernels that
// typed_functors.cu instantiates) against the f64 reference computed on the host.
template <class T>
void check_square_mlp(double tol, Device device = Device::cpu()) {
  const uint64_t seed = std::random_device{}();
  INFO("seed " << seed << " dtype " << dtype_name(dtype_of_v<T>) << " device " << device.str());
  const int64_t rows = 6, hidden = 8, ffn = 16;  // x is [3, 2, 8]: rows = 3 * 2
  mctest::SoloCommunicator tp;
  ly::TypedMLP<T, Square> mlp(tp, hidden, ffn, {.device = device, .init_std = 0.3, .seed = seed});
  Generator g(seed, 100);
  // Non-zero biases, so the bias paths are checked too.
  for (ly::Parameter* b : {&mlp.fc1().bias(), &mlp.fc2().bias()}) {
    Tensor host = Tensor::empty(b->data.shape(), b->data.dtype());
    host.normal_(g, 0.0, 0.5);
    b->data.copy_(host.to(device));
  }
  Tensor x = Tensor::empty({3, 2, hidden}, dtype_of_v<T>);
  x.normal_(g);
  Tensor dy = Tensor::empty({3, 2, hidden}, dtype_of_v<T>);
  dy.normal_(g);

  ly::ForwardContext ctx;
  Tensor y = mlp.forward(ctx, x.to(device)).to(Device::cpu());
  Tensor dx = mlp.backward(ctx, dy.to(device)).to(Device::cpu());
  REQUIRE(y.dtype() == dtype_of_v<T>);
  REQUIRE(y.shape() == x.shape());
  REQUIRE(dx.shape() == x.shape());

  // f64 reference from the layer's own (rounded) parameters and inputs.
  auto host = [](const Tensor& t) { return t.to(Device::cpu()).to_double_vector(); };
  const auto w1 = host(mlp.fc1().weight().data), b1 = host(mlp.fc1().bias().data);
  const auto w2 = host(mlp.fc2().weight().data), b2 = host(mlp.fc2().bias().data);
  const auto xv = x.to_double_vector(), dyv = dy.to_double_vector();
  std::vector<double> h = mm_bt(xv, w1, rows, ffn, hidden), a(h.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < ffn; ++f) {
      double& v = h[size_t(r * ffn + f)];
      v += b1[size_t(f)];
      a[size_t(r * ffn + f)] = v * v;
    }
  std::vector<double> yr = mm_bt(a, w2, rows, hidden, ffn);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < hidden; ++o) yr[size_t(r * hidden + o)] += b2[size_t(o)];
  std::vector<double> dh = mm(dyv, w2, rows, ffn, hidden);  // dy [rows, hidden] @ w2 [hidden, ffn]
  for (size_t i = 0; i < dh.size(); ++i) dh[i] *= 2.0 * h[i];
  const std::vector<double> dxr = mm(dh, w1, rows, hidden, ffn);          // dh @ w1 [ffn, hidden]
  const std::vector<double> dw1 = mm(dh, xv, ffn, hidden, rows, true);    // dh^T x
  const std::vector<double> dw2 = mm(dyv, a, hidden, ffn, rows, true);    // dy^T a

  CHECK(mctest::rel_err(y.to_double_vector(), yr) <= tol);
  CHECK(mctest::rel_err(dx.to_double_vector(), dxr) <= tol);
  CHECK(mctest::rel_err(host(mlp.fc1().weight().main_grad), dw1) <= tol);
  CHECK(mctest::rel_err(host(mlp.fc2().weight().main_grad), dw2) <= tol);
}

}  // namespace

TEST_CASE("TypedMLP with a user activation functor matches a float64 reference", "[layers][typed]") {
  check_square_mlp<float>(1e-5);
  check_square_mlp<bfloat16>(3e-2);
}

TEST_CASE("TypedMLP with a user activation functor on a GPU matches a float64 reference", "[layers][typed][gpu]") {
  MC_REQUIRE_GPU();
  // f32 GEMMs on the GPU may round their inputs to TF32 (10 mantissa bits): 3e-3 for f32.
  check_square_mlp<float>(3e-3, Device::cuda(0));
  check_square_mlp<bfloat16>(3e-2, Device::cuda(0));
}

TEST_CASE("TypedMLP: the compiled policies match ops' activations; errors name the fix", "[layers][typed]") {
  const uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  Tensor x = Tensor::empty({257});
  Generator g(seed, 0);
  x.normal_(g, 0.0, 3.0);
  Tensor y = Tensor::empty({257}), want = Tensor::empty({257}), dy = Tensor::full({257}, 1.0);
  for (auto [act, name] : {std::pair{ops::Activation::GeluTanh, "gelu_tanh"}, std::pair{ops::Activation::Silu, "silu"}}) {
    INFO(name);
    if (act == ops::Activation::Silu) ops::elementwise<float>(x, y, ops::fn::Silu{});
    else ops::elementwise<float>(x, y, ops::fn::GeluTanh{});
    ops::activation_forward(act, x, want);
    CHECK(mctest::rel_err(y.to_double_vector(), want.to_double_vector()) <= 1e-6);
    if (act == ops::Activation::Silu) ops::elementwise_grad<float>(dy, x, y, ops::fn::Silu{});
    else ops::elementwise_grad<float>(dy, x, y, ops::fn::GeluTanh{});
    ops::activation_backward(act, dy, x, want);
    CHECK(mctest::rel_err(y.to_double_vector(), want.to_double_vector()) <= 1e-6);
  }
  // A compiled instantiation (extern template in the header) runs end to end.
  mctest::SoloCommunicator tp;
  ly::TypedMLP<float, ops::fn::Relu> relu(tp, 8, 16);
  ly::ForwardContext ctx;
  Tensor out = relu.forward(ctx, Tensor::full({2, 8}, 1.0));
  REQUIRE(out.shape() == Shape{2, 8});
  REQUIRE(relu.parameters().size() == 4);
  REQUIRE_THROWS_WITH(relu.forward(ctx, Tensor::full({2, 8}, 1.0, DType::BF16)), Catch::Contains("dtype bf16"));
  mctest::SoloCommunicator tp3(3);
  REQUIRE_THROWS_WITH((ly::TypedMLP<float, Square>(tp3, 8, 16)), Catch::Contains("not divisible by the TP size 3"));
  ly::TypedMLP<float, Square> fresh(tp, 8, 16);
  REQUIRE_THROWS_WITH(fresh.backward(ctx, Tensor::full({2, 8}, 1.0)), Catch::Contains("run forward with ctx.training = true"));
  Tensor short_out = Tensor::empty({200});
  REQUIRE_THROWS_WITH(ops::elementwise<float>(x, short_out, Square{}),
                      Catch::Contains("elements on cpu"));
}
