// Distributed checkpoint save/commit/load (the protocol is described in dist_checkpoint.hpp).
#include "megacore/checkpoint/dist_checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "checkpoint/parallel_io.hpp"
#include "data/pinned_memory.hpp"
#include "megacore/build_config.hpp"
#include "megacore/checkpoint/safetensors.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/peer_error.hpp"
#include "megacore/optim/optimizer.hpp"

namespace megacore::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "megacore-distributed-checkpoint";
// 1: CRC-32 per shard entry ("crc32"); 2: CRC-32C ("crc32c"). Both load.
constexpr int kVersion = 2;
constexpr const char* kMetadataFile = "metadata.json";
constexpr const char* kLatestFile = "latest";

std::string errno_str() { return std::strerror(errno); }

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) raise<IOError>("checkpoint: cannot open '{}' to fsync it: {}", path, errno_str());
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) raise<IOError>("checkpoint: fsync of '{}' failed: {}", path, std::strerror(e));
}

// Writes `text` to `path` atomically: temporary file in the same directory, fsync, rename, fsync dir.
void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) raise<IOError>("checkpoint: cannot create '{}': {}", tmp, errno_str());
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      raise<IOError>("checkpoint: write to '{}' failed: {}", tmp, std::strerror(e));
    }
    p += n;
    left -= size_t(n);
  }
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    raise<IOError>("checkpoint: fsync of '{}' failed: {}", tmp, std::strerror(e));
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    raise<IOError>("checkpoint: cannot rename '{}' to '{}': {}", tmp, path, std::strerror(e));
  }
  fsync_path(fs::path(path).parent_path().string(), true);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) raise<IOError>("checkpoint: cannot read '{}': {}", path, errno_str());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string shard_file_name(int rank) { return fmt::format("shard_{:05d}.safetensors", rank); }
std::string fragment_file_name(int rank) { return fmt::format("shard_{:05d}.json", rank); }

std::string entry_key(const std::string& name, const Shape& offsets) {
  std::string k = name;
  k += '[';
  for (size_t i = 0; i < offsets.size(); ++i) {
    if (i) k += ',';
    k += std::to_string(offsets[i]);
  }
  k += ']';
  return k;
}

int64_t volume(const Shape& s) {
  int64_t v = 1;
  for (int64_t x : s) v *= x;
  return v;
}

using detail::parallel_for;

struct Entry {
  std::string name, key;
  Shape global_shape, offsets, shape;
  DType dtype = DType::F32;
  Tensor host;
  uint32_t crc = 0;
};

json entry_json(const Entry& e) {
  return {{"name", e.name},     {"key", e.key},     {"dtype", std::string(safetensors_dtype_name(e.dtype))},
          {"global_shape", e.global_shape}, {"offsets", e.offsets}, {"shape", e.shape}, {"crc32c", e.crc}};
}

bool boxes_overlap(const Shape& ao, const Shape& as, const Shape& bo, const Shape& bs) {
  for (size_t i = 0; i < ao.size(); ++i)
    if (ao[i] + as[i] <= bo[i] || bo[i] + bs[i] <= ao[i]) return false;
  return true;
}

// Shards must lie inside the tensor, not overlap and cover it completely.
void check_tiling(const std::string& where, const std::string& name, const Shape& gs,
                  const std::vector<TensorMeta::Shard>& shards) {
  int64_t covered = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    if (s.offsets.size() != gs.size() || s.shape.size() != gs.size())
      raise<IOError>("{}: tensor '{}' has a shard of rank {} but the tensor has rank {}", where, name, s.shape.size(),
                     gs.size());
    for (size_t d = 0; d < gs.size(); ++d)
      if (s.offsets[d] < 0 || s.shape[d] < 0 || s.offsets[d] + s.shape[d] > gs[d])
        raise<IOError>("{}: tensor '{}' of shape {} has shard {} at {} of shape {} outside it", where, name,
                       shape_str(gs), s.key, shape_str(s.offsets), shape_str(s.shape));
    for (size_t j = 0; j < i; ++j)
      if (volume(s.shape) > 0 && volume(shards[j].shape) > 0 &&
          boxes_overlap(s.offsets, s.shape, shards[j].offsets, shards[j].shape))
        raise<IOError>("{}: tensor '{}' has overlapping shards {} ({}) and {} ({})", where, name, s.key, s.file,
                       shards[j].key, shards[j].file);
    covered += volume(s.shape);
  }
  if (covered != volume(gs))
    raise<IOError>("{}: the shards of tensor '{}' cover {} of its {} elements (shape {}); the checkpoint is "
                   "incomplete — was a rank's shard lost?",
                   where, name, covered, volume(gs), shape_str(gs));
}

// The metadata of the checkpoint in `dir`, or nullopt when it has none that is a megacore checkpoint's; `why` (if
// given) then says what is wrong with it.
std::optional<json> parse_metadata(const std::string& dir, std::string* why = nullptr) {
  const fs::path p = fs::path(dir) / kMetadataFile;
  std::error_code ec;
  auto fail = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  if (!fs::is_regular_file(p, ec)) return fail(std::string(kMetadataFile) + " is missing");
  try {
    json j = json::parse(read_text(p.string()));
    if (!j.is_object() || j.value("format", "") != kFormat)
      return fail(fmt::format("{} is not a megacore checkpoint's (no \"format\": \"{}\")", kMetadataFile, kFormat));
    return j;
  } catch (const std::exception& e) {
    return fail(fmt::format("{} cannot be read or is not valid JSON ({})", kMetadataFile, e.what()));
  }
}

std::optional<int64_t> step_of_dir_name(const std::string& name) {
  if (name.rfind("step_", 0) != 0 || name.size() == 5) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  return std::stoll(name.substr(5));
}

}  // namespace

void agree(comm::Communicator* world, const std::exception_ptr& local, const char* phase) {
  if (world == nullptr || world->size() == 1) {
    if (local) std::rethrow_exception(local);
    return;
  }
  // On the communicator's device (a CUDA tensor for NCCL worlds), then back to the host.
  Tensor flag = Tensor::from_vector<int32_t>({local ? 1 : 0, local ? world->size() - world->rank() : 0}, {2})
                    .to(world->device());
  world->all_reduce(flag, comm::ReduceOp::Max)->wait();
  flag = flag.to(Device::cpu());
  const int32_t* f = flag.data<int32_t>();
  if (local) std::rethrow_exception(local);
  if (f[0] != 0) {
    const int group_rank = world->size() - f[1];  // named by its world rank, as its own reports are
    const int failed = size_t(group_rank) < world->world_ranks().size() ? world->world_ranks()[size_t(group_rank)]
                                                                       : group_rank;
    const bool save = std::string_view(phase).rfind("save", 0) == 0;
    throw PeerIOError(fmt::format("checkpoint {}: rank {} failed (its own error message says why){}", phase, failed,
                                  save ? "; nothing was committed" : ""),
                      failed);
  }
}

std::string checkpoint_dir(const std::string& root, int64_t step) {
  return (fs::path(root) / ("step_" + std::to_string(step))).string();
}

// ---- save -----------------------------------------------------------------------------------------

