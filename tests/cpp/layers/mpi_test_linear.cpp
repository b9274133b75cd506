// Tensor-parallel mappings and linear layers under mpirun: for every TP in {1, 2, 4} that divides the
// world (the world split into TP groups with a ProcessGrid), each rank's results equal the
// single-rank computation done locally with ops::gemm on the full tensors.
//
// Tolerances: the only differences from the local reference are the order of f32 additions (the
// reductions sum TP partial products, the reference sums one dot product), so results agree to a
// relative error (||a - b|| / ||b||) of 1e-5 in f32; pure data movement (splits, gathers) is exact.
#include <random>

#include "megacore/comm/collectives.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::parallel;
namespace ly = megacore::layers;

namespace {

constexpr double kTol = 1e-5;

std::vector<int> tp_sizes_for(int world) {
  std::vector<int> out;
  for (int tp : {1, 2, 4})
    if (world % tp == 0) out.push_back(tp);
  return out;
}

std::unique_ptr<comm::Communicator> world_comm() {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(60);
  return comm::make_mpi_world(o);
}

// The same values on every rank for the same (seed, offset).
Tensor randn(const Shape& shape, uint64_t offset, uint64_t seed = 77) {
  Tensor t = Tensor::empty(shape);
  Generator g(seed, offset);
  t.normal_(g);
  return t;
}

Tensor sum_of(const std::vector<Tensor>& ts) {
  Tensor out = Tensor::zeros(ts.at(0).shape());
  float* o = out.data<float>();
  for (const Tensor& t : ts) {
    Tensor c = t.contiguous();
    const float* p = c.data<float>();
    for (int64_t i = 0; i < out.numel(); ++i) o[i] += p[i];
  }
  return out;
}

Tensor chunk(const Tensor& t, int64_t dim, int parts, int r) {
  const int64_t n = t.size(dim) / parts;
  return t.narrow(dim, r * n, n).contiguous();
}

void require_close(const Tensor& got, const Tensor& want, double tol, const char* what) {
  INFO(what << ": got " << got.str() << " want " << want.str());
  REQUIRE(got.shape() == want.shape());
  REQUIRE(mctest::rel_err(got.to_double_vector(), want.to_double_vector()) <= tol);
}

void require_equal(const Tensor& got, const Tensor& want, const char* what) {
  INFO(what << ": got " << got.str() << " want " << want.str());
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.to_double_vector() == want.to_double_vector());
}

// Local reference: y = x W^T + b on [..., in] tensors.
Tensor ref_linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  Tensor x2 = x.contiguous().view({-1, x.size(-1)});
  ops::GemmOptions o;
  o.trans_b = true;
  if (b.defined()) {
    o.epilogue = ops::GemmEpilogue::Bias;
    o.bias = b;
  }
  Tensor y = ops::matmul(x2, w, o);
  Shape s = x.shape();
  s.back() = w.size(0);
  return y.view(s);
}

Tensor rows(const Tensor& t) { return t.contiguous().view({-1, t.size(-1)}); }

}  // namespace

