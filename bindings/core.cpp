// Python bindings of core: Tensor (numpy buffer protocol), Generator, Stream, Event, memory stats.
#include <pybind11/stl.h>

#include <map>

#include "bindings.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/core/device_memory.hpp"
#include "megacore/core/host_sync.hpp"
#include "megacore/core/log.hpp"

namespace megacore::py {

namespace {
thread_local std::map<std::pair<int, int>, Stream> t_current;

// numpy's buffer format characters for each dtype; bf16 has none.
const char* buffer_format(DType dt) {
  switch (dt) {
    case DType::F32: return "f";
    case DType::F16: return "e";
    case DType::I32: return "i";
    case DType::I64: return "q";
    case DType::U8: return "B";
    case DType::BF16: return nullptr;
    case DType::F8E4M3:
    case DType::F8E5M2: return nullptr;
  }
  return nullptr;
}

DType dtype_from_format(const std::string& f, ssize_t itemsize) {
  char c = f.empty() ? '?' : f.back();  // drop byte-order prefixes such as '<' or '='
  if (c == 'f' && itemsize == 4) return DType::F32;
  if (c == 'e' && itemsize == 2) return DType::F16;
  if ((c == 'i' || c == 'l') && itemsize == 4) return DType::I32;
  if ((c == 'q' || c == 'l') && itemsize == 8) return DType::I64;
  if (c == 'B' && itemsize == 1) return DType::U8;
  raise("cannot share a buffer of format '{}' ({} bytes per item): megacore supports float32, float16, int32, int64 "
        "and uint8 arrays; convert first (e.g. arr.astype(np.float32))",
        f, itemsize);
}

void check_numpy_compatible(const Tensor& x) {
  MC_CHECK(x.device().is_cpu(), "a {} tensor cannot be viewed by numpy; copy it first with t.to('cpu')",
           x.device().str());
  MC_CHECK(buffer_format(x.dtype()) != nullptr,
           "{} has no numpy dtype; convert with t.to('f32') (or view FP8 bits with t.view_as_dtype('u8')), or share it "
           "with torch through DLPack", dtype_name(x.dtype()));
}

// numpy view of a tensor; checks first because numpy turns a refused buffer into a vague error.
pyb::object as_numpy(const pyb::object& self) {
  check_numpy_compatible(self.cast<const Tensor&>());
  return pyb::module_::import("numpy").attr("asarray")(pyb::memoryview(self));
}

pyb::tuple to_tuple(const Shape& s) {
  pyb::tuple t(s.size());
  for (size_t i = 0; i < s.size(); ++i) t[i] = s[i];
  return t;
}
}  // namespace

Stream current_stream(Device d) {
  if (d.is_cpu()) return Stream{};
  auto it = t_current.find({int(d.type), d.index});
  return it == t_current.end() ? Stream::default_stream(d) : it->second;
}

Stream stream_arg(const pyb::object& stream, Device d) {
  if (stream.is_none()) return current_stream(d);
  Stream s = stream.cast<Stream>();
  MC_CHECK(s.device().is_cpu() || d.is_cpu() || s.device() == d, "stream of {} used with a tensor on {}",
           s.device().str(), d.str());
  return s;
}

Device device_arg(const pyb::object& o) {
  if (pyb::isinstance<pyb::int_>(o)) return Device::cuda(o.cast<int>());
  if (pyb::isinstance<pyb::str>(o)) return Device::parse(o.cast<std::string>());
  if (pyb::hasattr(o, "type") && pyb::hasattr(o, "index")) {  // torch.device and friends
    std::string type = pyb::str(o.attr("type"));
    pyb::object idx = o.attr("index");
    if (type == "cpu") return Device::cpu();
    if (type == "cuda") return Device::cuda(idx.is_none() ? 0 : idx.cast<int>());
  }
  raise("cannot interpret {} as a device; use 'cpu', 'cuda' or 'cuda:N'", std::string(pyb::repr(o)));
}

Tensor tensor_arg(const pyb::handle& o, const std::string& what, TensorArg mode) {
  if (pyb::isinstance<Tensor>(o)) return o.cast<Tensor>();
  MC_CHECK(!o.is_none(), "{} is None; pass a megacore.Tensor, a numpy array or a DLPack tensor (torch, cupy)", what);
  pyb::module_ np = pyb::module_::import("numpy");
  pyb::module_ core = pyb::module_::import("megacore._C");
  if (pyb::isinstance(o, np.attr("ndarray"))) {
    if (mode == TensorArg::Copy) return core.attr("from_numpy")(np.attr("ascontiguousarray")(o)).cast<Tensor>();
    MC_CHECK(o.attr("flags").attr("c_contiguous").cast<bool>(),
             "{} is a non-contiguous numpy array; pass np.ascontiguousarray(...) (outputs must share memory with "
             "the array they are written to)", what);
    return core.attr("from_numpy")(o).cast<Tensor>();
  }
  if (pyb::hasattr(o, "__dlpack__")) return core.attr("from_dlpack")(o).cast<Tensor>();
  MC_CHECK(mode == TensorArg::Copy, "{} is a {}; pass a megacore.Tensor, a numpy array or a DLPack tensor", what,
           std::string(pyb::repr(pyb::type::of(o))));
  return core.attr("from_numpy")(np.attr("ascontiguousarray")(np.attr("asarray")(o))).cast<Tensor>();
}

DType dtype_arg(const pyb::object& o) {
  std::string s = pyb::str(o);
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  return dtype_from_name(s);
}

void bind_core(pyb::module_& m) {
  m.def("cuda_available", &cuda_available, "True when this build has CUDA and a device is visible.");
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_device_name", &cuda_device_name, pyb::arg("index") = 0);
  m.def("cuda_device_total_memory", &cuda_device_total_memory, pyb::arg("index") = 0,
        "Total memory of a CUDA device in bytes, read from its properties (no CUDA context is created on it).");
  m.def("log_level", [] {
    static const char* names[] = {"debug", "info", "warning", "error", "off"};
    return std::string(names[int(log_level())]);
  }, "The log threshold of this process: MEGACORE_LOG_LEVEL (debug, info, warning, error, off; default info) "
     "unless set_log_level overrode it.");
  m.def("set_log_level", [](const std::string& name) {
    auto lv = parse_log_level(name);
    MC_CHECK(lv.has_value(), "log level '{}' is not one of debug, info, warning, error, off", name);
    set_log_level(*lv);
  }, pyb::arg("level"), "Overrides MEGACORE_LOG_LEVEL for the rest of this process.");

  pyb::class_<Generator>(m, "Generator", "Philox counter-based generator: same numbers on CPU and GPU.")
      .def(pyb::init<uint64_t, uint64_t>(), pyb::arg("seed") = 0, pyb::arg("offset") = 0)
      .def_property_readonly("seed", &Generator::seed)
      .def_property_readonly("offset", &Generator::offset)
      .def("set_state", &Generator::set_state, pyb::arg("seed"), pyb::arg("offset"));

  pyb::class_<Stream>(m, "Stream", "A CUDA stream (or the host stream).")
      .def(pyb::init([](const pyb::object& device, bool non_blocking, int priority) {
             return Stream::create(device_arg(device), non_blocking, priority);
           }),
           pyb::arg("device") = "cuda:0", pyb::arg("non_blocking") = true, pyb::arg("priority") = 0)
      .def_static("default", [](const pyb::object& d) { return Stream::default_stream(device_arg(d)); })
      .def_static("from_handle", [](const pyb::object& d, uintptr_t h) { return Stream::from_native(device_arg(d), reinterpret_cast<void*>(h)); },
                  "Wraps a cudaStream_t owned elsewhere (e.g. torch.cuda.current_stream().cuda_stream).")
      .def_property_readonly("device", [](const Stream& s) { return s.device().str(); })
      .def_property_readonly("handle", [](const Stream& s) { return reinterpret_cast<uintptr_t>(s.native()); })
      .def("synchronize", &Stream::synchronize, pyb::call_guard<pyb::gil_scoped_release>())
      .def("query", &Stream::query)
      .def("wait_stream", pyb::overload_cast<const Stream&>(&Stream::wait, pyb::const_))
      .def("wait_event", pyb::overload_cast<const Event&>(&Stream::wait, pyb::const_))
      .def("__eq__", [](const Stream& a, const Stream& b) { return a == b; })
      .def("__repr__", [](const Stream& s) {
        return fmt::format("megacore.Stream(device={}, handle={})", s.device().str(), s.native());
      });

  pyb::class_<Event>(m, "Event")
      .def(pyb::init<bool>(), pyb::arg("enable_timing") = false)
      .def("record", [](Event& e, const pyb::object& s) { e.record(s.is_none() ? current_stream(Device::cuda(0)) : s.cast<Stream>()); },
           pyb::arg("stream") = pyb::none())
      .def("synchronize", &Event::synchronize, pyb::call_guard<pyb::gil_scoped_release>())
      .def("query", &Event::query)
      .def("elapsed_ms", &Event::elapsed_ms);

  m.def("current_stream", [](const pyb::object& d) { return current_stream(device_arg(d)); }, pyb::arg("device") = "cuda:0",
        "The stream megacore uses for `device` in this thread when no stream is passed.");
  m.def("_set_current_stream", [](const Stream& s) {
    Stream prev = current_stream(s.device());
    if (s.device().is_cuda()) t_current[{int(s.device().type), s.device().index}] = s;
    return prev;
  });

  m.def("memory_stats", [](const pyb::object& d) {
    MemoryStats s = Allocator::get(device_arg(d)).stats();
    pyb::dict r;
    r["allocated"] = s.allocated;
    r["reserved"] = s.reserved;
    r["peak_allocated"] = s.peak_allocated;
    r["peak_reserved"] = s.peak_reserved;
    r["requested"] = s.requested;
    r["num_allocs"] = s.num_allocs;
    r["num_frees"] = s.num_frees;
    r["num_device_mallocs"] = s.num_device_mallocs;
    r["num_device_frees"] = s.num_device_frees;
    r["num_cache_flushes"] = s.num_cache_flushes;
    r["num_ooms"] = s.num_ooms;
    return r;
  }, pyb::arg("device") = "cuda:0");
  m.def("reset_peak_memory_stats", [](const pyb::object& d) { Allocator::get(device_arg(d)).reset_peak_stats(); },
        pyb::arg("device") = "cuda:0");
  m.def("host_sync_count", &host_sync_count,
        "Host synchronisations (stream/event/device synchronize, device-to-host reads, host waits on a "
        "collective) counted in this process since start-up or reset_host_syncs(); counted on CPU too.");
  m.def("host_sync_counts", &host_sync_counts, "host_sync_count() split by reason: {reason: count}.");
  m.def("reset_host_syncs", &reset_host_syncs, "Sets the host-sync counters to zero.");
  m.def("empty_cache", [](const pyb::object& d) { Allocator::get(device_arg(d)).empty_cache(); }, pyb::arg("device") = "cuda:0");
  m.def("set_memory_limit", [](const pyb::object& d, int64_t b) { Allocator::get(device_arg(d)).set_memory_limit(b); },
        pyb::arg("device"), pyb::arg("bytes"));
  m.def("synchronize", [](const pyb::object& d) {
    const Device dev = device_arg(d);
    {
      pyb::gil_scoped_release nogil;
      synchronize_device(dev);
    }
    comm::check_health();  // a collective the NCCL watchdog aborted ends here as CommError
  }, pyb::arg("device") = "cuda:0");

  auto shape_of = [](const pyb::object& o) {
    if (pyb::isinstance<pyb::int_>(o)) return Shape{o.cast<int64_t>()};
    return o.cast<Shape>();
  };

  pyb::class_<Tensor> t(m, "Tensor", pyb::buffer_protocol(), "A typed, strided view of host or device memory.");
  t.def_buffer([](Tensor& x) -> pyb::buffer_info {
     check_numpy_compatible(x);
     const char* f = buffer_format(x.dtype());
     std::vector<ssize_t> strides;
     for (int64_t s : x.strides()) strides.push_back(ssize_t(s * x.element_size()));
     return pyb::buffer_info(x.data_ptr(), ssize_t(x.element_size()), f, ssize_t(x.dim()),
                             std::vector<ssize_t>(x.shape().begin(), x.shape().end()), strides);
   })
      .def_property_readonly("shape", [](const Tensor& x) { return to_tuple(x.shape()); })
      .def_property_readonly("strides", [](const Tensor& x) { return to_tuple(x.strides()); }, "Strides in elements.")
      .def_property_readonly("dtype", [](const Tensor& x) { return std::string(dtype_name(x.dtype())); })
      .def_property_readonly("device", [](const Tensor& x) { return x.device().str(); })
      .def_property_readonly("ndim", &Tensor::dim)
      .def_property_readonly("numel", &Tensor::numel)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def_property_readonly("element_size", &Tensor::element_size)
      .def_property_readonly("data_ptr", [](const Tensor& x) { return reinterpret_cast<uintptr_t>(x.data_ptr()); })
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("__len__", [](const Tensor& x) {
        MC_CHECK(x.dim() > 0, "len() of a 0-d tensor");
        return x.size(0);
      })
      .def("__repr__", &Tensor::str)
      .def("size", &Tensor::size)
      .def("view", [=](const Tensor& x, const pyb::object& s) { return x.view(shape_of(s)); })
      .def("reshape", [=](const Tensor& x, const pyb::object& s, const pyb::object& st) {
        return x.reshape(shape_of(s), stream_arg(st, x.device()));
      }, pyb::arg("shape"), pyb::arg("stream") = pyb::none())
      .def("slice", &Tensor::slice, pyb::arg("dim"), pyb::arg("start"), pyb::arg("end"), pyb::arg("step") = 1)
      .def("narrow", &Tensor::narrow)
      .def("select", &Tensor::select)
      .def("transpose", &Tensor::transpose)
      .def("permute", &Tensor::permute)
      .def("unsqueeze", &Tensor::unsqueeze)
      .def("squeeze", &Tensor::squeeze)
      .def("contiguous", [](const Tensor& x, const pyb::object& st) { return x.contiguous(stream_arg(st, x.device())); },
           pyb::arg("stream") = pyb::none())
      .def("clone", [](const Tensor& x, const pyb::object& st) { return x.clone(stream_arg(st, x.device())); },
           pyb::arg("stream") = pyb::none())
      .def("to", [](const Tensor& x, const pyb::object& target, const pyb::object& st) {
        // A string names a dtype or a device; try dtype names first ("f32" is never a device).
        if (pyb::isinstance<pyb::str>(target)) {
          std::string s = target.cast<std::string>();
          if (s == "cpu" || s.rfind("cuda", 0) == 0) {
            Device d = Device::parse(s);
            return x.to(d, stream_arg(st, d.is_cuda() ? d : x.device()));
          }
          return x.to(dtype_from_name(s), stream_arg(st, x.device()));
        }
        Device d = device_arg(target);
        return x.to(d, stream_arg(st, d.is_cuda() ? d : x.device()));
      }, pyb::arg("target"), pyb::arg("stream") = pyb::none(), "Copy to a device ('cpu', 'cuda:0') or dtype ('bf16').")
      .def("view_as_dtype", [](const Tensor& x, const std::string& dtype) { return x.view_as_dtype(dtype_from_name(dtype)); },
           pyb::arg("dtype"), "The same bytes seen as another dtype of the same size (e.g. FP8 codes as 'u8').")
      .def("copy_", [](Tensor& x, const Tensor& src, const pyb::object& st) -> Tensor& {
        Device d = x.device().is_cuda() ? x.device() : src.device();
        return x.copy_(src, stream_arg(st, d));
      }, pyb::arg("src"), pyb::arg("stream") = pyb::none(), pyb::return_value_policy::reference_internal)
      .def("fill_", [](Tensor& x, double v, const pyb::object& st) -> Tensor& { return x.fill_(v, stream_arg(st, x.device())); },
           pyb::arg("value"), pyb::arg("stream") = pyb::none(), pyb::return_value_policy::reference_internal)
      .def("uniform_", [](Tensor& x, Generator& g, double lo, double hi, const pyb::object& st) -> Tensor& {
        return x.uniform_(g, lo, hi, stream_arg(st, x.device()));
      }, pyb::arg("generator"), pyb::arg("low") = 0.0, pyb::arg("high") = 1.0, pyb::arg("stream") = pyb::none(),
         pyb::return_value_policy::reference_internal)
      .def("normal_", [](Tensor& x, Generator& g, double mean, double std, const pyb::object& st) -> Tensor& {
        return x.normal_(g, mean, std, stream_arg(st, x.device()));
      }, pyb::arg("generator"), pyb::arg("mean") = 0.0, pyb::arg("std") = 1.0, pyb::arg("stream") = pyb::none(),
         pyb::return_value_policy::reference_internal)
      // Host reads of a device tensor are ordered after the current stream (the one its producer ran on).
      .def("item", [](const Tensor& t) { return t.to(Device::cpu(), current_stream(t.device())).item(); })
      .def("tolist_flat", [](const Tensor& t) { return t.to(Device::cpu(), current_stream(t.device())).to_double_vector(); },
           "All elements as floats, row-major.")
      .def("numpy", &as_numpy, "Zero-copy numpy view (the array keeps this tensor alive).")
      .def("__array__", [](const pyb::object& self, const pyb::object& dtype, const pyb::object& copy) {
        pyb::object a = as_numpy(self);
        return dtype.is_none() ? a : a.attr("astype")(dtype);
      }, pyb::arg("dtype") = pyb::none(), pyb::arg("copy") = pyb::none());

  auto factory = [&](const char* name, auto fn, const char* doc) {
    m.def(name, fn, pyb::arg("shape"), pyb::arg("dtype") = "f32", pyb::arg("device") = "cpu",
          pyb::arg("stream") = pyb::none(), doc);
  };
  factory("empty", [=](const pyb::object& s, const pyb::object& dt, const pyb::object& d, const pyb::object& st) {
    Device dev = device_arg(d);
    return Tensor::empty(shape_of(s), dtype_arg(dt), dev, stream_arg(st, dev));
  }, "Uninitialised tensor.");
  factory("zeros", [=](const pyb::object& s, const pyb::object& dt, const pyb::object& d, const pyb::object& st) {
    Device dev = device_arg(d);
    return Tensor::zeros(shape_of(s), dtype_arg(dt), dev, stream_arg(st, dev));
  }, "Tensor of zeros.");
  m.def("full", [=](const pyb::object& s, double v, const pyb::object& dt, const pyb::object& d, const pyb::object& st) {
    Device dev = device_arg(d);
    return Tensor::full(shape_of(s), v, dtype_arg(dt), dev, stream_arg(st, dev));
  }, pyb::arg("shape"), pyb::arg("value"), pyb::arg("dtype") = "f32", pyb::arg("device") = "cpu",
        pyb::arg("stream") = pyb::none());

  m.def("from_numpy", [](pyb::buffer b) {
    pyb::buffer_info info = b.request(/*writable=*/false);
    DType dt = dtype_from_format(info.format, info.itemsize);
    Shape shape(info.shape.begin(), info.shape.end()), strides;
    for (ssize_t s : info.strides) {
      MC_CHECK(s % info.itemsize == 0, "array strides {} are not a multiple of the item size {}; copy it with "
               "np.ascontiguousarray first", s, info.itemsize);
      strides.push_back(int64_t(s / info.itemsize));
    }
    // The array stays alive as long as any tensor uses its memory.
    auto* keep = new pyb::object(b);
    return Tensor::from_blob(info.ptr, shape, strides, dt, Device::cpu(), [keep] {
      pyb::gil_scoped_acquire gil;
      delete keep;
    });
  }, pyb::arg("array"), "Shares a numpy array's memory (no copy).");
}

}  // namespace megacore::py