struct AsyncCheckpointSaver::Job {
  std::string root, tmp_dir, final_dir;
  int64_t step = 0;
  std::vector<Entry> entries;
  std::map<std::string, std::string> json_blobs;
  std::optional<double> val_loss;
  std::thread thread;
  std::exception_ptr error;  // set by the writer thread before it ends
  bool joined = false;

  void join() {
    if (!joined && thread.joinable()) thread.join();
    joined = true;
  }
};

namespace {

// Phase 1: rank 0 prepares the temporary directory; each rank validates its pieces and, unless
// `keep_views` (the async saver snapshots them itself), stages them as contiguous host tensors.
void hook(const SaveOptions& o, const char* point) {
  if (o.fault_hook) o.fault_hook(point);
}

// The entries of a save of `state` on this rank: one per piece it writes (views of the live tensors with
// `keep_views`, else host copies). Checks names, dtypes and piece shapes.
std::vector<Entry> list_entries(const CheckpointState& state, int rank, bool keep_views) {
  std::vector<Entry> out;
  std::set<std::string> names;
  auto add = [&](const std::string& name, const Shape& gs, DType dt, const Tensor& view, const Shape& offs) {
    Entry e;
    e.name = name;
    e.key = entry_key(name, offs);
    e.global_shape = gs;
    e.offsets = offs;
    e.shape = view.shape();
    e.dtype = dt;
    e.host = keep_views ? view : view.to(Device::cpu()).contiguous();
    out.push_back(std::move(e));
  };
  for (const ShardedTensor& t : state.tensors) {
    MC_CHECK(!t.name.empty() && t.name.find('[') == std::string::npos,
             "save_checkpoint: tensor name '{}' is empty or contains '['; rename it", t.name);
    MC_CHECK(names.insert(t.name).second, "save_checkpoint: tensor '{}' is described twice on rank {}", t.name,
             rank);
    if (!t.write || t.pieces.empty()) continue;  // nothing of it on this rank (e.g. a ZeRO shard elsewhere)
    const bool own_data =
        std::all_of(t.pieces.begin(), t.pieces.end(), [](const ShardPiece& p) { return p.data.defined(); });
    if (!own_data) {
      MC_CHECK(t.local.defined(), "save_checkpoint: tensor '{}' has no local data", t.name);
      MC_CHECK(t.local.dtype() == t.dtype, "save_checkpoint: tensor '{}' is described as {} but its data is {}",
               t.name, dtype_name(t.dtype), dtype_name(t.local.dtype()));
    }
    for (const ShardPiece& p : t.pieces) {
      Tensor v = p.data;
      if (v.defined()) {
        MC_CHECK(v.shape() == p.shape && v.dtype() == t.dtype, "save_checkpoint: a piece of '{}' holds {} {} but is "
                 "described as {} {}", t.name, dtype_name(v.dtype()), shape_str(v.shape()), dtype_name(t.dtype),
                 shape_str(p.shape));
      } else {
        MC_CHECK(t.local.defined(), "save_checkpoint: tensor '{}' has no local data", t.name);
        v = t.local;
        for (size_t d = 0; d < p.shape.size(); ++d) v = v.narrow(int64_t(d), p.local_offsets[d], p.shape[d]);
      }
      add(t.name, t.global_shape, t.dtype, v, p.global_offsets);
    }
  }
  for (const auto& [name, t] : state.extra_tensors) {
    MC_CHECK(t.defined(), "save_checkpoint: extra tensor '{}' is undefined", name);
    MC_CHECK(!name.empty() && name.find('[') == std::string::npos && names.insert(name).second,
             "save_checkpoint: extra tensor name '{}' is empty, contains '[' or clashes with another tensor", name);
    add(name, t.shape(), t.dtype(), t, Shape(t.shape().size(), 0));
  }
  return out;
}

std::unique_ptr<AsyncCheckpointSaver::Job> prepare(comm::Communicator& world, const std::string& root,
                                                   const CheckpointState& state, bool keep_views,
                                                   const SaveOptions& options) {
  auto job = std::make_unique<AsyncCheckpointSaver::Job>();
  job->root = root;
  job->step = state.step;
  job->tmp_dir = (fs::path(root) / (".tmp.step_" + std::to_string(state.step))).string();
  job->final_dir = checkpoint_dir(root, state.step);
  job->json_blobs = state.json;
  job->val_loss = state.val_loss;
  std::exception_ptr err;
  try {
    MC_CHECK(!root.empty(), "save_checkpoint: the root directory is empty; pass a directory path");
    MC_CHECK(state.step >= 0, "save_checkpoint: step {} is negative; pass the training step (>= 0)", state.step);
    for (const auto& [name, text] : state.json) {
      MC_CHECK(json::accept(text), "save_checkpoint: JSON blob '{}' is not valid JSON; pass a JSON document", name);
    }
    if (world.rank() == 0) {
      std::error_code ec;
      fs::create_directories(root, ec);
      if (ec) raise<IOError>("save_checkpoint: cannot create '{}': {}", root, ec.message());
      // Leftovers of interrupted saves and deletions are never loaded; remove them now.
      for (const auto& de : fs::directory_iterator(root)) {
        const std::string n = de.path().filename().string();
        if (n.rfind(".tmp.", 0) == 0 || n.rfind(".trash.", 0) == 0) fs::remove_all(de.path(), ec);
      }
      fs::create_directories(job->tmp_dir, ec);
      if (ec) raise<IOError>("save_checkpoint: cannot create '{}': {}", job->tmp_dir, ec.message());
      fsync_path(root, true);
      hook(options, "prepared");
    }
    job->entries = list_entries(state, world.rank(), keep_views);
  } catch (...) {
    err = std::current_exception();
  }
  agree(&world, err, "save (prepare)");
  return job;
}

// Phase 2: the shard file (with the CRCs of the bytes written), verification and the fragment. Runs on
// any thread; no collectives.
void write_shards(AsyncCheckpointSaver::Job& job, int rank, const SaveOptions& options) {
  json frag = {{"rank", rank}, {"file", nullptr}, {"entries", json::array()}};
  if (!job.entries.empty()) {
    const std::string file = shard_file_name(rank);
    const std::string path = (fs::path(job.tmp_dir) / file).string();
    std::vector<std::pair<std::string, Tensor>> tensors;
    tensors.reserve(job.entries.size());
    for (const Entry& e : job.entries) tensors.emplace_back(e.key, e.host);
    const std::vector<uint32_t> crcs =
        save_safetensors_crc32c(path, tensors, {{"format", kFormat}, {"rank", std::to_string(rank)}}, options.threads);
    for (size_t i = 0; i < job.entries.size(); ++i) job.entries[i].crc = crcs[i];
    hook(options, "shard_written");
    if (options.verify) {
      SafetensorsFile f(path);
      parallel_for(job.entries.size(), options.threads, [&](size_t i) {
        const Entry& e = job.entries[i];
        const SafetensorsInfo& info = f.info(e.key);
        Tensor t = f.tensor(e.key);
        if (info.shape != e.shape || info.dtype != e.dtype || crc32c(t.data_ptr(), size_t(t.nbytes())) != e.crc)
          raise<IOError>("save_checkpoint: entry '{}' of '{}' reads back differently from what was written (shape, "
                         "dtype or CRC); the storage is corrupting data",
                         e.key, path);
      });
    }
    frag["file"] = file;
    for (const Entry& e : job.entries) frag["entries"].push_back(entry_json(e));
  }
  // Drop this job's references to the host copies (staged ones are freed; an async saver keeps its
  // snapshot buffers for the next save).
  for (Entry& e : job.entries) e.host = Tensor();
  write_file_atomic((fs::path(job.tmp_dir) / fragment_file_name(rank)).string(), frag.dump());
  hook(options, "fragment_written");
}

// Phase 3 on rank 0: merge the fragments, check, rename and point `latest` at the result.
void commit(AsyncCheckpointSaver::Job& job, int world_size, const SaveOptions& options) {
  json tensors = json::object();
  std::map<std::string, std::vector<TensorMeta::Shard>> shards;
  std::map<std::string, Shape> shapes;
  for (int r = 0; r < world_size; ++r) {
    const std::string fp = (fs::path(job.tmp_dir) / fragment_file_name(r)).string();
    json frag;
    try {
      frag = json::parse(read_text(fp));
    } catch (const json::exception& e) {
      raise<IOError>("save_checkpoint: fragment '{}' is malformed ({})", fp, e.what());
    }
    for (const json& e : frag.at("entries")) {
      const std::string name = e.at("name");
      json& t = tensors[name];
      if (t.is_null()) {
        t = {{"dtype", e.at("dtype")}, {"shape", e.at("global_shape")}, {"shards", json::array()}};
        shapes[name] = e.at("global_shape").get<Shape>();
      } else if (t["dtype"] != e.at("dtype") || t["shape"] != e.at("global_shape")) {
        raise<IOError>("save_checkpoint: ranks disagree about tensor '{}': dtype {} shape {} vs dtype {} shape {}; "
                       "every rank must describe the same model",
                       name, t["dtype"].dump(), t["shape"].dump(), e.at("dtype").dump(), e.at("global_shape").dump());
      }
      t["shards"].push_back({{"file", frag.at("file")},
                             {"key", e.at("key")},
                             {"offsets", e.at("offsets")},
                             {"shape", e.at("shape")},
                             {"crc32c", e.at("crc32c")}});
      shards[name].push_back({frag.at("file").get<std::string>(), e.at("key").get<std::string>(),
                              e.at("offsets").get<Shape>(), e.at("shape").get<Shape>(), e.at("crc32c").get<uint32_t>(), true});
    }
  }
  for (const auto& [name, s] : shards) check_tiling("save_checkpoint", name, shapes[name], s);
  json blobs = json::object();
  for (const auto& [name, text] : job.json_blobs) blobs[name] = json::parse(text);
  json meta = {{"format", kFormat},
               {"version", kVersion},
               {"step", job.step},
               {"world_size", world_size},
               {"val_loss", job.val_loss ? json(*job.val_loss) : json(nullptr)},
               {"tensors", tensors},
               {"json", blobs}};
  write_file_atomic((fs::path(job.tmp_dir) / kMetadataFile).string(), meta.dump(1));
  std::error_code ec;
  for (int r = 0; r < world_size; ++r) fs::remove(fs::path(job.tmp_dir) / fragment_file_name(r), ec);
  fsync_path(job.tmp_dir, true);
  hook(options, "metadata_written");
  std::string trash;
  if (fs::exists(job.final_dir)) {  // re-saving a step replaces it
    trash = (fs::path(job.root) / (".trash.step_" + std::to_string(job.step))).string();
    fs::remove_all(trash, ec);
    if (::rename(job.final_dir.c_str(), trash.c_str()) != 0)
      raise<IOError>("save_checkpoint: cannot move the old '{}' aside: {}", job.final_dir, errno_str());
  }
  if (::rename(job.tmp_dir.c_str(), job.final_dir.c_str()) != 0)
    raise<IOError>("save_checkpoint: cannot rename '{}' to '{}': {}", job.tmp_dir, job.final_dir, errno_str());
  fsync_path(job.root, true);
  hook(options, "renamed");
  write_file_atomic((fs::path(job.root) / kLatestFile).string(),
                    fs::path(job.final_dir).filename().string() + "\n");
  if (!trash.empty()) fs::remove_all(trash, ec);
}

}  // namespace

