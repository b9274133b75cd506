// Single-process checks of the RMSNorm / LayerNorm layers (they need no communicator: forward and
// backward against the f64 reference, gradient accumulation, the sequence_parallel flag) and of the
// MLP block's argument errors and TP-invariant SwiGLU initialisation.
//
// Tolerance: the layers run the f32 ops, compared with the f64 reference at relative error 1e-5.
#include "layers_test_util.hpp"

using namespace megacore;
using namespace layers_test;
namespace ly = megacore::layers;

TEST_CASE("RMSNorm and LayerNorm layers match the f64 reference and accumulate main grads", "[layers]") {
  const int64_t rows = 6, h = 10;
  for (bool layer : {false, true}) {
    INFO("layernorm " << layer);
    std::unique_ptr<ly::NormLayer> norm;
    if (layer)
      norm = std::make_unique<ly::LayerNorm>(h, ly::NormOptions{.sequence_parallel = true});
    else
      norm = std::make_unique<ly::RMSNorm>(h);
    REQUIRE(norm->has_bias() == layer);
    REQUIRE(norm->weight().sequence_parallel == layer);  // flagged only when asked
    REQUIRE(norm->weight().partition_dim == -1);
    norm->weight().data.copy_(randn({h}, 1));
    if (layer) norm->bias().data.copy_(randn({h}, 2));
    const Tensor x = randn({3, 2, h}, 3), dy = randn({3, 2, h}, 4);
    std::vector<double> xd = x.to_double_vector(), dyd = dy.to_double_vector(), w = norm->weight().data.to_double_vector();
    std::vector<double> b = layer ? norm->bias().data.to_double_vector() : std::vector<double>();
    std::vector<double> y(rows * h), mean(rows), rstd(rows), dx(rows * h), dw(h), db(h);
    ops::ref::norm_forward_f64(layer, xd.data(), w.data(), layer ? b.data() : nullptr, y.data(), mean.data(),
                               rstd.data(), rows, h, 1e-5);
    ops::ref::norm_backward_f64(layer, dyd.data(), xd.data(), w.data(), mean.data(), rstd.data(), dx.data(), dw.data(),
                                db.data(), rows, h);
    ly::ForwardContext ctx;
    for (int micro = 0; micro < 2; ++micro) {
      Tensor out = norm->forward(ctx, x);
      REQUIRE(mctest::rel_err(out.to_double_vector(), y) <= 1e-5);
      Tensor g = norm->backward(ctx, dy);
      REQUIRE(mctest::rel_err(g.to_double_vector(), dx) <= 1e-5);
    }
    for (double& v : dw) v *= 2;
    for (double& v : db) v *= 2;
    REQUIRE(mctest::rel_err(norm->weight().main_grad.to_double_vector(), dw) <= 1e-5);
    if (layer) REQUIRE(mctest::rel_err(norm->bias().main_grad.to_double_vector(), db) <= 1e-5);

    // Fused residual: the gradient of x and residual is d(norm)/dh + dresidual_out.
    const Tensor r = randn({3, 2, h}, 5), dr = randn({3, 2, h}, 6);
    std::vector<double> hd = xd, rd = r.to_double_vector(), drd = dr.to_double_vector();
    for (size_t i = 0; i < hd.size(); ++i) hd[i] += rd[i];
    ops::ref::norm_forward_f64(layer, hd.data(), w.data(), layer ? b.data() : nullptr, y.data(), mean.data(),
                               rstd.data(), rows, h, 1e-5);
    ops::ref::norm_backward_f64(layer, dyd.data(), hd.data(), w.data(), mean.data(), rstd.data(), dx.data(), dw.data(),
                                db.data(), rows, h);
    for (size_t i = 0; i < dx.size(); ++i) dx[i] += drd[i];
    norm->zero_grad();
    auto out = norm->forward_residual(ctx, x, r);
    REQUIRE(mctest::rel_err(out.residual_out.to_double_vector(), hd) <= 1e-6);
    REQUIRE(mctest::rel_err(out.y.to_double_vector(), y) <= 1e-5);
    REQUIRE_THROWS_WITH(norm->backward(ctx, dy), Catch::Contains("pair forward with backward"));
    REQUIRE(mctest::rel_err(norm->backward_residual(ctx, dy, dr).to_double_vector(), dx) <= 1e-5);
    REQUIRE(mctest::rel_err(norm->weight().main_grad.to_double_vector(), dw) <= 1e-5);
  }
}

