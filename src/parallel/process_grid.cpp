#include "megacore/parallel/process_grid.hpp"

#include <algorithm>

#include "megacore/core/error.hpp"

namespace megacore::parallel {

namespace {
size_t kind_slot(GroupKind k) { return size_t(k); }
}  // namespace

ProcessGrid::ProcessGrid(comm::Communicator& world, const ParallelConfig& config, std::vector<GroupKind> kinds)
    : world_(world), layout_(config, world.size()) {
  // Every rank walks the kinds in the same (canonical) order, since each split is collective.
  for (GroupKind k : kGroupKinds) {
    if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) continue;
    comm::CommOptions o = world.options();
    o.name = std::string(group_kind_name(k));
    o.copy_engine = k == GroupKind::Cp && config.cp_copy_engine;
    if (o.copy_engine) o.copy_engine_buffer_bytes = size_t(32) << 20;  // only all_gather's collectives stage
    int color = layout_.group_index(k, world.rank());
    int key = layout_.rank_in_group(k, world.rank());
    groups_[kind_slot(k)] = world.split(color, key, o);
    built_[kind_slot(k)] = true;
    if (color >= 0) {
      const auto& expect = layout_.group_of(k, world.rank());
      MC_CHECK_AS(CommError, groups_[kind_slot(k)] && groups_[kind_slot(k)]->world_ranks() == expect,
                  "group '{}' was split with the wrong members on rank {}: the world communicator's ranks are "
                  "not the job's global ranks",
                  group_kind_name(k), world.rank());
    }
  }
}

bool ProcessGrid::has_group(GroupKind kind) const { return built_[kind_slot(kind)] && groups_[kind_slot(kind)]; }

comm::Communicator& ProcessGrid::group(GroupKind kind) const {
  MC_CHECK(built_[kind_slot(kind)], "group '{}' was not built for this ProcessGrid; include it in `kinds`",
           group_kind_name(kind));
  MC_CHECK(groups_[kind_slot(kind)] != nullptr, "rank {} is in no '{}' group (e.g. a middle pipeline stage has no "
           "embedding group); check has_group() first",
           world_.rank(), group_kind_name(kind));
  return *groups_[kind_slot(kind)];
}

}  // namespace megacore::parallel