AsyncCheckpointSaver::AsyncCheckpointSaver(comm::Communicator& world, const SaveOptions& options)
    : world_(world), options_(options) {}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (job_) job_->join();
}

bool AsyncCheckpointSaver::pending() const { return job_ != nullptr; }

namespace {

// MemAvailable of /proc/meminfo in bytes; -1 when unknown (then no limit applies).
int64_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

// Processes of this job on this host, from the launcher's environment (torchrun, Open MPI, Slurm); 1 when
// none says. Ranks on one host share its memory, and each checks its snapshot against its share.
int64_t local_ranks() {
  for (const char* v : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    const char* s = std::getenv(v);
    if (s != nullptr && std::atoll(s) > 0) return std::atoll(s);
  }
  return 1;
}

bool same_layout(const Tensor& buffer, const Tensor& like);

// The held buffer a snapshot of `e` reuses (same key, shape and dtype), or nullptr.
const Tensor* reusable(const std::map<std::string, Tensor>& held, const Entry& e) {
  auto it = held.find(e.key);
  return it != held.end() && same_layout(it->second, e.host) ? &it->second : nullptr;
}

// What a snapshot of `entries` costs given the buffers held.
struct SnapshotPlan {
  int64_t need = 0;      // bytes of new buffers
  int64_t released = 0;  // bytes of held buffers it does not reuse (freed before the new ones are allocated)
  int64_t limit = 0;     // bytes it may take beyond those it reuses: SaveOptions::async_host_memory_limit, or this
                         // rank's share of 90 % of MemAvailable
  bool fits() const { return need - released <= limit; }
};

SnapshotPlan plan_buffers(const std::vector<Entry>& entries, const std::map<std::string, Tensor>& held,
                          const SaveOptions& opts) {
  SnapshotPlan p;
  int64_t reused = 0;
  for (const Entry& e : entries) (reusable(held, e) ? reused : p.need) += e.host.nbytes();
  for (const auto& [key, b] : held) p.released += b.nbytes();
  p.released -= reused;
  if (opts.async_host_memory_limit >= 0) {
    p.limit = opts.async_host_memory_limit;
  } else {
    const int64_t avail = host_memory_available();
    p.limit = avail < 0 ? std::numeric_limits<int64_t>::max() : avail / 10 * 9 / local_ranks();
  }
  return p;
}

// Host memory of `shape` x `dtype`: page-locked when `pin` (copies to and from a GPU then run at the link's speed
// and the buffer can be reused without re-pinning), pageable otherwise or when pinning fails.
Tensor host_buffer(const Shape& shape, DType dtype, bool pin) {
#if MEGACORE_WITH_CUDA
  const int64_t nbytes = volume(shape) * dtype_size(dtype);
  if (pin && nbytes > 0) {
    try {
      void* p = data::detail::pinned_alloc(size_t(nbytes));
      return Tensor::from_blob(p, shape, contiguous_strides(shape), dtype, Device::cpu(),
                               [p] { data::detail::pinned_free(p); });
    } catch (const std::exception&) {
      // fall through to pageable memory: slower copies, same result
    }
  }
#else
  (void)pin;
#endif
  return Tensor::empty(shape, dtype);
}

// A host buffer for a snapshot of `like`: page-locked when the source is on a GPU.
Tensor snapshot_buffer(const Tensor& like) { return host_buffer(like.shape(), like.dtype(), !like.device().is_cpu()); }

// Makes `held` one buffer per entry of `entries`: the held ones they reuse, new ones for the rest (the others are
// freed before the new ones are allocated).
void hold_buffers(const std::vector<Entry>& entries, std::map<std::string, Tensor>& held) {
  std::map<std::string, Tensor> kept;
  for (const Entry& e : entries)
    if (const Tensor* b = reusable(held, e)) kept[e.key] = *b;
  held.clear();
  for (const Entry& e : entries) {
    Tensor& b = kept[e.key];
    if (!b.defined()) b = snapshot_buffer(e.host);
  }
  held = std::move(kept);
}

bool same_layout(const Tensor& buffer, const Tensor& like) {
  return buffer.defined() && buffer.shape() == like.shape() && buffer.dtype() == like.dtype();
}

// Copies each entry's live view into its buffer. Host sources: contiguous ones in chunks on `threads`
// threads (memcpy), strided ones one per task; device sources on the calling thread (device→host copies).
void copy_snapshot(std::vector<Entry>& entries, const std::vector<Tensor>& buffers, int threads) {
  constexpr int64_t kChunk = int64_t(16) << 20;
  struct Task {
    size_t entry;
    int64_t begin, length;  // bytes; length < 0: the whole entry through copy_
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Tensor& src = entries[i].host;
    if (!src.device().is_cpu()) {
      Tensor(buffers[i]).copy_(src.contiguous());
    } else if (src.is_contiguous()) {
      for (int64_t b = 0; b < src.nbytes(); b += kChunk) tasks.push_back({i, b, std::min(kChunk, src.nbytes() - b)});
    } else {
      tasks.push_back({i, 0, -1});
    }
  }
  parallel_for(tasks.size(), threads, [&](size_t k) {
    const Task& t = tasks[k];
    const Tensor& src = entries[t.entry].host;
    const Tensor& dst = buffers[t.entry];
    if (t.length < 0) {
      Tensor(dst).copy_(src);
    } else {
      std::memcpy(static_cast<uint8_t*>(dst.data_ptr()) + t.begin,
                  static_cast<const uint8_t*>(src.data_ptr()) + t.begin, size_t(t.length));
    }
  });
  for (size_t i = 0; i < entries.size(); ++i) entries[i].host = buffers[i];
}

}  // namespace

