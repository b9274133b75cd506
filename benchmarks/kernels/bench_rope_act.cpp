// RoPE (Llama-3 8B heads), the fused QKV split/merge with RoPE (Llama-1.1B heads), SwiGLU and GELU, bf16.
#include "kernels/bench_memops_util.hpp"
#include "megacore/ops/activation.hpp"
#include "megacore/ops/rope.hpp"
#include "ops/cuda/activation_cuda.hpp"
#include "ops/cuda/rope_cuda.hpp"

using namespace megacore;

namespace {

using RopeTuning = ops::cuda::RopeTuning;

// Alternatives to the default (128-thread blocks, 4 heads per thread, loads of 4 heads issued together).
std::vector<mcbench::Variant<RopeTuning>> rope_variants() {
  return {
      // the first kernel's shape: a thread walks all heads of its token, one head's loads at a time
      {"all_heads_u1", RopeTuning{.threads = 128, .head_chunk = 0, .unroll = 1}},
      {"all_heads_u2", RopeTuning{.threads = 128, .head_chunk = 0, .unroll = 2}},
      {"all_heads_u4", RopeTuning{.threads = 128, .head_chunk = 0, .unroll = 4}},
      {"c8_u1", RopeTuning{.threads = 128, .head_chunk = 8, .unroll = 1}},
      {"c8_u4", RopeTuning{.threads = 128, .head_chunk = 8, .unroll = 4}},
      {"c4_u2", RopeTuning{.threads = 128, .head_chunk = 4, .unroll = 2}},
      {"c8_u2", RopeTuning{.threads = 128, .head_chunk = 8, .unroll = 2}},
      {"c2_u2", RopeTuning{.threads = 128, .head_chunk = 2, .unroll = 2}},
      {"c16_u2", RopeTuning{.threads = 128, .head_chunk = 16, .unroll = 2}},
      {"c8_u2_t256", RopeTuning{.threads = 256, .head_chunk = 8, .unroll = 2}},
      {"c8_u2_t64", RopeTuning{.threads = 64, .head_chunk = 8, .unroll = 2}},
  };
}

using ActTuning = ops::cuda::ActTuning;

// Alternatives to the default elementwise activation launch (1 vector per thread, 256 threads, one round
// of as many blocks as the tensor needs).
std::vector<mcbench::Variant<ActTuning>> act_variants() {
  return {
      {"u1_g16", ActTuning{.unroll = 1, .blocks_per_sm = 16}},  // the first shape: grid-stride rounds
      {"u2_g16", ActTuning{.unroll = 2, .blocks_per_sm = 16}},
      {"u4_g16", ActTuning{.unroll = 4, .blocks_per_sm = 16}},
      {"u4_g8", ActTuning{.unroll = 4, .blocks_per_sm = 8}},
      {"u2_flat", ActTuning{.unroll = 2, .blocks_per_sm = 0}},
      {"u4_flat", ActTuning{.unroll = 4, .blocks_per_sm = 0}},
      {"u1_t128_flat", ActTuning{.unroll = 1, .threads = 128, .blocks_per_sm = 0}},
      {"u2_t512_g4", ActTuning{.unroll = 2, .threads = 512, .blocks_per_sm = 4}},
  };
}
std::string describe(const ActTuning& t) {
  return "unroll=" + std::to_string(t.unroll) + " threads=" + std::to_string(t.threads) +
         " blocks_per_sm=" + std::to_string(t.blocks_per_sm);
}

std::string describe(const RopeTuning& t) {
  return "threads=" + std::to_string(t.threads) + " head_chunk=" + std::to_string(t.head_chunk) +
         " unroll=" + std::to_string(t.unroll);
}

}  // namespace

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
  const std::string def = ctx.variants ? "default" : "";
  const std::string def_t = ctx.variants ? describe(RopeTuning{}) : "";
  double ms = mcbench::time_ms([&] { ops::rope_forward(x, pos, inv, y, false); }, 3, smp);
  mcbench::record_bw(ctx, "rope_fwd", shape, "bf16", ms, bytes, def, def_t);
  ms = mcbench::time_ms([&] { ops::rope_backward(x, pos, inv, y, false); }, 3, smp);
  mcbench::record_bw(ctx, "rope_bwd", shape, "bf16", ms, bytes, def, def_t);
  if (!ctx.variants) return;
  // The call rope_forward makes, with the variant's tuning (default stream, device 0).
  ops::cuda::RopeArgs a;
  a.x = x.data_ptr();
  a.y = y.data_ptr();
  a.positions = pos.data_ptr();
  a.positions_i64 = false;
  a.inv_freq = inv.data<float>();
  a.tokens = t;
  a.heads = heads;
  a.head_dim = hd;
  a.rotary_dim = hd;
  for (const auto& v : rope_variants()) {
    a.tuning = v.t;
    ms = mcbench::time_ms([&] { ops::cuda::rope(DType::BF16, a, 0, nullptr); }, 3, smp);
    mcbench::record_bw(ctx, "rope_fwd", shape, "bf16", ms, bytes, v.name, describe(v.t));
  }
}

