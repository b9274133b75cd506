// FP8 (emulated on CPU) column → row parallel linear chain under mpirun: with TP = 2 and 4 the layers use
// the same scales as with TP = 1 (the amaxes are reduced over the TP group), so the FP8 codes are the same
// and the results differ from TP = 1 only by where the partial sums are rounded.
//
// Tolerances: the row layer's TP partial outputs are bf16 and all-reduced in bf16, so the outputs and input
// gradients agree with TP = 1 to a relative error (||a - b|| / ||b||) of 2e-2 (measured at most 3.6e-3 on 4
// ranks); the scales agree exactly. Against the unquantised bf16 chain FP8 stays within 0.15 (measured at most
// 0.086): E4M3 rounds each operand by up to 2^-4 relative and E5M2 (the gradients) by up to 2^-3, and the input
// gradient passes two FP8 products.
#include "layers/layers_test_util.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/layers/fp8.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/parallel/process_grid.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;

namespace {

constexpr double kVsTp1 = 2e-2, kVsBf16 = 0.15;

struct ChainResult {
  std::vector<Tensor> y, dx;             // per step: full output and input gradient (f32)
  std::vector<std::vector<double>> scales;  // per step, after begin_step: fc1's and fc2's scales
};

ChainResult run(comm::Communicator& tp, ly::Fp8Scaling scaling, bool sp, bool fp8, int steps) {
  const int tpn = tp.size(), r = tp.rank();
  const int64_t s = 16, b = 2, h = 64, f = 128;
  ly::ColumnParallelLinear fc1(tp, h, f,
                               {.bias = false, .sequence_parallel = sp, .params_dtype = DType::BF16, .init_std = 0.1,
                                .seed = 91, .init_offset = 1});
  ly::RowParallelLinear fc2(tp, f, h,
                            {.bias = true, .input_is_parallel = true, .sequence_parallel = sp,
                             .params_dtype = DType::BF16, .init_std = 0.1, .seed = 91, .init_offset = 2});
  if (fp8) {
    ly::Fp8Recipe rec;
    rec.scaling = scaling;
    rec.amax_history_len = 4;
    rec.margin = 1;  // headroom for the inputs growing from step to step (delayed scales trail them)
    REQUIRE(fc1.enable_fp8(rec, "fc1"));
    REQUIRE(fc2.enable_fp8(rec, "fc2"));
  }
  ChainResult out;
  ly::ForwardContext ctx;
  for (int step = 0; step < steps; ++step) {
    fc1.fp8_begin_step();
    fc2.fp8_begin_step();
    if (fp8) {
      std::vector<double> sc;
      for (ly::ParallelLinearBase* l : {static_cast<ly::ParallelLinearBase*>(&fc1), static_cast<ly::ParallelLinearBase*>(&fc2)})
        for (auto& [n, t] : l->fp8()->state())
          if (n == "scale") for (double v : t.to_double_vector()) sc.push_back(v);
      out.scales.push_back(sc);
    }
    // Each step's inputs grow by 10 %, so the scales move from step to step.
    const double k = 1.0 + 0.1 * step;
    Tensor X = scaled(randn({s, b, h}, 100 + step), k).to(DType::BF16), G = scaled(randn({s, b, h}, 200 + step), 3 * k).to(DType::BF16);
    Tensor y = fc2.forward(ctx, fc1.forward(ctx, sp ? chunk(X, 0, tpn, r) : X));
    Tensor dx = fc1.backward(ctx, fc2.backward(ctx, sp ? chunk(G, 0, tpn, r) : G));
    if (sp) {
      y = all_gather_from_sp_forward(tp, y.contiguous(), {});
      dx = all_gather_from_sp_forward(tp, dx.contiguous(), {});
    }
    out.y.push_back(y.to(DType::F32));
    out.dx.push_back(dx.to(DType::F32));
  }
  return out;
}

}  // namespace

TEST_CASE("fp8 linear chain: TP = 2/4 uses TP = 1's scales and matches it; close to bf16", "[layers][mpi][fp8]") {
  auto world = world_comm();
  ProcessGrid one(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (ly::Fp8Scaling scaling : {ly::Fp8Scaling::Delayed, ly::Fp8Scaling::Current}) {
    for (bool sp : {false, true}) {
      INFO("scaling " << ly::fp8_scaling_name(scaling) << " SP " << sp);
      const int steps = 4;
      const ChainResult ref = run(one.tp(), scaling, false, true, steps);
      const ChainResult bf16 = run(one.tp(), scaling, false, false, steps);
      for (int step = 0; step < steps; ++step) {
        require_close(ref.y[size_t(step)], bf16.y[size_t(step)], kVsBf16, "fp8 output vs bf16");
        require_close(ref.dx[size_t(step)], bf16.dx[size_t(step)], kVsBf16, "fp8 input gradient vs bf16");
      }
      if (scaling == ly::Fp8Scaling::Delayed) REQUIRE(ref.scales.back() != ref.scales.front());  // scales moved
      for (int tpn : tp_sizes_for(world->size())) {
        if (tpn == 1) continue;
        INFO("TP " << tpn);
        ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
        const ChainResult got = run(grid.tp(), scaling, sp, true, steps);
        REQUIRE(got.scales == ref.scales);
        for (int step = 0; step < steps; ++step) {
          require_close(got.y[size_t(step)], ref.y[size_t(step)], kVsTp1, "output vs TP 1");
          require_close(got.dx[size_t(step)], ref.dx[size_t(step)], kVsTp1, "input gradient vs TP 1");
        }
      }
    }
  }
}