int64_t AsyncCheckpointSaver::snapshot_bytes() const {
  int64_t n = 0;
  for (const auto& [key, b] : buffers_) n += b.nbytes();
  return n;
}

std::map<std::string, const void*> AsyncCheckpointSaver::snapshot_buffers() const {
  std::map<std::string, const void*> out;
  for (const auto& [key, b] : buffers_) out[key] = b.data_ptr();
  return out;
}

int64_t AsyncCheckpointSaver::reserve(const CheckpointState& state) {
  MC_CHECK_AS(ConfigError, !pending(), "AsyncCheckpointSaver::reserve: a save is pending; call wait() first");
  std::vector<Entry> entries = list_entries(state, world_.rank(), /*keep_views=*/true);
  const SnapshotPlan plan = plan_buffers(entries, buffers_, options_);
  if (!plan.fits()) {
    std::fprintf(stderr,
                 "[rank %d] checkpoint: async-save snapshot buffers of %.3g GB not reserved: %.3g GB of host memory may "
                 "be used (SaveOptions::async_host_memory_limit, or this rank's share of 90%% of MemAvailable); a save "
                 "that still does not fit is written synchronously\n",
                 world_.rank(), double(plan.need) / 1e9, (double(plan.limit) + double(plan.released)) / 1e9);
    return snapshot_bytes();
  }
  hold_buffers(entries, buffers_);
  return snapshot_bytes();
}

void AsyncCheckpointSaver::save(const std::string& root, const CheckpointState& state) {
  wait();
  auto job = prepare(world_, root, state, /*keep_views=*/true, options_);
  Job* j = job.get();
  const int rank = world_.rank();
  const SaveOptions opts = options_;
  job_ = std::move(job);
  last_sync_ = false;
  // Snapshot: reuse the buffers held (from the previous save or reserve()) where the layouts match; the rest must
  // fit in host memory.
  try {
    const SnapshotPlan plan = plan_buffers(j->entries, buffers_, opts);
    if (!plan.fits()) {
      // Does not fit: write from the live tensors now (like save_checkpoint), commit at wait() as usual.
      std::fprintf(stderr,
                   "[rank %d] checkpoint: an async save of step %lld needs %.3g GB of host memory for its snapshot "
                   "but %.3g GB may be used (SaveOptions::async_host_memory_limit, or this rank's share of 90%% of "
                   "MemAvailable); "
                   "writing it synchronously instead\n",
                   rank, static_cast<long long>(j->step), double(plan.need) / 1e9,
                   (double(plan.limit) + double(plan.released)) / 1e9);
      buffers_.clear();
      last_sync_ = true;
      for (Entry& e : j->entries) e.host = e.host.to(Device::cpu()).contiguous();
      write_shards(*j, rank, opts);
      return;
    }
    hold_buffers(j->entries, buffers_);
    std::vector<Tensor> buffers;
    buffers.reserve(j->entries.size());
    for (const Entry& e : j->entries) buffers.push_back(buffers_.at(e.key));
    copy_snapshot(j->entries, buffers, opts.threads);
  } catch (...) {
    j->error = std::current_exception();  // reported (on every rank) by wait()
    return;
  }
  j->thread = std::thread([j, rank, opts] {
    try {
      write_shards(*j, rank, opts);
    } catch (...) {
      j->error = std::current_exception();
    }
  });
}

std::string AsyncCheckpointSaver::wait() {
  if (!job_) return "";
  std::unique_ptr<Job> job = std::move(job_);
  job->join();
  agree(&world_, job->error, "save (write)");
  std::exception_ptr err;
  if (world_.rank() == 0) {
    try {
      commit(*job, world_.size(), options_);
      if (on_commit_) on_commit_(job->root, job->step);
    } catch (...) {
      err = std::current_exception();
    }
  }
  agree(&world_, err, "save (commit)");
  return job->final_dir;
}

std::string save_checkpoint(comm::Communicator& world, const std::string& root, const CheckpointState& state,
                            const SaveOptions& options) {
  auto job = prepare(world, root, state, /*keep_views=*/false, options);
  std::exception_ptr err;
  try {
    write_shards(*job, world.rank(), options);
  } catch (...) {
    err = std::current_exception();
  }
  agree(&world, err, "save (write)");
  err = nullptr;
  if (world.rank() == 0) {
    try {
      commit(*job, world.size(), options);
    } catch (...) {
      err = std::current_exception();
    }
  }
  agree(&world, err, "save (commit)");
  return job->final_dir;
}

// ---- resolve --------------------------------------------------------------------------------------

