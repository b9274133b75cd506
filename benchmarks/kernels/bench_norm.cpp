// RMSNorm / LayerNorm forward and backward, bf16, tokens x hidden. After the library's default
// (through the public ops), each launch-shape variant of ops::cuda::NormTuning is timed through the
// kernels' internal interface, so one run on a card shows which shape to make the default there.
#include <functional>
#include <string>
#include <vector>

#include "kernels/bench_memops_util.hpp"
#include "megacore/ops/norm.hpp"
#include "ops/cuda/norm_cuda.hpp"

using namespace megacore;

namespace {

using NormTuning = ops::cuda::NormTuning;

// Alternatives to the default (fwd 8 vectors/thread, 128-thread minimum block; bwd without prefetch, 4
// vectors, dw/db sums in shared memory, 512-thread blocks with one partial row each, 16-byte finalize; at
// most 1024 backward threads per SM), each spelled out.
std::vector<mcbench::Variant<NormTuning>> norm_variants() {
  return {
      // register sums (4 vectors RMSNorm, 2 LayerNorm), scalar finalize
      {"f8_breg_scal", NormTuning{.bwd_smem_acc = false, .bwd_finalize = 0}},
      // register sums with the 16-byte finalize
      {"f8_breg_fin", NormTuning{.bwd_smem_acc = false}},
      {"f8_b2_reg_fin", NormTuning{.bwd_vecs = 2, .bwd_smem_acc = false}},
      // shared-memory sums with the scalar finalize
      {"f8_b4_sacc_scal", NormTuning{.bwd_finalize = 0}},
      // shared-memory sums, other vector counts
      {"f8_b2_sacc_fin", NormTuning{.bwd_vecs = 2}},
      {"f8_b2pf_sacc_fin", NormTuning{.bwd_vecs = 2, .bwd_prefetch = true}},
      // larger forward blocks (min_block; the backward keeps its 512-thread default), and the
      // backward without the 1024-thread cap or with 768
      {"f8_b4_m256_sacc_fin", NormTuning{.min_block = 256}},
      {"f8_b4_m512_sacc_fin", NormTuning{.min_block = 512}},
      {"f8_b4_m256_sacc_fin_occ", NormTuning{.min_block = 256, .bwd_threads_per_sm = 0}},
      {"f8_b4_sacc_fin_768", NormTuning{.bwd_threads_per_sm = 768}},
      {"f4_b4_sacc_fin", NormTuning{.fwd_vecs = 4}},
      // 4 backward vectors and 128-thread blocks for both norms
      {"f8_b4_sacc_fin_m128", NormTuning{.bwd_vecs = 4, .bwd_min_block = 128}},
      // LayerNorm 256-thread backward blocks; RMSNorm 2 vectors at h <= 2048
      // (128-thread blocks at 2048), else row f8_b4_sacc_fin_m128
      {"bm256_b4", NormTuning{.bwd_vecs = 4, .bwd_min_block = 256}},
      {"bm128_b2", NormTuning{.bwd_vecs = 2, .bwd_min_block = 128}},
      {"bm512_b2", NormTuning{.bwd_vecs = 2, .bwd_min_block = 512}},
      // the finalize launched after the backward completes (no programmatic dependent launch)
      {"no_pdl", NormTuning{.bwd_pdl = false}},
  };
}

std::string describe(const ops::cuda::NormTuning& t) {
  return "fwd_vecs=" + std::to_string(t.fwd_vecs) + " bwd_vecs=" + std::to_string(t.bwd_vecs) +
         " bwd_prefetch=" + std::to_string(int(t.bwd_prefetch)) + " min_block=" + std::to_string(t.min_block) +
         " bwd_min_block=" + std::to_string(t.bwd_min_block) +
         " bwd_threads_per_sm=" + std::to_string(t.bwd_threads_per_sm) +
         " bwd_smem_acc=" + std::to_string(int(t.bwd_smem_acc)) +
         " bwd_finalize=" + std::to_string(t.bwd_finalize) + " bwd_pdl=" + std::to_string(int(t.bwd_pdl));
}

}  // namespace

