// GEMM through megacore (cuBLASLt, cached plan, timed choice among the heuristic's candidates: see
// ops::GemmAutotune) against plain cuBLAS (cublasGemmEx, default algorithm selection) on the same data,
// at the shapes of a Llama-style layer (8k tokens). With variants on, the heuristic's first choice
// (autotuning off) is timed too.
// (A .cpp, not a .cu: it has no device code, and .cu files build as C++17 while the headers need C++20.)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "kernels/bench.hpp"
#include "kernels/bench_memops_util.hpp"
#include "megacore/megacore.hpp"
#include "ops/cuda/gemm_cuda.hpp"

using namespace megacore;

namespace {

struct Shape3 {
  const char* name;
  int64_t m, n, k;
  bool ta, tb;
  bool f32_accumulate;  // bf16 inputs, f32 output with beta = 1 (gradient accumulation)
};

void cublas_ok(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(int(s)));
}

Tensor dev_rand(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::BF16, Device::cuda(0));
  Generator g(seed, 0);
  t.normal_(g, 0.0, 1.0);
  return t;
}

}  // namespace

MC_BENCHMARK("gemm", 10) {
  std::vector<Shape3> shapes{
      {"square", 8192, 8192, 8192, false, false, false},
      {"qkv_fwd", 8192, 6144, 4096, false, true, false},    // y = x W^T, GQA 32/8 heads of 128
      {"fc1_fwd", 8192, 28672, 4096, false, true, false},   // SwiGLU gate+up, FFN 14336
      {"fc2_fwd", 8192, 4096, 14336, false, true, false},
      {"fc2_dgrad", 8192, 14336, 4096, false, false, false},  // dX = dY W
      {"fc2_wgrad_acc", 4096, 14336, 8192, true, false, true},  // main_grad += dY^T X (f32)
  };
  if (ctx.quick) shapes.resize(3);
  cublasHandle_t handle;
  cublas_ok(cublasCreate(&handle), "cublasCreate");
  const int samples = ctx.quick ? 10 : 30;
  int64_t retuned_before = ops::cuda::gemm_autotuned_plan_count();
  std::printf("  %-14s %-22s %9s %9s %9s %9s %7s %7s\n", "shape", "m x n x k", "ms", "TFLOP/s", "cublas ms",
              "TFLOP/s", "ratio", "%ceil");
  for (const auto& s : shapes) {
    Tensor a = dev_rand(s.ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, 1);
    Tensor b = dev_rand(s.tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, 2);
    Tensor c = s.f32_accumulate ? Tensor::empty({s.m, s.n}, DType::F32, Device::cuda(0))
                                : Tensor::empty({s.m, s.n}, DType::BF16, Device::cuda(0));
    c.fill_(0.25);
    ops::GemmOptions o;
    o.trans_a = s.ta, o.trans_b = s.tb, o.beta = s.f32_accumulate ? 1.f : 0.f;
    auto ours = [&] { ops::gemm(a, b, c, o); };
    // Plain cuBLAS on the same column-major mapping (C^T = op(b)^T op(a)^T).
    const float alpha = 1.f, beta = o.beta;
    auto peer = [&] {
      cublas_ok(cublasGemmEx(handle, s.tb ? CUBLAS_OP_T : CUBLAS_OP_N, s.ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(s.n),
                             int(s.m), int(s.k), &alpha, b.data_ptr(), CUDA_R_16BF, int(s.tb ? s.k : s.n),
                             a.data_ptr(), CUDA_R_16BF, int(s.ta ? s.m : s.k), &beta, c.data_ptr(),
                             s.f32_accumulate ? CUDA_R_32F : CUDA_R_16BF, int(s.n), CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx");
    };
    // Interleave two rounds of each so that clock drift shows up as spread, not as a difference.
    double t_ours = 1e30, t_peer = 1e30, t_ours2 = 0, t_peer2 = 0;
    t_ours = mcbench::time_ms(ours, 5, samples);
    t_peer = mcbench::time_ms(peer, 5, samples);
    t_ours2 = mcbench::time_ms(ours, 2, samples);
    t_peer2 = mcbench::time_ms(peer, 2, samples);
    const double ms = std::min(t_ours, t_ours2), pms = std::min(t_peer, t_peer2);
    const double flops = 2.0 * double(s.m) * double(s.n) * double(s.k);
    const double tf = flops / (ms * 1e-3) / 1e12, ptf = flops / (pms * 1e-3) / 1e12;
    const std::string shape = std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
    const bool retuned = ops::cuda::gemm_autotuned_plan_count() > retuned_before;
    retuned_before = ops::cuda::gemm_autotuned_plan_count();
    double ms_first = 0;  // the heuristic's first choice (autotuning off), a variant row
    if (ctx.variants) {
      const ops::GemmAutotune saved = ops::gemm_autotune();
      ops::GemmAutotune off = saved;
      off.enabled = false;
      ops::set_gemm_autotune(off);
      ms_first = std::min(mcbench::time_ms(ours, 5, samples), mcbench::time_ms(ours, 2, samples));
      ops::set_gemm_autotune(saved);
    }
    std::printf("  %-14s %-22s %9.4f %9.1f %9.4f %9.1f %6.1f%% %6.1f%%%s\n", s.name, shape.c_str(), ms, tf, pms, ptf,
                100.0 * pms / ms, 100.0 * tf / ctx.gemm_bf16_tflops, retuned ? "  (timed choice)" : "");
    if (ms_first > 0)
      std::printf("  %-14s %-22s %9.4f %9.1f %9s %9s %6.1f%%   [variant] heuristic first choice\n", s.name,
                  shape.c_str(), ms_first, flops / (ms_first * 1e-3) / 1e12, "", "", 100.0 * pms / ms_first);
    ctx.record({{"op", std::string("gemm_") + s.name},
                {"shape", shape},
                {"dtype", s.f32_accumulate ? "bf16->f32 acc" : "bf16"},
                {"ms", ms},
                {"ms_rounds", {t_ours, t_ours2}},
                {"tflops", tf},
                {"flops", flops},
                {"frac_gemm_ceiling", tf / ctx.gemm_bf16_tflops},
                {"peer", "cublasGemmEx"},
                {"peer_ms", pms},
                {"peer_ms_rounds", {t_peer, t_peer2}},
                {"peer_tflops", ptf},
                {"vs_peer", pms / ms},
                {"autotune", ops::gemm_autotune().enabled},
                {"timed_choice_differs", retuned},
                {"card", ctx.card}});
    if (ms_first > 0)
      ctx.record({{"op", std::string("gemm_") + s.name},
                  {"variant", "heuristic first choice (autotune off)"},
                  {"shape", shape},
                  {"ms", ms_first},
                  {"tflops", flops / (ms_first * 1e-3) / 1e12},
                  {"peer", "cublasGemmEx"},
                  {"peer_ms", pms},
                  {"vs_peer", pms / ms_first},
                  {"card", ctx.card}});
  }
  cublasDestroy(handle);
}

// FP8 (ops::gemm_fp8: cuBLASLt E4M3/E5M2 with per-tensor scales) against bf16 (ops::gemm) on the same
// operands, at the linear layers of the reference Llama-1.1B (hidden 2048, GQA 32/8 heads of 64, FFN 8192,
// as benchmarks/training/bench_ddp.cpp) and Llama-3-8B (hidden 4096, GQA 32/8 of 128, FFN 14336) at 8192 tokens. Forward products
// use fast accumulation and E4M3 × E4M3; input-gradient products E5M2 × E4M3 without it (the FP8 layers'
// recipe). The FP8 operands are the bf16 ones cast with scale 1 (values are N(0, 1): no saturation).
MC_BENCHMARK("gemm_fp8", 10) {
  struct Fp8Shape {
    const char* name;
    int64_t m, n, k;
    bool grad;  // dgrad: E5M2 a, no fast accumulation
  };
  std::vector<Fp8Shape> shapes{
      {"1b_qkv_fwd", 8192, 3072, 2048, false},  {"1b_proj_fwd", 8192, 2048, 2048, false},
      {"1b_fc1_fwd", 8192, 16384, 2048, false}, {"1b_fc2_fwd", 8192, 2048, 8192, false},
      {"1b_fc2_dgrad", 8192, 8192, 2048, true}, {"8b_qkv_fwd", 8192, 6144, 4096, false},
      {"8b_proj_fwd", 8192, 4096, 4096, false}, {"8b_fc1_fwd", 8192, 28672, 4096, false},
      {"8b_fc2_fwd", 8192, 4096, 14336, false}, {"8b_fc2_dgrad", 8192, 14336, 4096, true},
  };
  if (ctx.quick) shapes.resize(4);
  const int samples = ctx.quick ? 10 : 30;
  const Device dev = Device::cuda(0);
  std::printf("  %-14s %-20s %9s %9s %9s %9s %8s\n", "shape", "m x n x k", "bf16 ms", "TFLOP/s", "fp8 ms", "TFLOP/s",
              "speedup");
  for (const auto& s : shapes) {
    Tensor a = dev_rand({s.m, s.k}, 1), b = dev_rand({s.n, s.k}, 2);
    Tensor c = Tensor::empty({s.m, s.n}, DType::BF16, dev);
    Tensor one = Tensor::full({1}, 1.0, DType::F32, dev);
    Tensor a8 = Tensor::empty(a.shape(), s.grad ? DType::F8E5M2 : DType::F8E4M3, dev);
    Tensor b8 = Tensor::empty(b.shape(), DType::F8E4M3, dev);
    ops::fp8_cast(a, one, a8);
    ops::fp8_cast(b, one, b8);
    ops::GemmOptions o;
    o.trans_b = true;
    auto bf16 = [&] { ops::gemm(a, b, c, o); };
    auto fp8 = [&] { ops::gemm_fp8(a8, b8, c, one, one, {.fast_accum = !s.grad}); };
    const double t1 = mcbench::time_ms(bf16, 5, samples), t2 = mcbench::time_ms(fp8, 5, samples);
    const double t3 = mcbench::time_ms(bf16, 2, samples), t4 = mcbench::time_ms(fp8, 2, samples);
    const double ms16 = std::min(t1, t3), ms8 = std::min(t2, t4);
    const double flops = 2.0 * double(s.m) * double(s.n) * double(s.k);
    const double tf16 = flops / (ms16 * 1e-3) / 1e12, tf8 = flops / (ms8 * 1e-3) / 1e12;
    const std::string shape = std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
    std::printf("  %-14s %-20s %9.4f %9.1f %9.4f %9.1f %7.2fx\n", s.name, shape.c_str(), ms16, tf16, ms8, tf8,
                ms16 / ms8);
    ctx.record({{"op", std::string("gemm_fp8_") + s.name},
                {"shape", shape},
                {"dtype", s.grad ? "e5m2 x e4m3 -> bf16" : "e4m3 x e4m3 -> bf16 (fast accum)"},
                {"ms", ms8},
                {"ms_rounds", {t2, t4}},
                {"tflops", tf8},
                {"flops", flops},
                {"peer", "megacore bf16 gemm (same shape, same run)"},
                {"peer_ms", ms16},
                {"peer_ms_rounds", {t1, t3}},
                {"peer_tflops", tf16},
                {"vs_peer", ms16 / ms8},
                {"card", ctx.card}});
  }
}

// The FP8 casts of the linear layers' operands (ops::fp8_cast, ops::fp8_cast_transpose with amax and
// saturation counts) at the Llama-3-8B TP 4 shapes of a 16384-token micro-batch and the reference 1.1B's, in
// TB/s of bytes moved (2 read + 1 per output written) against the run's device-to-device copy ceiling.
MC_BENCHMARK("fp8_cast", 10) {
  struct CastShape {
    const char* name;
    int64_t rows, cols;
  };
  std::vector<CastShape> shapes{{"8b_tp4_hidden", 16384, 4096}, {"8b_tp4_fc1_dy", 16384, 7168},
                                {"8b_tp4_qkv_dy", 16384, 1536}, {"8b_tp4_proj_in", 16384, 1024},
                                {"1b_fc2_in", 8192, 8192},       {"1b_hidden", 8192, 2048}};
  if (ctx.quick) shapes.resize(2);
  const int samples = ctx.quick ? 10 : 30;
  const Device dev = Device::cuda(0);
  for (const auto& s : shapes) {
    Tensor x = mcbench::dev_randn({s.rows, s.cols}, DType::BF16, 11);
    Tensor scale = Tensor::full({1}, 8.0, DType::F32, dev), amax = Tensor::zeros({1}, DType::F32, dev);
    Tensor counts = Tensor::zeros({2}, DType::I64, dev);
    Tensor q = Tensor::empty(x.shape(), DType::F8E4M3, dev), qt = Tensor::empty({s.cols, s.rows}, DType::F8E4M3, dev);
    const std::string shape = std::to_string(s.rows) + "x" + std::to_string(s.cols);
    const double n = double(s.rows) * double(s.cols);
    double ms = mcbench::time_ms([&] { ops::fp8_cast(x, scale, q, amax, counts); }, 3, samples);
    mcbench::record_bw(ctx, std::string("fp8_cast_") + s.name, shape, "bf16 -> e4m3", ms, 3 * n);
    ms = mcbench::time_ms([&] { ops::fp8_cast_transpose(x, scale, q, qt, amax, counts); }, 3, samples);
    mcbench::record_bw(ctx, std::string("fp8_cast_transpose_") + s.name, shape, "bf16 -> e4m3 + transpose", ms, 4 * n);
    ms = mcbench::time_ms([&] { ops::fp8_cast_transpose(x, scale, Tensor(), qt, amax, counts); }, 3, samples);
    mcbench::record_bw(ctx, std::string("fp8_transpose_only_") + s.name, shape, "bf16 -> e4m3 transposed", ms, 3 * n);
  }
}
