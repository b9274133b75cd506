// Multi-tensor AdamW (f32 master, f32 grads; with and without bf16 params written), global L2 norm, f32 -> bf16 cast,
// embedding lookup and dropout.
#include "kernels/bench_memops_util.hpp"
#include "megacore/ops/cast.hpp"
#include "megacore/ops/dropout.hpp"
#include "megacore/ops/embedding.hpp"
#include "megacore/ops/optimizer.hpp"
#include "ops/cuda/dropout_cuda.hpp"
#include "ops/cuda/embedding_cuda.hpp"
#include "ops/dropout_math.hpp"

using namespace megacore;

MC_BENCHMARK("optimizer", 60) {
  const Device d = Device::cuda(0);
  // A 1.2B-parameter model as 48 tensors of 16M and 48 of 8M elements, roughly a Llama-1B layer mix.
  std::vector<int64_t> sizes;
  for (int i = 0; i < (ctx.quick ? 8 : 48); ++i) {
    sizes.push_back(int64_t(16) << 20);
    sizes.push_back(int64_t(8) << 20);
  }
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  const std::string shape = std::to_string(sizes.size()) + "tensors_" + std::to_string(total) + "el";
  std::vector<Tensor> g, w, m, v, p;
  for (size_t i = 0; i < sizes.size(); ++i) {
    g.push_back(mcbench::dev_randn({sizes[i]}, DType::F32, 100 + i, 1e-3));
    w.push_back(mcbench::dev_randn({sizes[i]}, DType::F32, 200 + i, 0.02));
    m.push_back(mcbench::dev_randn({sizes[i]}, DType::F32, 300 + i, 1e-4));
    v.push_back(Tensor::full({sizes[i]}, 1e-6, DType::F32, d));
    p.push_back(Tensor::empty({sizes[i]}, DType::BF16, d));
  }
  ops::AdamWHyper h;
  h.lr = 1e-4f;
  h.step = 10;
  const int smp = ctx.quick ? 3 : 10;
  // "adamw": f32 master weights only, the work torch's fused AdamW (the peer) does: read g, w, m, v and
  // write w, m, v. "adamw_bf16_out": the trainer's step, which also writes the bf16 model weights in the
  // same pass (torch has no such kernel).
  double ms = mcbench::time_ms([&] { ops::multi_tensor_adamw(g, w, m, v, {}, h); }, 2, smp);
  mcbench::record_bw(ctx, "adamw", shape, "f32", ms, double(total) * (4 * 4 + 3 * 4));
  ms = mcbench::time_ms([&] { ops::multi_tensor_adamw(g, w, m, v, p, h); }, 2, smp);
  mcbench::record_bw(ctx, "adamw_bf16_out", shape, "f32+bf16", ms, double(total) * (4 * 4 + 3 * 4 + 2));
  Tensor out = Tensor::empty({1}, DType::F32, d);
  ms = mcbench::time_ms([&] { ops::multi_tensor_l2norm(g, out); }, 2, smp);
  mcbench::record_bw(ctx, "l2norm", shape, "f32", ms, double(total) * 4);
  ms = mcbench::time_ms([&] { ops::multi_tensor_scale(w, p, 1.f); }, 2, smp);
  mcbench::record_bw(ctx, "cast_f32_bf16", shape, "f32->bf16", ms, double(total) * 6);
}

namespace {

using EmbeddingTuning = ops::cuda::EmbeddingTuning;
using DropoutTuning = ops::cuda::DropoutTuning;

// Alternatives to the default (counting sort, ordered segment sums, 16-byte accesses, 256 threads,
// 2 vectors per thread).
std::vector<mcbench::Variant<EmbeddingTuning>> embedding_variants() {
  return {
      {"scalar", EmbeddingTuning{.vector = false}},  // the first kernel: element accesses (radix sort)
      // make_keys + CUB's radix sort (the default until 2026-11-26), by launch shape
      {"radix_t256_u2", EmbeddingTuning{.sort = 0}},
      {"radix_t128_u1", EmbeddingTuning{.threads = 128, .unroll = 1, .sort = 0}},
      {"radix_t128_u4", EmbeddingTuning{.threads = 128, .unroll = 4, .sort = 0}},
      {"radix_t64_u4", EmbeddingTuning{.threads = 64, .unroll = 4, .sort = 0}},
      // the cooperative counting sort at other launch shapes
      {"csort_t128_u4", EmbeddingTuning{.threads = 128, .unroll = 4, .sort = 1}},
      {"csort_t256_u1", EmbeddingTuning{.threads = 256, .unroll = 1, .sort = 1}},
      {"csort_t512_u1", EmbeddingTuning{.threads = 512, .unroll = 1, .sort = 1}},
      // the radix sort with the counting sort's segment kernel (its one-round-trip lookups alone)
      {"radix_ordered_t256_u2", EmbeddingTuning{.sort = 2}},
  };
}
std::string describe(const EmbeddingTuning& t) {
  return "vector=" + std::to_string(int(t.vector)) + " threads=" + std::to_string(t.threads) +
         " unroll=" + std::to_string(t.unroll) + " sort=" + std::to_string(t.sort);
}

// Alternatives to the default dropout (8 elements per step, 2 steps of loads in flight, 256 threads,
// 16 blocks per SM); blocks_per_sm 0 is one resident wave of blocks.
std::vector<mcbench::Variant<DropoutTuning>> dropout_variants() {
  return {
      // the first kernel's shape: 4 elements (8-byte bf16 accesses), 16 blocks of 256 per SM
      {"e4_u1_g16", DropoutTuning{.elems = 4, .unroll = 1, .threads = 256, .blocks_per_sm = 16}},
      {"e4_u2", DropoutTuning{.elems = 4, .unroll = 2, .blocks_per_sm = 0}},
      {"e8_u1", DropoutTuning{.elems = 8, .unroll = 1, .blocks_per_sm = 0}},
      {"e8_u4", DropoutTuning{.elems = 8, .unroll = 4, .blocks_per_sm = 0}},
      {"e8_u2_t512", DropoutTuning{.elems = 8, .unroll = 2, .threads = 512, .blocks_per_sm = 0}},
      {"e8_u2_t128", DropoutTuning{.elems = 8, .unroll = 2, .threads = 128, .blocks_per_sm = 0}},
      {"e8_u2_wave", DropoutTuning{.elems = 8, .unroll = 2, .threads = 256, .blocks_per_sm = 0}},
      {"e8_u4_g8", DropoutTuning{.elems = 8, .unroll = 4, .threads = 256, .blocks_per_sm = 8}},
  };
}
std::string describe(const DropoutTuning& t) {
  return "elems=" + std::to_string(t.elems) + " unroll=" + std::to_string(t.unroll) +
         " threads=" + std::to_string(t.threads) + " blocks_per_sm=" + std::to_string(t.blocks_per_sm);
}

}  // namespace