namespace {

// Why the step_<N> directory `dir` cannot be loaded, or nullopt when its metadata is a megacore checkpoint's. The
// save protocol renames a directory to step_<N> only once it is complete, so one without valid metadata was damaged
// after its commit (a disk fault, a partial copy, a deleted file).
std::optional<std::string> metadata_damage(const fs::path& dir) {
  std::string why;
  if (parse_metadata(dir.string(), &why)) return std::nullopt;
  return why;
}

struct StepDir {
  int64_t step;
  fs::path dir;
};

// Whether `dir` holds a checkpoint's own files (metadata.json or shard_*.safetensors), damaged or not.
bool holds_checkpoint_files(const fs::path& dir) {
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string n = de.path().filename().string();
    if (n == kMetadataFile || (n.rfind("shard_", 0) == 0 && de.path().extension() == ".safetensors")) return true;
  }
  return false;
}

// The newest loadable step_<N> under `root` newer than `after`, and the newest damaged one newer than that (if any).
void scan_steps(const fs::path& root, int64_t after, std::optional<StepDir>& best, std::optional<StepDir>& damaged,
                std::string& why) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  std::vector<StepDir> dirs;
  for (const auto& de : fs::directory_iterator(root, ec)) {
    auto step = step_of_dir_name(de.path().filename().string());
    if (step && *step > after && de.is_directory(ec)) dirs.push_back({*step, de.path()});
  }
  std::sort(dirs.begin(), dirs.end(), [](const StepDir& a, const StepDir& b) { return a.step > b.step; });
  for (const StepDir& d : dirs) {  // newest first: the first loadable one ends the scan
    if (auto bad = metadata_damage(d.dir)) {
      if (!damaged) damaged = d, why = *bad;
      continue;
    }
    best = d;
    return;
  }
}

// `named`: the damaged directory was asked for by name, not found as the newest under its root.
[[noreturn]] void raise_damaged(const fs::path& root, const StepDir& bad, const std::string& why,
                                const std::optional<StepDir>& intact, bool named = false) {
  if (intact)
    raise<IOError>("checkpoint '{}' is damaged: {}. {}: resume from the newest intact one with checkpoint.resume = "
                   "'{}', or move '{}' out of '{}' (megacore never loads a damaged checkpoint, and retention does not "
                   "delete one)",
                   bad.dir.string(), why,
                   named ? "It cannot be loaded" : fmt::format("It is the newest under '{}', where a resume starts",
                                                               root.string()),
                   intact->dir.string(), bad.dir.string(), root.string());
  raise<IOError>("checkpoint '{}' is damaged: {}, and '{}' holds no intact checkpoint: start without one "
                 "(checkpoint.resume = ''), or move '{}' out of '{}' (megacore never loads a damaged checkpoint, and "
                 "retention does not delete one)",
                 bad.dir.string(), why, root.string(), bad.dir.string(), root.string());
}

}  // namespace

std::optional<std::string> resolve_checkpoint(const std::string& path) {
  if (parse_metadata(path)) return path;
  std::error_code ec;
  fs::path p = fs::path(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "root/step_4/"
  // A step_<N> directory given by name that holds a checkpoint's files (a metadata.json or shards; not a checkpoint
  // root that happens to be named so): damaged if its metadata is (the newest intact sibling is the fix).
  if (step_of_dir_name(p.filename().string()) && fs::is_directory(p, ec) && holds_checkpoint_files(p)) {
    if (auto bad = metadata_damage(p)) {
      std::optional<StepDir> intact, newer_bad;
      std::string ignored;
      const fs::path root = p.parent_path().empty() ? fs::path(".") : p.parent_path();  // a bare "step_4"
      scan_steps(root, -1, intact, newer_bad, ignored);
      raise_damaged(root, StepDir{*step_of_dir_name(p.filename().string()), p}, *bad, intact, true);
    }
  }
  // A root: `latest`'s target when it is loadable (a user may point it back at an older step); else the newest
  // loadable step_<N> (no `latest`, a stale one, or one naming a damaged directory), where a damaged step_<N> newer
  // than it is an error, not skipped.
  const fs::path latest = p / kLatestFile;
  if (fs::is_regular_file(latest, ec)) {
    try {
      std::string name = read_text(latest.string());
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
      if (step_of_dir_name(name) && parse_metadata((p / name).string())) return (p / name).string();
    } catch (const IOError&) {
    }
  }
  std::optional<StepDir> chosen, damaged;
  std::string why;
  scan_steps(p, -1, chosen, damaged, why);
  if (damaged) raise_damaged(p, *damaged, why, chosen);
  if (chosen) return chosen->dir.string();
  return std::nullopt;
}

std::vector<CheckpointInfo> list_checkpoints(const std::string& root) {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& de : fs::directory_iterator(root, ec)) {
    auto step = step_of_dir_name(de.path().filename().string());
    if (!step || !de.is_directory(ec)) continue;
    auto meta = parse_metadata(de.path().string());
    if (!meta) continue;
    CheckpointInfo info{*step, de.path().string(), std::nullopt};
    if (meta->contains("val_loss") && (*meta)["val_loss"].is_number()) info.val_loss = (*meta)["val_loss"].get<double>();
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step < b.step; });
  return out;
}

// ---- load -----------------------------------------------------------------------------------------

namespace {

// One intersection of a target piece with a saved shard (global coordinates [lo, hi)), the shard's entry
// checked against metadata.json.
struct Overlap {
  const TensorMeta::Shard* shard = nullptr;
  Shape lo, hi;
  SafetensorsFile* file = nullptr;
  const SafetensorsInfo* info = nullptr;
  bool whole = true;  // the piece needs the entire entry
  int64_t volume() const {
    int64_t v = 1;
    for (size_t d = 0; d < lo.size(); ++d) v *= hi[d] - lo[d];
    return v;
  }
};

// The shards of `m` that piece `p` intersects. `open` opens a shard file (IOError when missing,
// truncated or malformed); an entry missing from its file or unlike metadata.json is an IOError.
std::vector<Overlap> piece_overlaps(const std::string& dir, const TensorMeta& m, const ShardPiece& p,
                                    const std::function<SafetensorsFile&(const std::string&)>& open) {
  std::vector<Overlap> out;
  for (const TensorMeta::Shard& s : m.shards) {
    Overlap o;
    o.shard = &s;
    o.lo.resize(p.shape.size()), o.hi.resize(p.shape.size());
    bool empty = false;
    for (size_t d = 0; d < p.shape.size(); ++d) {
      o.lo[d] = std::max(p.global_offsets[d], s.offsets[d]);
      o.hi[d] = std::min(p.global_offsets[d] + p.shape[d], s.offsets[d] + s.shape[d]);
      empty |= o.hi[d] <= o.lo[d];
      o.whole &= o.lo[d] == s.offsets[d] && o.hi[d] == s.offsets[d] + s.shape[d];
    }
    if (empty) continue;
    o.file = &open(s.file);
    if (!o.file->contains(s.key))
      raise<IOError>("checkpoint '{}': file {} lacks entry '{}' that metadata.json lists; the file is corrupt or "
                     "from another save",
                     dir, s.file, s.key);
    o.info = &o.file->info(s.key);
    if (o.info->shape != s.shape || o.info->dtype != m.dtype)
      raise<IOError>("checkpoint '{}': entry '{}' of {} is {} {} but metadata.json says {} {}; the file is corrupt",
                     dir, s.key, s.file, dtype_name(o.info->dtype), shape_str(o.info->shape), dtype_name(m.dtype),
                     shape_str(s.shape));
    out.push_back(std::move(o));
  }
  return out;
}

// The view of `local` (holding piece p at p.local_offsets) that overlap o fills.
Tensor overlap_view(const Tensor& local, const ShardPiece& p, const Overlap& o) {
  Tensor dst = local;
  for (size_t d = 0; d < p.shape.size(); ++d)
    dst = dst.narrow(int64_t(d), o.lo[d] - p.global_offsets[d] + p.local_offsets[d], o.hi[d] - o.lo[d]);
  return dst;
}

[[noreturn]] void raise_crc_failed(const std::string& dir, const TensorMeta::Shard& s) {
  raise<IOError>("checkpoint '{}': entry '{}' of {} fails its {} check; the file is corrupt — load an earlier "
                 "checkpoint",
                 dir, s.key, s.file, s.crc32c ? "CRC-32C" : "CRC-32");
}

[[noreturn]] void raise_incomplete(const std::string& dir, const std::string& name, int64_t filled,
                                   const ShardPiece& p) {
  raise<IOError>("checkpoint '{}': tensor '{}' has only {} of the {} elements at {} of shape {}", dir, name, filled,
                 volume(p.shape), shape_str(p.global_offsets), shape_str(p.shape));
}

}  // namespace


