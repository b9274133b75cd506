// megacore._C.optim: the parts of megacore/optim usable without a model in Python — dynamic loss
// scaling (with its checkpoint state) and the DDP bucket-size default. DDP and the optimizers run
// inside the C++ Trainer (megacore._C.train).
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/optim/loss_scaler.hpp"
#include "megacore/optim/param_and_grad_buffer.hpp"

namespace megacore::py {

namespace {

pyb::dict scaler_state(const optim::LossScalerState& s) {
  pyb::dict d;
  d["scale"] = s.scale;
  d["growth_tracker"] = s.growth_tracker;
  d["hysteresis_tracker"] = s.hysteresis_tracker;
  return d;
}

}  // namespace

void bind_optim(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("optim", "Loss scaling and DDP helpers.");
  using C = optim::LossScalerConfig;
  pyb::class_<C>(m, "LossScalerConfig", "Dynamic loss scaling settings (Megatron-Core's DynamicGradScaler).")
      .def(pyb::init([](double initial_scale, double growth_factor, double backoff_factor, int64_t growth_interval,
                        int hysteresis, double min_scale, double max_scale) {
             return C{initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale};
           }),
           pyb::kw_only(), pyb::arg("initial_scale") = C{}.initial_scale, pyb::arg("growth_factor") = C{}.growth_factor,
           pyb::arg("backoff_factor") = C{}.backoff_factor, pyb::arg("growth_interval") = C{}.growth_interval,
           pyb::arg("hysteresis") = C{}.hysteresis, pyb::arg("min_scale") = C{}.min_scale,
           pyb::arg("max_scale") = C{}.max_scale)
      .def_readwrite("initial_scale", &C::initial_scale)
      .def_readwrite("growth_factor", &C::growth_factor)
      .def_readwrite("backoff_factor", &C::backoff_factor)
      .def_readwrite("growth_interval", &C::growth_interval)
      .def_readwrite("hysteresis", &C::hysteresis)
      .def_readwrite("min_scale", &C::min_scale)
      .def_readwrite("max_scale", &C::max_scale);

  pyb::class_<optim::DynamicLossScaler>(m, "DynamicLossScaler",
                                        "f16 loss scale: back off on overflow (after `hysteresis` of them), grow "
                                        "after `growth_interval` finite steps.")
      .def(pyb::init<const C&>(), pyb::arg("config") = C{}, "ConfigError listing every problem with the config.")
      .def_property_readonly("scale", &optim::DynamicLossScaler::scale)
      .def_property_readonly("inv_scale", &optim::DynamicLossScaler::inv_scale)
      .def("update", &optim::DynamicLossScaler::update, pyb::arg("found_inf"),
           "Records one step's overflow check (True: NaN/Inf found, skip the step) and adjusts the scale.")
      .def("state", [](const optim::DynamicLossScaler& s) { return scaler_state(s.state()); },
           "{'scale', 'growth_tracker', 'hysteresis_tracker'}: everything needed to resume.")
      .def("load_state", [](optim::DynamicLossScaler& s, const pyb::dict& d) {
             optim::LossScalerState st;
             st.scale = d["scale"].cast<double>();
             st.growth_tracker = d["growth_tracker"].cast<int64_t>();
             st.hysteresis_tracker = d["hysteresis_tracker"].cast<int>();
             s.load_state(st);
           }, pyb::arg("state"), "Restores state(); ValueError for a non-positive scale or negative trackers.");

  m.def("default_bucket_size", &optim::default_bucket_size, pyb::arg("dp_size"),
        "Megatron-Core's DDP bucket size in elements: max(40M, 1M x DP).");
}

}  // namespace megacore::py
