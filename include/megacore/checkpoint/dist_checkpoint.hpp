// Distributed checkpoints that reshard on load.
//
// On disk (one directory per checkpoint, `<root>/step_<N>`; docs/checkpoint.md has the full format):
//   shard_<rank>.safetensors  the pieces this rank wrote, one entry per piece, keyed "<name>[o0,o1,..]"
//                             (global offsets); only ranks with something to write have one
//   metadata.json             written by rank 0 last: format/version, step, every tensor's global shape,
//                             dtype and shards (file, key, global offsets, shape, CRC-32C; format 1
//                             carried a CRC-32 instead, and still loads), the caller's JSON blobs and the
//                             validation loss
// and `<root>/latest` names the newest complete checkpoint ("step_<N>\n").
//
// Save protocol (collective over `world`; all ranks must see the same file system):
//   1. rank 0 removes leftovers of interrupted saves (.tmp.* / .trash.* in root) and creates
//      root/.tmp.step_<N>; every rank stages its pieces in host memory (device pieces are copied down;
//      an async save snapshots host pieces too, into buffers it reuses from save to save);
//   2. each rank writes shard_<rank>.safetensors on several threads (temporary name, pwrite at offsets,
//      fsync, rename), checksumming each block of memory right before it is written, optionally re-reads
//      it (verify), and writes its fragment shard_<rank>.json — in a background thread when async;
//   3. finalize: the ranks agree that every write succeeded; rank 0 merges the fragments into
//      metadata.json, checks that every tensor's shards tile it exactly, fsyncs the directory, renames it
//      to step_<N> (fsync root), then writes `latest` (temporary file, fsync, rename, fsync root).
// A crash anywhere before the rename leaves only a .tmp.* directory, which loaders never look at and
// the next save removes; a crash after it leaves a complete checkpoint whatever `latest` says, and
// resolve_checkpoint() falls back to the newest complete step_<N> if `latest` is missing or stale.
//
// Errors: every phase ends with an agreement (agree(): all-reduce of a failure flag), so a failure on one rank is
// its own error there and a PeerIOError naming it on every other rank, never a hang or a half-finished save.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megacore/checkpoint/sharded_tensor.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::optim {
class Optimizer;
}

