// Data-parallel training throughput and scaling, one GPU per rank (NCCL), launched with mpirun:
//   mpirun -np 4 build/benchmarks/megacore_bench_training --out ddp.json            # DDP + AdamW
//   mpirun -np 4 build/benchmarks/megacore_bench_training --zero --out zero.json    # ZeRO-1
//   mpirun -np 1 build/benchmarks/megacore_bench_training --out one.json            # one GPU only
//   mpirun -np 4 build/benchmarks/megacore_bench_training --max-ctas 0,8,16          # DP comm CTA limits
//   mpirun -np 4 build/benchmarks/megacore_bench_training --zero --overlap-param-gather --grad-accum 4
//   mpirun -np 4 build/benchmarks/megacore_bench_training --max-ctas 16 --gemm-sm-margin 0,16 --cta-policy 0,1
//   mpirun -np 1 build/benchmarks/megacore_bench_training --single --bf16-states   # the torch peer's precision
//   mpirun -np 1 -x MEGACORE_PROFILE_OUT=p.json -x MEGACORE_PROFILE_STEPS=10 \
//     -x LD_PRELOAD=build/benchmarks/libmegacore_step_profile.so build/benchmarks/megacore_bench_training --single --profile-steps 10
//   mpirun -np 1 build/benchmarks/megacore_bench_training --single --fp8 delayed   # FP8 linears (docs/fp8.md)
// Model: the Llama-1.1B of the peer figures in NOTES.md (h2048, 16 layers, 32 heads, 8 KV groups,
// FFN 8192, vocab 32000, untied), bf16 parameters, f32 main grads and AdamW masters, sequence 2048,
// micro-batch 4 by default, --grad-accum micro-batches per step. Each step: zero_grad, forward/backward
// per micro-batch (DDP reduces buckets during the last backward through the model's grad-ready
// callback), finish_grad_sync, checked_step (global-norm clip 1.0, AdamW).
//
// Phases, all in one launch so the numbers come from the same cards:
//   1. single: every rank trains its own copy alone (a DP group of one, no communication) — the 1-GPU
//      baseline; tokens/s is the mean over ranks. --single stops after it.
//   2. ddp: the same steps over all ranks; tokens/s per GPU and scaling efficiency =
//      (tokens/s per GPU in ddp) / (tokens/s in single).
//   3. breakdown (not timed for throughput): steps with a device sync after the last backward, with the
//      overlap on and off: time in finish_grad_sync after backward has finished is the EXPOSED
//      reduction; with the overlap off it is the whole reduction. Buckets launched during backward are
//      counted.
// --max-ctas runs phases 2-3 once per value, each with a DP communicator whose NCCL CTAs are capped
// (CommOptions::nccl_max_ctas; 0 = NCCL's choice): fewer CTAs leave more SMs to the backward GEMMs
// that the reduction overlaps with. --cta-policy (CommOptions::nccl_cta_policy: 0 default, 1 efficiency,
// 2 zero) and --gemm-sm-margin (DDPConfig::gemm_sm_margin: SMs the GEMMs leave to the overlapped
// collective) take lists too; phases 2-3 run once per combination of the three lists. The first
// combination's run is "ddp", every run is in "ddp_variants".
// Tokens per step per GPU = micro_batch · seq · grad_accum. FLOPs per token = 6·N_matmul + 12·L·h·s
// (model::flops_per_token, non-causal attention count).
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/bench_common.hpp"
#include "core/cuda_backend.hpp"

#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/model/fp8.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/loss_scaler.hpp"

using namespace megacore;
namespace mdl = megacore::model;
namespace ly = megacore::layers;
namespace op = megacore::optim;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