TEST_CASE("TP/SP mappings: forward and backward match a local reference", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    INFO("TP " << tpn);
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    comm::Communicator& tp = grid.tp();
    const int r = tp.rank();
    REQUIRE(tp.size() == tpn);
    const Shape full{8, 2, 12};  // [s, b, h]: s and h divisible by 1, 2 and 4
    // Per-rank distinct tensors (offset 100 + rank) and shared ones (offsets 1, 2).
    std::vector<Tensor> per_rank;
    for (int q = 0; q < tpn; ++q) per_rank.push_back(randn(full, 100 + q));
    const Tensor X = randn(full, 1), G = randn(full, 2);
    const Tensor sum = sum_of(per_rank);
    const Tensor mine = per_rank[r];

    // copy_to_tp: identity / all-reduce.
    require_equal(copy_to_tp_forward(tp, X.clone()), X, "copy_to_tp fwd");
    require_close(copy_to_tp_backward(tp, mine.clone()), sum, kTol, "copy_to_tp bwd");
    // reduce_from_tp: all-reduce / identity.
    require_close(reduce_from_tp_forward(tp, mine.clone()), sum, kTol, "reduce_from_tp fwd");
    require_equal(reduce_from_tp_backward(tp, G.clone()), G, "reduce_from_tp bwd");
    // scatter_to_sp: split / all-gather along seq.
    require_equal(scatter_to_sp_forward(tp, X), chunk(X, 0, tpn, r), "scatter_to_sp fwd");
    require_equal(scatter_to_sp_backward(tp, chunk(G, 0, tpn, r)), G, "scatter_to_sp bwd");
    // gather_from_sp: all-gather / split along seq.
    require_equal(gather_from_sp_forward(tp, chunk(X, 0, tpn, r)), X, "gather_from_sp fwd");
    require_equal(gather_from_sp_backward(tp, G), chunk(G, 0, tpn, r), "gather_from_sp bwd");
    // reduce_scatter_to_sp: reduce-scatter / all-gather along seq.
    require_close(reduce_scatter_to_sp_forward(tp, mine), chunk(sum, 0, tpn, r), kTol, "reduce_scatter_to_sp fwd");
    require_equal(reduce_scatter_to_sp_backward(tp, chunk(G, 0, tpn, r)), G, "reduce_scatter_to_sp bwd");
    // all_gather_from_sp: all-gather / reduce-scatter along seq.
    require_equal(all_gather_from_sp_forward(tp, chunk(X, 0, tpn, r)), X, "all_gather_from_sp fwd");
    require_close(all_gather_from_sp_backward(tp, mine), chunk(sum, 0, tpn, r), kTol, "all_gather_from_sp bwd");
    // scatter_to_tp / gather_from_tp along the last dim (through the transposing gather).
    require_equal(scatter_to_tp_forward(tp, X), chunk(X, -1, tpn, r), "scatter_to_tp fwd");
    require_equal(scatter_to_tp_backward(tp, chunk(G, -1, tpn, r)), G, "scatter_to_tp bwd");
    require_equal(gather_from_tp_forward(tp, chunk(X, -1, tpn, r)), X, "gather_from_tp fwd");
    require_equal(gather_from_tp_backward(tp, G), chunk(G, -1, tpn, r), "gather_from_tp bwd");
    // A 2-D [tokens, h] tensor and a non-contiguous input gather the same way.
    Tensor X2 = X.view({16, 12});
    require_equal(gather_from_tp_forward(tp, chunk(X2, -1, tpn, r)), X2, "gather_from_tp 2-D");
    Tensor Xt = X2.transpose(0, 1);  // [12, 16], not contiguous
    require_equal(gather_from_tp_forward(tp, Xt.narrow(1, r * (16 / tpn), 16 / tpn)), Xt.contiguous(),
                  "gather_from_tp of a strided view");
    if (tpn > 1) {
      // Indivisible dimensions are refused with the fix, on every rank alike (no collective started).
      REQUIRE_THROWS_WITH(scatter_to_sp_forward(tp, randn({tpn + 1, 2, 4}, 3)),
                          Catch::Contains("make the sequence length a multiple of TP"));
      REQUIRE_THROWS_WITH(reduce_scatter_to_sp_forward(tp, randn({tpn + 1, 4}, 3)),
                          Catch::Contains("make the sequence length a multiple of TP"));
      REQUIRE_THROWS_WITH(scatter_to_tp_forward(tp, randn({4, tpn + 1}, 3)), Catch::Contains("pad it to a multiple of"));
      REQUIRE_THROWS_WITH(split_along(tp, X, 1), Catch::Contains("use dim 0 / -1"));
    }
  }
}

