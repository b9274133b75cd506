// Single-process checks of the parallel linear layers: argument errors name the fix, and TP = 1
// (a one-rank group) is a plain linear layer.
#include "megacore/layers/linear.hpp"
#include "megacore/ops/gemm.hpp"
#include "layers_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
namespace ly = megacore::layers;

using layers_test::NoCommCommunicator;  // every collective throws; size 1 is a TP = 1 group

namespace {

Tensor randn(const Shape& shape, uint64_t offset) {
  Tensor t = Tensor::empty(shape);
  Generator g(5, offset);
  t.normal_(g);
  return t;
}

}  // namespace

TEST_CASE("parallel linear constructors refuse bad shapes with the fix", "[layers]") {
  NoCommCommunicator tp4(1, 4);
  REQUIRE_THROWS_AS(ly::ColumnParallelLinear(tp4, 8, 10), ValueError);
  REQUIRE_THROWS_WITH(ly::ColumnParallelLinear(tp4, 8, 10),
                      Catch::Contains("out_features 10 is not divisible by the TP size 4; make out_features a multiple of 4"));
  REQUIRE_THROWS_WITH(ly::RowParallelLinear(tp4, 10, 8),
                      Catch::Contains("in_features 10 is not divisible by the TP size 4; make in_features a multiple of 4"));
  REQUIRE_THROWS_WITH(ly::ColumnParallelLinear(tp4, 0, 8), Catch::Contains("must be positive"));
  REQUIRE_THROWS_WITH(ly::ColumnParallelLinear(tp4, 8, 8, {.gather_output = true, .sequence_parallel = true}),
                      Catch::Contains("turn gather_output off"));
  REQUIRE_THROWS_WITH(ly::RowParallelLinear(tp4, 8, 8, {.input_is_parallel = false, .sequence_parallel = true}),
                      Catch::Contains("sequence_parallel needs input_is_parallel = true"));
  REQUIRE_THROWS_WITH(ly::ColumnParallelLinear(tp4, 8, 8, {.params_dtype = DType::I32}),
                      Catch::Contains("use f32, bf16 or f16"));
  // Rank 1 of 4 holds rows [2, 4) of the column weight and columns [2, 4) of the row weight.
  ly::ColumnParallelLinear col(tp4, 8, 8, {.seed = 9, .init_offset = 3});
  Tensor full = ly::init_full_weight(8, 8, 0.02, 9, 3);
  REQUIRE(col.weight().data.shape() == Shape{2, 8});
  REQUIRE(col.weight().data.to_double_vector() == full.narrow(0, 2, 2).to_double_vector());
  ly::RowParallelLinear row(tp4, 8, 8, {.seed = 9, .init_offset = 3});
  REQUIRE(row.weight().data.to_double_vector() == full.narrow(1, 2, 2).contiguous().to_double_vector());
  REQUIRE(row.weight().partition_dim == 1);
  REQUIRE(row.bias().partition_dim == -1);
  REQUIRE(row.bias().main_grad.dtype() == DType::F32);
}

