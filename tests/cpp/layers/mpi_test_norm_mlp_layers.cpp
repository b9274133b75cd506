// RMSNorm / LayerNorm layers and the MLP block under mpirun: for every TP in {1, 2, 4} that divides the
// world (split with a ProcessGrid), with and without sequence parallelism, the forward output, the
// input gradient and every (gathered) parameter gradient equal a single-rank reference computed
// locally with the ops on the full tensors.
//
// Tolerances: only the order of f32 additions differs from the reference (TP partial products summed
// by the reductions, per-chunk norm gradients summed by allreduce_sequence_parallel_grads), so results
// agree to a relative error (||a - b|| / ||b||) of 1e-5.
#include "layers_test_util.hpp"
#include "megacore/parallel/process_grid.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;

namespace {

constexpr double kTol = 1e-5;

Tensor rows(const Tensor& t) { return t.contiguous().view({-1, t.size(-1)}); }

// Column sums of a [..., n] tensor: the bias gradient.
Tensor colsum(const Tensor& t) {
  Tensor r = rows(t);
  return ops::matmul(Tensor::full({1, r.size(0)}, 1.0), r).view({r.size(1)});
}

// y = x W^T + b on [..., in] tensors.
Tensor ref_linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  ops::GemmOptions o;
  o.trans_b = true;
  if (b.defined()) {
    o.epilogue = ops::GemmEpilogue::Bias;
    o.bias = b;
  }
  Shape s = x.shape();
  s.back() = w.size(0);
  return ops::matmul(rows(x), w, o).view(s);
}

void run_norm(comm::Communicator& tp, bool layer, bool sp, bool residual) {
  const int tpn = tp.size(), r = tp.rank();
  INFO("TP " << tpn << " layernorm " << layer << " SP " << sp << " residual " << residual);
  const int64_t s = 8, b = 2, h = 12;
  std::unique_ptr<ly::NormLayer> norm;
  if (layer)
    norm = std::make_unique<ly::LayerNorm>(h, ly::NormOptions{.sequence_parallel = sp});
  else
    norm = std::make_unique<ly::RMSNorm>(h, ly::NormOptions{.sequence_parallel = sp});
  const Tensor W = randn({h}, 60), B = randn({h}, 61);
  norm->weight().data.copy_(W);
  if (layer) norm->bias().data.copy_(B);
  const Tensor X = randn({s, b, h}, 62), R = randn({s, b, h}, 63), G = randn({s, b, h}, 64), DR = randn({s, b, h}, 65);
  // Reference on the full sequence with the ops.
  Tensor Hs = X.clone(), Y = Tensor::empty({s, b, h}), mean = Tensor::empty({s * b}), rstd = Tensor::empty({s * b});
  Tensor dX = Tensor::empty({s, b, h}), dW = Tensor::zeros({h}), dB = Tensor::zeros({h});
  Tensor no_bias;
  if (residual) {
    ops::rmsnorm_forward_residual(X, R, W, Y, Hs, rstd, 1e-5f);  // h = x + r (its y is recomputed below)
  }
  if (layer) {
    ops::layernorm_forward(Hs, W, B, Y, mean, rstd, 1e-5f);
    ops::layernorm_backward(G, Hs, W, mean, rstd, dX, dW, dB);
  } else {
    ops::rmsnorm_forward(Hs, W, Y, rstd, 1e-5f);
    ops::rmsnorm_backward(G, Hs, W, rstd, dX, dW);
  }
  if (residual)
    for (int64_t i = 0; i < dX.numel(); ++i) dX.data<float>()[i] += DR.data<float>()[i];

  auto local = [&](const Tensor& t) { return sp ? chunk(t, 0, tpn, r) : t; };
  ly::ForwardContext ctx;
  for (int micro = 0; micro < 2; ++micro) {
    if (residual) {
      auto out = norm->forward_residual(ctx, local(X), local(R));
      require_close(out.residual_out, local(Hs), kTol, "residual stream");
      require_close(out.y, local(Y), kTol, "norm output");
      require_close(norm->backward_residual(ctx, local(G), local(DR)), local(dX), kTol, "input gradient");
    } else {
      require_close(norm->forward(ctx, local(X)), local(Y), kTol, "norm output");
      require_close(norm->backward(ctx, local(G)), local(dX), kTol, "input gradient");
    }
  }
  REQUIRE(norm->weight().sequence_parallel == sp);
  ly::allreduce_sequence_parallel_grads(tp, norm->parameters());
  require_close(norm->weight().main_grad, scaled(dW, 2), kTol, "weight gradient");
  if (layer) require_close(norm->bias().main_grad, scaled(dB, 2), kTol, "bias gradient");
}