MC_BENCHMARK("embedding_dropout", 70) {
  const Device d = Device::cuda(0);
  const int64_t n = 16384, vocab = 128256, h = 4096;
  const int smp = mcbench::bench_samples(ctx);
  {
    Tensor w = mcbench::dev_randn({vocab, h}, DType::BF16, 20, 0.02);
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = int32_t((i * 104729) % vocab);
    Tensor gid = Tensor::from_vector(ids, {n}).to(d), out = Tensor::empty({n, h}, DType::BF16, d);
    const std::string shape = std::to_string(n) + "x" + std::to_string(h) + "_v" + std::to_string(vocab);
    double ms = mcbench::time_ms([&] { ops::embedding_forward(w, gid, out); }, 3, smp);
    mcbench::record_bw(ctx, "embedding_fwd", shape, "bf16", ms, 2.0 * double(n) * double(h) * 2);
    Tensor dw = Tensor::empty({vocab, h}, DType::F32, d);
    const std::string def = ctx.variants ? "default" : "";
    ms = mcbench::time_ms([&] { ops::embedding_backward(out, gid, dw, true); }, 2, ctx.quick ? 3 : 10);
    // gradient rows read, touched f32 rows read and written
    const double ebytes = double(n) * double(h) * (2 + 8);
    mcbench::record_bw(ctx, "embedding_bwd", shape, "bf16->f32", ms, ebytes, def,
                       ctx.variants ? describe(EmbeddingTuning{}) : "");
    if (ctx.variants) {
      // The call embedding_backward makes (sort included), with the variant's tuning.
      const size_t ws_bytes = ops::cuda::embedding_backward_workspace_bytes(n, vocab, 0);
      Tensor ws = Tensor::empty({int64_t(ws_bytes / 4 + 1)}, DType::F32, d);
      for (const auto& v : embedding_variants()) {
        ms = mcbench::time_ms(
            [&] {
              ops::cuda::embedding_backward(DType::BF16, DType::F32, out.data_ptr(), gid.data_ptr(), false,
                                            dw.data_ptr(), n, vocab, h, -1, true, ws.data_ptr(), ws_bytes, 0, nullptr,
                                            v.t);
            },
            2, ctx.quick ? 3 : 10);
        mcbench::record_bw(ctx, "embedding_bwd", shape, "bf16->f32", ms, ebytes, v.name, describe(v.t));
      }
    }
  }
  {
    const int64_t f = 8192;
    Tensor x = mcbench::dev_randn({n, f}, DType::BF16, 21), y = Tensor::empty({n, f}, DType::BF16, d);
    const std::string shape = std::to_string(n) + "x" + std::to_string(f);
    const double dbytes = 2.0 * double(n) * double(f) * 2;
    double ms = mcbench::time_ms([&] { ops::dropout_forward(x, y, 0.1f, 1234, 0); }, 3, smp);
    mcbench::record_bw(ctx, "dropout_fwd", shape, "bf16", ms, dbytes, ctx.variants ? "default" : "",
                       ctx.variants ? describe(DropoutTuning{}) : "");
    if (ctx.variants) {
      // The call dropout_forward makes (p = 0.1), with the variant's tuning.
      const uint32_t thr = ops::dropmath::threshold(0.1f);
      const float scale = 1.f / (1.f - 0.1f);
      for (const auto& v : dropout_variants()) {
        ms = mcbench::time_ms(
            [&] {
              ops::cuda::dropout(DType::BF16, x.data_ptr(), y.data_ptr(), nullptr, n * f, thr, scale, 1234, 0, 0,
                                 nullptr, v.t);
            },
            3, smp);
        mcbench::record_bw(ctx, "dropout_fwd", shape, "bf16", ms, dbytes, v.name, describe(v.t));
      }
    }
  }
}
