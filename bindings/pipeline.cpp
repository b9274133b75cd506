// Python bindings of pipeline parallelism (megacore._C.pipeline, re-exported as megacore.pipeline):
// layouts, schedules as data, GPTModel pipeline stages and the PipelineEngine. See docs/pipeline.md.
#include <memory>
#include <optional>
#include <utility>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/pipeline/engine.hpp"
#include "megacore/pipeline/layout.hpp"
#include "megacore/pipeline/schedule.hpp"

namespace megacore::py {
namespace {

namespace pl = megacore::pipeline;
namespace mdl = megacore::model;

// A megacore.Tensor as is, anything else through numpy (as the model bindings take batches).
Tensor batch_tensor(const pyb::object& o, const char* what) {
  if (pyb::isinstance<Tensor>(o)) return o.cast<Tensor>();
  MC_CHECK(!o.is_none(), "{} is None; pass a megacore.Tensor, a numpy array or a DLPack tensor", what);
  pyb::module_ np = pyb::module_::import("numpy");
  pyb::module_ core = pyb::module_::import("megacore._C");
  if (!pyb::isinstance(o, np.attr("ndarray")) && pyb::hasattr(o, "__dlpack__"))
    return core.attr("from_dlpack")(o).cast<Tensor>();
  return core.attr("from_numpy")(np.attr("ascontiguousarray")(np.attr("asarray")(o))).cast<Tensor>();
}

pyb::tuple op_tuple(const pl::Op& op) {
  return pyb::make_tuple(std::string(pl::op_kind_name(op.kind)), op.microbatch, op.chunk, op.peer);
}

pl::ScheduleConfig schedule_of(int pp, int vp, int64_t m) { return pl::make_schedule_config(pp, vp, m); }

// The engine with the model chunks and groups it refers to kept alive by the Python object.
struct PyEngine {
  std::unique_ptr<pl::PipelineEngine> engine;
  pyb::object keep;  // (pp, layout, chunks, dp, embedding)
};

}  // namespace

void bind_pipeline(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("pipeline", "Pipeline parallelism: layouts, schedules, stages, engine.");

  pyb::class_<pl::PipelineLayout>(m, "PipelineLayout", "Transformer layers per (pipeline rank, virtual chunk).")
      .def_static("uniform", &pl::PipelineLayout::uniform, pyb::arg("num_layers"), pyb::arg("pipeline_parallel"),
                  pyb::arg("virtual_stages") = 1, "num_layers / (PP × VP) per virtual stage; ConfigError if uneven.")
      .def_static("from_counts", &pl::PipelineLayout::from_counts, pyb::arg("num_layers"),
                  pyb::arg("pipeline_parallel"), pyb::arg("virtual_stages"), pyb::arg("counts"),
                  "Explicit per-virtual-stage counts in model order (index chunk · PP + pp_rank).")
      .def_static(
          "balanced",
          [](int64_t num_layers, int pp, int vp, double embedding_cost, double head_cost,
             int64_t recompute_num_layers) {
            return pl::PipelineLayout::balanced(num_layers, pp, vp,
                                                pl::StageCosts{embedding_cost, head_cost, recompute_num_layers});
          },
          pyb::arg("num_layers"), pyb::arg("pipeline_parallel"), pyb::arg("virtual_stages") = 1,
          pyb::arg("embedding_cost") = 0.0, pyb::arg("head_cost") = 0.0, pyb::arg("recompute_num_layers") = -1,
          "Counts that minimise the largest stage cost, the first stage's embedding and the last stage's head "
          "(output layer + loss) costing the given number of layers; with recompute_num_layers N >= 0 (block "
          "recompute) the first N layers of each virtual stage cost 4/3 of a layer.")
      .def_property_readonly("pipeline_parallel", &pl::PipelineLayout::pipeline_parallel)
      .def_property_readonly("virtual_stages", &pl::PipelineLayout::virtual_stages)
      .def_property_readonly("num_layers", &pl::PipelineLayout::num_layers)
      .def_property_readonly("counts", &pl::PipelineLayout::counts)
      .def("layer_indices", &pl::PipelineLayout::layer_indices, pyb::arg("pp_rank"), pyb::arg("chunk") = 0)
      .def("num_layers_on_rank", &pl::PipelineLayout::num_layers_on_rank, pyb::arg("pp_rank"))
      .def("has_embedding", &pl::PipelineLayout::has_embedding, pyb::arg("pp_rank"), pyb::arg("chunk") = 0)
      .def("has_head", &pl::PipelineLayout::has_head, pyb::arg("pp_rank"), pyb::arg("chunk") = 0);

  m.def("stage_costs_from_profile", [](const pl::PipelineLayout& layout, const std::vector<double>& busy,
                                       int64_t recompute_num_layers) {
    const pl::StageCosts c = pl::stage_costs_from_profile(layout, busy, recompute_num_layers);
    return pyb::make_tuple(c.embedding, c.head);
  }, pyb::arg("layout"), pyb::arg("busy_per_rank"), pyb::arg("recompute_num_layers") = -1,
     "(embedding_cost, head_cost) in layers from one step's compute time per pipeline rank under `layout` "
     "(recompute_num_layers: the profiled run's block recompute, -1 = none).");

  m.def("stage_costs_from_model", [](const megacore::model::TransformerConfig& cfg, int64_t seq_len, int tp,
                                     int64_t recompute_num_layers) {
    const pl::StageCosts c = pl::stage_costs_from_model(cfg, seq_len, tp, recompute_num_layers);
    return pyb::make_tuple(c.embedding, c.head);
  }, pyb::arg("config"), pyb::arg("seq_len"), pyb::arg("tp_size") = 1, pyb::arg("recompute_num_layers") = -1,
     "(embedding_cost, head_cost) in layers from the model's shape: output-layer matmul FLOPs (padded vocabulary of a "
     "TP rank) over an average layer's (weights, causal attention, recompute); the embedding lookup does none. With "
     "recompute_num_layers N >= 0 (full recompute only) the layer is one without recompute.");
  m.def("resolve_stage_costs", [](const megacore::model::TransformerConfig& cfg, int64_t seq_len, int tp,
                                  double embedding_cost, double head_cost, int64_t recompute_num_layers) {
    const pl::StageCosts c =
        pl::resolve_stage_costs({embedding_cost, head_cost, recompute_num_layers}, cfg, seq_len, tp);
    return pyb::make_tuple(c.embedding, c.head);
  }, pyb::arg("config"), pyb::arg("seq_len"), pyb::arg("tp_size"), pyb::arg("embedding_cost") = pl::kAutoStageCost,
     pyb::arg("head_cost") = pl::kAutoStageCost, pyb::arg("recompute_num_layers") = -1,
     "(embedding_cost, head_cost) with each negative (-1 = auto) one replaced by stage_costs_from_model's.");
  m.def("choose_layout", [](int64_t num_layers, int pp, int vp, std::vector<int64_t> counts, double embedding_cost,
                            double head_cost, int64_t recompute_num_layers) {
    return pl::choose_layout(num_layers, pp, vp, std::move(counts), {embedding_cost, head_cost, recompute_num_layers});
  }, pyb::arg("num_layers"), pyb::arg("pipeline_parallel"), pyb::arg("virtual_stages"), pyb::arg("counts"),
     pyb::arg("embedding_cost"), pyb::arg("head_cost"), pyb::arg("recompute_num_layers") = -1,
     "The layout a run uses: `counts` if non-empty, else balanced for the (resolved) costs if either is > 0, else "
     "uniform; recompute_num_layers N >= 0 prices the first N layers of each virtual stage at 4/3.");
  m.def("rank_work", [](const pl::PipelineLayout& layout, double embedding_cost, double head_cost,
                        int64_t recompute_num_layers) {
    return pl::rank_work(layout, {embedding_cost, head_cost, recompute_num_layers});
  }, pyb::arg("layout"), pyb::arg("embedding_cost"), pyb::arg("head_cost"), pyb::arg("recompute_num_layers") = -1,
     "Estimated work per pipeline rank in layers (its layers, block-recomputed ones at 4/3, + the embedding/head it "
     "holds).");
  m.def("describe_layout", [](const pl::PipelineLayout& layout, double embedding_cost, double head_cost,
                              int64_t recompute_num_layers) {
    return pl::describe_layout(layout, {embedding_cost, head_cost, recompute_num_layers});
  }, pyb::arg("layout"), pyb::arg("embedding_cost") = 0.0, pyb::arg("head_cost") = 0.0,
     pyb::arg("recompute_num_layers") = -1, "One line: layers per stage and the estimated work per stage.");

  m.def("rank_schedule", [](int pp, int vp, int64_t m, int rank) {
    pyb::list out;
    for (const pl::Op& op : pl::rank_schedule(schedule_of(pp, vp, m), rank)) out.append(op_tuple(op));
    return out;
  }, pyb::arg("pipeline_parallel"), pyb::arg("virtual_stages"), pyb::arg("num_microbatches"), pyb::arg("pp_rank"),
     "The rank's ops for one step as (kind, microbatch, chunk, peer) tuples (the natural schedule for the sizes).");
  m.def("theoretical_bubble_fraction", [](int pp, int vp, int64_t m) {
    return pl::theoretical_bubble_fraction(schedule_of(pp, vp, m));
  }, pyb::arg("pipeline_parallel"), pyb::arg("virtual_stages"), pyb::arg("num_microbatches"));
  m.def("num_microbatches", &pl::num_microbatches, pyb::arg("global_batch"), pyb::arg("micro_batch"),
        pyb::arg("data_parallel"));

  m.def("make_stage", [](const mdl::TransformerConfig& cfg, comm::Communicator& tp, std::vector<int64_t> layer_indices,
                         bool pre_process, bool post_process, const pyb::object& device) {
    mdl::GPTModelOptions o;
    o.device = device_arg(device);
    o.layer_indices = std::move(layer_indices);
    o.pre_process = pre_process;
    o.post_process = post_process;
    pyb::gil_scoped_release nogil;
    return std::make_unique<mdl::GPTModel>(cfg, tp, o);
  }, pyb::arg("config"), pyb::arg("tp"), pyb::arg("layer_indices"), pyb::arg("pre_process"), pyb::arg("post_process"),
     pyb::arg("device") = "cpu", pyb::keep_alive<0, 2>(),
     "A GPTModel holding one pipeline stage: the given GLOBAL layers, plus the embedding (pre_process) and/or the "
     "final norm, output layer and loss (post_process).");

  pyb::class_<PyEngine>(m, "PipelineEngine", "Runs one training step of the pipeline schedule on this rank's chunks.")
      .def(pyb::init([](pyb::object pp, pyb::object layout, pyb::list chunks, pyb::object dp, pyb::object embedding,
                        bool record_ops) {
             std::vector<mdl::GPTModel*> cs;
             for (auto c : chunks) cs.push_back(c.cast<mdl::GPTModel*>());
             pl::PipelineEngineOptions o;
             o.dp = dp.is_none() ? nullptr : dp.cast<comm::Communicator*>();
             o.embedding = embedding.is_none() ? nullptr : embedding.cast<comm::Communicator*>();
             o.record_ops = record_ops;
             auto e = std::make_unique<PyEngine>();
             comm::Communicator& ppc = pp.cast<comm::Communicator&>();
             const pl::PipelineLayout& lay = layout.cast<const pl::PipelineLayout&>();
             {
               pyb::gil_scoped_release nogil;
               e->engine = std::make_unique<pl::PipelineEngine>(ppc, lay, cs, o);
             }
             e->keep = pyb::make_tuple(pp, layout, chunks, dp, embedding);
             return e;
           }),
           pyb::arg("pp"), pyb::arg("layout"), pyb::arg("chunks"), pyb::arg("dp") = pyb::none(),
           pyb::arg("embedding") = pyb::none(), pyb::arg("record_ops") = false)
      .def("step", [](PyEngine& e, pyb::list micro_batches, bool training) {
        std::vector<pl::MicroBatch> mbs;
        for (auto item : micro_batches) {
          pyb::tuple t = item.cast<pyb::tuple>();
          MC_CHECK(t.size() == 2 || t.size() == 3, "PipelineEngine.step: each micro-batch is (tokens, labels) or "
                   "(tokens, labels, loss_mask); got {} items", t.size());
          pl::MicroBatch mb{batch_tensor(t[0], "tokens"), batch_tensor(t[1], "labels"),
                            t.size() == 3 && !t[2].is_none() ? batch_tensor(t[2], "loss_mask") : Tensor()};
          mbs.push_back(std::move(mb));
        }
        pl::StepResult r;
        {
          pyb::gil_scoped_release nogil;
          layers::ForwardContext ctx;
          ctx.training = training;
          r = e.engine->step(ctx, mbs);
        }
        pyb::dict d;
        d["loss"] = r.loss;
        d["tokens"] = r.tokens;
        d["step_seconds"] = r.step_seconds;
        d["busy_seconds"] = r.busy_seconds;
        d["idle_seconds"] = r.idle_seconds;
        d["idle_fraction"] = r.idle_fraction;
        d["theoretical_bubble"] = r.theoretical_bubble;
        d["max_in_flight"] = r.max_in_flight;
        pyb::list ops;
        for (const pl::Op& op : r.executed) ops.append(op_tuple(op));
        d["executed"] = ops;
        return d;
      }, pyb::arg("micro_batches"), pyb::arg("training") = true,
         "micro_batches: list of (tokens, labels[, loss_mask]) [b, s] on every rank of the pipeline. Accumulates "
         "main_grads; returns {loss (global per-token mean), tokens, step/busy/idle seconds, idle_fraction, "
         "theoretical_bubble, max_in_flight, executed}.")
      .def("schedule", [](const PyEngine& e, int64_t m) {
        pyb::list out;
        const pl::ScheduleConfig c = e.engine->schedule_config(m);
        for (const pl::Op& op : pl::rank_schedule(c, e.engine->pp_rank())) out.append(op_tuple(op));
        return out;
      }, pyb::arg("num_microbatches"), "This rank's op list for a step with that many micro-batches.");
}

}  // namespace megacore::py
