// FP8 (emulated on CPU) column → row parallel linear chain under mpirun: with TP = 2 and 4 the layers use
// the same scales as with TP = 1 (the amaxes are reduced over the TP group), so the FP8 codes are the same
// and the results differ from TP = 1 only by where the partial sums are rounded. All three GEMMs run in FP8
// (the weight gradients too). A second case checks the amax reduction over TP × DP: one all-reduce per step
// for all layers, after which every rank holds the scales of the max over all ranks' amaxes. With SP, keeping the
// gathered input's FP8 codes from forward (Fp8Recipe::keep_gathered_input) gives the same bits as re-gathering.
//
// Tolerances: the row layer's TP partial outputs are bf16 and all-reduced in bf16, so the outputs, input
// gradients and weight gradients (their shards of TP = 1's) agree with TP = 1 to a relative error
// (||a - b|| / ||b||) of 2e-2 (measured at most 3.6e-3 on 4 ranks for the outputs); the scales agree exactly. Against the unquantised bf16 chain FP8 stays within 0.15 (measured at most
// 0.086): E4M3 rounds each operand by up to 2^-4 relative and E5M2 (the gradients) by up to 2^-3, and the input
// gradient passes two FP8 products.
#include <algorithm>
#include <set>

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
  Tensor dw1, dw2;                          // this rank's weight gradient shards, summed over the steps (f32)
};

ChainResult run(comm::Communicator& tp, ly::Fp8Scaling scaling, bool sp, bool fp8, int steps,
                bool keep_gathered = false) {
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
    rec.keep_gathered_input = keep_gathered;
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
  out.dw1 = fc1.weight().main_grad.clone();
  out.dw2 = fc2.weight().main_grad.clone();
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
      require_close(ref.dw1, bf16.dw1, kVsBf16, "fp8 fc1 weight gradient vs bf16");
      require_close(ref.dw2, bf16.dw2, kVsBf16, "fp8 fc2 weight gradient vs bf16");
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
        const int r = grid.tp().rank();
        require_close(got.dw1, chunk(ref.dw1, 0, tpn, r), kVsTp1, "fc1 weight gradient vs TP 1's rows");
        require_close(got.dw2, chunk(ref.dw2, 1, tpn, r), kVsTp1, "fc2 weight gradient vs TP 1's columns");
        if (sp) {
          // Keeping the gathered input's FP8 codes from forward instead of re-gathering and re-casting the bf16
          // chunk in backward: the same codes and scales, so the same bits.
          const ChainResult kept = run(grid.tp(), scaling, sp, true, steps, /*keep_gathered=*/true);
          REQUIRE(kept.scales == got.scales);
          for (int step = 0; step < steps; ++step) {
            REQUIRE(kept.y[size_t(step)].to_double_vector() == got.y[size_t(step)].to_double_vector());
            REQUIRE(kept.dx[size_t(step)].to_double_vector() == got.dx[size_t(step)].to_double_vector());
          }
          REQUIRE(kept.dw1.to_double_vector() == got.dw1.to_double_vector());
          REQUIRE(kept.dw2.to_double_vector() == got.dw2.to_double_vector());
        }
      }
    }
  }
}

TEST_CASE("fp8 delayed scaling over TP x DP: one all-reduce per step, every rank gets the max over ranks' amaxes",
          "[layers][mpi][fp8]") {
  auto world = world_comm();
  const int n = world->size();
  for (int tpn : tp_sizes_for(n)) {
    if (n / tpn < 2) continue;  // needs data parallelism
    INFO("TP " << tpn << " DP " << n / tpn);
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp, GroupKind::TpDpCp});
    comm::Communicator& tp = grid.tp();
    comm::Communicator& stage = grid.group(GroupKind::TpDpCp);
    REQUIRE(stage.size() == n);
    const int64_t s = 16, b = 2, h = 64, f = 128;
    ly::ColumnParallelLinear fc1(tp, h, f, {.bias = false, .params_dtype = DType::BF16, .init_std = 0.1, .seed = 5});
    ly::RowParallelLinear fc2(tp, f, h,
                              {.bias = false, .input_is_parallel = true, .params_dtype = DType::BF16, .init_std = 0.1,
                               .seed = 5, .init_offset = 1});
    ly::Fp8Recipe rec;
    rec.amax_history_len = 4;
    REQUIRE(fc1.enable_fp8(rec, "fc1"));
    REQUIRE(fc2.enable_fp8(rec, "fc2"));
    const std::vector<ly::Fp8LinearState*> states{fc1.fp8(), fc2.fp8()};
    ly::fp8_begin_step(states, stage);
    // Each data-parallel replica (the ranks of one TP group share it) sees its own data, of its own size.
    const int dp = world->rank() / tpn;
    const double k = 1.0 + dp;
    Tensor X = scaled(randn({s, b, h}, 300 + uint64_t(dp)), k).to(DType::BF16);
    Tensor G = scaled(randn({s, b, h}, 400 + uint64_t(dp)), 0.1 * k).to(DType::BF16);
    ly::ForwardContext ctx;
    fc1.backward(ctx, fc2.backward(ctx, fc2.forward(ctx, fc1.forward(ctx, X))));
    // Every rank's unreduced amaxes, then the expected scales from their max over all ranks.
    Tensor local = Tensor::empty({6}, DType::F32);
    local.narrow(0, 0, 3).copy_(fc1.fp8()->amax_row());
    local.narrow(0, 3, 3).copy_(fc2.fp8()->amax_row());
    Tensor all = Tensor::empty({int64_t(n) * 6}, DType::F32);
    world->all_gather(local, all)->wait();
    const std::vector<double> a = all.to_double_vector();
    std::vector<float> want(6, 0.f);
    std::set<double> input_amaxes;
    for (int q = 0; q < n; ++q) {
      input_amaxes.insert(a[size_t(q * 6)]);
      for (int j = 0; j < 6; ++j) want[size_t(j)] = std::max(want[size_t(j)], float(a[size_t(q * 6 + j)]));
    }
    REQUIRE(input_amaxes.size() >= 2);  // the replicas' amaxes differ: a TP-only reduction would disagree
    const float maxes[3] = {448.f, 448.f, 57344.f};  // input, weight E4M3; output gradient E5M2 (hybrid)
    for (int j = 0; j < 6; ++j) want[size_t(j)] = maxes[j % 3] / want[size_t(j)];

    const uint64_t before = stage.flight_recorder()->snapshot().collectives;
    const uint64_t tp_before = tp.flight_recorder()->snapshot().collectives;
    ly::fp8_begin_step(states, stage);
    CHECK(stage.flight_recorder()->snapshot().collectives - before == 1);  // both layers' amaxes at once
    CHECK(tp.flight_recorder()->snapshot().collectives - tp_before == 0);
    std::vector<double> got;
    for (ly::Fp8LinearState* st : states)
      for (auto& [name, t] : st->state())
        if (name == "scale") for (double v : t.to_double_vector()) got.push_back(v);
    REQUIRE(got.size() == 6);
    for (int j = 0; j < 6; ++j) CHECK(got[size_t(j)] == double(want[size_t(j)]));
    // And the same on every rank, bit for bit.
    Tensor mine = Tensor::from_vector<float>(std::vector<float>(got.begin(), got.end()), {6});
    Tensor everyone = Tensor::empty({int64_t(n) * 6}, DType::F32);
    world->all_gather(mine, everyone)->wait();
    const std::vector<double> e = everyone.to_double_vector();
    for (int q = 1; q < n; ++q)
      for (int j = 0; j < 6; ++j) CHECK(e[size_t(q * 6 + j)] == e[size_t(j)]);
  }
}
