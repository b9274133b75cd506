// GPTModel forward + backward throughput and activation memory, one GPU per rank, tensor parallel over all
// ranks (NCCL):
//   mpirun -np 1 build/benchmarks/megacore_bench_model --out results.json
//   mpirun -np 4 build/benchmarks/megacore_bench_model --sequence-parallel --out results.json
//   (--tp-comm-overlap overlaps the column-parallel backward collectives; --tp-comm-overlap-forward, with
//   --sequence-parallel, the forward's all-gathers and reduce-scatters as rings beside row chunks of the GEMMs;
//   --tp-comm-priority N gives their communication streams CUDA priority N, negative = higher)
// Model: the Llama-1.1B of the peer figures in NOTES.md (h2048, 16 layers, 32 heads, 8 KV groups, FFN 8192,
// vocab 32000, untied), bf16 parameters and activations, micro-batch 4 × 2048 by default. No optimizer step:
// this measures the model (the trainer benchmarks measure whole steps). The peer is Hugging Face
// LlamaForCausalLM of the same shape (benchmarks/model/torch_llama_peer.py), run in the same call.
//
// Reported: ms per forward+backward, tokens/s (global and per GPU), model TFLOP/s per GPU with FLOPs =
// (6·N_matmul + 12·L·h·s non-causal attention) per token (model::flops_per_token), MFU against --peak-tflops
// (989 = dense bf16 of an H100/H200 SXM), peak allocated memory, and the saved activations of one
// TransformerLayer measured with the caching allocator (allocated after its forward, output included, minus
// before) next to model::activation_bytes_per_layer for recompute none and selective.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/bench_common.hpp"

#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/model/memory.hpp"

using namespace megacore;
namespace mdl = megacore::model;
namespace ly = megacore::layers;
using json = nlohmann::json;

namespace {

struct Args : bench::ShapeArgs {
  Args() : ShapeArgs{.micro_batch = 4, .seq = 2048, .iters = 10, .warmup = 3} {}
  bool sp = false, overlap = false, overlap_forward = false;
  int comm_priority = 0;  // TransformerConfig::tp_comm_stream_priority
  std::string recompute = "none";
  double peak_tflops = 989.0;
  std::string out;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::ArgReader r(argc, argv);
  while (r.next()) {
    const std::string& k = r.key();
    if (a.read(r)) continue;
    if (k == "--sequence-parallel") a.sp = true;
    else if (k == "--tp-comm-overlap") a.overlap = true;
    else if (k == "--tp-comm-overlap-forward") a.overlap_forward = true;
    else if (k == "--tp-comm-priority") a.comm_priority = int(r.integer());
    else if (k == "--recompute") a.recompute = r.text();
    else if (k == "--peak-tflops") a.peak_tflops = r.number();
    else if (k == "--out") a.out = r.text();
    else r.unknown();
  }
  return a;
}

mdl::RecomputeGranularity recompute_of(const std::string& s) {
  if (s == "none") return mdl::RecomputeGranularity::None;
  if (s == "selective") return mdl::RecomputeGranularity::Selective;
  if (s == "full") return mdl::RecomputeGranularity::Full;
  throw std::runtime_error("--recompute must be none, selective or full");
}

// Saved activations of one layer: allocated bytes after its forward (output held) minus before.
json measure_layer(comm::Communicator& tp, mdl::TransformerConfig cfg, const Args& a, Device dev,
                   mdl::RecomputeGranularity rc) {
  cfg.recompute_granularity = rc;
  ly::ForwardContext ctx;
  ctx.stream = Stream::create(dev);
  mdl::TransformerLayerOptions lo;
  lo.device = dev;
  mdl::TransformerLayer layer(tp, cfg, lo);
  const int64_t s_local = cfg.sequence_parallel ? a.seq / tp.size() : a.seq;
  Tensor x = Tensor::empty({s_local, a.micro_batch, cfg.hidden_size}, cfg.params_dtype, dev, ctx.stream);
  Generator g(7, 0);
  x.normal_(g, 0.0, 1.0, ctx.stream);
  Allocator& al = Allocator::get(dev);
  ctx.stream.synchronize();
  const int64_t before = al.stats().allocated;
  Tensor y = layer.forward(ctx, x);
  ctx.stream.synchronize();
  const int64_t after = al.stats().allocated;
  mdl::ActivationEstimate est = mdl::activation_bytes_per_layer(cfg, a.seq, a.micro_batch, tp.size(),
                                                                cfg.sequence_parallel, 2, rc);
  const double measured = double(after - before);
  return {{"recompute", std::string(mdl::recompute_granularity_name(rc))},
          {"measured_bytes", measured},
          {"analytic_bytes", est.total},
          {"ratio", measured / est.total}};
}

}  // namespace