namespace megacore::checkpoint {

/// What one rank contributes to a checkpoint. `json` and `val_loss` are taken from rank 0.
struct CheckpointState {
  int64_t step = 0;
  std::vector<ShardedTensor> tensors;
  /// Caller's blobs (scheduler, scaler, data-loader position, config, ...): name → JSON text.
  std::map<std::string, std::string> json;
  /// Small tensors this rank writes whole (RNG states, ...). Names must be unique across ranks (put
  /// the rank in the name of per-rank state) and must not clash with `tensors`.
  std::map<std::string, Tensor> extra_tensors;
  /// Validation loss, for CheckpointManager's keep-top-k policy.
  std::optional<double> val_loss;
};

struct SaveOptions {
  /// Also re-read each written file and check every entry's CRC before committing. Off by default: the
  /// CRCs are computed from the memory being written, the loader checks them, and a re-read right after
  /// the write is served from the page cache, so it checks the kernel's copy rather than the disk's.
  bool verify = false;
  /// Threads checksumming and writing a rank's shard file, and copying an async save's snapshot
  /// (0 = min(8, hardware threads)).
  int threads = 0;
  /// Host memory an async save may take for its snapshot beyond the buffers it already holds, in bytes:
  /// -1 = 90 % of what /proc/meminfo calls MemAvailable, divided among the ranks on this host (from
  /// LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS or SLURM_NTASKS_PER_NODE). A save whose snapshot
  /// does not fit is written synchronously instead (from the live tensors, no copy), with a line on
  /// stderr saying so.
  int64_t async_host_memory_limit = -1;
  /// Fault injection for tests: called at the protocol's points ("prepared" on rank 0 after the temporary
  /// directory exists, "shard_written", "fragment_written", and on rank 0 "metadata_written" (before the
  /// rename) and "renamed" (before `latest` is updated)). Leave empty.
  std::function<void(const std::string& point)> fault_hook;
};

/// Path of the checkpoint directory for `step` under `root` ("<root>/step_<step>").
std::string checkpoint_dir(const std::string& root, int64_t step);

/// Saves synchronously and returns the checkpoint directory. Collective over `world`; every rank must
/// call it with the same root and step. Throws IOError (on every rank) when any rank fails, leaving the
/// previous checkpoints untouched.
std::string save_checkpoint(comm::Communicator& world, const std::string& root, const CheckpointState& state,
                            const SaveOptions& options = {});

/// Async save: save() snapshots this rank's pieces into host buffers (device→host copies, or multi-
/// threaded memcpy for host tensors: the only work on the caller's time, besides waiting for the previous
/// save) and returns; a background thread checksums, writes and fsyncs them. Only one save is in flight,
/// and the snapshot buffers are kept and reused by the next save of the same shapes, so an async save
/// needs host memory for one copy of this rank's pieces (SaveOptions::async_host_memory_limit; a save
/// that does not fit is written synchronously, logged). The commit (step 3) is collective and happens in
/// the next wait() or save(); errors of the background writer surface there as IOError (on every rank).
class AsyncCheckpointSaver {
 public:
  /// `world` must outlive the saver.
  explicit AsyncCheckpointSaver(comm::Communicator& world, const SaveOptions& options = {});
  /// Waits for the background writer but does not commit (a collective may not be reachable from a
  /// destructor): call wait() before destroying it, or the checkpoint is left uncommitted (ignored).
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  /// Commits the previous save (wait()), snapshots `state` and starts writing it. Collective.
  void save(const std::string& root, const CheckpointState& state);
  /// Allocates the snapshot buffers a save of `state`'s tensors needs (page-locked for device tensors), so that the
  /// first save() blocks only for its copies, like every later one; buffers already held with the right layout are
  /// kept. Not collective; nothing is written. Within the same host-memory limit as save() (when the buffers do not
  /// fit, none are allocated and one line says so). ConfigError while a save is pending. Returns snapshot_bytes().
  int64_t reserve(const CheckpointState& state);
  /// True when the last save() fell back to writing synchronously (its snapshot did not fit in host memory).
  bool last_save_was_synchronous() const { return last_sync_; }
  /// Bytes of host buffers held for snapshots (reused by the next save).
  int64_t snapshot_bytes() const;
  /// The data address of each snapshot buffer held, by entry key (for inspection: saves reuse buffers in place).
  std::map<std::string, const void*> snapshot_buffers() const;
  /// Waits for the writer and commits. Collective; returns the committed directory ("" if none pending).
  std::string wait();
  /// True while a save is written or waits for its commit.
  bool pending() const;
  /// Invoked (on rank 0, after the commit of step N) with the root and step: CheckpointManager applies
  /// its retention policy here.
  void set_on_commit(std::function<void(const std::string& root, int64_t step)> fn) { on_commit_ = std::move(fn); }

  struct Job;  ///< one save in flight (implementation detail)

 private:
  comm::Communicator& world_;
  SaveOptions options_;
  std::unique_ptr<Job> job_;
  std::map<std::string, Tensor> buffers_;  // snapshot buffers by entry key, reused when shape and dtype match
  bool last_sync_ = false;
  std::function<void(const std::string&, int64_t)> on_commit_;
};

/// The checkpoint directory to load from `path`: `path` itself when it holds a metadata.json, else the
/// target of `<path>/latest` when complete, else the complete step_<N> with the largest N; nullopt when
/// there is none. Never returns a .tmp.* directory. A step_<N> directory is renamed into place complete, so one
/// whose metadata.json is missing or invalid is damaged: an IOError when it is newer than the directory chosen
/// without `latest` (or is `path` itself), naming the newest intact one to resume from instead.
std::optional<std::string> resolve_checkpoint(const std::string& path);

/// A complete checkpoint under a root.
struct CheckpointInfo {
  int64_t step = 0;
  std::string dir;
  std::optional<double> val_loss;
};
/// The complete step_<N> checkpoints under `root` (metadata.json present and valid), by increasing step.
std::vector<CheckpointInfo> list_checkpoints(const std::string& root);

struct LoadOptions {
  /// Check the CRC of every shard entry read from (reads the whole entry, not just the needed bytes).
  /// An entry read whole into a contiguous destination (the same layout as the save) is read straight
  /// into it with pread and checksummed block by block as it lands; other entries are read through the
  /// file's mapping and checksummed once.
  bool verify_checksums = true;
  /// Skip targets the checkpoint does not have instead of failing.
  bool allow_missing = false;
  /// Threads of load_all / load_checkpoint (0 = the default). Entries read whole into memory of their
  /// saved layout (the usual load: same model, same or resharded layout with whole shards) are read in
  /// file order by `threads` readers (default 2 per shard file read, at most min(8, hardware threads)),
  /// each pread block checksummed as it lands and, for GPU targets, copied to the device from a
  /// page-locked staging buffer while the next block is read. The other targets (converting dtypes, parts
  /// of entries) are loaded concurrently on `threads` threads (default min(8, hardware threads)).
  int threads = 0;
};

/// What the header of one tensor in a checkpoint says.
struct TensorMeta {
  std::string name;
  Shape global_shape;
  DType dtype = DType::F32;
  struct Shard {
    std::string file, key;
    Shape offsets, shape;
    uint32_t crc = 0;
    bool crc32c = true;  ///< CRC-32C (format 2); false: CRC-32 (format 1)
  };
  std::vector<Shard> shards;
};

/// A checkpoint directory opened for reading: metadata.json is parsed and validated up front; shard
/// files are mapped lazily, and only the pages a load needs are touched.
class CheckpointReader {
 public:
  /// `dir` is a checkpoint directory (or a root with `latest`; see resolve_checkpoint). IOError when
  /// there is no complete checkpoint or its metadata is malformed.
  explicit CheckpointReader(const std::string& dir, const LoadOptions& options = {});
  ~CheckpointReader();
  CheckpointReader(CheckpointReader&&) noexcept;

