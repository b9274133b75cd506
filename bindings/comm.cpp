// Python bindings of the comm layer: megacore._C.comm (re-exported as megacore.comm).
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/abort.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"

namespace megacore::py {
namespace {

using namespace megacore::comm;
using Release = pyb::call_guard<pyb::gil_scoped_release>;

ReduceOp op_arg(const std::string& s) {
  if (s == "sum") return ReduceOp::Sum;
  if (s == "avg" || s == "mean") return ReduceOp::Avg;
  if (s == "max") return ReduceOp::Max;
  if (s == "min") return ReduceOp::Min;
  raise("unknown reduce op '{}'; use 'sum', 'avg', 'max' or 'min'", s);
}

CommOptions options_arg(const std::string& name, double timeout_s, bool check_shapes, bool nccl_blocking) {
  MC_CHECK(timeout_s > 0, "timeout_s must be > 0, got {}", timeout_s);
  CommOptions o;
  o.name = name;
  o.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000));
  o.check_shapes = check_shapes;
  o.nccl_blocking = nccl_blocking;
  return o;
}

// Synchronous calls wait before returning; async_op=True hands the Work back instead.
// async_op: the Work is returned. Otherwise the call returns once `s` is ordered after the operation
// (Work::wait_on, as torch.distributed does: NCCL does not block the host, MPI completes the operation).
pyb::object finish(WorkPtr w, bool async_op, const Stream& s) {
  if (async_op) return pyb::cast(w);
  {
    pyb::gil_scoped_release nogil;
    w->wait_on(s);
  }
  return pyb::none();
}

Stream comm_stream(const pyb::object& st, const Tensor& t) { return stream_arg(st, t.device()); }

}  // namespace

