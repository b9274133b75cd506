// Pipeline bubble: measured idle fraction per stage of PipelineEngine vs theoretical_bubble_fraction().
//
//   mpirun -np 4 build/benchmarks/megacore_bench_pipeline --out results.json               # 4 GPUs (NCCL)
//   mpirun -np 4 build/benchmarks/megacore_bench_pipeline --vp 2 --microbatches 4,8,16
//   mpirun --oversubscribe -np 4 build/benchmarks/megacore_bench_pipeline --cpu            # CPU ranks (MPI)
//   mpirun -np 4 build/benchmarks/megacore_bench_pipeline --layers 15 --layout balanced
//
// Every launched rank is one pipeline stage (PP = world size, TP = DP = 1). With GPUs (one per rank,
// NCCL point-to-point on a dedicated stream) the model is a Llama-style decoder (h1024, 16 layers, 16
// heads, 8 KV groups, FFN 4096, vocab 32000, bf16, micro-batch 1 × 2048) split evenly over PP × VP
// virtual stages; on CPU (or with --cpu) a tiny one (h128, 8 layers, vocab 256, f32, 2 × 64).
// For each micro-batch count m it runs --warmup untimed steps, then --iters steps, and reports per stage
// the compute (busy) time, the step time and the idle fraction 1 − busy/step (averaged over the
// timed steps), next to the ideal (PP − 1)/(VP·m + PP − 1). Measured idle also contains what the ideal
// ignores: transfers, stage imbalance (the first stage embeds, the last runs the output layer and
// loss — with a 32k vocabulary that is a sizeable extra) and host overhead. No optimizer step.
// --layout: `uniform` (default; needs layers % (PP·VP) == 0), explicit counts `4,4,4,3` (model order), or
// `balanced`: one profiled step with the near-even split measures each rank's compute, then
// stage_costs_from_profile() gives the embedding and head costs in layers and PipelineLayout::balanced()
// the split that evens out the stages, which the measurement then uses (both recorded in the JSON).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench_common.hpp"
#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/core/device.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/pipeline/engine.hpp"

using namespace megacore;
namespace mdl = megacore::model;
namespace ly = megacore::layers;
namespace pl = megacore::pipeline;
using json = nlohmann::json;

namespace {

struct Args {
  int vp = 1;
  std::vector<int64_t> microbatches;
  int64_t micro_batch = 0, seq = 0, layers = 0, hidden = 0;
  int iters = 5, warmup = 2;
  bool cpu = false;
  std::string out, layout = "uniform";
};

Args parse(int argc, char** argv) {
  Args a;
  bench::ArgReader r(argc, argv);
  while (r.next()) {
    const std::string& k = r.key();
    if (k == "--vp") a.vp = int(r.integer());
    else if (k == "--microbatches") a.microbatches = r.list();
    else if (k == "--micro-batch") a.micro_batch = r.integer();
    else if (k == "--seq") a.seq = r.integer();
    else if (k == "--layers") a.layers = r.integer();
    else if (k == "--hidden") a.hidden = r.integer();
    else if (k == "--iters") a.iters = int(r.integer());
    else if (k == "--warmup") a.warmup = int(r.integer());
    else if (k == "--cpu") a.cpu = true;
    else if (k == "--layout") a.layout = r.text();
    else if (k == "--out") a.out = r.text();
    else r.unknown();
  }
  return a;
}

// A one-rank NCCL communicator (the TP group of TP = 1).
std::unique_ptr<comm::Communicator> solo_nccl(Device dev, const std::string& name) {
  comm::CommOptions o;
  o.name = name;
  o.timeout = std::chrono::seconds(300);
  return comm::make_nccl_communicator(0, 1, comm::nccl_unique_id(), dev, o);
}

}  // namespace

