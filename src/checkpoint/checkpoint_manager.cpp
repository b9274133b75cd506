// CheckpointManager (see checkpoint_manager.hpp).
#include "megacore/checkpoint/checkpoint_manager.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>

#include "megacore/core/error.hpp"

namespace megacore::checkpoint {

namespace fs = std::filesystem;

CheckpointManager::CheckpointManager(comm::Communicator& world, std::string root, const CheckpointPolicy& policy)
    : world_(world), root_(std::move(root)), policy_(policy), saver_(world, policy.save_options) {
  MC_CHECK(!root_.empty(), "CheckpointManager: root is empty; pass the directory checkpoints go to");
  MC_CHECK(policy.save_every >= 0 && policy.keep_last >= 0 && policy.keep_top_k >= 0,
           "CheckpointManager: save_every {}, keep_last {} and keep_top_k {} must be >= 0 (0 disables a rule)",
           policy.save_every, policy.keep_last, policy.keep_top_k);
  saver_.set_on_commit([this](const std::string&, int64_t) { apply_retention(); });
}

CheckpointManager::~CheckpointManager() {
  if (!saver_.pending()) return;
  try {
    saver_.wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] CheckpointManager: the last async save failed: %s\n", world_.rank(), e.what());
  }
}

void CheckpointManager::save(const CheckpointState& state) {
  saver_.save(root_, state);
  if (!policy_.async) saver_.wait();
}

std::string CheckpointManager::wait() { return saver_.wait(); }

int64_t CheckpointManager::reserve(const CheckpointState& state) { return policy_.async ? saver_.reserve(state) : 0; }

std::optional<CheckpointReader> CheckpointManager::resume(std::vector<ShardedTensor>& targets,
                                                          const LoadOptions& options) {
  // Every rank must make the same choice; rank 0's view of the file system decides.
  auto dir = latest();
  Tensor has = Tensor::from_vector<int32_t>({dir ? 1 : 0}, {1}).to(world_.device());
  world_.broadcast(has, 0)->wait();
  has = has.to(Device::cpu());
  if (has.data<int32_t>()[0] == 0) {
    MC_CHECK_AS(IOError, !dir, "CheckpointManager: rank 0 sees no checkpoint under '{}' but rank {} sees {}", root_,
                world_.rank(), *dir);
    return std::nullopt;
  }
  MC_CHECK_AS(IOError, dir.has_value(), "CheckpointManager: rank 0 sees a checkpoint under '{}' but rank {} does not; "
              "all ranks must share the checkpoint file system", root_, world_.rank());
  return load_checkpoint(&world_, *dir, targets, options);
}

void CheckpointManager::apply_retention() {
  if (world_.rank() != 0) return;
  if (policy_.keep_last == 0) return;  // every checkpoint is kept; keep_top_k only adds to keep_last's
  std::vector<CheckpointInfo> all = list_checkpoints(root_);
  std::set<std::string> keep;
  if (auto l = latest()) keep.insert(fs::path(*l).filename().string());
  if (policy_.keep_last > 0)
    for (size_t i = all.size() > size_t(policy_.keep_last) ? all.size() - size_t(policy_.keep_last) : 0; i < all.size(); ++i)
      keep.insert(fs::path(all[i].dir).filename().string());
  if (policy_.keep_top_k > 0) {
    std::vector<CheckpointInfo> scored;
    for (const auto& c : all)
      if (c.val_loss) scored.push_back(c);
    std::stable_sort(scored.begin(), scored.end(),
                     [](const CheckpointInfo& a, const CheckpointInfo& b) { return *a.val_loss < *b.val_loss; });
    for (size_t i = 0; i < scored.size() && i < size_t(policy_.keep_top_k); ++i)
      keep.insert(fs::path(scored[i].dir).filename().string());
  }
  for (const auto& c : all) {
    const std::string name = fs::path(c.dir).filename().string();
    if (keep.count(name)) continue;
    const fs::path trash = fs::path(root_) / (".trash." + name);
    std::error_code ec;
    fs::rename(c.dir, trash, ec);  // atomic: the checkpoint is gone or intact, never half-deleted
    if (ec) raise<IOError>("CheckpointManager: cannot remove old checkpoint '{}': {}", c.dir, ec.message());
    fs::remove_all(trash, ec);
  }
}

}  // namespace megacore::checkpoint