namespace {

struct ChainCase {
  bool sequence_parallel;
  bool bias;
  bool gather_output;  // column gathers its output; the row layer then takes the full input
};

void run_chain(comm::Communicator& tp, const ChainCase& cc) {
  const int tpn = tp.size(), r = tp.rank();
  INFO("TP " << tpn << " SP " << cc.sequence_parallel << " bias " << cc.bias << " gather_output " << cc.gather_output);
  const int64_t s = 8, b = 2, h = 12, f = 16;
  const uint64_t seed = 4242;
  ly::ColumnParallelLinear fc1(tp, h, f,
                               {.bias = cc.bias, .gather_output = cc.gather_output,
                                .sequence_parallel = cc.sequence_parallel, .init_std = 0.5, .seed = seed, .init_offset = 10});
  ly::RowParallelLinear fc2(tp, f, h,
                            {.bias = cc.bias, .input_is_parallel = !cc.gather_output,
                             .sequence_parallel = cc.sequence_parallel, .init_std = 0.5, .seed = seed, .init_offset = 11});
  // The full weights every TP degree slices; non-zero biases so the forward checks them too.
  const Tensor W1 = ly::init_full_weight(f, h, 0.5, seed, 10), W2 = ly::init_full_weight(h, f, 0.5, seed, 11);
  Tensor B1, B2;
  if (cc.bias) {
    B1 = randn({f}, 20);
    B2 = randn({h}, 21);
    fc1.bias().data.copy_(chunk(B1, 0, tpn, r));
    fc2.bias().data.copy_(B2);
  }
  require_equal(fc1.weight().data, chunk(W1, 0, tpn, r), "fc1 init is a row slice of the full weight");
  require_equal(fc2.weight().data, chunk(W2, 1, tpn, r), "fc2 init is a column slice of the full weight");

  const Tensor X = randn({s, b, h}, 30), G = randn({s, b, h}, 31);
  // Reference on the full tensors.
  Tensor Y1 = ref_linear(X, W1, B1), Y = ref_linear(Y1, W2, B2);
  Tensor dW2 = ops::matmul(rows(G), rows(Y1), {.trans_a = true});
  Tensor dY1 = ops::matmul(rows(G), W2).view({s, b, f});
  Tensor dW1 = ops::matmul(rows(dY1), rows(X), {.trans_a = true});
  Tensor dX = ops::matmul(rows(dY1), W1).view({s, b, h});
  Tensor ones = Tensor::full({1, s * b}, 1.0);
  Tensor dB1 = ops::matmul(ones, rows(dY1)).view({f}), dB2 = ops::matmul(ones, rows(G)).view({h});

  ly::ForwardContext ctx;
  const Tensor x_in = cc.sequence_parallel ? chunk(X, 0, tpn, r) : X;
  const Tensor dy_in = cc.sequence_parallel ? chunk(G, 0, tpn, r) : G;
  // Two identical micro-batches: main_grad accumulates to twice the reference.
  for (int micro = 0; micro < 2; ++micro) {
    Tensor y1 = fc1.forward(ctx, x_in);
    REQUIRE(y1.shape() == Shape{s, b, cc.gather_output ? f : f / tpn});
    Tensor y = fc2.forward(ctx, y1);
    require_close(y, cc.sequence_parallel ? chunk(Y, 0, tpn, r) : Y, kTol, "output");
    Tensor dy1 = fc2.backward(ctx, dy_in);
    require_close(dy1, cc.gather_output ? dY1 : chunk(dY1, -1, tpn, r), kTol, "fc2 input gradient");
    Tensor dx = fc1.backward(ctx, dy1);
    require_close(dx, cc.sequence_parallel ? chunk(dX, 0, tpn, r) : dX, kTol, "input gradient");
  }
  ly::allreduce_sequence_parallel_grads(tp, fc2.parameters());
  auto twice = [](const Tensor& t) {
    Tensor c = t.clone();
    for (int64_t i = 0; i < c.numel(); ++i) c.data<float>()[i] *= 2;
    return c;
  };
  // Gathered weight gradients equal the full ones.
  require_close(all_gather_along(tp, fc1.weight().main_grad, 0), twice(dW1), kTol, "fc1 weight grad (gathered)");
  require_close(all_gather_along(tp, fc2.weight().main_grad, -1), twice(dW2), kTol, "fc2 weight grad (gathered)");
  if (cc.bias) {
    require_close(all_gather_along(tp, fc1.bias().main_grad, 0), twice(dB1), kTol, "fc1 bias grad (gathered)");
    REQUIRE(fc2.bias().sequence_parallel == cc.sequence_parallel);
    require_close(fc2.bias().main_grad, twice(dB2), kTol, "fc2 bias grad");
  }
  fc1.zero_grad();
  REQUIRE(fc1.weight().main_grad.to_double_vector() == std::vector<double>(size_t(f / tpn * h), 0.0));
}

}  // namespace

TEST_CASE("column → row parallel linear chain equals the single-rank computation", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (bool sp : {false, true})
      for (bool bias : {false, true}) run_chain(grid.tp(), {sp, bias, false});
    run_chain(grid.tp(), {false, true, true});   // gather_output → full-input row layer
    run_chain(grid.tp(), {false, false, true});
  }
}