// Shared by the threads of load_all: the open files and the verified entries are guarded by `mu`.
struct CheckpointReader::Files {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
  std::set<std::pair<std::string, std::string>> verified;
  std::atomic<int64_t> bytes_read{0};

  SafetensorsFile& file(const std::string& dir, const std::string& name) {
    std::lock_guard<std::mutex> l(mu);
    auto& f = open[name];
    if (!f) f = std::make_unique<SafetensorsFile>((fs::path(dir) / name).string());  // IOError when bad
    return *f;
  }
  bool is_verified(const std::string& file, const std::string& key) {
    std::lock_guard<std::mutex> l(mu);
    return verified.count({file, key}) != 0;
  }
  void set_verified(const std::string& file, const std::string& key) {
    std::lock_guard<std::mutex> l(mu);
    verified.insert({file, key});
  }
};

// One whole entry read into contiguous memory of its saved dtype, on the host or a device.
struct CheckpointReader::DirectRead {
  SafetensorsFile* file = nullptr;
  const TensorMeta::Shard* shard = nullptr;
  int64_t position = 0;  // the entry's offset in the file's data section: reads run in this order
  int64_t nbytes = 0;
  void* dst = nullptr;
  Device device = Device::cpu();
  bool check = false;
  std::vector<uint32_t> crcs;  // one per block, combined once every block has landed
};

int64_t CheckpointReader::bytes_read() const { return files_->bytes_read.load(); }

void CheckpointReader::load_all(std::vector<ShardedTensor>& targets) {
  // Whole entries into memory of their saved layout go to the readers in file order; the rest are loaded
  // target by target on a pool of threads.
  std::vector<DirectRead> direct;
  std::vector<ShardedTensor*> todo;
  for (ShardedTensor& t : targets) {
    if (options_.allow_missing && !has_tensor(t.name)) continue;
    if (auto reads = plan_direct(t)) {
      for (DirectRead& r : *reads) direct.push_back(std::move(r));
    } else {
      todo.push_back(&t);
    }
  }
  run_direct(direct);
  parallel_for(todo.size(), options_.threads, [&](size_t i) { load(*todo[i]); });
}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;

CheckpointReader::CheckpointReader(const std::string& path, const LoadOptions& options)
    : options_(options), files_(std::make_unique<Files>()) {
  auto dir = resolve_checkpoint(path);
  if (!dir)
    raise<IOError>("checkpoint: '{}' holds no complete checkpoint (no metadata.json, no valid `latest`, no complete "
                   "step_<N>); pass a checkpoint directory or a root a save wrote to",
                   path);
  dir_ = *dir;
  const std::string mp = (fs::path(dir_) / kMetadataFile).string();
  nlohmann::json meta = nlohmann::json::parse(read_text(mp));  // parse_metadata succeeded, so this does
  try {
    if (meta.at("version").get<int>() > kVersion)
      raise<IOError>("checkpoint '{}': format version {} is newer than this megacore reads ({}); upgrade megacore",
                     mp, meta.at("version").get<int>(), kVersion);
    step_ = meta.at("step").get<int64_t>();
    if (meta.contains("val_loss") && !meta["val_loss"].is_null()) val_loss_ = meta["val_loss"].get<double>();
    for (const auto& [name, t] : meta.at("tensors").items()) {
      TensorMeta tm;
      tm.name = name;
      tm.global_shape = t.at("shape").get<Shape>();
      tm.dtype = safetensors_dtype_from_name(t.at("dtype").get<std::string>());
      for (const nlohmann::json& s : t.at("shards")) {
        const bool castagnoli = s.contains("crc32c");  // format 2; format 1 has "crc32"
        tm.shards.push_back({s.at("file").get<std::string>(), s.at("key").get<std::string>(),
                             s.at("offsets").get<Shape>(), s.at("shape").get<Shape>(),
                             s.at(castagnoli ? "crc32c" : "crc32").get<uint32_t>(), castagnoli});
      }
      check_tiling("checkpoint '" + mp + "'", name, tm.global_shape, tm.shards);
      tensors_[name] = std::move(tm);
    }
    for (const auto& [name, v] : meta.at("json").items()) json_[name] = v.dump();
  } catch (const nlohmann::json::exception& e) {
    raise<IOError>("checkpoint '{}': metadata is malformed ({}); the file is corrupt", mp, e.what());
  }
}

std::vector<std::string> CheckpointReader::tensor_names() const {
  std::vector<std::string> out;
  for (const auto& [n, _] : tensors_) out.push_back(n);
  return out;
}

const TensorMeta& CheckpointReader::meta(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    std::string some;
    int k = 0;
    for (const auto& [n, _] : tensors_) {
      if (k++ == 5) break;
      some += (some.empty() ? "" : ", ") + n;
    }
    raise<IOError>("checkpoint '{}' has no tensor '{}' (it has {} tensors, e.g. {}); was it saved from a different "
                   "model or without optimizer state?",
                   dir_, name, tensors_.size(), some);
  }
  return it->second;
}

const std::string& CheckpointReader::json(const std::string& name) const {
  auto it = json_.find(name);
  if (it == json_.end()) {
    std::string have;
    for (const auto& [n, _] : json_) have += (have.empty() ? "" : ", ") + n;
    raise<IOError>("checkpoint '{}' has no JSON blob '{}' (it has: {})", dir_, name, have.empty() ? "none" : have);
  }
  return it->second;
}

