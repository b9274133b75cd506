// DLPack exchange: Tensor.__dlpack__ / __dlpack_device__ and megacore.from_dlpack, zero-copy on CPU
// and CUDA, with the stream handshake of the Python array API standard.
#include "bindings.hpp"
#include "dlpack_abi.hpp"

namespace megacore::py {
namespace {

namespace dl = megacore::dlpack;

dl::DataType to_dl(DType dt) {
  switch (dt) {
    case DType::F32: return {dl::kFloat, 32, 1};
    case DType::BF16: return {dl::kBfloat, 16, 1};
    case DType::F16: return {dl::kFloat, 16, 1};
    case DType::I32: return {dl::kInt, 32, 1};
    case DType::I64: return {dl::kInt, 64, 1};
    case DType::U8: return {dl::kUInt, 8, 1};
    case DType::F8E4M3: return {dl::kFloat8_e4m3fn, 8, 1};
    case DType::F8E5M2: return {dl::kFloat8_e5m2, 8, 1};
  }
  return {dl::kFloat, 32, 1};
}

DType from_dl(dl::DataType t) {
  MC_CHECK(t.lanes == 1, "DLPack tensors with {} lanes are not supported (only scalar elements)", t.lanes);
  if (t.code == dl::kFloat && t.bits == 32) return DType::F32;
  if (t.code == dl::kFloat && t.bits == 16) return DType::F16;
  if (t.code == dl::kBfloat && t.bits == 16) return DType::BF16;
  if (t.code == dl::kInt && t.bits == 32) return DType::I32;
  if (t.code == dl::kInt && t.bits == 64) return DType::I64;
  if (t.code == dl::kUInt && t.bits == 8) return DType::U8;
  if (t.code == dl::kFloat8_e4m3fn && t.bits == 8) return DType::F8E4M3;
  if (t.code == dl::kFloat8_e5m2 && t.bits == 8) return DType::F8E5M2;
  raise("DLPack dtype (code {}, {} bits) has no megacore equivalent; megacore supports f32, bf16, f16, i32, i64 and "
        "u8: convert the tensor first",
        int(t.code), int(t.bits));
}

// What a capsule keeps alive: a reference to the tensor plus the shape/stride arrays.
struct Ctx {
  Tensor tensor;
  Shape shape, strides;
};

template <class M>
void fill_dl(M* m, Ctx* ctx) {
  const Tensor& t = ctx->tensor;
  m->dl_tensor.data = t.data_ptr();
  m->dl_tensor.device = {t.device().is_cuda() ? dl::kCUDA : dl::kCPU, t.device().is_cuda() ? t.device().index : 0};
  m->dl_tensor.ndim = int32_t(t.dim());
  m->dl_tensor.dtype = to_dl(t.dtype());
  m->dl_tensor.shape = ctx->shape.data();
  m->dl_tensor.strides = ctx->strides.data();
  m->dl_tensor.byte_offset = 0;
  m->manager_ctx = ctx;
}

// The producer's side of the stream handshake: make the consumer's stream wait for work megacore
// queued on its current stream, so the consumer never reads data still being written.
void sync_for_consumer(const Tensor& t, const pyb::object& stream) {
  if (!t.device().is_cuda()) return;
  Stream producer = current_stream(t.device());
  if (stream.is_none()) {
    // The standard: None means the legacy default stream.
    Stream::from_native(t.device(), reinterpret_cast<void*>(uintptr_t(1))).wait(producer);
    return;
  }
  int64_t s = stream.cast<int64_t>();
  if (s == -1) return;  // the consumer asked for no synchronisation
  MC_CHECK(s != 0, "__dlpack__(stream=0) is ambiguous for CUDA; pass 1 for the legacy default stream, 2 for the "
           "per-thread default stream, or a stream handle");
  Stream consumer = Stream::from_native(t.device(), reinterpret_cast<void*>(uintptr_t(s)));
  if (!(consumer == producer)) consumer.wait(producer);
}

pyb::capsule export_capsule(const Tensor& t, const pyb::object& stream, const pyb::object& max_version) {
  sync_for_consumer(t, stream);
  auto* ctx = new Ctx{t, t.shape(), t.strides()};
  bool versioned = false;
  if (!max_version.is_none()) {
    auto v = max_version.cast<std::pair<int, int>>();
    versioned = v.first >= 1;
  }
  if (versioned) {
    auto* m = new dl::ManagedTensorVersioned{};
    m->version = {dl::kMajor, dl::kMinor};
    m->flags = 0;
    fill_dl(m, ctx);
    m->deleter = [](dl::ManagedTensorVersioned* self) {
      delete static_cast<Ctx*>(self->manager_ctx);
      delete self;
    };
    return pyb::capsule(m, "dltensor_versioned", [](PyObject* cap) {
      // Only an unconsumed capsule still owns the tensor; a consumer renames it and calls the deleter.
      if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        auto* p = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(cap, "dltensor_versioned"));
        if (p && p->deleter) p->deleter(p);
      }
    });
  }
  auto* m = new dl::ManagedTensor{};
  fill_dl(m, ctx);
  m->deleter = [](dl::ManagedTensor* self) {
    delete static_cast<Ctx*>(self->manager_ctx);
    delete self;
  };
  return pyb::capsule(m, "dltensor", [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* p = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      if (p && p->deleter) p->deleter(p);
    }
  });
}

