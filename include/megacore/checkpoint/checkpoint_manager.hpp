// CheckpointManager: when to save, which checkpoints to keep, and where to resume from.
//
// Policies: save every N steps (should_save), keep the newest k, keep the k with the lowest validation
// loss (both may be combined: a checkpoint survives if either keeps it; the one `latest` names is never
// deleted), and resume from the newest complete checkpoint. Saves go through AsyncCheckpointSaver, so
// with `async` the caller's step continues while the previous save is written; retention runs on rank 0
// right after each commit. Deletion renames a directory to .trash.step_<N> first (atomic), so a crash
// mid-delete never leaves a half-deleted step_<N> that looks complete; the next save removes the trash.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megacore/checkpoint/dist_checkpoint.hpp"

namespace megacore::checkpoint {

struct CheckpointPolicy {
  /// should_save(step) is true when step % save_every == 0 (0: never on its own).
  int64_t save_every = 0;
  /// Keep the newest k checkpoints (0: no limit from this rule).
  int keep_last = 0;
  /// Also keep the k checkpoints with the lowest val_loss (0: no such rule).
  int keep_top_k = 0;
  /// Write in a background thread; the next save (or wait()) commits.
  bool async = false;
  SaveOptions save_options;
};

class CheckpointManager {
 public:
  /// `world` must outlive the manager. ValueError for negative policy values.
  CheckpointManager(comm::Communicator& world, std::string root, const CheckpointPolicy& policy = {});
  /// Commits a pending async save if there is one (errors are logged, not thrown, from a destructor;
  /// call wait() to see them).
  ~CheckpointManager();

  const std::string& root() const { return root_; }
  const CheckpointPolicy& policy() const { return policy_; }
  bool should_save(int64_t step) const { return policy_.save_every > 0 && step > 0 && step % policy_.save_every == 0; }
  /// Saves `state` (collective). Sync: returns after the commit; async: after the host copy.
  void save(const CheckpointState& state);
  /// With `async`: allocates the snapshot buffers for saves of `state`'s tensors now (AsyncCheckpointSaver::reserve),
  /// so that the first save blocks training no longer than later ones. Not collective; returns the bytes held (0
  /// without `async`).
  int64_t reserve(const CheckpointState& state);
  /// Commits a pending async save; returns its directory ("" when none). Collective.
  std::string wait();
  /// The checkpoint to resume from, or nullopt for a fresh start.
  std::optional<std::string> latest() const { return resolve_checkpoint(root_); }
  /// Loads `targets` from latest() (collective); nullopt (nothing loaded) when there is no checkpoint.
  std::optional<CheckpointReader> resume(std::vector<ShardedTensor>& targets, const LoadOptions& options = {});
  /// Deletes what the policy does not keep (rank 0's work; call on every rank, it is not collective).
  void apply_retention();

 private:
  comm::Communicator& world_;
  std::string root_;
  CheckpointPolicy policy_;
  AsyncCheckpointSaver saver_;
};

}  // namespace megacore::checkpoint