int main(int argc, char** argv) {
  return bench::mpi_main(argc, argv, "bench_gpt_model", [&] {
    const Args a = parse(argc, argv);
    auto mpi = comm::make_mpi_world();
    const Device dev = bench::local_gpu();
    auto tp = bench::nccl_over(*mpi, dev, "tp", std::chrono::seconds(300));
    mdl::TransformerConfig cfg = bench::llama_1b();
    cfg.sequence_parallel = a.sp && tp->size() > 1;
    cfg.tp_comm_overlap = a.overlap;
    cfg.tp_comm_overlap_forward = a.overlap_forward && cfg.sequence_parallel;
    cfg.tp_comm_stream_priority = a.comm_priority;
    cfg.recompute_granularity = recompute_of(a.recompute);
    const bool root = mpi->rank() == 0;

    json layer_mem = json::array();
    for (auto g : {mdl::RecomputeGranularity::None, mdl::RecomputeGranularity::Selective})
      layer_mem.push_back(measure_layer(*tp, cfg, a, dev, g));

    mdl::GPTModelOptions mo;
    mo.device = dev;
    mdl::GPTModel model(cfg, *tp, mo);
    ly::ForwardContext ctx;
    ctx.stream = Stream::create(dev);
    std::vector<int64_t> tok(size_t(a.micro_batch * a.seq)), lab(tok.size());
    for (size_t i = 0; i < tok.size(); ++i) {
      tok[i] = int64_t((i * 7919 + 13) % uint64_t(cfg.vocab_size));
      lab[i] = int64_t((i * 104729 + 3) % uint64_t(cfg.vocab_size));
    }
    Tensor tokens = Tensor::from_vector<int64_t>(tok, {a.micro_batch, a.seq}).to(dev, ctx.stream);
    Tensor labels = Tensor::from_vector<int64_t>(lab, {a.micro_batch, a.seq}).to(dev, ctx.stream);
    Allocator& al = Allocator::get(dev);
    // The loss is read once after the timed loop: an item() per step would stall the host between the
    // forward and the backward and hide what the stream-ordered collectives save.
    Tensor loss_t;
    auto step = [&] {
      loss_t = model.forward(ctx, tokens, labels);
      model.backward(ctx);
    };
    for (int64_t i = 0; i < a.warmup; ++i) step();
    ctx.stream.synchronize();
    al.reset_peak_stats();
    tp->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < a.iters; ++i) step();
    ctx.stream.synchronize();
    tp->barrier();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(a.iters);
    const double loss = loss_t.item();
    const double tokens_per_step = double(a.micro_batch * a.seq);
    const mdl::FlopsPerToken fpt = mdl::flops_per_token(cfg, a.seq, false);
    const double tflops_gpu = fpt.total * tokens_per_step / sec / tp->size() / 1e12;
    MemoryStats ms = al.stats();
    json r = {{"benchmark", "gpt_model_fwd_bwd"},
              {"card", cuda_device_name(dev.index)},
              {"model", "llama-1.1b (h2048 L16 a32 g8 ffn8192 v32000)"},
              {"dtype", "bf16"},
              {"gpus", tp->size()},
              {"tensor_parallel", tp->size()},
              {"sequence_parallel", cfg.sequence_parallel},
              {"tp_comm_overlap", cfg.tp_comm_overlap},
              {"tp_comm_overlap_forward", cfg.tp_comm_overlap_forward},
              {"tp_comm_stream_priority", cfg.tp_comm_stream_priority},
              {"recompute", a.recompute},
              {"micro_batch", a.micro_batch},
              {"seq", a.seq},
              {"ms_per_step", sec * 1e3},
              {"tokens_per_s", tokens_per_step / sec},
              {"tokens_per_s_per_gpu", tokens_per_step / sec / tp->size()},
              {"tflops_per_gpu", tflops_gpu},
              {"flops_convention", "6N_matmul + 12*L*h*s (non-causal)"},
              {"mfu", tflops_gpu / a.peak_tflops},
              {"peak_tflops", a.peak_tflops},
              {"loss", loss},
              {"peak_allocated_gib", double(ms.peak_allocated) / (1 << 30)},
              {"layer_activation_memory", layer_mem}};
    if (root) {
      std::printf("%s\n", r.dump(2).c_str());
      if (!a.out.empty()) std::ofstream(a.out) << r.dump(2) << "\n";
    }
  });
}