TEST_CASE("parallel linear shape errors under TP name the fix on every rank", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    INFO("TP " << tpn);
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    comm::Communicator& tp = grid.tp();
    ly::ColumnParallelLinear col(tp, 8, 8, {.sequence_parallel = true});
    ly::ForwardContext ctx;
    // Sequence chunks gather to a full sequence; the row layer's reduce-scatter needs s % TP == 0.
    ly::RowParallelLinear row(tp, 8, 8, {.input_is_parallel = true, .sequence_parallel = true});
    REQUIRE_THROWS_WITH(row.forward(ctx, randn({tpn + 1, 1, 8 / tpn}, 5)),
                        Catch::Contains("make the sequence length a multiple of TP"));
    REQUIRE_THROWS_WITH(col.forward(ctx, randn({2, 8}, 5).view({16})),
                        Catch::Contains("its last dimension must be 8"));
    REQUIRE_THROWS_WITH(col.forward(ctx, randn({4, 8}, 5).view({4, 8}).select(0, 0)),
                        Catch::Contains("must be [s/TP, ..., features]"));
    REQUIRE_THROWS_WITH(ly::RowParallelLinear(tp, 8 * tpn + 1, 8), Catch::Contains("make in_features a multiple of"));
    // The world is still usable: nobody is stuck in a collective.
    Tensor t = Tensor::full({1}, 1.0);
    tp.all_reduce(t)->wait();
    REQUIRE(t.item() == double(tpn));
  }
}

namespace {

// One seed for every rank of `world`, fresh per run (printed on failure).
uint64_t shared_fresh_seed(comm::Communicator& world) {
  std::random_device rd;
  return uint64_t(comm::all_reduce_value<int64_t>(world, world.rank() == 0 ? int64_t(rd() % 1000000) : 0));
}

// overlap_sp_forward against the serial SP layers, on fresh random inputs and non-zero biases: the column
// layer's output (and, the backward being the serial one, its gradients) bit-identical; the row layer's
// output within `row_tol` of the serial one (its partial sums are added in ring order) and, in f32, of
// the single-rank reference.
void check_sp_forward_overlap(comm::Communicator& tp, DType dt, bool bias, int64_t s, uint64_t seed) {
  const int tpn = tp.size(), r = tp.rank();
  const int64_t b = 3, h = 24, f = 32;
  INFO("TP " << tpn << " " << dtype_name(dt) << " bias " << bias << " s " << s << " seed " << seed);
  auto col = [&](bool ov) {
    return ly::ColumnParallelLinear(tp, h, f, {.bias = bias, .sequence_parallel = true, .params_dtype = dt,
                                               .init_std = 0.5, .seed = seed, .init_offset = 1,
                                               .overlap_sp_forward = ov});
  };
  auto row = [&](bool ov) {
    return ly::RowParallelLinear(tp, f, h, {.bias = bias, .input_is_parallel = true, .sequence_parallel = true,
                                            .params_dtype = dt, .init_std = 0.5, .seed = seed, .init_offset = 2,
                                            .overlap_sp_forward = ov});
  };
  ly::ColumnParallelLinear c0 = col(false), c1 = col(true);
  ly::RowParallelLinear r0 = row(false), r1 = row(true);
  const Tensor B1 = randn({f}, 5, seed).to(dt), B2 = randn({h}, 6, seed).to(dt);
  if (bias) {
    for (ly::ColumnParallelLinear* c : {&c0, &c1}) c->bias().data.copy_(chunk(B1, 0, tpn, r));
    for (ly::RowParallelLinear* w : {&r0, &r1}) w->bias().data.copy_(B2);
  }
  const Tensor X = randn({s, b, h}, 7, seed).to(dt), G1 = randn({s, b, f}, 8, seed).to(dt);
  const Tensor Xr = randn({s, b, f}, 9, seed).to(dt);
  ly::ForwardContext ctx;

  // Column: same output bits, then the same input and parameter gradients.
  const Tensor x = chunk(X, 0, tpn, r), g1 = chunk(G1, -1, tpn, r);
  const Tensor y0 = c0.forward(ctx, x), y1 = c1.forward(ctx, x);
  REQUIRE(y1.shape() == Shape{s, b, f / tpn});
  require_equal(y1, y0, "column output (overlapped vs serial)");
  require_equal(c1.backward(ctx, g1), c0.backward(ctx, g1), "column input gradient");
  require_equal(c1.weight().main_grad, c0.weight().main_grad, "column weight gradient");
  if (bias) require_equal(c1.bias().main_grad, c0.bias().main_grad, "column bias gradient");

  // Row: the ring's sum against the collective's, and against the full product.
  const Tensor xr = chunk(Xr, -1, tpn, r);
  const Tensor z0 = r0.forward(ctx, xr), z1 = r1.forward(ctx, xr);
  REQUIRE(z1.shape() == Shape{s / tpn, b, h});
  const double row_tol = dt == DType::F32 ? 1e-6 : 1e-2;
  if (tpn == 2 && dt == DType::F32) require_equal(z1, z0, "row output at TP 2 (a two-term sum)");
  else require_close(z1.to(DType::F32), z0.to(DType::F32), row_tol, "row output (overlapped vs serial)");
  if (dt == DType::F32) {
    const Tensor Z = ref_linear(Xr, ly::init_full_weight(h, f, 0.5, seed, 2), bias ? B2 : Tensor());
    require_close(z1, chunk(Z, 0, tpn, r), kTol, "row output (overlapped vs single-rank reference)");
  }
  const Tensor dz = chunk(randn({s, b, h}, 10, seed).to(dt), 0, tpn, r);
  require_equal(r1.backward(ctx, dz), r0.backward(ctx, dz), "row input gradient");
  require_equal(r1.weight().main_grad, r0.weight().main_grad, "row weight gradient");
}

}  // namespace

