// megacore._C: the compiled half of the Python package.
#include "bindings.hpp"

#include "megacore/build_config.hpp"
#include "megacore/core/peer_error.hpp"

namespace megacore::py {
namespace {

// C++ error types map to the Python classes in megacore/errors.py, most specific first.
void translate(std::exception_ptr p) {
  // Leaked on purpose: a static py::object would be released after the interpreter has shut down.
  static auto* errors = new pyb::module_(pyb::module_::import("megacore.errors"));
  auto set = [&](const char* cls, const std::exception& e) { PyErr_SetString(errors->attr(cls).ptr(), e.what()); };
  try {
    if (p) std::rethrow_exception(p);
  } catch (const ConfigError& e) {
    set("ConfigError", e);
  } catch (const ValueError& e) {
    set("ValueError", e);
  } catch (const CommError& e) {
    set("CommError", e);
  } catch (const OutOfMemoryError& e) {
    set("OutOfMemoryError", e);
  } catch (const CudaError& e) {
    set("CudaError", e);
  } catch (const PeerIOError& e) {
    // The instance carries the rank that failed (megacore.train.fail_fast waits for that rank's own report).
    pyb::object cls = errors->attr("PeerIOError"), exc = cls(e.what());
    exc.attr("failed_rank") = e.failed_rank();
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (const IOError& e) {
    set("IOError", e);
  } catch (const InternalError& e) {
    set("InternalError", e);
  } catch (const Error& e) {
    set("Error", e);
  }
}

}  // namespace
}  // namespace megacore::py

PYBIND11_MODULE(_C, m) {
  namespace mp = megacore::py;
  m.doc() = "megacore compiled core";
  pybind11::register_exception_translator(&mp::translate);
  m.def("build_info", [] {
    pybind11::dict d;
    d["version"] = MEGACORE_VERSION;
    d["cuda"] = bool(MEGACORE_WITH_CUDA);
    d["nccl"] = bool(MEGACORE_WITH_NCCL);
    d["cudnn"] = bool(MEGACORE_WITH_CUDNN);
    d["mpi"] = bool(MEGACORE_WITH_MPI);
    d["cuda_architectures"] = MEGACORE_CUDA_ARCHITECTURES;
    return d;
  }, "Which optional backends this build contains.");
  mp::bind_core(m);
  mp::bind_dlpack(m);
  mp::bind_comm(m);
  mp::bind_parallel(m);
  mp::bind_data(m);
  mp::bind_model(m);
  mp::bind_checkpoint(m);
  mp::bind_train(m);
  mp::bind_optim(m);
  mp::bind_pipeline(m);
  mp::bind_ops(m);
}
