// Fused softmax cross-entropy forward + backward (gradient written over the logits), bf16. After the
// library's default (through the public op), each launch-shape variant of ops::cuda::CeTuning is timed
// through the kernel's internal interface, so one run on a card shows which shape to make the default.
#include "kernels/bench_memops_util.hpp"
#include "megacore/ops/cross_entropy.hpp"
#include "ops/cuda/cross_entropy_cuda.hpp"

using namespace megacore;

namespace {

using CeTuning = ops::cuda::CeTuning;

// Alternatives to the default (512 threads, 4 blocks per SM; rows up to 128 KiB: unroll 2 and 0.75 of L2
// in flight, longer rows: unroll 8 and 0.5 of L2; evict-first pass-2 reads), each spelled out.
std::vector<mcbench::Variant<ops::cuda::CeTuning>> ce_variants() {
  using ops::cuda::CeTuning;
  // The first default was u2_l2_50 for rows up to 128 KiB and u4_l2_50 above.
  return {{"u2_l2_50", CeTuning{.unroll = 2, .l2_fraction = 0.5f}},
          {"u2_l2_75", CeTuning{.unroll = 2, .l2_fraction = 0.75f}},
          {"u4_l2_50", CeTuning{.unroll = 4, .l2_fraction = 0.5f}},
          {"u8_l2_50", CeTuning{.unroll = 8, .l2_fraction = 0.5f}},
          {"u4_l2_75", CeTuning{.unroll = 4, .l2_fraction = 0.75f}},
          {"t256_u4", CeTuning{.threads = 256, .unroll = 4, .blocks_per_sm = 8, .l2_fraction = 0.5f}},
          {"no_stream", CeTuning{.stream_pass2 = false}},  // pass 2 as before: normal loads
          // The row on chip: read once from device memory into the shared memory of a cluster of CTAs (a
          // variant whose slice does not fit shared memory is skipped: it would time the two-pass kernel).
          {"smem_c1", CeTuning{.cluster = 1}},
          {"smem_c1_t256", CeTuning{.threads = 256, .cluster = 1}},
          {"smem_c2", CeTuning{.cluster = 2}},
          {"smem_c2_t256", CeTuning{.threads = 256, .cluster = 2}},
          {"smem_c4", CeTuning{.cluster = 4}},
          {"smem_c4_t256", CeTuning{.threads = 256, .cluster = 4}},
          {"smem_c8_t256", CeTuning{.threads = 256, .cluster = 8}},
          // The library's shape before smem_c4_t256 became the default for 2-byte rows over 128 KiB.
          {"two_pass", CeTuning{}}};
}

std::string describe(const ops::cuda::CeTuning& t) {
  return "threads=" + std::to_string(t.threads) + " unroll=" + std::to_string(t.unroll) +
         " blocks_per_sm=" + std::to_string(t.blocks_per_sm) + " l2_fraction=" + std::to_string(t.l2_fraction) +
         " stream_pass2=" + std::to_string(int(t.stream_pass2)) + " cluster=" + std::to_string(t.cluster);
}

}  // namespace

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
    const double bytes = 2.0 * double(n) * double(v) * 2;
    const int smp = mcbench::bench_samples(ctx);
    // Out of place, so every timed run sees the same logits; in place moves the same bytes.
    const double ms = mcbench::time_ms([&] { ops::cross_entropy_fused(z, labels, loss, lse, dz, 1.f / float(n)); }, 3,
                                       smp);
    mcbench::record_bw(ctx, "cross_entropy_fwd_bwd", shape, "bf16", ms, bytes, ctx.variants ? "default" : "",
                       ctx.variants ? describe(ops::cuda::CeTuning{}) : "");
    if (!ctx.variants) continue;
    for (const auto& var : ce_variants()) {
      // The call the public op makes, with the variant's tuning (default stream, device 0).
      ops::cuda::CeArgs a;
      a.mode = ops::cuda::CeMode::Fused;
      a.logits = z.data_ptr();
      a.dlogits = dz.data_ptr();
      a.labels = labels.data_ptr();
      a.labels_i64 = labels.dtype() == DType::I64;
      a.loss = loss.data<float>();
      a.lse_out = lse.data<float>();
      a.n = n;
      a.v = v;
      a.vocab_total = v;
      a.grad_scale = 1.f / float(n);
      a.tuning = var.t;
      if (var.t.cluster > 0 && !ops::cuda::ce_row_on_chip(DType::BF16, a, 0)) continue;
      const double vms = mcbench::time_ms([&] { ops::cuda::cross_entropy(DType::BF16, a, 0, nullptr); }, 3, smp);
      mcbench::record_bw(ctx, "cross_entropy_fwd_bwd", shape, "bf16", vms, bytes, var.name, describe(var.t));
    }
  }
}
