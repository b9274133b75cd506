// Fused softmax cross-entropy forward + backward (gradient written over the logits), bf16.
#include "kernels/bench_memops_util.hpp"
#include "megacore/ops/cross_entropy.hpp"

using namespace megacore;

MC_BENCHMARK("cross_entropy", 50) {
  const Device d = Device::cuda(0);
  std::vector<std::pair<int64_t, int64_t>> shapes{{8192, 32000}, {8192, 128256}};
  if (ctx.quick) shapes = {{8192, 32000}};
  for (auto [n, v] : shapes) {
    const std::string shape = std::to_string(n) + "x" + std::to_string(v);
    Tensor z = mcbench::dev_randn({n, v}, DType::BF16, 10, 2.0);
    std::vector<int64_t> lv(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) lv[size_t(i)] = (i * 7919) % v;
    Tensor labels = Tensor::from_vector(lv, {n}).to(d);
    Tensor loss = Tensor::empty({n}, DType::F32, d), lse = Tensor::empty({n}, DType::F32, d);
    Tensor dz = Tensor::empty({n, v}, DType::BF16, d);
    // Out of place, so every timed run sees the same logits; in place moves the same bytes.
    const double ms = mcbench::time_ms([&] { ops::cross_entropy_fused(z, labels, loss, lse, dz, 1.f / float(n)); }, 3,
                                       mcbench::bench_samples(ctx));
    mcbench::record_bw(ctx, "cross_entropy_fwd_bwd", shape, "bf16", ms, 2.0 * double(n) * double(v) * 2);
  }
}
