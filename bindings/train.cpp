// megacore._C.train: the C++ Trainer, driven by python/megacore/train.py.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/train/trainer.hpp"

namespace megacore::py {

namespace {

pyb::dict metrics_dict(const train::StepMetrics& m) {
  pyb::dict d;
  d["step"] = m.step;
  d["loss"] = m.loss;
  d["grad_norm"] = m.grad_norm;
  d["lr"] = m.lr;
  d["skipped"] = m.skipped;
  d["step_seconds"] = m.step_seconds;
  d["tokens_per_s"] = m.tokens_per_s;
  d["tflops_per_gpu"] = m.tflops_per_gpu;
  d["mfu"] = m.mfu;
  d["mem_allocated_gib"] = m.mem_allocated_gib;
  d["mem_peak_gib"] = m.mem_peak_gib;
  d["consumed_samples"] = m.consumed_samples;
  return d;
}

}  // namespace

void bind_train(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("train", "The training loop (C++ Trainer).");
  pyb::class_<train::TrainConfig>(m, "TrainConfig")
      .def_static("from_recipe_json", &train::TrainConfig::from_recipe_json, pyb::arg("json"),
                  "Parses Recipe.to_json(); ConfigError naming a missing or mistyped field.")
      .def_readonly("max_steps", &train::TrainConfig::max_steps)
      .def_readonly("seq_length", &train::TrainConfig::seq_length)
      .def_readonly("global_batch_size", &train::TrainConfig::global_batch_size);

  pyb::class_<train::Trainer>(m, "Trainer")
      .def(pyb::init([](const train::TrainConfig& cfg, comm::Communicator& world,
                        std::shared_ptr<data::SampleSource> train_src, std::shared_ptr<data::SampleSource> valid_src) {
             pyb::gil_scoped_release nogil;
             return std::make_unique<train::Trainer>(cfg, world, std::move(train_src), std::move(valid_src));
           }),
           pyb::arg("config"), pyb::arg("world"), pyb::arg("train"), pyb::arg("valid") = nullptr,
           pyb::keep_alive<1, 3>())
      .def("fit", [](train::Trainer& t) {
        train::TrainResult r;
        {
          pyb::gil_scoped_release nogil;
          r = t.fit();
        }
        pyb::dict d;
        pyb::list hist;
        for (const auto& m : r.history) hist.append(metrics_dict(m));
        d["history"] = hist;
        d["val_losses"] = r.val_losses;
        d["start_step"] = r.start_step;
        d["final_step"] = r.final_step;
        d["last_checkpoint"] = r.last_checkpoint;
        return d;
      }, "Trains to max_steps; returns {history: [per-step metrics], val_losses, start_step, final_step, "
         "last_checkpoint}.")
      .def("evaluate", [](train::Trainer& t, int64_t n) {
        pyb::gil_scoped_release nogil;
        return t.evaluate(n);
      }, pyb::arg("max_batches") = 1)
      .def("generate", [](train::Trainer& t, const std::vector<int64_t>& prompt, int64_t n) {
        pyb::gil_scoped_release nogil;
        return t.generate(prompt, n);
      }, pyb::arg("prompt"), pyb::arg("max_new_tokens"))
      .def("save", [](train::Trainer& t) {
        pyb::gil_scoped_release nogil;
        return t.save();
      })
      .def("load", [](train::Trainer& t, const std::string& p, bool optimizer) {
        pyb::gil_scoped_release nogil;
        t.load(p, optimizer);
      }, pyb::arg("path"), pyb::arg("optimizer") = true)
      .def_property_readonly("step", &train::Trainer::step)
      .def_property_readonly("rank", [](const train::Trainer& t) { return t.grid().rank(); })
      .def_property_readonly("is_last_stage", [](const train::Trainer& t) { return t.grid().is_last_stage(); });
}

}  // namespace megacore::py