// The fused QKV split + RoPE and its backward merge against the sequence they replace in SelfAttention
// (three strided copies and RoPE in place on q and on k; RoPE's backward on dq and dk and three copies),
// at the reference Llama-1.1B step's shapes: 4 x 2048 tokens, 8 KV groups of 4 query heads, head_dim 64.
// Bytes are those of the fused pass: the grouped tensor read (or written) once, q, k and v written (or read).
MC_BENCHMARK("qkv_rope", 31) {
  const Device d = Device::cuda(0);
  const int64_t s = 2048, b = 4, groups = 8, hpg = 4, hd = 64;
  const std::string shape = std::to_string(s * b) + "x" + std::to_string(groups) + "x" + std::to_string(hpg + 2) +
                            "x" + std::to_string(hd);
  const DType dt = DType::BF16;
  Tensor qkv = mcbench::dev_randn({s, b, groups, hpg + 2, hd}, dt, 11);
  Tensor q = Tensor::empty({s, b, groups * hpg, hd}, dt, d), k = Tensor::empty({s, b, groups, hd}, dt, d),
         v = Tensor::empty({s, b, groups, hd}, dt, d);
  std::vector<int32_t> pv(static_cast<size_t>(s * b));
  for (int64_t i = 0; i < s * b; ++i) pv[size_t(i)] = int32_t(i / b);
  Tensor pos = Tensor::from_vector(pv, {s * b}).to(d);
  ops::RopeConfig cfg;
  cfg.rotary_dim = hd;
  Tensor inv = ops::rope_inv_freq(cfg, d);
  const double bytes = 2.0 * double(qkv.nbytes());
  const int smp = mcbench::bench_samples(ctx);
  double ms = mcbench::time_ms([&] { ops::qkv_split_rope(qkv, pos, inv, q, k, v, false); }, 3, smp);
  mcbench::record_bw(ctx, "qkv_split_rope", shape, "bf16", ms, bytes, "fused");
  ms = mcbench::time_ms([&] {
    Tensor uq = qkv.narrow(3, 0, hpg).contiguous().view({s, b, groups * hpg, hd});
    Tensor uk = qkv.select(3, hpg).contiguous(), uv = qkv.select(3, hpg + 1).contiguous();
    ops::rope_forward(uq, pos, inv, uq, false);
    ops::rope_forward(uk, pos, inv, uk, false);
  }, 3, smp);
  mcbench::record_bw(ctx, "qkv_split_rope", shape, "bf16", ms, bytes, "unfused_copies_rope");
  ms = mcbench::time_ms([&] { ops::qkv_merge_rope_backward(q, k, v, pos, inv, qkv, false); }, 3, smp);
  mcbench::record_bw(ctx, "qkv_merge_rope_bwd", shape, "bf16", ms, bytes, "fused");
  Tensor rq = Tensor::empty(q.shape(), dt, d), rk = Tensor::empty(k.shape(), dt, d);
  ms = mcbench::time_ms([&] {
    ops::rope_backward(q, pos, inv, rq, false);
    ops::rope_backward(k, pos, inv, rk, false);
    qkv.narrow(3, 0, hpg).copy_(rq.view({s, b, groups, hpg, hd}));
    qkv.select(3, hpg).copy_(rk);
    qkv.select(3, hpg + 1).copy_(v);
  }, 3, smp);
  mcbench::record_bw(ctx, "qkv_merge_rope_bwd", shape, "bf16", ms, bytes, "unfused_rope_copies");
  if (!ctx.variants) return;
  // The fused kernel finds each row's source and destination through its group (ptxas, sm_90a, bf16,
  // unroll 4: split 126 and merge 117 registers against plain RoPE's 116), so its best launch shape may
  // differ from plain RoPE's.
  ops::cuda::QkvRopeArgs a;
  a.qkv = qkv.data_ptr();
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.positions = pos.data_ptr();
  a.inv_freq = inv.data<float>();
  a.tokens = s * b;
  a.groups = groups;
  a.hpg = hpg;
  a.head_dim = hd;
  a.rotary_dim = hd;
  for (const auto& var : rope_variants()) {
    a.tuning = var.t;
    for (bool merge : {false, true}) {
      a.merge = merge;
      ms = mcbench::time_ms([&] { ops::cuda::qkv_rope(DType::BF16, a, 0, nullptr); }, 3, smp);
      mcbench::record_bw(ctx, merge ? "qkv_merge_rope_bwd" : "qkv_split_rope", shape, "bf16", ms, bytes,
                         std::string("fused_") + var.name, describe(var.t));
    }
  }
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
    if (ctx.variants) {
      const int64_t el = n * f;
      for (const auto& v : act_variants()) {
        ms = mcbench::time_ms([&] {
          ops::cuda::activation(DType::BF16, ops::actmath::Act::GeluTanh, x.data_ptr(), nullptr, y.data_ptr(), el, 0, nullptr, v.t);
        }, 3, smp);
        mcbench::record_bw(ctx, "gelu_tanh_fwd", shape, "bf16", ms, 2 * unit, v.name, describe(v.t));
        ms = mcbench::time_ms([&] {
          ops::cuda::activation(DType::BF16, ops::actmath::Act::GeluTanh, x.data_ptr(), dy.data_ptr(), y.data_ptr(), el, 0, nullptr, v.t);
        }, 3, smp);
        mcbench::record_bw(ctx, "gelu_tanh_bwd", shape, "bf16", ms, 3 * unit, v.name, describe(v.t));
      }
    }
  }
}