MC_BENCHMARK("norm", 20) {
  std::vector<std::pair<int64_t, int64_t>> shapes{{16384, 4096}, {16384, 8192}, {32768, 2048}};
  if (ctx.quick) shapes = {{16384, 4096}};
  for (auto [n, h] : shapes) {
    const std::string shape = std::to_string(n) + "x" + std::to_string(h);
    const Device d = Device::cuda(0);
    Tensor x = mcbench::dev_randn({n, h}, DType::BF16, 1), dy = mcbench::dev_randn({n, h}, DType::BF16, 2);
    Tensor w = mcbench::dev_randn({h}, DType::BF16, 3, 0.1), b = mcbench::dev_randn({h}, DType::BF16, 4, 0.1);
    Tensor y = Tensor::empty({n, h}, DType::BF16, d), dx = Tensor::empty({n, h}, DType::BF16, d);
    Tensor mean = Tensor::empty({n}, DType::F32, d), rstd = Tensor::empty({n}, DType::F32, d);
    Tensor dw = Tensor::empty({h}, DType::F32, d), db = Tensor::empty({h}, DType::F32, d);
    const double act = double(n) * double(h) * 2;  // one bf16 activation tensor
    const int smp = mcbench::bench_samples(ctx);
    const std::string def = ctx.variants ? "default" : "";
    const std::string def_t = ctx.variants ? describe(ops::cuda::NormTuning{}) : "";
    // The public ops, timed in two rounds (before and after the variants, best taken) like the GEMM
    // benchmark, so the first timing of a shape is not the only one.
    const std::vector<std::pair<const char*, std::function<void()>>> ops_pub{
        {"rmsnorm_fwd", [&] { ops::rmsnorm_forward(x, w, y, rstd, 1e-5f); }},
        {"rmsnorm_bwd", [&] { ops::rmsnorm_backward(dy, x, w, rstd, dx, dw); }},
        {"layernorm_fwd", [&] { ops::layernorm_forward(x, w, b, y, mean, rstd, 1e-5f); }},
        {"layernorm_bwd", [&] { ops::layernorm_backward(dy, x, w, mean, rstd, dx, dw, db); }}};
    std::vector<double> first;
    for (const auto& [name, fn] : ops_pub) first.push_back(mcbench::time_ms(fn, 3, smp));
    auto record_public = [&] {
      for (size_t i = 0; i < ops_pub.size(); ++i) {
        const double again = ctx.variants ? mcbench::time_ms(ops_pub[i].second, 3, smp) : first[i];
        const bool bwd = std::string(ops_pub[i].first).ends_with("_bwd");
        mcbench::record_bw(ctx, ops_pub[i].first, shape, "bf16", std::min(first[i], again), (bwd ? 3 : 2) * act, def,
                           def_t);
      }
    };
    if (!ctx.variants) {
      record_public();
      continue;
    }

    // The same calls the public ops make, with the variant's tuning (default stream, device 0).
    for (const auto& v : norm_variants()) {
      for (bool layer : {false, true}) {
        ops::cuda::NormForwardArgs f;
        f.layer = layer;
        f.x = x.data_ptr();
        f.w = w.data_ptr();
        f.b = layer ? b.data_ptr() : nullptr;
        f.y = y.data_ptr();
        f.mean = layer ? mean.data<float>() : nullptr;
        f.rstd = rstd.data<float>();
        f.rows = n;
        f.h = h;
        f.eps = 1e-5f;
        f.tuning = v.t;
        ops::cuda::NormBackwardArgs g;
        g.layer = layer;
        g.dy = dy.data_ptr();
        g.x = x.data_ptr();
        g.w = w.data_ptr();
        g.mean = f.mean;
        g.rstd = f.rstd;
        g.dx = dx.data_ptr();
        g.dw = dw.data_ptr();
        g.dw_dtype = DType::F32;
        g.db = layer ? db.data_ptr() : nullptr;
        g.db_dtype = DType::F32;
        g.rows = n;
        g.h = h;
        g.tuning = v.t;
        const size_t ws_bytes = ops::cuda::norm_backward_workspace_bytes(g, DType::BF16, 0);
        Tensor ws = Tensor::empty({int64_t(ws_bytes / 4 + 1)}, DType::F32, d);
        const std::string name = layer ? "layernorm" : "rmsnorm";
        double ms = mcbench::time_ms([&] { ops::cuda::norm_forward(DType::BF16, f, 0, nullptr); }, 3, smp);
        mcbench::record_bw(ctx, name + "_fwd", shape, "bf16", ms, 2 * act, v.name, describe(v.t));
        ms = mcbench::time_ms([&] { ops::cuda::norm_backward(DType::BF16, g, ws.data_ptr(), 0, nullptr); }, 3, smp);
        mcbench::record_bw(ctx, name + "_bwd", shape, "bf16", ms, 3 * act, v.name, describe(v.t));
      }
    }
    record_public();
  }
}
