// megacore._C.train: the C++ Trainer, driven by python/megacore/train.py.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/train/run_config.hpp"
#include "megacore/train/stop_signal.hpp"
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
  d["nonfinite"] = m.nonfinite;
  d["loss_spike"] = m.loss_spike;
  d["compute_seconds"] = m.compute_seconds;
  d["rank_compute_seconds"] = m.rank_compute_seconds;
  d["stragglers"] = m.stragglers;
  d["step_seconds"] = m.step_seconds;
  d["tokens_per_s"] = m.tokens_per_s;
  d["tflops_per_gpu"] = m.tflops_per_gpu;
  d["mfu"] = m.mfu;
  d["mem_allocated_gib"] = m.mem_allocated_gib;
  d["mem_peak_gib"] = m.mem_peak_gib;
  d["consumed_samples"] = m.consumed_samples;
  d["moe_aux_loss"] = m.moe_aux_loss;
  d["moe_load_imbalance"] = m.moe_load_imbalance;
  return d;
}

}  // namespace

void bind_train(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("train", "The training loop (C++ Trainer).");
  // The run configuration is declared once in C++ (train/run_config.hpp); Python's Recipe classes are
  // generated from run_config_schema() and hand their JSON here to be parsed, set and validated.
  pyb::class_<train::RunConfig>(m, "RunConfig", "A parsed recipe (train::RunConfig).")
      .def(pyb::init<>())
      .def_static("from_json", &train::run_config_from_json, pyb::arg("json"),
                  "Parses a recipe JSON; ConfigError naming an unknown or mistyped field or an unaccepted value.")
      .def("to_json", [](const train::RunConfig& c) { return train::to_json(c); })
      .def("set", &train::set_field, pyb::arg("key"), pyb::arg("value"),
           "Sets 'section.field' (aliases accepted) from its text form, as --set does.")
      .def("validate", [](const train::RunConfig& c, int world_size, bool check_paths) {
             train::ValidationReport r = train::validate(c, world_size, {.check_paths = check_paths});
             return pyb::make_tuple(r.errors, r.warnings);
           }, pyb::arg("world_size"), pyb::arg("check_paths") = true,
           "(errors, warnings): every problem of the run as a whole, each naming the field and its fix.")
      .def("transformer_config", &train::RunConfig::transformer_config, pyb::arg("on_gpu") = false,
           "The TransformerConfig the layers get (precision 'auto' resolved for the device).")
      .def_property_readonly("world_size", &train::RunConfig::world_size);
  m.def("install_stop_signal_handlers", &train::install_stop_signal_handlers,
        "SIGTERM/SIGUSR1 (and a first SIGINT) ask Trainer.fit to stop after the current step and save; a second "
        "SIGINT exits at once (130). Python's own SIGINT handler is replaced until uninstall.");
  m.def("uninstall_stop_signal_handlers", &train::uninstall_stop_signal_handlers);
  m.def("stop_requested", &train::stop_requested, "The signal that asked for a stop, 0 when none did.");
  m.def("request_stop", &train::request_stop, pyb::arg("signal"));
  m.def("clear_stop_request", &train::clear_stop_request);
  m.def("run_config_schema", &train::run_config_schema,
        "Every section and field (type, default, doc, accepted values, alias) as JSON.");
  m.def("model_preset_json", [](const std::string& name) {
    return train::model_section_json(train::ModelSection::preset(name));
  }, pyb::arg("name"), "The model section of a C++ preset as JSON.");

  pyb::class_<train::Trainer>(m, "Trainer")
      .def(pyb::init([](const train::RunConfig& cfg, comm::Communicator& world,
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
        d["stopped_by_signal"] = r.stopped_by_signal;
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
      .def("set_step_callback", [](train::Trainer& t, pyb::object cb) {
        if (cb.is_none()) return t.set_step_callback({});
        // The callback runs inside fit() (GIL released) on every rank; an exception it raises ends fit().
        auto fn = std::make_shared<pyb::object>(std::move(cb));
        t.set_step_callback([fn](const train::StepMetrics& m) {
          pyb::gil_scoped_acquire gil;
          (*fn)(metrics_dict(m));
        });
      }, pyb::arg("callback"), "Calls callback(metrics dict) on every rank after each step (None removes it).")
      .def_property_readonly("step", &train::Trainer::step)
      .def_property_readonly("rank", [](const train::Trainer& t) { return t.grid().rank(); })
      .def_property_readonly("is_last_stage", [](const train::Trainer& t) { return t.grid().is_last_stage(); });
}

}  // namespace megacore::py