  const std::string& dir() const { return dir_; }
  int64_t step() const { return step_; }
  std::optional<double> val_loss() const { return val_loss_; }
  std::vector<std::string> tensor_names() const;
  bool has_tensor(const std::string& name) const { return tensors_.count(name) != 0; }
  /// IOError naming the tensor (and a few that exist) when absent.
  const TensorMeta& meta(const std::string& name) const;
  const std::map<std::string, std::string>& json() const { return json_; }
  /// One JSON blob; IOError listing the names present when absent.
  const std::string& json(const std::string& name) const;

  /// Fills target.local's pieces from the checkpoint: IOError when the tensor is absent, its global shape
  /// or dtype differs (both named), a file is missing, truncated or fails its CRC.
  void load(ShardedTensor& target);
  /// load() of every target, on LoadOptions::threads threads; the first failure is rethrown after all
  /// threads have stopped. Targets missing from the checkpoint are skipped when allow_missing.
  void load_all(std::vector<ShardedTensor>& targets);
  /// The whole global tensor, on the host.
  Tensor load_full(const std::string& name);
  /// Bytes copied out of shard files so far (excluding checksum reads).
  int64_t bytes_read() const;

 private:
  struct Files;
  struct DirectRead;
  /// The reads of `target` when every part of it is a whole entry read into contiguous memory of the saved
  /// dtype (host memory, or a device tensor its pieces cover completely); nullopt otherwise (load() then).
  std::optional<std::vector<DirectRead>> plan_direct(ShardedTensor& target);
  /// Runs the reads in file order on the reader threads (see LoadOptions::threads).
  void run_direct(std::vector<DirectRead>& reads);
  std::string dir_;
  LoadOptions options_;
  int64_t step_ = 0;
  std::optional<double> val_loss_;
  std::map<std::string, TensorMeta> tensors_;
  std::map<std::string, std::string> json_;
  std::unique_ptr<Files> files_;
};

/// Ends a phase every rank of `world` takes together (acts as a barrier): each rank passes the error its part of the
/// phase raised (or none); a rank that failed rethrows its own error, every other rank, when any failed, a
/// PeerIOError (core/peer_error.hpp) naming the lowest failing rank. Without a world (or with one rank) it rethrows
/// `local` if set. `phase` names the step in the message ("load", "save (write)", ...).
void agree(comm::Communicator* world, const std::exception_ptr& local, const char* phase);

/// Loads every target (a missing one is an IOError unless allow_missing) and returns the reader (for
/// the step and JSON blobs). Collective over `world` when given: a failure on one rank is an IOError on
/// all of them.
CheckpointReader load_checkpoint(comm::Communicator* world, const std::string& dir, std::vector<ShardedTensor>& targets,
                                 const LoadOptions& options = {});

// ---- optimizer state ------------------------------------------------------------------------------

/// The optimizer's state (opt.state(), views of the live state) mapped like its parameters, plus the
/// step count in a JSON blob "optimizer" = {"step": n}; appends both to `state`.
void add_optimizer_state(CheckpointState& state, const optim::Optimizer& opt, const std::vector<ShardedTensor>& params);
/// Restores what add_optimizer_state saved (any layout) into `opt`: reads into copies of its current
/// state, then opt.load_state(copies, step). Padding rows keep their current values.
void load_optimizer_state(CheckpointReader& reader, optim::Optimizer& opt, const std::vector<ShardedTensor>& params);

}  // namespace megacore::checkpoint
