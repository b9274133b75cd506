// Attention forward and forward+backward (causal, d = 128, bf16) through cuDNN SDPA and megacore's own
// flash kernels (rows flash[fwd/bwd]: the forward kernel, sm80 mma.sync or sm90 wgmma, and the
// backward, det = the deterministic two-kernel backward, atomic = the default single kernel with
// atomic dQ; variants: the other launch shapes); torch SDPA's figures come from
// torch_attention_peer.py run in the same job on the same card (pass its JSON in
// MC_TORCH_ATTN_PEERS). FLOPs follow FlashAttention's convention: forward 4 B H S^2 D (two products),
// backward 2.5x forward, halved for the causal mask.
// (A .cpp, not a .cu: it has no device code, and .cu files build as C++17 while the headers need C++20.)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "kernels/bench.hpp"
#include "megacore/megacore.hpp"
#include "ops/attention_tuned.hpp"

using namespace megacore;

namespace {

Tensor dev_rand(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::BF16, Device::cuda(0));
  Generator g(seed, 0);
  t.normal_(g, 0.0, 1.0);
  return t;
}

std::map<std::string, nlohmann::json> load_peers(std::string* card) {
  std::map<std::string, nlohmann::json> rows;
  const char* path = std::getenv("MC_TORCH_ATTN_PEERS");
  if (!path) return rows;
  std::ifstream f(path);
  if (!f) {
    std::printf("  note: %s not found; no torch SDPA peer in this run\n", path);
    return rows;
  }
  nlohmann::json j = nlohmann::json::parse(f);
  *card = j.value("card", "");
  for (auto& r : j["results"]) rows[r.value("shape", "")] = r;
  return rows;
}

}  // namespace