struct Args : bench::ShapeArgs {
  Args() : ShapeArgs{.micro_batch = 4, .seq = 2048, .iters = 10, .warmup = 3} {}
  int64_t grad_accum = 1, breakdown_iters = 3;
  int64_t profile_steps = 0;  // steps between cudaProfilerStart/Stop after the single phase (step profile)
  int64_t bucket_size = 0;  // 0: DDP's default
  bool zero = false, single = false, bf16_reduce = false, no_overlap = false;
  bool bf16_states = false;  // bf16 main grads, no f32 masters, bf16 AdamW moments (the torch peer's precision)
  bool overlap_param_gather = false;  // ZeRO: all-gathers left running after the step, waited per layer in forward
  int comm_priority = 0;  // DDPConfig::comm_stream_priority
  double peak_tflops = 989.0;
  std::vector<int> max_ctas{0}, cta_policy{0}, gemm_sm_margin{0};
  std::string fp8 = "none";  // FP8 linears (docs/fp8.md): none, delayed or current
  bool fp8_bf16_wgrad = false;  // --fp8-bf16-wgrad: weight gradients in bf16 (Fp8Recipe::wgrad = false)
  std::string out;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::ArgReader r(argc, argv);
  // The current flag's comma-separated list, each value in [lo, hi] (runtime_error naming the flag otherwise).
  auto ints = [&r](int64_t lo, int64_t hi, const char* what) {
    std::vector<int> v;
    for (int64_t c : r.list()) {
      if (c < lo || c > hi) throw std::runtime_error(r.key() + " takes " + what);
      v.push_back(int(c));
    }
    return v;
  };
  while (r.next()) {
    const std::string& k = r.key();
    if (a.read(r)) continue;
    if (k == "--grad-accum") a.grad_accum = r.integer();
    else if (k == "--breakdown-iters") a.breakdown_iters = r.integer();
    else if (k == "--bucket-size") a.bucket_size = r.integer();
    else if (k == "--zero") a.zero = true;
    else if (k == "--overlap-param-gather") a.overlap_param_gather = true;
    else if (k == "--single") a.single = true;
    else if (k == "--bf16-reduce") a.bf16_reduce = true;
    else if (k == "--bf16-states") a.bf16_states = true;
    else if (k == "--profile-steps") a.profile_steps = r.integer();
    else if (k == "--no-overlap") a.no_overlap = true;
    else if (k == "--comm-priority") a.comm_priority = int(r.integer());
    else if (k == "--peak-tflops") a.peak_tflops = r.number();
    else if (k == "--max-ctas") a.max_ctas = ints(0, INT32_MAX, "CTA counts >= 0 (0 = NCCL's choice)");
    else if (k == "--cta-policy") a.cta_policy = ints(0, 2, "0 (default), 1 (efficiency) or 2 (zero)");
    else if (k == "--gemm-sm-margin") a.gemm_sm_margin = ints(0, INT32_MAX, "SM counts >= 0 (0 = off)");
    else if (k == "--fp8") a.fp8 = r.text();
    else if (k == "--fp8-bf16-wgrad") a.fp8_bf16_wgrad = true;
    else if (k == "--out") a.out = r.text();
    else r.unknown();
  }
  if (a.overlap_param_gather && !a.zero) throw std::runtime_error("--overlap-param-gather needs --zero");
  if (a.micro_batch < 1 || a.seq < 1 || a.grad_accum < 1 || a.iters < 1 || a.warmup < 0)
    throw std::runtime_error("--micro-batch, --seq, --grad-accum, --iters must be >= 1 (--warmup >= 0)");
  return a;
}

struct Trainer {
  mdl::GPTModel model;
  op::DistributedDataParallel ddp;
  std::unique_ptr<op::AdamW> adamw;
  std::unique_ptr<op::DistributedOptimizer> dopt;
  op::GradNormGroups groups;
  ly::ForwardContext ctx;
  Tensor tokens, labels;
  double loss = 0;

  static op::DDPConfig ddp_config(const Args& a, const Stream& s, int sm_margin) {
    op::DDPConfig c;
    c.gemm_sm_margin = sm_margin;
    c.bucket_size = a.bucket_size;
    c.use_distributed_optimizer = a.zero;
    c.reduce_dtype = a.bf16_reduce ? DType::BF16 : DType::F32;
    c.grad_dtype = a.bf16_states ? DType::BF16 : DType::F32;
    c.overlap_grad_reduce = !a.no_overlap;
    c.compute_stream = s;
    c.comm_stream_priority = a.comm_priority;
    return c;
  }