void run_mlp(comm::Communicator& tp, bool swiglu, bool bias, bool sp) {
  const int tpn = tp.size(), r = tp.rank();
  INFO("TP " << tpn << " swiglu " << swiglu << " bias " << bias << " SP " << sp);
  const int64_t s = 8, b = 2, h = 12, f = 16, w1_rows = swiglu ? 2 * f : f;
  const uint64_t seed = 99, off = 40;
  ly::MLP mlp(tp, h, f,
              {.activation = swiglu ? model::ActivationType::SwiGLU : model::ActivationType::GELU, .bias = bias,
               .sequence_parallel = sp, .init_std = 0.5, .output_init_std = 0.3, .seed = seed, .init_offset = off});
  // The full weights: fc1 as [gate; up] (SwiGLU) or plain, fc2 [h, f].
  Tensor W1 = Tensor::empty({w1_rows, h});
  W1.narrow(0, 0, f).copy_(ly::init_full_weight(f, h, 0.5, seed, off));
  if (swiglu) W1.narrow(0, f, f).copy_(ly::init_full_weight(f, h, 0.5, seed, off + 1));
  const Tensor W2 = ly::init_full_weight(h, f, 0.3, seed, off + 2);
  Tensor B1, B2;
  if (bias) {
    B1 = randn({w1_rows}, 70);
    B2 = randn({h}, 71);
    const Tensor b1_ranked = swiglu ? swiglu_rank_layout(B1.view({w1_rows, 1}), tpn).view({w1_rows}) : B1;
    mlp.fc1().bias().data.copy_(chunk(b1_ranked, 0, tpn, r));
    mlp.fc2().bias().data.copy_(B2);
  }
  const Tensor X = randn({s, b, h}, 72), G = randn({s, b, h}, 73);
  // Reference.
  Tensor H1 = ref_linear(X, W1, B1), A = Tensor::empty({s, b, f});
  if (swiglu)
    ops::swiglu_forward(H1, A);
  else
    ops::activation_forward(ops::Activation::GeluTanh, H1, A);
  Tensor Y = ref_linear(A, W2, B2);
  Tensor dA = ops::matmul(rows(G), W2).view({s, b, f});
  Tensor dW2 = ops::matmul(rows(G), rows(A), {.trans_a = true});
  Tensor dH1 = Tensor::empty({s, b, w1_rows});
  if (swiglu)
    ops::swiglu_backward(dA, H1, dH1);
  else
    ops::activation_backward(ops::Activation::GeluTanh, dA, H1, dH1);
  Tensor dW1 = ops::matmul(rows(dH1), rows(X), {.trans_a = true});
  Tensor dX = ops::matmul(rows(dH1), W1).view({s, b, h});

  auto local = [&](const Tensor& t) { return sp ? chunk(t, 0, tpn, r) : t; };
  auto ranked = [&](const Tensor& t) { return swiglu ? swiglu_rank_layout(t, tpn) : t; };
  require_equal(all_gather_along(tp, mlp.fc1().weight().data, 0), ranked(W1), "fc1 init (gathered)");
  ly::ForwardContext ctx;
  for (int micro = 0; micro < 2; ++micro) {
    require_close(mlp.forward(ctx, local(X)), local(Y), kTol, "MLP output");
    require_close(mlp.backward(ctx, local(G)), local(dX), kTol, "input gradient");
  }
  ly::allreduce_sequence_parallel_grads(tp, mlp.parameters());
  require_close(all_gather_along(tp, mlp.fc1().weight().main_grad, 0), scaled(ranked(dW1), 2), kTol,
                "fc1 weight gradient (gathered)");
  require_close(all_gather_along(tp, mlp.fc2().weight().main_grad, -1), scaled(dW2, 2), kTol,
                "fc2 weight gradient (gathered)");
  if (bias) {
    Tensor dB1 = colsum(dH1);
    if (swiglu) dB1 = swiglu_rank_layout(dB1.view({w1_rows, 1}), tpn).view({w1_rows});
    require_close(all_gather_along(tp, mlp.fc1().bias().main_grad, 0), scaled(dB1, 2), kTol,
                  "fc1 bias gradient (gathered)");
    require_close(mlp.fc2().bias().main_grad, scaled(colsum(G), 2), kTol, "fc2 bias gradient");
  }
}

}  // namespace

TEST_CASE("RMSNorm / LayerNorm layers equal the full-sequence reference, with and without SP", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (bool layer : {false, true})
      for (bool sp : {false, true})
        for (bool residual : {false, true}) run_norm(grid.tp(), layer, sp, residual);
  }
}

TEST_CASE("MLP (SwiGLU and GELU) equals the single-rank computation, with and without SP", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (bool swiglu : {true, false})
      for (bool bias : {false, true})
        for (bool sp : {false, true}) run_mlp(grid.tp(), swiglu, bias, sp);
  }
}