int main(int argc, char** argv) {
  return bench::mpi_main(argc, argv, "bench_pipeline", [&] {
    Args a = parse(argc, argv);
    comm::CommOptions mo;
    mo.timeout = std::chrono::seconds(300);
    auto mpi = comm::make_mpi_world(mo);
    const bool gpu = !a.cpu && cuda_available() && cuda_device_count() > 0;
    const int pp = mpi->size();
    Device dev = Device::cpu();
    std::unique_ptr<comm::Communicator> pp_comm, tp;
    mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
    if (gpu) {
      dev = bench::local_gpu();
      pp_comm = bench::nccl_over(*mpi, dev, "pp", std::chrono::seconds(300));
      tp = solo_nccl(dev, "tp");
      cfg = mdl::presets::llama32_1b();
      cfg.hidden_size = a.hidden ? a.hidden : 1024;
      cfg.num_layers = a.layers ? a.layers : 16;
      cfg.num_attention_heads = 16;
      cfg.num_query_groups = 8;
      cfg.ffn_hidden_size = 4 * cfg.hidden_size;
      cfg.vocab_size = 32000;
      cfg.tie_word_embeddings = false;
      cfg.rope_scaling = {};
      cfg.max_position_embeddings = 4096;
      cfg.params_dtype = DType::BF16;
      if (!a.micro_batch) a.micro_batch = 1;
      if (!a.seq) a.seq = 2048;
    } else {
      pp_comm = mpi->split(0, mpi->rank(), [&] { comm::CommOptions o = mo; o.name = "pp"; return o; }());
      tp = mpi->split(mpi->rank(), 0, [&] { comm::CommOptions o = mo; o.name = "tp"; return o; }());
      cfg.hidden_size = a.hidden ? a.hidden : 128;
      cfg.num_layers = a.layers ? a.layers : 8;
      cfg.ffn_hidden_size = 2 * cfg.hidden_size;
      if (!a.micro_batch) a.micro_batch = 2;
      if (!a.seq) a.seq = 64;
    }
    if (a.microbatches.empty()) a.microbatches = {int64_t(pp), int64_t(2 * pp), int64_t(4 * pp)};
    const int r = pp_comm->rank();
    // The model chunks and engine for one layout (rebuilt when `balanced` replaces the profiling split).
    struct Built {
      pl::PipelineLayout layout;
      std::vector<std::unique_ptr<mdl::GPTModel>> chunks;
      std::vector<mdl::GPTModel*> ptrs;
      std::unique_ptr<pl::PipelineEngine> engine;
    };
    auto build = [&](const pl::PipelineLayout& lay) {
      auto b = std::make_unique<Built>(Built{lay, {}, {}, nullptr});
      for (int c = 0; c < a.vp; ++c) {
        b->chunks.push_back(std::make_unique<mdl::GPTModel>(
            cfg, *tp,
            mdl::GPTModelOptions{.device = dev,
                                 .layer_indices = b->layout.layer_indices(r, c),
                                 .pre_process = b->layout.has_embedding(r, c),
                                 .post_process = b->layout.has_head(r, c)}));
        b->ptrs.push_back(b->chunks.back().get());
      }
      b->engine = std::make_unique<pl::PipelineEngine>(*pp_comm, b->layout, b->ptrs);
      return b;
    };
    std::unique_ptr<Built> built;
    json layout_info = {{"mode", a.layout}};
    ly::ForwardContext ctx;
    if (gpu) ctx.stream = Stream::create(dev);
    std::vector<int64_t> tok(size_t(a.micro_batch * a.seq)), lab(tok.size());
    for (size_t i = 0; i < tok.size(); ++i) {
      tok[i] = int64_t((i * 7919 + 13) % size_t(cfg.vocab_size));
      lab[i] = int64_t((i * 104729 + 7) % size_t(cfg.vocab_size));
    }
    const pl::MicroBatch mb{Tensor::from_vector<int64_t>(tok, {a.micro_batch, a.seq}).to(dev),
                            Tensor::from_vector<int64_t>(lab, {a.micro_batch, a.seq}).to(dev), Tensor()};

    if (a.layout == "uniform") {
      built = build(pl::PipelineLayout::uniform(cfg.num_layers, pp, a.vp));
    } else if (a.layout == "balanced") {
      // Profile: the near-even split, warm-up steps then one measured step at the largest m.
      built = build(pl::PipelineLayout::balanced(cfg.num_layers, pp, a.vp, {}));
      const std::vector<pl::MicroBatch> mbs(size_t(a.microbatches.back()), mb);
      double busy = 0;
      for (int it = 0; it < a.warmup + 1; ++it) {
        for (auto* c : built->ptrs) c->zero_grad();
        busy = built->engine->step(ctx, mbs).busy_seconds;
      }
      std::vector<double> all(static_cast<size_t>(pp), 0.0);
      MPI_Allgather(&busy, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
      const pl::StageCosts costs = pl::stage_costs_from_profile(built->layout, all);
      layout_info["profiled_counts"] = built->layout.counts();
      std::vector<double> all_ms = all;
      for (double& v : all_ms) v *= 1e3;
      layout_info["profiled_busy_ms"] = all_ms;
      layout_info["embedding_cost_layers"] = costs.embedding;
      layout_info["head_cost_layers"] = costs.head;
      const pl::PipelineLayout lay = pl::PipelineLayout::balanced(cfg.num_layers, pp, a.vp, costs);
      built.reset();
      built = build(lay);
      if (mpi->rank() == 0)
        std::printf("balanced layout: head %.2f layers, embedding %.2f layers -> %s\n", costs.head,
                    costs.embedding, json(lay.counts()).dump().c_str());
    } else {
      built = build(pl::PipelineLayout::from_counts(cfg.num_layers, pp, a.vp, bench::ArgReader::int_list("--layout", a.layout)));
    }
    layout_info["counts"] = built->layout.counts();
    pl::PipelineEngine& engine = *built->engine;
    const std::vector<mdl::GPTModel*>& ptrs = built->ptrs;

    json results = json::array();
    for (int64_t m : a.microbatches) {
      const std::vector<pl::MicroBatch> mbs(size_t(m), mb);
      double busy = 0, step = 0, idle = 0, loss = 0, theory = 0;
      for (int it = 0; it < a.warmup + a.iters; ++it) {
        for (auto* c : ptrs) c->zero_grad();
        const pl::StepResult s = engine.step(ctx, mbs);
        if (it < a.warmup) continue;
        busy += s.busy_seconds / a.iters;
        step += s.step_seconds / a.iters;
        idle += s.idle_fraction / a.iters;
        loss = s.loss;
        theory = s.theoretical_bubble;
      }
      std::vector<double> mine = {busy, step, idle}, all(size_t(3 * pp));
      MPI_Allgather(mine.data(), 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, MPI_COMM_WORLD);
      json stages = json::array();
      double mean_idle = 0, max_step = 0;
      for (int q = 0; q < pp; ++q) {
        stages.push_back({{"stage", q},
                          {"busy_ms", all[size_t(3 * q)] * 1e3},
                          {"step_ms", all[size_t(3 * q + 1)] * 1e3},
                          {"idle_fraction", all[size_t(3 * q + 2)]}});
        mean_idle += all[size_t(3 * q + 2)] / pp;
        max_step = std::max(max_step, all[size_t(3 * q + 1)]);
      }
      results.push_back({{"microbatches", m},
                         {"theoretical_bubble", theory},
                         {"mean_idle_fraction", mean_idle},
                         {"step_ms", max_step * 1e3},
                         {"loss", loss},
                         {"stages", stages}});
      if (mpi->rank() == 0) {
        std::printf("PP %d VP %d m %3lld  theory %.3f  measured mean %.3f  per stage:", pp, a.vp, (long long)m, theory,
                    mean_idle);
        for (int q = 0; q < pp; ++q) std::printf(" %.3f", all[size_t(3 * q + 2)]);
        std::printf("  (step %.1f ms)\n", max_step * 1e3);
      }
    }
    json out = {{"benchmark", "pipeline_bubble"},
                {"card", gpu ? cuda_device_name(dev.index) : std::string("cpu")},
                {"backend", gpu ? "nccl" : "mpi"},
                {"pipeline_parallel", pp},
                {"virtual_stages", a.vp},
                {"schedule", std::string(pl::schedule_kind_name(engine.schedule_config(a.microbatches[0]).kind))},
                {"model", {{"hidden", cfg.hidden_size}, {"layers", cfg.num_layers}, {"heads", cfg.num_attention_heads},
                           {"ffn", cfg.ffn_hidden_size}, {"vocab", cfg.vocab_size},
                           {"dtype", std::string(dtype_name(cfg.params_dtype))}}},
                {"layout", layout_info},
                {"micro_batch", a.micro_batch},
                {"seq", a.seq},
                {"iters", a.iters},
                {"idle_definition", "1 - compute(F+B) time / step time, per stage, mean over timed steps"},
                {"results", results}};
    if (mpi->rank() == 0) {
      std::printf("%s\n", out.dump(2).c_str());
      if (!a.out.empty()) std::ofstream(a.out) << out.dump(2) << "\n";
    }
  });
}
