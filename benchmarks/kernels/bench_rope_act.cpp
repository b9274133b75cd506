// RoPE (Llama-3 8B heads), SwiGLU and GELU, bf16.
#include "kernels/bench_memops_util.hpp"
#include "megacore/ops/activation.hpp"
#include "megacore/ops/rope.hpp"

using namespace megacore;

MC_BENCHMARK("rope", 30) {
  const Device d = Device::cuda(0);
  const int64_t t = 16384, heads = 32, hd = 128;
  const std::string shape = std::to_string(t) + "x" + std::to_string(heads) + "x" + std::to_string(hd);
  Tensor x = mcbench::dev_randn({t, heads, hd}, DType::BF16, 5), y = Tensor::empty({t, heads, hd}, DType::BF16, d);
  std::vector<int32_t> pv(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) pv[size_t(i)] = int32_t(i % 4096);
  Tensor pos = Tensor::from_vector(pv, {t}).to(d);
  ops::RopeConfig cfg;
  cfg.rotary_dim = hd;
  cfg.theta = 500000;
  cfg.scaling.type = ops::RopeScaling::Type::Llama3;
  Tensor inv = ops::rope_inv_freq(cfg, d);
  const double bytes = 2.0 * double(t * heads * hd) * 2;
  const int smp = mcbench::bench_samples(ctx);
  double ms = mcbench::time_ms([&] { ops::rope_forward(x, pos, inv, y, false); }, 3, smp);
  mcbench::record_bw(ctx, "rope_fwd", shape, "bf16", ms, bytes);
  ms = mcbench::time_ms([&] { ops::rope_backward(x, pos, inv, y, false); }, 3, smp);
  mcbench::record_bw(ctx, "rope_bwd", shape, "bf16", ms, bytes);
}

MC_BENCHMARK("activation", 40) {
  const Device d = Device::cuda(0);
  const int64_t n = 16384, f = ctx.quick ? 8192 : 14336;
  const std::string shape = std::to_string(n) + "x" + std::to_string(f);
  const int smp = mcbench::bench_samples(ctx);
  {
    Tensor x = mcbench::dev_randn({n, 2 * f}, DType::BF16, 6), y = Tensor::empty({n, f}, DType::BF16, d);
    Tensor dy = mcbench::dev_randn({n, f}, DType::BF16, 7), dx = Tensor::empty({n, 2 * f}, DType::BF16, d);
    const double unit = double(n) * double(f) * 2;
    double ms = mcbench::time_ms([&] { ops::swiglu_forward(x, y); }, 3, smp);
    mcbench::record_bw(ctx, "swiglu_fwd", shape, "bf16", ms, 3 * unit);
    ms = mcbench::time_ms([&] { ops::swiglu_backward(dy, x, dx); }, 3, smp);
    mcbench::record_bw(ctx, "swiglu_bwd", shape, "bf16", ms, 5 * unit);
  }
  {
    Tensor x = mcbench::dev_randn({n, f}, DType::BF16, 8), y = Tensor::empty({n, f}, DType::BF16, d);
    Tensor dy = mcbench::dev_randn({n, f}, DType::BF16, 9);
    const double unit = double(n) * double(f) * 2;
    double ms = mcbench::time_ms([&] { ops::gelu_forward(x, y, true); }, 3, smp);
    mcbench::record_bw(ctx, "gelu_tanh_fwd", shape, "bf16", ms, 2 * unit);
    ms = mcbench::time_ms([&] { ops::gelu_backward(dy, x, y, true); }, 3, smp);
    mcbench::record_bw(ctx, "gelu_tanh_bwd", shape, "bf16", ms, 3 * unit);
  }
}
