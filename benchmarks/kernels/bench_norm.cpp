// RMSNorm / LayerNorm forward and backward, bf16, tokens x hidden.
#include "kernels/bench_memops_util.hpp"
#include "megacore/ops/norm.hpp"

using namespace megacore;

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
    double ms = mcbench::time_ms([&] { ops::rmsnorm_forward(x, w, y, rstd, 1e-5f); }, 3, smp);
    mcbench::record_bw(ctx, "rmsnorm_fwd", shape, "bf16", ms, 2 * act);
    ms = mcbench::time_ms([&] { ops::rmsnorm_backward(dy, x, w, rstd, dx, dw); }, 3, smp);
    mcbench::record_bw(ctx, "rmsnorm_bwd", shape, "bf16", ms, 3 * act);
    ms = mcbench::time_ms([&] { ops::layernorm_forward(x, w, b, y, mean, rstd, 1e-5f); }, 3, smp);
    mcbench::record_bw(ctx, "layernorm_fwd", shape, "bf16", ms, 2 * act);
    ms = mcbench::time_ms([&] { ops::layernorm_backward(dy, x, w, mean, rstd, dx, dw, db); }, 3, smp);
    mcbench::record_bw(ctx, "layernorm_bwd", shape, "bf16", ms, 3 * act);
  }
}