void bind_comm(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("comm", "Collectives, bootstrap and groups.");

  pyb::class_<Work, WorkPtr>(m, "Work", "Handle of an asynchronous collective.")
      .def("wait", &Work::wait, Release(), "Blocks until done; raises CommError on timeout or failure.")
      .def("is_completed", &Work::is_completed)
      .def("wait_on", &Work::wait_on, pyb::arg("stream"), Release(),
           "Orders `stream` after the operation without blocking the host (NCCL); MPI waits like wait(). A "
           "failure is then raised by the next operation on the communicator (the watchdog aborts it).");

  pyb::class_<Communicator>(m, "Communicator")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("name", &Communicator::name)
      .def_property_readonly("backend", [](const Communicator& c) { return std::string(backend_name(c.backend())); })
      .def_property_readonly("world_ranks", &Communicator::world_ranks)
      .def_property_readonly("timeout_s", [](const Communicator& c) { return c.options().timeout.count() / 1000.0; })
      .def("all_reduce", [](Communicator& c, Tensor& t, const std::string& op, const pyb::object& st, bool async_op) {
        Stream s = comm_stream(st, t);
        return finish(c.all_reduce(t, op_arg(op), s), async_op, s);
      }, pyb::arg("tensor"), pyb::arg("op") = "sum", pyb::arg("stream") = pyb::none(), pyb::arg("async_op") = false)
      .def("all_gather", [](Communicator& c, const Tensor& in, Tensor& out, const pyb::object& st, bool async_op) {
        Stream s = comm_stream(st, in);
        return finish(c.all_gather(in, out, s), async_op, s);
      }, pyb::arg("input"), pyb::arg("output"), pyb::arg("stream") = pyb::none(), pyb::arg("async_op") = false)
      .def("reduce_scatter", [](Communicator& c, const Tensor& in, Tensor& out, const std::string& op,
                                const pyb::object& st, bool async_op) {
        Stream s = comm_stream(st, in);
        return finish(c.reduce_scatter(in, out, op_arg(op), s), async_op, s);
      }, pyb::arg("input"), pyb::arg("output"), pyb::arg("op") = "sum", pyb::arg("stream") = pyb::none(),
         pyb::arg("async_op") = false)
      .def("broadcast", [](Communicator& c, Tensor& t, int root_rank, const pyb::object& st, bool async_op) {
        Stream s = comm_stream(st, t);
        return finish(c.broadcast(t, root_rank, s), async_op, s);
      }, pyb::arg("tensor"), pyb::arg("root"), pyb::arg("stream") = pyb::none(), pyb::arg("async_op") = false)
      .def("all_to_all", [](Communicator& c, const Tensor& in, Tensor& out, const std::vector<int64_t>& sc,
                            const std::vector<int64_t>& rc, const pyb::object& st, bool async_op) {
        Stream s = comm_stream(st, in);
        return finish(c.all_to_all(in, out, sc, rc, s), async_op, s);
      }, pyb::arg("input"), pyb::arg("output"), pyb::arg("send_counts") = std::vector<int64_t>{},
         pyb::arg("recv_counts") = std::vector<int64_t>{}, pyb::arg("stream") = pyb::none(), pyb::arg("async_op") = false)
      .def("batch_send_recv", [](Communicator& c, const std::vector<std::tuple<std::string, Tensor, int>>& ops,
                                 const pyb::object& st, bool async_op) {
        std::vector<P2POp> v;
        Device d = Device::cpu();
        for (const auto& [kind, t, peer] : ops) {
          MC_CHECK(kind == "send" || kind == "recv", "batch_send_recv: kind must be 'send' or 'recv', got '{}'", kind);
          v.push_back(P2POp{kind == "send" ? P2POp::Send : P2POp::Recv, t, peer});
          d = t.device();
        }
        Stream s = stream_arg(st, d);
        return finish(c.batch_send_recv(v, s), async_op, s);
      }, pyb::arg("ops"), pyb::arg("stream") = pyb::none(), pyb::arg("async_op") = false,
         "ops: list of ('send' | 'recv', tensor, peer)")
      .def("barrier", &Communicator::barrier, Release())
      .def("split", [](Communicator& c, int color, int key, const pyb::object& name, const pyb::object& timeout_s) {
        CommOptions o = c.options();
        if (!name.is_none()) o.name = name.cast<std::string>();
        if (!timeout_s.is_none()) o.timeout = std::chrono::milliseconds(int64_t(timeout_s.cast<double>() * 1000));
        std::unique_ptr<Communicator> sub;
        {
          pyb::gil_scoped_release nogil;
          sub = c.split(color, key, o);
        }
        return sub;
      }, pyb::arg("color"), pyb::arg("key") = 0, pyb::arg("name") = pyb::none(), pyb::arg("timeout_s") = pyb::none())
      .def("abort", &Communicator::abort)
      .def_property_readonly("aborted", &Communicator::aborted)
      .def("__repr__", [](const Communicator& c) {
        return fmt::format("megacore.comm.Communicator(name='{}', backend={}, rank={}, size={})", c.name(),
                           backend_name(c.backend()), c.rank(), c.size());
      });

  m.def("abort_job", [](int code) { abort_job(code); }, pyb::arg("code") = 1,
        "Ends this process now with `code`: MPI_Abort of the MPI world when MPI is initialised (mpirun then "
        "ends every rank), else an immediate exit without teardown. Flush your output first.");
  m.def("flight_record", [](size_t last_n) { return format_flight_records(flight_records(), last_n); },
        pyb::arg("last_n") = 8,
        "The last `last_n` operations of every live communicator of this process (op, bytes, sequence number, "
        "duration or NOT FINISHED), one line per communicator: the flight record the trainer's watchdog prints.");
  m.def("check_health", &check_health,
        "Raises CommError if the NCCL watchdog aborted a communicator since the last check (each once).");
  m.def("init_from_env", [](const std::string& device, const std::string& name, double timeout_s, bool check_shapes,
                            bool nccl_blocking) {
    CommOptions o = options_arg(name, timeout_s, check_shapes, nccl_blocking);
    pyb::gil_scoped_release nogil;
    if (device == "auto") return init_from_env(o);
    return init_from_env(Device::parse(device), o);
  }, pyb::arg("device") = "auto", pyb::arg("name") = "world", pyb::arg("timeout_s") = 600.0,
     pyb::arg("check_shapes") = false, pyb::arg("nccl_blocking") = true,
     "The world communicator (mpirun, srun, torchrun or megacore.launch): NCCL on GPUs, MPI on CPUs.");

  m.def("detect_launch_env", [] {
    LaunchEnv e = detect_launch_env();
    pyb::dict d;
    d["launcher"] = std::string(launcher_name(e.launcher));
    d["rank"] = e.rank;
    d["world_size"] = e.world_size;
    d["local_rank"] = e.local_rank;
    d["local_world_size"] = e.local_world_size;
    d["master_addr"] = e.master_addr;
    d["master_port"] = e.master_port;
    return d;
  });
  m.def("mpi_available", &mpi_available);
  m.def("nccl_available", &nccl_available);
  m.def("nccl_version", &nccl_version);
}

}  // namespace megacore::py