TEST_CASE("overlapped sequence-parallel forward of the parallel linears equals the serial one", "[layers][mpi]") {
  auto world = world_comm();
  const uint64_t seed = shared_fresh_seed(*world);
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (DType dt : {DType::F32, DType::BF16})
      for (bool bias : {false, true})
        for (int64_t s : {int64_t(2) * tpn, int64_t(4) * tpn}) check_sp_forward_overlap(grid.tp(), dt, bias, s, seed);
  }
  // With FP8 the layers keep the serial forward: the same bits as the serial FP8 layers (the ring would skip
  // the FP8 cast and give other numbers).
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    comm::Communicator& tp = grid.tp();
    const int64_t s = 16, b = 2, h = 64, f = 128;
    std::vector<Tensor> outs;
    for (bool ov : {false, true}) {
      ly::ColumnParallelLinear fc1(tp, h, f, {.bias = false, .sequence_parallel = true, .params_dtype = DType::BF16,
                                              .init_std = 0.1, .seed = seed, .init_offset = 1, .overlap_sp_forward = ov});
      ly::RowParallelLinear fc2(tp, f, h, {.bias = true, .input_is_parallel = true, .sequence_parallel = true,
                                           .params_dtype = DType::BF16, .init_std = 0.1, .seed = seed, .init_offset = 2,
                                           .overlap_sp_forward = ov});
      ly::Fp8Recipe rec;
      rec.scaling = ly::Fp8Scaling::Current;
      REQUIRE(fc1.enable_fp8(rec, "fc1"));
      REQUIRE(fc2.enable_fp8(rec, "fc2"));
      fc1.fp8_begin_step();
      fc2.fp8_begin_step();
      ly::ForwardContext ctx;
      const Tensor x = chunk(randn({s, b, h}, 11, seed).to(DType::BF16), 0, tpn, tp.rank());
      outs.push_back(fc2.forward(ctx, fc1.forward(ctx, x)));
    }
    INFO("FP8, TP " << tpn << " seed " << seed);
    require_equal(outs[1], outs[0], "FP8 layers with overlap_sp_forward (serial forward)");
  }
  // A constructor refuses the option without sequence parallelism.
  comm::Communicator& self = *world;
  REQUIRE_THROWS_WITH(ly::ColumnParallelLinear(self, 8, 8 * self.size(), {.overlap_sp_forward = true}),
                      Catch::Contains("needs sequence_parallel"));
  REQUIRE_THROWS_WITH(ly::RowParallelLinear(self, 8 * self.size(), 8, {.input_is_parallel = true, .overlap_sp_forward = true}),
                      Catch::Contains("needs sequence_parallel"));
}