MC_BENCHMARK("attention", 30) {
  struct Cfg {
    int64_t b, s, h, hk;
  };
  std::vector<Cfg> cfgs{{8, 2048, 16, 16}, {4, 4096, 16, 16}, {2, 8192, 16, 16}, {1, 16384, 16, 16}, {4, 4096, 32, 8}};
  if (ctx.quick) cfgs = {{4, 4096, 16, 16}};
  std::string peer_card;
  auto peers = load_peers(&peer_card);
  const int64_t D = 128;
  const int samples = ctx.quick ? 5 : 15;
  // Paths: cuDNN; the flash kernels as forward kernel / backward: forward sm80 (mma.sync) or, on sm_90,
  // sm90 (wgmma, 128-key tiles: the default there); backward det (two mma.sync kernels, no atomics),
  // sm80-atomic (one mma.sync kernel, atomic dQ) or sm90-atomic (one wgmma kernel, atomic dQ: the
  // default on sm_90). Variants: sm90 forward with 64-key tiles or warp-specialized schedules, each
  // launch shape of the mma.sync atomic kernel.
  struct Path {
    const char* label;
    ops::AttentionBackend backend;
    ops::FlashImpl impl;
    int block_n;
    int sm90_variant;  // AttentionOptions::flash_sm90_variant
    bool deterministic;
    int warps;     // 0: through the public op
    bool variant;  // only with variants on
    ops::FlashImpl bwd;  // AttentionOptions::flash_bwd_impl
    int bwd_variant = 0;  // AttentionOptions::flash_sm90_bwd_variant
    bool cudnn_autotune = false;  // cuDNN: every plan timed, the fastest kept (set_cudnn_attention_autotune)
  };
  const bool sm90 = ops::attention_flash_sm90_available(Device::cuda(0));
  if (!sm90) std::printf("  note: the sm90 flash kernels are not available on this device/build; no sm90 rows\n");
  using FI = ops::FlashImpl;
  const auto Fl = ops::AttentionBackend::Flash;
  std::vector<Path> paths;
  if (ops::attention_cudnn_available()) {
    // the library's default (the heuristic's first plan); variant: every plan timed on the first call of a
    // shape and the fastest kept (set_cudnn_attention_autotune)
    paths.push_back({"cudnn", ops::AttentionBackend::Cudnn, FI::Auto, 0, 0, false, 0, false, FI::Auto});
    paths.push_back({"cudnn[autotune]", ops::AttentionBackend::Cudnn, FI::Auto, 0, 0, false, 0, true, FI::Auto, 0, true});
  }
  paths.push_back({"flash[sm80/det]", Fl, FI::Sm80, 0, 0, true, 0, false, FI::Auto});
  paths.push_back({"flash[sm80/sm80-atomic]", Fl, FI::Sm80, 0, 0, false, 0, false, FI::Sm80});
  if (sm90) {
    paths.push_back({"flash[sm90/det]", Fl, FI::Sm90, 128, 0, true, 0, false, FI::Auto});
    paths.push_back({"flash[sm90/sm80-atomic]", Fl, FI::Sm90, 128, 0, false, 0, false, FI::Sm80});
    paths.push_back({"flash[sm90/sm90-atomic]", Fl, FI::Sm90, 128, 0, false, 0, false, FI::Sm90});
    // the sm90 backward with dQ added by every thread (red.global.add) instead of one bulk reduce per tile
    paths.push_back({"flash[sm90/sm90-atomic-red]", Fl, FI::Sm90, 128, 0, false, 0, false, FI::Sm90, 1});
    paths.push_back({"flash[sm90-n64/sm90-atomic]", Fl, FI::Sm90, 64, 0, false, 0, true, FI::Sm90});
    // Warp-specialized forward (producer warpgroup + mbarriers, consumer warpgroups decoupled), 2 / 3
    // stages (flash_sm90_variant 1 / 2), and the same with ping-pong warpgroup scheduling (3 / 4).
    paths.push_back({"flash[sm90-ws2/sm90-atomic]", Fl, FI::Sm90, 128, 1, false, 0, true, FI::Sm90});
    paths.push_back({"flash[sm90-ws3/sm90-atomic]", Fl, FI::Sm90, 128, 2, false, 0, true, FI::Sm90});
    paths.push_back({"flash[sm90-pp2/sm90-atomic]", Fl, FI::Sm90, 128, 3, false, 0, true, FI::Sm90});
    paths.push_back({"flash[sm90-pp3/sm90-atomic]", Fl, FI::Sm90, 128, 4, false, 0, true, FI::Sm90});
  }
  const FI best = sm90 ? FI::Sm90 : FI::Sm80;
  paths.push_back({"flash[atomic_w8k128]", Fl, best, 0, 0, false, 8, true, FI::Sm80});
  paths.push_back({"flash[atomic_w4k64]", Fl, best, 0, 0, false, 4, true, FI::Sm80});
  std::printf("  %-26s %-28s %9s %9s %11s %9s  %s\n", "shape", "path", "fwd ms", "TFLOP/s", "fwd+bwd ms", "TFLOP/s",
              "torch SDPA fwd / fwd+bwd TFLOP/s");
  for (const auto& c : cfgs) {
    Tensor q = dev_rand({c.b, c.s, c.h, D}, 1), k = dev_rand({c.b, c.s, c.hk, D}, 2), v = dev_rand({c.b, c.s, c.hk, D}, 3);
    Tensor dout = dev_rand({c.b, c.s, c.h, D}, 4);
    Tensor out = Tensor::empty(q.shape(), DType::BF16, Device::cuda(0));
    Tensor lse = Tensor::empty({c.b, c.h, c.s}, DType::F32, Device::cuda(0));
    Tensor dq = Tensor::empty(q.shape(), DType::BF16, Device::cuda(0));
    Tensor dk = Tensor::empty(k.shape(), DType::BF16, Device::cuda(0)), dv = Tensor::empty(k.shape(), DType::BF16, Device::cuda(0));
    const double fwd_flops = 4.0 * c.b * c.h * double(c.s) * double(c.s) * D / 2.0;
    const double fb_flops = fwd_flops * 3.5;
    const std::string shape = "b" + std::to_string(c.b) + "_s" + std::to_string(c.s) + "_h" + std::to_string(c.h) +
                              "_kv" + std::to_string(c.hk) + "_d128_causal";
    nlohmann::json peer = peers.count(shape) ? peers[shape] : nlohmann::json();
    for (const Path& path : paths) {
      const ops::AttentionBackend be = path.backend;
      if (path.variant && !ctx.variants) continue;
      ops::AttentionOptions o;
      o.causal = true, o.backend = be, o.deterministic = path.deterministic;
      o.flash_impl = path.impl, o.flash_sm90_block_n = path.block_n;
      o.flash_sm90_variant = path.sm90_variant;
      o.flash_bwd_impl = path.bwd;
      o.flash_sm90_bwd_variant = path.bwd_variant;
      auto fwd = [&] { ops::attention_forward(q, k, v, out, lse, o); };
      auto fb = [&] {
        ops::attention_forward(q, k, v, out, lse, o);
        if (path.warps)
          ops::detail::attention_backward_flash_tuned(q, k, v, out, lse, dout, dq, dk, dv, o,
                                                      ops::cuda::FlashBwdTuning{.warps = path.warps});
        else
          ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o);
      };
      const std::string op = std::string("attention_") + ops::attention_backend_name(be);
      double fwd_ms = 0, fb_ms = 0;
      const bool tuned = ops::cudnn_attention_autotune();
      ops::set_cudnn_attention_autotune(path.cudnn_autotune || tuned);
      try {
        fwd_ms = mcbench::time_ms(fwd, 3, samples);
        fb_ms = mcbench::time_ms(fb, 3, samples);
        ops::set_cudnn_attention_autotune(tuned);
      } catch (const std::exception& e) {
        ops::set_cudnn_attention_autotune(tuned);
        std::printf("  %-26s %-28s failed: %s\n", shape.c_str(), path.label, e.what());
        ctx.record({{"op", op}, {"path", path.label}, {"shape", shape}, {"error", e.what()}});
        continue;
      }
      const double ftf = fwd_flops / (fwd_ms * 1e-3) / 1e12, btf = fb_flops / (fb_ms * 1e-3) / 1e12;
      nlohmann::json row{{"op", op},
                         {"path", path.label},
                         {"fwd_kernel", path.impl == ops::FlashImpl::Sm90 ? "sm90" : path.impl == ops::FlashImpl::Sm80 ? "sm80" : "auto"},
                         {"bwd", path.backend == ops::AttentionBackend::Cudnn ? "cudnn"
                                 : path.deterministic            ? "deterministic"
                                 : path.bwd == FI::Sm80          ? "atomic dQ, sm80 kernel"
                                 : path.bwd == FI::Sm90          ? (path.bwd_variant == 1 ? "atomic dQ, sm90 kernel, per-thread red.add" : "atomic dQ, sm90 kernel")
                                                                 : "atomic dQ, auto"},
                         {"shape", shape},
                         {"dtype", "bf16"},
                         {"ms", fb_ms},
                         {"fwd_ms", fwd_ms},
                         {"fwd_tflops", ftf},
                         {"fwdbwd_ms", fb_ms},
                         {"fwdbwd_tflops", btf},
                         {"fwd_flops", fwd_flops},
                         {"fwdbwd_flops", fb_flops},
                         {"frac_gemm_ceiling_fwdbwd", btf / ctx.gemm_bf16_tflops},
                         {"card", ctx.card}};
      std::string peer_txt = "-";
      if (!peer.is_null()) {
        row["peer"] = "torch SDPA";
        row["peer_card"] = peer_card;
        for (const char* key : {"default", "flash", "cudnn", "efficient"}) {
          if (!peer.contains(key)) continue;
          const auto& p = peer[key];
          if (!p.contains("fwd_ms")) continue;
          row[std::string("torch_") + key] = {{"fwd_ms", p["fwd_ms"]},
                                              {"fwdbwd_ms", p["fwdbwd_ms"]},
                                              {"fwd_tflops", fwd_flops / (p["fwd_ms"].get<double>() * 1e-3) / 1e12},
                                              {"fwdbwd_tflops", fb_flops / (p["fwdbwd_ms"].get<double>() * 1e-3) / 1e12}};
        }
        // megacore.ops and torch SDPA timed interleaved in one Python process (torch_attention_peer.py)
        if (!path.variant && peer.contains("same_process")) row["same_process"] = peer["same_process"];
        if (row.contains("torch_default")) {
          const auto& p = row["torch_default"];
          char buf[64];
          std::snprintf(buf, sizeof(buf), "%.0f / %.0f", p["fwd_tflops"].get<double>(), p["fwdbwd_tflops"].get<double>());
          peer_txt = buf;
          row["vs_torch_default_fwdbwd"] = p["fwdbwd_ms"].get<double>() / fb_ms;
        }
      }
      if (path.variant) row["variant"] = path.label;
      std::printf("  %-26s %-28s %9.3f %9.1f %11.3f %9.1f  %s\n", shape.c_str(), path.label, fwd_ms, ftf, fb_ms,
                  btf, peer_txt.c_str());
      ctx.record(row);
    }
  }
}