TEST_CASE("parallel linear forward/backward refuse bad inputs with the fix", "[layers]") {
  NoCommCommunicator tp1(0, 1);
  ly::ForwardContext ctx;
  ly::ColumnParallelLinear col(tp1, 8, 6);
  REQUIRE_THROWS_WITH(col.forward(ctx, randn({4, 7}, 1)),
                      Catch::Contains("has shape [4, 7] but its last dimension must be 8; the layer was built with in_features = 8"));
  REQUIRE_THROWS_WITH(col.forward(ctx, randn({4, 8}, 1).to(DType::BF16)),
                      Catch::Contains("has dtype bf16 but the layer's parameters are f32; convert it"));
  REQUIRE_THROWS_WITH(col.forward(ctx, Tensor()), Catch::Contains("is undefined"));
  REQUIRE_THROWS_WITH(col.backward(ctx, randn({4, 6}, 2)), Catch::Contains("call forward with ctx.training = true"));
  ly::ForwardContext eval{.training = false};
  col.forward(eval, randn({4, 8}, 1));
  REQUIRE_THROWS_WITH(col.backward(eval, randn({4, 6}, 2)), Catch::Contains("no saved input"));
  col.forward(ctx, randn({4, 8}, 1));
  REQUIRE_THROWS_WITH(col.backward(ctx, randn({4, 5}, 2)), Catch::Contains("last dimension must be 6"));
  REQUIRE_THROWS_WITH(col.backward(ctx, randn({3, 6}, 2)), Catch::Contains("forward's output had 4 rows"));

  ly::RowParallelLinear row(tp1, 8, 6, {.input_is_parallel = true});
  REQUIRE_THROWS_WITH(row.forward(ctx, randn({4, 6}, 1)),
                      Catch::Contains("with input_is_parallel it is this rank's slice in_features / TP = 8 / 1"));
  ly::RowParallelLinear row_full(tp1, 8, 6);
  REQUIRE_THROWS_WITH(row_full.forward(ctx, randn({4, 6}, 1)),
                      Catch::Contains("without input_is_parallel it is the full in_features = 8"));
  ly::ColumnParallelLinear sp(tp1, 8, 8, {.sequence_parallel = true});
  REQUIRE_THROWS_WITH(sp.forward(ctx, randn({8}, 1)), Catch::Contains("add the sequence dimension"));
}

TEST_CASE("TP = 1: column and row layers are y = x W^T + b with accumulated f32 grads", "[layers]") {
  NoCommCommunicator tp1(0, 1);
  ly::ForwardContext ctx;
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    ly::ColumnParallelLinear col(tp1, 8, 6, {.params_dtype = dt, .init_std = 0.3, .init_offset = 1});
    ly::RowParallelLinear row(tp1, 6, 8, {.input_is_parallel = true, .params_dtype = dt, .init_std = 0.3, .init_offset = 2});
    Tensor x = randn({3, 2, 8}, 7).to(dt), g = randn({3, 2, 8}, 8).to(dt);
    Tensor y = row.forward(ctx, col.forward(ctx, x));
    REQUIRE(y.shape() == Shape{3, 2, 8});
    REQUIRE(y.dtype() == dt);
    Tensor dx = col.backward(ctx, row.backward(ctx, g));
    REQUIRE(dx.shape() == x.shape());
    REQUIRE(col.weight().main_grad.dtype() == DType::F32);
    // Reference in f32 from the (rounded) parameters: the chain is linear, so dx = g W2 W1.
    Tensor w1 = col.weight().data.to(DType::F32), w2 = row.weight().data.to(DType::F32);
    Tensor x2 = x.to(DType::F32).view({6, 8}), g2 = g.to(DType::F32).view({6, 8});
    Tensor y_ref = ops::matmul(ops::matmul(x2, w1, {.trans_b = true}), w2, {.trans_b = true});
    Tensor dx_ref = ops::matmul(ops::matmul(g2, w2), w1);
    Tensor dw2_ref = ops::matmul(g2, ops::matmul(x2, w1, {.trans_b = true}), {.trans_a = true});
    // bf16: activations are rounded to 8 bits of mantissa between the layers (relative ~4e-3).
    const double tol = dt == DType::F32 ? 1e-6 : 2e-2;
    REQUIRE(mctest::rel_err(y.to_double_vector(), y_ref.to_double_vector()) <= tol);
    REQUIRE(mctest::rel_err(dx.to_double_vector(), dx_ref.to_double_vector()) <= tol);
    REQUIRE(mctest::rel_err(row.weight().main_grad.to_double_vector(), dw2_ref.to_double_vector()) <= tol);
    // Bias grad of the row layer: column sums of g.
    Tensor db_ref = ops::matmul(Tensor::full({1, 6}, 1.0), g2).view({8});
    REQUIRE(mctest::rel_err(row.bias().main_grad.to_double_vector(), db_ref.to_double_vector()) <= 1e-6);
  }
}