TEST_CASE("norm layers refuse bad shapes and options with the fix", "[layers]") {
  REQUIRE_THROWS_AS(ly::RMSNorm(0), ValueError);
  REQUIRE_THROWS_WITH(ly::RMSNorm(0), Catch::Contains("pass the (positive) size"));
  REQUIRE_THROWS_WITH(ly::LayerNorm(8, {.eps = 0}), Catch::Contains("use a small positive value"));
  ly::RMSNorm norm(8);
  REQUIRE(!norm.has_bias());
  ly::ForwardContext ctx;
  REQUIRE_THROWS_WITH(norm.forward(ctx, Tensor::zeros({2, 6})),
                      Catch::Contains("its last dimension must be hidden_size 8; pass [..., 8]"));
  REQUIRE_THROWS_WITH(norm.forward(ctx, Tensor::zeros({2, 8}, DType::BF16)), Catch::Contains("convert it with .to("));
  REQUIRE_THROWS_WITH(norm.backward(ctx, Tensor::zeros({2, 8})), Catch::Contains("call forward with ctx.training = true"));
  REQUIRE_THROWS_WITH(norm.forward_residual(ctx, Tensor::zeros({2, 8}), Tensor::zeros({4, 8})),
                      Catch::Contains("pass tensors of the same shape"));
  norm.forward(ctx, Tensor::zeros({2, 8}));
  REQUIRE_THROWS_WITH(norm.backward(ctx, Tensor::zeros({3, 8})), Catch::Contains("pass the gradient of forward's output"));
}

TEST_CASE("MLP refuses bad sizes and builds the TP-invariant SwiGLU shard layout", "[layers]") {
  NoCommCommunicator tp4(2, 4);
  REQUIRE_THROWS_AS(ly::MLP(tp4, 8, 10), ValueError);
  REQUIRE_THROWS_WITH(ly::MLP(tp4, 8, 10),
                      Catch::Contains("ffn_hidden_size 10 is not divisible by the TP size 4; make ffn_hidden_size a multiple of 4"));
  REQUIRE_THROWS_WITH(ly::MLP(tp4, 0, 8), Catch::Contains("must be positive"));
  // Rank 2 of 4, ffn 16: fc1 shard = [gate rows 8..12 ; up rows 8..12], fc2 = columns 8..12.
  ly::MLP mlp(tp4, 6, 16, {.init_std = 0.5, .output_init_std = 0.25, .seed = 3, .init_offset = 30});
  const Tensor gate = ly::init_full_weight(16, 6, 0.5, 3, 30), up = ly::init_full_weight(16, 6, 0.5, 3, 31);
  const Tensor w2 = ly::init_full_weight(6, 16, 0.25, 3, 32);
  const Tensor& w1 = mlp.fc1().weight().data;
  REQUIRE(w1.shape() == Shape{8, 6});
  require_equal(w1.narrow(0, 0, 4).contiguous(), gate.narrow(0, 8, 4).contiguous(), "gate rows");
  require_equal(w1.narrow(0, 4, 4).contiguous(), up.narrow(0, 8, 4).contiguous(), "up rows");
  require_equal(mlp.fc2().weight().data, w2.narrow(1, 8, 4).contiguous(), "fc2 columns");
  REQUIRE(mlp.parameters().size() == 2);
  ly::MLP gelu(tp4, 6, 16, {.activation = model::ActivationType::GELU, .bias = true, .seed = 3, .init_offset = 30});
  REQUIRE(gelu.fc1().weight().data.shape() == Shape{4, 6});
  require_equal(gelu.fc1().weight().data, ly::init_full_weight(16, 6, 0.02, 3, 30).narrow(0, 8, 4).contiguous(),
                "GELU fc1 rows");
  REQUIRE(gelu.parameters().size() == 4);
  ly::ForwardContext ctx;
  REQUIRE_THROWS_WITH(mlp.backward(ctx, Tensor::zeros({2, 6})), Catch::Contains("call forward with ctx.training = true"));
}