namespace {

// The checks every load of a target starts with: its global shape and dtype against the checkpoint's, and
// the pieces with their own tensors (ZeRO shards) described as they are.
void check_target(const std::string& dir, const TensorMeta& m, const ShardedTensor& target) {
  if (m.global_shape != target.global_shape)
    raise<IOError>("checkpoint '{}': tensor '{}' has global shape {} but the model expects {}; the checkpoint is of "
                   "a different model configuration",
                   dir, target.name, shape_str(m.global_shape), shape_str(target.global_shape));
  const auto is_float = [](DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; };
  if (m.dtype != target.dtype && !(target.convert_dtype && is_float(m.dtype) && is_float(target.dtype)))
    raise<IOError>("checkpoint '{}': tensor '{}' is stored as {} but the model expects {}; load into a model with "
                   "params_dtype {} (or convert the checkpoint)",
                   dir, target.name, dtype_name(m.dtype), dtype_name(target.dtype), dtype_name(m.dtype));
  for (const ShardPiece& p : target.pieces)
    if (p.data.defined()) {
      MC_CHECK(p.data.shape() == p.shape && p.data.dtype() == target.dtype, "checkpoint load: a piece of '{}' holds "
               "{} {} but is described as {} {}", target.name, dtype_name(p.data.dtype()), shape_str(p.data.shape()),
               dtype_name(target.dtype), shape_str(p.shape));
    }
}

bool has_own_data(const ShardedTensor& target) {
  for (const ShardPiece& p : target.pieces)
    if (p.data.defined()) {
      for (const ShardPiece& q : target.pieces)
        MC_CHECK(q.data.defined(), "checkpoint load: target '{}' mixes pieces with and without their own data",
                 target.name);
      return true;
    }
  return false;
}

// Pieces with their own tensors (ZeRO shards): each one as a one-piece target of its own.
std::vector<ShardedTensor> split_own_data(const ShardedTensor& target) {
  std::vector<ShardedTensor> out;
  for (const ShardPiece& p : target.pieces) {
    ShardedTensor one;
    one.name = target.name;
    one.global_shape = target.global_shape;
    one.dtype = target.dtype;
    one.convert_dtype = target.convert_dtype;
    one.local = p.data;
    one.pieces.push_back({Shape(p.shape.size(), 0), p.global_offsets, p.shape, Tensor()});
    out.push_back(std::move(one));
  }
  return out;
}

}  // namespace

void CheckpointReader::load(ShardedTensor& target) {
  const TensorMeta& m = meta(target.name);
  check_target(dir_, m, target);
  if (target.pieces.empty()) return;  // this rank needs none of it (e.g. a ZeRO shard owned elsewhere)
  if (has_own_data(target)) {
    for (ShardedTensor& one : split_own_data(target)) load(one);
    return;
  }
  MC_CHECK(target.local.defined() && target.local.dtype() == target.dtype,
           "checkpoint load: target '{}' has no local tensor of dtype {}", target.name, dtype_name(target.dtype));
  // A device target is filled through a host staging copy. When its pieces cover it completely (the usual
  // case; not the padded vocabulary rows) nothing of the old contents survives, so it is not copied down.
  int64_t covered = 0;
  for (const ShardPiece& p : target.pieces) covered += volume(p.shape);
  Tensor host = target.local.device().is_cpu()      ? target.local
                : covered == target.local.numel() ? Tensor::empty(target.local.shape(), target.local.dtype())
                                                  : target.local.to(Device::cpu());
  const auto open = [this](const std::string& file) -> SafetensorsFile& { return files_->file(dir_, file); };
  for (const ShardPiece& p : target.pieces) {
    int64_t filled = 0;
    for (const Overlap& o : piece_overlaps(dir_, m, p, open)) {
      const TensorMeta::Shard& s = *o.shard;
      const SafetensorsInfo& info = *o.info;
      SafetensorsFile* f = o.file;
      Tensor dst = overlap_view(host, p, o);
      const bool check = options_.verify_checksums && !files_->is_verified(s.file, s.key);
      auto checksum = [&s](const void* data, size_t n, uint32_t crc) {
        return s.crc32c ? crc32c(data, n, crc) : crc32(data, n, crc);
      };
      if (o.whole && dst.is_contiguous() && dst.dtype() == info.dtype) {
        // Same layout and dtype as the save: read straight into the destination, checksumming each block as it
        // lands. (A converting load, e.g. f32 optimizer state into bf16 state, goes through the mapped entry.)
        // A large CRC-32C entry is read in chunks on several threads and the chunks' CRCs are combined.
        constexpr int64_t kChunk = int64_t(32) << 20;
        const int64_t chunks = s.crc32c ? std::max<int64_t>(1, (info.nbytes + kChunk - 1) / kChunk) : 1;
        std::vector<uint32_t> crcs(size_t(chunks), 0);
        auto* out = static_cast<uint8_t*>(dst.data_ptr());
        parallel_for(size_t(chunks), chunks > 1 ? options_.threads : 1, [&](size_t c) {
          const int64_t begin = int64_t(c) * kChunk;
          const int64_t len = chunks == 1 ? info.nbytes : std::min(kChunk, info.nbytes - begin);
          std::function<void(const uint8_t*, size_t)> on_block;
          if (check) on_block = [&crcs, c, &checksum](const uint8_t* b, size_t n) { crcs[c] = checksum(b, n, crcs[c]); };
          f->read_into(s.key, begin, len, out + begin, on_block);
        });
        if (check) {
          uint32_t crc = crcs[0];
          for (int64_t c = 1; c < chunks; ++c)
            crc = crc32c_combine(crc, crcs[size_t(c)], uint64_t(std::min(kChunk, info.nbytes - c * kChunk)));
          if (crc != s.crc) raise_crc_failed(dir_, s);
          files_->set_verified(s.file, s.key);
        }
        filled += dst.numel();
        files_->bytes_read += info.nbytes;
        continue;
      }
      Tensor src = f->tensor(s.key);
      if (check) {
        if (checksum(src.data_ptr(), size_t(src.nbytes()), 0) != s.crc) raise_crc_failed(dir_, s);
        files_->set_verified(s.file, s.key);
      }
      for (size_t d = 0; d < p.shape.size(); ++d) src = src.narrow(int64_t(d), o.lo[d] - s.offsets[d], o.hi[d] - o.lo[d]);
      dst.copy_(src);
      filled += volume(src.shape());
      files_->bytes_read += src.nbytes();
    }
    if (filled != volume(p.shape)) raise_incomplete(dir_, target.name, filled, p);
  }
  if (!target.local.device().is_cpu()) target.local.copy_(host);
}

std::optional<std::vector<CheckpointReader::DirectRead>> CheckpointReader::plan_direct(ShardedTensor& target) {
  const TensorMeta& m = meta(target.name);
  check_target(dir_, m, target);
  if (target.pieces.empty()) return std::vector<DirectRead>{};
  std::vector<ShardedTensor> parts;
  if (has_own_data(target)) {
    parts = split_own_data(target);
  } else {
    if (!target.local.defined() || target.local.dtype() != target.dtype) return std::nullopt;  // load() says why
    parts.push_back(target);
  }
  const auto open = [this](const std::string& file) -> SafetensorsFile& { return files_->file(dir_, file); };
  std::vector<DirectRead> reads;
  for (const ShardedTensor& t : parts) {
    const Tensor& local = t.local;
    if (!local.device().is_cpu()) {  // a device target is written only where the checkpoint has its bytes
      int64_t covered = 0;
      for (const ShardPiece& p : t.pieces) covered += volume(p.shape);
      if (covered != local.numel()) return std::nullopt;
    }
    for (const ShardPiece& p : t.pieces) {
      int64_t filled = 0;
      for (const Overlap& o : piece_overlaps(dir_, m, p, open)) {
        const Tensor dst = overlap_view(local, p, o);
        const bool check = options_.verify_checksums && !files_->is_verified(o.shard->file, o.shard->key);
        if (!o.whole || !dst.is_contiguous() || dst.dtype() != o.info->dtype || (check && !o.shard->crc32c))
          return std::nullopt;
        DirectRead r;
        r.file = o.file;
        r.shard = o.shard;
        r.position = o.info->data_begin;
        r.nbytes = o.info->nbytes;
        r.dst = dst.data_ptr();
        r.device = local.device();
        r.check = check;
        reads.push_back(std::move(r));
        filled += o.volume();
      }
      if (filled != volume(p.shape)) return std::nullopt;  // load() raises the error naming what is missing
    }
  }
  return reads;
}