Tensor tensor_from_dl(const dl::DLTensor& d, std::function<void()> release) {
  Device dev;
  if (d.device.device_type == dl::kCPU || d.device.device_type == dl::kCUDAHost) dev = Device::cpu();
  else if (d.device.device_type == dl::kCUDA) dev = Device::cuda(d.device.device_id);
  else
    raise("DLPack device type {} is not supported; megacore takes CPU, CUDA-host and CUDA tensors",
          d.device.device_type);
  DType dt = from_dl(d.dtype);
  MC_CHECK(d.byte_offset % uint64_t(dtype_size(dt)) == 0, "DLPack byte_offset {} is not a multiple of the element size",
           d.byte_offset);
  Shape shape(d.shape, d.shape + d.ndim);
  Shape strides = d.strides ? Shape(d.strides, d.strides + d.ndim) : contiguous_strides(shape);
  void* data = static_cast<char*>(d.data) + d.byte_offset;
  return Tensor::from_blob(data, shape, strides, dt, dev, std::move(release));
}

Tensor import_capsule(pyb::capsule cap) {
  PyObject* c = cap.ptr();
  if (PyCapsule_IsValid(c, "dltensor_versioned")) {
    auto* m = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
    MC_CHECK(m->version.major == dl::kMajor, "DLPack major version {} is not supported (megacore speaks {})",
             m->version.major, dl::kMajor);
    PyCapsule_SetName(c, "used_dltensor_versioned");
    auto release = [m] {
      pyb::gil_scoped_acquire gil;  // the producer's deleter may touch Python objects
      if (m->deleter) m->deleter(m);
    };
    try {
      return tensor_from_dl(m->dl_tensor, release);
    } catch (...) {
      release();
      throw;
    }
  }
  if (PyCapsule_IsValid(c, "dltensor")) {
    auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
    PyCapsule_SetName(c, "used_dltensor");
    auto release = [m] {
      pyb::gil_scoped_acquire gil;
      if (m->deleter) m->deleter(m);
    };
    try {
      return tensor_from_dl(m->dl_tensor, release);
    } catch (...) {
      release();
      throw;
    }
  }
  raise("not a DLPack capsule, or one that was already consumed (a capsule can be imported once)");
}

}  // namespace

void bind_dlpack(pyb::module_& m) {
  auto t = pyb::reinterpret_borrow<pyb::class_<Tensor>>(m.attr("Tensor"));
  t.def("__dlpack__", [](const Tensor& x, const pyb::object& stream, const pyb::object& max_version,
                         const pyb::object& dl_device, const pyb::object& copy) {
     MC_CHECK(copy.is_none() || !copy.cast<bool>(), "__dlpack__(copy=True) is not supported; megacore shares memory");
     if (!dl_device.is_none()) {
       auto dd = dl_device.cast<std::pair<int, int>>();
       bool same = x.device().is_cuda() ? (dd.first == dl::kCUDA && dd.second == x.device().index) : dd.first == dl::kCPU;
       MC_CHECK(same, "__dlpack__(dl_device={}) differs from the tensor's device {}; move it with t.to(...) first",
                std::string(pyb::repr(dl_device)), x.device().str());
     }
     return export_capsule(x, stream, max_version);
   }, pyb::kw_only(), pyb::arg("stream") = pyb::none(), pyb::arg("max_version") = pyb::none(),
     pyb::arg("dl_device") = pyb::none(), pyb::arg("copy") = pyb::none())
      .def("__dlpack_device__", [](const Tensor& x) {
        return std::make_pair(int(x.device().is_cuda() ? dl::kCUDA : dl::kCPU), x.device().is_cuda() ? x.device().index : 0);
      });

  m.def("from_dlpack", [](const pyb::object& obj) {
    if (pyb::isinstance<pyb::capsule>(obj)) return import_capsule(obj.cast<pyb::capsule>());
    MC_CHECK(pyb::hasattr(obj, "__dlpack__"), "from_dlpack needs an object with __dlpack__ (torch, cupy, jax, numpy) "
             "or a DLPack capsule; got {}", std::string(pyb::repr(pyb::type::of(obj))));
    pyb::object stream = pyb::none();
    if (pyb::hasattr(obj, "__dlpack_device__")) {
      auto dev = obj.attr("__dlpack_device__")().cast<std::pair<int, int>>();
      if (dev.first == dl::kCUDA) {
        // Ask the producer to order its pending writes before our current stream.
        Stream ours = current_stream(Device::cuda(dev.second));
        stream = pyb::int_(ours.is_default() ? uintptr_t(1) : reinterpret_cast<uintptr_t>(ours.native()));
      }
    }
    pyb::object cap;
    try {
      cap = obj.attr("__dlpack__")(pyb::arg("stream") = stream, pyb::arg("max_version") = pyb::make_tuple(1, 0));
    } catch (pyb::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) throw;
      cap = obj.attr("__dlpack__")(pyb::arg("stream") = stream);  // a producer older than DLPack 1.0
    }
    return import_capsule(cap.cast<pyb::capsule>());
  }, pyb::arg("obj"), "Shares memory with any DLPack producer (no copy).");
}

}  // namespace megacore::py