// Packed (cu_seqlens) attention: 16k tokens per step made of documents of unequal length, causal, d = 128,
// through cuDNN's ragged layout and megacore's flash kernel (defaults of each). torch SDPA has no
// public packed-sequence entry point, so the two megacore paths are each other's peer here; the dense
// rows above give both at equal token counts. FLOPs: the sum over documents of the dense formula.
MC_BENCHMARK("attention_packed", 31) {
  struct Cfg {
    const char* name;
    std::vector<int32_t> lens;
    int64_t h, hk;
  };
  std::vector<int32_t> many;  // 32 documents of 300..724 tokens, 16384 in all
  for (int i = 0; i < 32; ++i) many.push_back(300 + (i * 37) % 425);
  int32_t sum = 0;
  for (int32_t l : many) sum += l;
  many.back() += 16384 - sum;
  std::vector<Cfg> cfgs{{"docs6", {5000, 4096, 3000, 2048, 1240, 1000}, 16, 16},
                        {"docs32", many, 16, 16},
                        {"docs6_gqa", {5000, 4096, 3000, 2048, 1240, 1000}, 32, 8}};
  if (ctx.quick) cfgs.resize(1);
  const int64_t D = 128;
  const int samples = ctx.quick ? 5 : 15;
  std::vector<ops::AttentionBackend> backends{ops::AttentionBackend::Flash};
  if (ops::attention_cudnn_available()) backends.insert(backends.begin(), ops::AttentionBackend::Cudnn);
  std::printf("  %-26s %-10s %9s %9s %11s %9s\n", "shape", "path", "fwd ms", "TFLOP/s", "fwd+bwd ms", "TFLOP/s");
  for (const auto& c : cfgs) {
    std::vector<int32_t> cu{0};
    int32_t longest = 0;
    double fwd_flops = 0;
    for (int32_t l : c.lens) {
      cu.push_back(cu.back() + l);
      longest = std::max(longest, l);
      fwd_flops += 4.0 * c.h * double(l) * double(l) * D / 2.0;
    }
    const int64_t t = cu.back();
    const double fb_flops = fwd_flops * 3.5;
    Tensor q = dev_rand({t, c.h, D}, 1), k = dev_rand({t, c.hk, D}, 2), v = dev_rand({t, c.hk, D}, 3);
    Tensor dout = dev_rand({t, c.h, D}, 4);
    Tensor out = Tensor::empty(q.shape(), DType::BF16, Device::cuda(0));
    Tensor lse = Tensor::empty({c.h, t}, DType::F32, Device::cuda(0));
    Tensor dq = Tensor::empty(q.shape(), DType::BF16, Device::cuda(0));
    Tensor dk = Tensor::empty(k.shape(), DType::BF16, Device::cuda(0)), dv = Tensor::empty(k.shape(), DType::BF16, Device::cuda(0));
    const std::string shape = std::string(c.name) + "_t" + std::to_string(t) + "_h" + std::to_string(c.h) + "_kv" +
                              std::to_string(c.hk) + "_d128_causal";
    for (ops::AttentionBackend be : backends) {
      ops::AttentionOptions o;
      o.causal = true, o.backend = be;
      o.cu_seqlens_q = Tensor::from_vector(cu, {int64_t(cu.size())}).to(Device::cuda(0));
      o.cu_seqlens_kv = o.cu_seqlens_q;
      o.max_seqlen_q = o.max_seqlen_kv = longest;
      auto fwd = [&] { ops::attention_forward(q, k, v, out, lse, o); };
      auto fb = [&] {
        ops::attention_forward(q, k, v, out, lse, o);
        ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o);
      };
      const std::string op = std::string("attention_packed_") + ops::attention_backend_name(be);
      double fwd_ms = 0, fb_ms = 0;
      try {
        fwd_ms = mcbench::time_ms(fwd, 3, samples);
        fb_ms = mcbench::time_ms(fb, 3, samples);
      } catch (const std::exception& e) {
        std::printf("  %-26s %-10s failed: %s\n", shape.c_str(), ops::attention_backend_name(be), e.what());
        ctx.record({{"op", op}, {"shape", shape}, {"error", e.what()}});
        continue;
      }
      const double ftf = fwd_flops / (fwd_ms * 1e-3) / 1e12, btf = fb_flops / (fb_ms * 1e-3) / 1e12;
      std::printf("  %-26s %-10s %9.3f %9.1f %11.3f %9.1f\n", shape.c_str(), ops::attention_backend_name(be), fwd_ms,
                  ftf, fb_ms, btf);
      ctx.record({{"op", op}, {"shape", shape}, {"documents", c.lens.size()}, {"tokens", t}, {"dtype", "bf16"},
                  {"ms", fb_ms}, {"fwd_ms", fwd_ms}, {"fwd_tflops", ftf}, {"fwdbwd_ms", fb_ms}, {"fwdbwd_tflops", btf},
                  {"fwd_flops", fwd_flops}, {"fwdbwd_flops", fb_flops},
                  {"frac_gemm_ceiling_fwdbwd", btf / ctx.gemm_bf16_tflops}, {"card", ctx.card},
                  {"peer", "none: torch SDPA has no packed-sequence entry point; cuDNN and flash rows compare"}});
    }
  }
}