void CheckpointReader::run_direct(std::vector<DirectRead>& reads) {
  // Blocks of at most kBlock bytes, file by file in data order: the readers claim them in that order, so the
  // disk sees a few neighbouring sequential streams per file instead of scattered reads.
  constexpr int64_t kBlock = int64_t(16) << 20;
  std::sort(reads.begin(), reads.end(), [](const DirectRead& a, const DirectRead& b) {
    return a.file != b.file ? a.file->path() < b.file->path() : a.position < b.position;
  });
  struct Block {
    DirectRead* read;
    int64_t begin, length;
    size_t index;  // in read->crcs
  };
  std::vector<Block> blocks;
  std::set<const SafetensorsFile*> files;
  for (DirectRead& r : reads) {
    files.insert(r.file);
    const size_t n = size_t(std::max<int64_t>(1, (r.nbytes + kBlock - 1) / kBlock));
    r.crcs.assign(n, 0);
    for (size_t i = 0; i < n; ++i)
      blocks.push_back({&r, int64_t(i) * kBlock, std::min(kBlock, r.nbytes - int64_t(i) * kBlock), i});
  }
  if (blocks.empty()) return;
  for (const SafetensorsFile* f : files) f->advise_sequential();
  int readers = options_.threads > 0 ? options_.threads
                                     : std::min(detail::default_io_threads(0), int(2 * files.size()));
  readers = int(std::min<size_t>(size_t(std::max(1, readers)), blocks.size()));

  std::atomic<size_t> next{0};
  std::mutex err_mu;
  std::exception_ptr err;
  auto work = [&] {
    // A device destination is reached through two page-locked staging buffers of this reader: block k + 1 is
    // read into one while block k's copy to the device runs from the other on this reader's stream.
    struct Staging {
      Tensor buffer;
      Event copied;
      bool pending = false;
    };
    std::optional<Stream> stream;
    Staging staging[2];
    int slot = 0;
    try {
      for (size_t i; (i = next.fetch_add(1)) < blocks.size();) {
        const Block& b = blocks[i];
        DirectRead& r = *b.read;
        const TensorMeta::Shard& s = *r.shard;
        std::function<void(const uint8_t*, size_t)> on_block;
        if (r.check)
          on_block = [&r, &b](const uint8_t* p, size_t n) { r.crcs[b.index] = crc32c(p, n, r.crcs[b.index]); };
        if (r.device.is_cpu()) {
          r.file->read_into(s.key, b.begin, b.length, static_cast<uint8_t*>(r.dst) + b.begin, on_block);
        } else {
          if (!stream) stream = Stream::create(r.device);
          Staging& st = staging[slot];
          slot ^= 1;
          if (st.pending) st.copied.synchronize();  // its previous block is on the device
          if (!st.buffer.defined()) st.buffer = host_buffer({kBlock}, DType::U8, /*pin=*/true);
          r.file->read_into(s.key, b.begin, b.length, st.buffer.data_ptr(), on_block);
          Tensor dst = Tensor::from_blob(static_cast<uint8_t*>(r.dst) + b.begin, {b.length}, {1}, DType::U8,
                                         r.device, [] {});
          dst.copy_(st.buffer.narrow(0, 0, b.length), *stream);
          st.copied.record(*stream);
          st.pending = true;
        }
        files_->bytes_read += b.length;
      }
      if (stream) stream->synchronize();
    } catch (...) {
      if (stream) stream->synchronize();  // no copy may still read a staging buffer freed below
      std::lock_guard<std::mutex> l(err_mu);
      if (!err) err = std::current_exception();
      next = blocks.size();
    }
  };
  std::vector<std::thread> pool;
  for (int k = 1; k < readers; ++k) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (err) std::rethrow_exception(err);
  for (DirectRead& r : reads) {
    if (!r.check) continue;
    uint32_t crc = r.crcs[0];
    for (size_t c = 1; c < r.crcs.size(); ++c)
      crc = crc32c_combine(crc, r.crcs[c], uint64_t(std::min(kBlock, r.nbytes - int64_t(c) * kBlock)));
    if (crc != r.shard->crc) raise_crc_failed(dir_, *r.shard);
    files_->set_verified(r.shard->file, r.shard->key);
  }
}

Tensor CheckpointReader::load_full(const std::string& name) {
  const TensorMeta& m = meta(name);
  ShardedTensor t;
  t.name = name;
  t.global_shape = m.global_shape;
  t.dtype = m.dtype;
  t.local = Tensor::empty(m.global_shape, m.dtype);
  t.pieces.push_back({Shape(m.global_shape.size(), 0), Shape(m.global_shape.size(), 0), m.global_shape, Tensor()});
  load(t);
  return t.local;
}

CheckpointReader load_checkpoint(comm::Communicator* world, const std::string& dir, std::vector<ShardedTensor>& targets,
                                 const LoadOptions& options) {
  std::optional<CheckpointReader> reader;
  std::exception_ptr err;
  try {
    reader.emplace(dir, options);
    reader->load_all(targets);
  } catch (...) {
    err = std::current_exception();
  }
  agree(world, err, "load");
  return std::move(*reader);
}

// ---- optimizer ------------------------------------------------------------------------------------

void add_optimizer_state(CheckpointState& state, const optim::Optimizer& opt, const std::vector<ShardedTensor>& params) {
  for (ShardedTensor& t : shard_optimizer_state(opt.state(), params)) state.tensors.push_back(std::move(t));
  state.json["optimizer"] = nlohmann::json{{"step", opt.step_count()}}.dump();
}

void load_optimizer_state(CheckpointReader& reader, optim::Optimizer& opt, const std::vector<ShardedTensor>& params) {
  std::vector<optim::NamedTensor> st = opt.state();
  for (auto& nt : st) nt.tensor = nt.tensor.clone();
  std::vector<ShardedTensor> desc = shard_optimizer_state(st, params);
  reader.load_all(desc);
  int64_t step = 0;
  try {
    step = json::parse(reader.json("optimizer")).at("step").get<int64_t>();
  } catch (const json::exception& e) {
    raise<IOError>("checkpoint '{}': JSON blob 'optimizer' has no integer 'step' ({})", reader.dir(), e.what());
  }
  opt.load_state(st, step);
}

}  // namespace megacore::checkpoint
