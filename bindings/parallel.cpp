// Python bindings of the process grid: megacore._C.parallel (re-exported as megacore.parallel).
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace megacore::py {

void bind_parallel(pyb::module_& root) {
  using namespace megacore::parallel;
  pyb::module_ m = root.def_submodule("parallel", "Process grid: TP/CP/EP/DP/PP groups.");

  pyb::class_<ParallelConfig>(m, "ParallelConfig")
      .def(pyb::init([](int tensor, int pipeline, int context, int expert, int expert_tensor, const std::string& order,
                        int virtual_pipeline) {
             return ParallelConfig{tensor, pipeline, context, expert, expert_tensor, order, virtual_pipeline};
           }),
           pyb::arg("tensor") = 1, pyb::arg("pipeline") = 1, pyb::arg("context") = 1, pyb::arg("expert") = 1,
           pyb::arg("expert_tensor") = 0, pyb::arg("order") = "tp-cp-ep-dp-pp", pyb::arg("virtual_pipeline") = 1)
      .def_readwrite("tensor", &ParallelConfig::tensor)
      .def_readwrite("pipeline", &ParallelConfig::pipeline)
      .def_readwrite("context", &ParallelConfig::context)
      .def_readwrite("expert", &ParallelConfig::expert)
      .def_readwrite("expert_tensor", &ParallelConfig::expert_tensor)
      .def_readwrite("order", &ParallelConfig::order)
      .def_readwrite("virtual_pipeline", &ParallelConfig::virtual_pipeline)
      .def_readwrite("cp_copy_engine", &ParallelConfig::cp_copy_engine);

  auto kind = [](const std::string& name) { return group_kind_from_name(name); };
  m.def("group_kinds", [] {
    std::vector<std::string> v;
    for (GroupKind k : kGroupKinds) v.emplace_back(group_kind_name(k));
    return v;
  });

  pyb::class_<GridLayout>(m, "GridLayout", "Pure rank math of a layout (no communicator).")
      .def(pyb::init<const ParallelConfig&, int>(), pyb::arg("config"), pyb::arg("world_size"))
      .def_static("validate", &GridLayout::validate, pyb::arg("config"), pyb::arg("world_size"))
      .def_property_readonly("world_size", &GridLayout::world_size)
      .def_property_readonly("order", &GridLayout::order)
      .def_property_readonly("sizes", [](const GridLayout& L) {
        pyb::dict d;
        d["tp"] = L.tp_size();
        d["pp"] = L.pp_size();
        d["cp"] = L.cp_size();
        d["dp"] = L.dp_size();
        d["ep"] = L.ep_size();
        d["expert_tp"] = L.expert_tp_size();
        d["expert_dp"] = L.expert_dp_size();
        d["vpp"] = L.virtual_pipeline_size();
        return d;
      })
      .def("groups", [=](const GridLayout& L, const std::string& k) { return L.groups(kind(k)); })
      .def("group_of", [=](const GridLayout& L, const std::string& k, int r) { return L.group_of(kind(k), r); })
      .def("coordinates", [](const GridLayout& L, int r) {
        pyb::dict d;
        d["tp"] = L.tp_rank(r);
        d["cp"] = L.cp_rank(r);
        d["dp"] = L.dp_rank(r);
        d["pp"] = L.pp_rank(r);
        d["ep"] = L.ep_rank(r);
        d["expert_tp"] = L.expert_tp_rank(r);
        d["expert_dp"] = L.expert_dp_rank(r);
        return d;
      })
      .def("table", &GridLayout::table);

  pyb::class_<ProcessGrid>(m, "ProcessGrid", "The communicators of every group of this rank (collective).")
      .def(pyb::init([](comm::Communicator& world, const ParallelConfig& c) { return new ProcessGrid(world, c); }),
           pyb::arg("world"), pyb::arg("config"), pyb::keep_alive<1, 2>(), pyb::call_guard<pyb::gil_scoped_release>())
      .def_property_readonly("layout", &ProcessGrid::layout, pyb::return_value_policy::reference_internal)
      .def("group", [=](const ProcessGrid& g, const std::string& k) -> comm::Communicator& { return g.group(kind(k)); },
           pyb::return_value_policy::reference_internal)
      .def("has_group", [=](const ProcessGrid& g, const std::string& k) { return g.has_group(kind(k)); })
      .def_property_readonly("tp", &ProcessGrid::tp, pyb::return_value_policy::reference_internal)
      .def_property_readonly("pp", &ProcessGrid::pp, pyb::return_value_policy::reference_internal)
      .def_property_readonly("cp", &ProcessGrid::cp, pyb::return_value_policy::reference_internal)
      .def_property_readonly("dp", &ProcessGrid::dp, pyb::return_value_policy::reference_internal)
      .def_property_readonly("dp_cp", &ProcessGrid::dp_cp, pyb::return_value_policy::reference_internal)
      .def_property_readonly("rank", &ProcessGrid::rank)
      .def_property_readonly("tp_rank", &ProcessGrid::tp_rank)
      .def_property_readonly("pp_rank", &ProcessGrid::pp_rank)
      .def_property_readonly("dp_rank", &ProcessGrid::dp_rank)
      .def_property_readonly("cp_rank", &ProcessGrid::cp_rank)
      .def("is_first_stage", &ProcessGrid::is_first_stage)
      .def("is_last_stage", &ProcessGrid::is_last_stage);
}

}  // namespace megacore::py