  static op::AdamWConfig adamw_config(const Args& a) {
    op::AdamWConfig c;
    if (a.bf16_states) c.main_params_dtype = c.exp_avg_dtype = c.exp_avg_sq_dtype = DType::BF16;
    return c;
  }

  Trainer(const mdl::TransformerConfig& cfg, comm::Communicator& tp, comm::Communicator& dp, Device dev,
          const Args& a, const Stream& s, int sm_margin = 0)
      : model(cfg, tp, mdl::GPTModelOptions{.device = dev}), ddp(model.parameters(), dp, ddp_config(a, s, sm_margin)) {
    ctx.stream = s;
    if (a.zero) {
      dopt = std::make_unique<op::DistributedOptimizer>(ddp, adamw_config(a), a.overlap_param_gather);
      if (a.overlap_param_gather)
        model.set_pre_forward_callback(
            [d = dopt.get()](const std::vector<ly::Parameter*>& ps) { d->wait_param_gather(ps); });
      groups.reduce = {&dp};
    } else {
      adamw = std::make_unique<op::AdamW>(model.parameters(), adamw_config(a));
    }
    model.set_grad_ready_callback(ddp.grad_ready_hook());
    if (a.fp8 != "none") {
      ly::Fp8Recipe r;
      r.scaling = ly::fp8_scaling_from_name(a.fp8);
      r.wgrad = !a.fp8_bf16_wgrad;
      mdl::enable_fp8(model, r);
    }
    // Different data on every rank (what DP does), fixed over steps.
    std::vector<int64_t> tok(size_t(a.micro_batch * a.seq)), lab(tok.size());
    for (size_t i = 0; i < tok.size(); ++i) {
      tok[i] = int64_t((i * 7919 + 13 + size_t(dp.rank()) * 31) % uint64_t(cfg.vocab_size));
      lab[i] = int64_t((i * 104729 + 3 + size_t(dp.rank()) * 17) % uint64_t(cfg.vocab_size));
    }
    tokens = Tensor::from_vector<int64_t>(tok, {a.micro_batch, a.seq}).to(dev, s);
    labels = Tensor::from_vector<int64_t>(lab, {a.micro_batch, a.seq}).to(dev, s);
  }

  // One optimizer step. With `timing`, the device is synchronised after the last backward and the
  // returned pair is (seconds of forward+backward, seconds in finish_grad_sync).
  std::pair<double, double> step(const Args& a, bool timing) {
    const auto t0 = Clock::now();
    ddp.zero_grad();
    mdl::fp8_begin_step(model, ctx.stream);  // no-op without FP8
    for (int64_t m = 0; m < a.grad_accum; ++m) {
      ddp.set_is_last_microbatch(m == a.grad_accum - 1);
      model.forward(ctx, tokens, labels);
      model.backward(ctx);
    }
    if (timing) ctx.stream.synchronize();
    const auto t1 = Clock::now();
    ddp.finish_grad_sync();
    if (timing) ctx.stream.synchronize();
    const auto t2 = Clock::now();
    const op::CheckedStepOptions co{.max_norm = 1.0, .grad_scale = 1.0 / double(a.grad_accum)};
    op::StepResult r = dopt ? op::checked_step(*dopt, 3e-4, groups, co) : op::checked_step(*adamw, 3e-4, groups, co);
    if (r.skipped) throw std::runtime_error("non-finite gradients in the benchmark");
    return {std::chrono::duration<double>(t1 - t0).count(), std::chrono::duration<double>(t2 - t1).count()};
  }
};

// Mean seconds per step over a.iters after a.warmup (all ranks in lockstep).
double time_steps(Trainer& t, const Args& a, comm::Communicator& mpi) {
  for (int64_t i = 0; i < a.warmup; ++i) t.step(a, false);
  t.ctx.stream.synchronize();
  mpi.barrier();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < a.iters; ++i) t.step(a, false);
  t.ctx.stream.synchronize();
  const double local = std::chrono::duration<double>(Clock::now() - t0).count() / double(a.iters);
  Tensor x = Tensor::full({1}, local, DType::F32);
  mpi.all_reduce(x, comm::ReduceOp::Max)->wait();  // the slowest rank sets the pace
  return x.item();
}

