// megacore._C.checkpoint: distributed checkpoints from Python (save / load / inspect). Tensors are
// given as (name, local, global_shape, global_offsets[, write]) tuples — one box per tensor, which covers
// every plain TP slice — or as a {name: tensor} dict of whole (replicated) tensors. See
// include/megacore/checkpoint/dist_checkpoint.hpp for the format and the crash-safety protocol.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/checkpoint/dist_checkpoint.hpp"
#include "megacore/checkpoint/safetensors.hpp"

namespace megacore::py {

namespace {

using namespace megacore::checkpoint;

std::vector<ShardedTensor> sharded_arg(const pyb::object& tensors) {
  std::vector<ShardedTensor> out;
  if (pyb::isinstance<pyb::dict>(tensors)) {
    for (auto [k, v] : tensors.cast<pyb::dict>()) {
      const std::string name = k.cast<std::string>();
      out.push_back(replicated_tensor(name, tensor_arg(v, "checkpoint: " + name)));
    }
    return out;
  }
  for (const pyb::handle& item : tensors) {
    auto t = item.cast<pyb::tuple>();
    MC_CHECK(t.size() == 4 || t.size() == 5,
             "checkpoint: each tensor is (name, local, global_shape, global_offsets[, write]); got {} fields", t.size());
    ShardedTensor st;
    st.name = t[0].cast<std::string>();
    st.local = tensor_arg(t[1], "checkpoint: " + st.name);
    st.dtype = st.local.dtype();
    st.global_shape = t[2].cast<Shape>();
    Shape offs = t[3].cast<Shape>();
    MC_CHECK(offs.size() == st.local.shape().size() && st.global_shape.size() == offs.size(),
             "checkpoint: tensor '{}' has {} dims but {} global dims and {} offsets", st.name, st.local.dim(),
             st.global_shape.size(), offs.size());
    // The box is the local tensor clipped to the global one (vocabulary padding rows fall off the end).
    Shape box = st.local.shape();
    for (size_t d = 0; d < box.size(); ++d) box[d] = std::max<int64_t>(0, std::min(box[d], st.global_shape[d] - offs[d]));
    st.pieces.push_back({Shape(offs.size(), 0), offs, box, Tensor()});
    st.write = t.size() == 5 ? t[4].cast<bool>() : true;
    out.push_back(std::move(st));
  }
  return out;
}

CheckpointState state_arg(int64_t step, const pyb::object& tensors, const std::map<std::string, std::string>& json,
                          const pyb::object& extra, const std::optional<double>& val_loss) {
  CheckpointState st;
  st.step = step;
  st.tensors = sharded_arg(tensors);
  st.json = json;
  if (!extra.is_none())
    for (auto [k, v] : extra.cast<pyb::dict>()) st.extra_tensors[k.cast<std::string>()] = tensor_arg(v, "checkpoint: extra tensor");
  st.val_loss = val_loss;
  return st;
}

}  // namespace

void bind_checkpoint(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("checkpoint", "Distributed checkpoints that reshard on load.");
  m.def("save", [](comm::Communicator& world, const std::string& path, int64_t step, const pyb::object& tensors,
                   const std::map<std::string, std::string>& json, const pyb::object& extra_tensors,
                   std::optional<double> val_loss, bool verify, int threads) {
    CheckpointState st = state_arg(step, tensors, json, extra_tensors, val_loss);
    SaveOptions o;
    o.verify = verify;
    o.threads = threads;
    pyb::gil_scoped_release nogil;
    return save_checkpoint(world, path, st, o);
  }, pyb::arg("world"), pyb::arg("root"), pyb::arg("step"), pyb::arg("tensors"),
     pyb::arg("json") = std::map<std::string, std::string>{}, pyb::arg("extra_tensors") = pyb::none(),
     pyb::arg("val_loss") = pyb::none(), pyb::arg("verify") = false, pyb::arg("threads") = 0,
     "Collective save into root/step_<step>; returns the directory. tensors: {name: tensor} (whole) or a list of "
     "(name, local, global_shape, global_offsets[, write]).");
  pyb::class_<AsyncCheckpointSaver>(m, "AsyncSaver",
                                    "Async saves: save() returns once this rank's pieces are snapshotted in host "
                                    "memory; a background thread writes them; the next save() or wait() commits.")
      .def(pyb::init([](comm::Communicator& world, bool verify, int threads, int64_t host_memory_limit) {
             SaveOptions o;
             o.verify = verify;
             o.threads = threads;
             o.async_host_memory_limit = host_memory_limit;
             return std::make_unique<AsyncCheckpointSaver>(world, o);
           }),
           pyb::arg("world"), pyb::arg("verify") = false, pyb::arg("threads") = 0,
           pyb::arg("host_memory_limit") = int64_t(-1), pyb::keep_alive<1, 2>(),
           "host_memory_limit: bytes the snapshot may take beyond the buffers already held (-1: this rank's share "
           "of 90% of MemAvailable); a save that does not fit is written synchronously.")
      .def("save", [](AsyncCheckpointSaver& s, const std::string& root, int64_t step, const pyb::object& tensors,
                      const std::map<std::string, std::string>& json, const pyb::object& extra_tensors,
                      std::optional<double> val_loss) {
        CheckpointState st = state_arg(step, tensors, json, extra_tensors, val_loss);
        pyb::gil_scoped_release nogil;
        s.save(root, st);
      }, pyb::arg("root"), pyb::arg("step"), pyb::arg("tensors"),
         pyb::arg("json") = std::map<std::string, std::string>{}, pyb::arg("extra_tensors") = pyb::none(),
         pyb::arg("val_loss") = pyb::none(), "Commits the previous save, snapshots these tensors and starts writing.")
      .def("reserve", [](AsyncCheckpointSaver& s, const pyb::object& tensors, const pyb::object& extra_tensors) {
        CheckpointState st = state_arg(0, tensors, {}, extra_tensors, std::nullopt);
        pyb::gil_scoped_release nogil;
        return s.reserve(st);
      }, pyb::arg("tensors"), pyb::arg("extra_tensors") = pyb::none(),
         "Allocates the snapshot buffers for saves of these tensors now (page-locked for GPU tensors), so the first "
         "save blocks no longer than later ones; not collective. Returns the bytes held.")
      .def("wait", &AsyncCheckpointSaver::wait, pyb::call_guard<pyb::gil_scoped_release>(),
           "Waits for the writer and commits (collective); returns the directory, '' when nothing was pending.")
      .def_property_readonly("pending", &AsyncCheckpointSaver::pending)
      .def_property_readonly("last_save_was_synchronous", &AsyncCheckpointSaver::last_save_was_synchronous)
      .def_property_readonly("snapshot_bytes", &AsyncCheckpointSaver::snapshot_bytes);
  m.def("load", [](comm::Communicator* world, const std::string& path, const pyb::object& tensors, bool verify,
                   bool allow_missing, int threads) {
    std::vector<ShardedTensor> targets = sharded_arg(tensors);
    LoadOptions o;
    o.verify_checksums = verify;
    o.allow_missing = allow_missing;
    o.threads = threads;
    std::optional<CheckpointReader> r;
    {
      pyb::gil_scoped_release nogil;
      r.emplace(load_checkpoint(world, path, targets, o));
    }
    pyb::dict d;
    d["dir"] = r->dir();
    d["step"] = r->step();
    d["json"] = r->json();
    d["val_loss"] = r->val_loss() ? pyb::cast(*r->val_loss()) : pyb::none();
    d["bytes_read"] = r->bytes_read();
    return d;
  }, pyb::arg("world"), pyb::arg("path"), pyb::arg("tensors"), pyb::arg("verify") = true,
     pyb::arg("allow_missing") = false, pyb::arg("threads") = 0,
     "Fills the given tensors in place from the checkpoint at path (a step dir or a root with `latest`); "
     "world may be None (no agreement). Returns {dir, step, json, val_loss, bytes_read}.");
  m.def("resolve", &resolve_checkpoint, pyb::arg("path"),
        "The checkpoint directory to load from path, or None.");
  m.def("list_checkpoints", [](const std::string& root) {
    pyb::list out;
    for (const auto& c : list_checkpoints(root)) {
      pyb::dict d;
      d["step"] = c.step;
      d["dir"] = c.dir;
      d["val_loss"] = c.val_loss ? pyb::cast(*c.val_loss) : pyb::none();
      out.append(d);
    }
    return out;
  }, pyb::arg("root"));
  m.def("read_full", [](const std::string& path, const std::string& name, bool verify) {
    LoadOptions o;
    o.verify_checksums = verify;
    CheckpointReader r(path, o);
    return r.load_full(name);
  }, pyb::arg("path"), pyb::arg("name"), pyb::arg("verify") = true, "One whole tensor on the host.");
  m.def("tensor_names", [](const std::string& path) { return CheckpointReader(path).tensor_names(); },
        pyb::arg("path"));
  // The one safetensors reader: Python's SafetensorsReader opens files through it, so both languages accept and
  // refuse exactly the same files (overlaps, holes, size/shape mismatches, truncation, bad JSON, duplicates).
  pyb::class_<SafetensorsFile>(m, "SafetensorsFile",
                               "A validated, memory-mapped safetensors file (every problem is an IOError naming the "
                               "file and the tensor).")
      .def(pyb::init<const std::string&>(), pyb::arg("path"), pyb::call_guard<pyb::gil_scoped_release>())
      .def_property_readonly("path", &SafetensorsFile::path)
      .def("names", &SafetensorsFile::names, "Tensor names in data order.")
      .def("__contains__", &SafetensorsFile::contains)
      .def_property_readonly("metadata", &SafetensorsFile::metadata)
      .def_property_readonly("data_size", &SafetensorsFile::data_size)
      .def("info", [](const SafetensorsFile& f, const std::string& name) {
        const SafetensorsInfo& i = f.info(name);
        pyb::dict d;
        d["dtype"] = std::string(safetensors_dtype_name(i.dtype));
        d["shape"] = i.shape;
        d["data_offsets"] = std::vector<int64_t>{i.data_begin, i.data_begin + i.nbytes};
        return d;
      }, pyb::arg("name"), "{dtype, shape, data_offsets: [begin, end)} of one tensor (offsets from the data start).")
      .def("tensor", &SafetensorsFile::tensor, pyb::arg("name"), "A CPU tensor viewing the mapped bytes (no copy).")
      .def("load", [](const SafetensorsFile& f, const std::string& name) { return f.load(name); }, pyb::arg("name"),
           "A CPU tensor owning a copy of the bytes.");
  m.def("crc32", [](const pyb::bytes& b, uint32_t crc) {
    std::string_view s = b;
    return crc32(s.data(), s.size(), crc);
  }, pyb::arg("data"), pyb::arg("crc") = 0u);
  m.def("crc32c", [](const pyb::buffer& b, uint32_t crc) {
    pyb::buffer_info info = b.request();
    bool contiguous = true;
    for (pyb::ssize_t d = info.ndim - 1, step = info.itemsize; d >= 0; step *= info.shape[size_t(d)], --d)
      contiguous &= info.shape[size_t(d)] <= 1 || info.strides[size_t(d)] == step;
    MC_CHECK(contiguous, "crc32c: pass a C-contiguous buffer (bytes, memoryview, numpy array)");
    const size_t n = size_t(info.size) * size_t(info.itemsize);
    pyb::gil_scoped_release nogil;
    return crc32c(info.ptr, n, crc);
  }, pyb::arg("data"), pyb::arg("crc") = 0u, "CRC-32C of a contiguous buffer (what format-2 checkpoints carry).");
}

}  // namespace megacore::py