double mean_over(comm::Communicator& mpi, double v) {
  Tensor x = Tensor::full({1}, v, DType::F32);
  mpi.all_reduce(x, comm::ReduceOp::Sum)->wait();
  return x.item() / mpi.size();
}

}  // namespace

int main(int argc, char** argv) {
  return bench::mpi_main(argc, argv, "bench_ddp", [&] {
    const Args a = parse(argc, argv);
    auto mpi = comm::make_mpi_world();
    const Device dev = bench::local_gpu();
    const bool root = mpi->rank() == 0;
    const mdl::TransformerConfig cfg = bench::llama_1b();
    comm::CommOptions so;
    so.name = "self";
    auto self_mpi = mpi->split(mpi->rank(), 0, so);
    // TP = 1, and the DP group of the single phase
    auto self = bench::nccl_over(*self_mpi, dev, "self", std::chrono::seconds(600));
    const double tokens_per_step = double(a.micro_batch * a.seq * a.grad_accum);
    const mdl::FlopsPerToken fpt = mdl::flops_per_token(cfg, a.seq, false);
    Allocator& al = Allocator::get(dev);
    Stream s = Stream::create(dev);

    // 1. Each GPU alone.
    double single_sec = 0, single_peak_gib = 0;
    {
      Trainer t(cfg, *self, *self, dev, a, s);
      al.reset_peak_stats();
      for (int64_t i = 0; i < a.warmup; ++i) t.step(a, false);
      s.synchronize();
      const auto t1 = Clock::now();
      for (int64_t i = 0; i < a.iters; ++i) t.step(a, false);
      s.synchronize();
      single_sec = mean_over(*mpi, std::chrono::duration<double>(Clock::now() - t1).count() / double(a.iters));
      single_peak_gib = double(al.stats().peak_allocated) / (1 << 30);
      if (a.profile_steps > 0) {  // a range for benchmarks/tools/step_profile (or nsys --capture-range=cudaProfilerApi)
        cuda_impl::profiler_range(true);
        for (int64_t i = 0; i < a.profile_steps; ++i) t.step(a, false);
        s.synchronize();
        cuda_impl::profiler_range(false);
      }
    }
    const double single_tps = tokens_per_step / single_sec;
    json r = {{"benchmark", "ddp_training"},
              {"card", cuda_device_name(dev.index)},
              {"model", "llama-1.1b (h2048 L16 a32 g8 ffn8192 v32000, untied)"},
              {"dtype", a.bf16_states ? "bf16 params, grads and AdamW moments (no f32 masters)"
                                      : "bf16 params, f32 grads and AdamW state"},
              {"optimizer", a.zero ? "DistributedOptimizer (ZeRO-1 AdamW)" : "AdamW (replicated)"},
              {"overlap_param_gather", a.zero && a.overlap_param_gather},
              {"grad_reduce_dtype", a.bf16_reduce ? "bf16" : "f32"},
              {"overlap_grad_reduce", !a.no_overlap},
              {"comm_stream_priority", a.comm_priority},
              {"micro_batch", a.micro_batch},
              {"seq", a.seq},
              {"grad_accum", a.grad_accum},
              {"fp8", a.fp8},
              {"fp8_wgrad", a.fp8 != "none" && !a.fp8_bf16_wgrad},
              {"flops_convention", "6N_matmul + 12*L*h*s (non-causal)"},
              {"single", {{"ms_per_step", single_sec * 1e3},
                          {"tokens_per_s", single_tps},
                          {"tflops", fpt.total * single_tps / 1e12},
                          {"mfu", fpt.total * single_tps / 1e12 / a.peak_tflops},
                          {"peak_allocated_gib", single_peak_gib}}}};

    // 2. and 3. DDP over all ranks.
    struct Variant {
      int max_ctas, cta_policy, sm_margin;
    };
    std::vector<Variant> variants;
    for (int c : a.max_ctas)
      for (int p : a.cta_policy)
        for (int m : a.gemm_sm_margin) variants.push_back({c, p, m});
    for (size_t variant = 0; variant < variants.size() && !a.single && mpi->size() > 1; ++variant) {
      const Variant& v = variants[variant];
      auto dp = bench::nccl_over(*mpi, dev, "dp", std::chrono::seconds(600), v.max_ctas, v.cta_policy);
      Trainer t(cfg, *self, *dp, dev, a, s, v.sm_margin);
      al.reset_peak_stats();
      const double sec = time_steps(t, a, *mpi);
      const double tps_gpu = tokens_per_step / sec;
      const double peak_gib = double(al.stats().peak_allocated) / (1 << 30);
      // Breakdown: with and without overlap (the DDP config is read at launch time: flip it per run).
      json br = json::object();
      for (bool overlap : {true, false}) {
        t.model.set_grad_ready_callback(overlap ? t.ddp.grad_ready_hook() : mdl::GradReadyCallback{});
        double fb = 0, fin = 0;
        int64_t from_notify = 0;
        for (int64_t i = 0; i < a.breakdown_iters; ++i) {
          auto [x, y] = t.step(a, true);
          fb += x;
          fin += y;
          for (const op::BucketLaunch& l : t.ddp.launches()) from_notify += l.from_notify;
        }
        fb = mean_over(*mpi, fb / double(a.breakdown_iters));
        fin = mean_over(*mpi, fin / double(a.breakdown_iters));
        br[overlap ? "overlap" : "no_overlap"] = {
            {"forward_backward_ms", fb * 1e3},
            {"finish_grad_sync_after_backward_ms", fin * 1e3},
            {"buckets", t.ddp.buffer().buckets().size()},
            {"buckets_launched_during_backward_per_step", double(from_notify) / double(a.breakdown_iters)}};
      }
      t.model.set_grad_ready_callback(t.ddp.grad_ready_hook());
      const double exposed = br["overlap"]["finish_grad_sync_after_backward_ms"].get<double>();
      const double whole = br["no_overlap"]["finish_grad_sync_after_backward_ms"].get<double>();
      json d = {{"gpus", mpi->size()},
                  {"nccl_max_ctas", v.max_ctas},
                  {"nccl_cta_policy", v.cta_policy},
                  {"gemm_sm_margin", v.sm_margin},
                  {"ms_per_step", sec * 1e3},
                  {"tokens_per_s", tps_gpu * mpi->size()},
                  {"tokens_per_s_per_gpu", tps_gpu},
                  {"tflops_per_gpu", fpt.total * tps_gpu / 1e12},
                  {"mfu", fpt.total * tps_gpu / 1e12 / a.peak_tflops},
                  {"scaling_efficiency", tps_gpu / single_tps},
                  {"peak_allocated_gib", peak_gib},
                  {"optimizer_state_gib", double(t.dopt ? t.dopt->state_bytes()
                                                        : 12 * t.ddp.buffer().param_numel()) / (1 << 30)},
                  {"breakdown", br},
                  {"reduction_hidden_fraction", whole > 0 ? std::max(0.0, 1.0 - exposed / whole) : 0.0}};
      if (variant == 0) r["ddp"] = d;
      r["ddp_variants"].push_back(d);
      if (root)
        std::printf("ddp max_ctas %d cta_policy %d sm_margin %d: %.1f ms/step, scaling %.4f, fwd+bwd overlap %.1f / "
                    "no overlap %.1f ms, exposed %.2f ms\n",
                    v.max_ctas, v.cta_policy, v.sm_margin, sec * 1e3, tps_gpu / single_tps,
                    br["overlap"]["forward_backward_ms"].get<double>(),
                    br["no_overlap"]["forward_backward_ms"].get<double>(), exposed);
    }
    if (root) {
      std::printf("%s\n", r.dump(2).c_str());
      if (!a.out.empty()) std::ofstream(a.out) << r.dump(2) << "\n";
    }
  });
}
