// Process-grid rank math: which global ranks form each TP/CP/DP/PP/EP/... group.
//
// GridLayout is pure arithmetic over (ParallelConfig, world_size); it talks to no communicator, so
// the same layout can be printed by `megacore plan`, checked in tests for any world size, and
// turned into communicators elsewhere (group_index() is the split color, rank_in_group() the key).
//
// The layout reproduces Megatron-Core's RankGenerator: a global rank is a mixed-radix number over
// the dimensions of `order`, first dimension fastest (default tp-cp-ep-dp-pp), and a group of some
// dimensions holds the ranks that agree on every other coordinate, in increasing rank order; the
// groups of a kind are listed by increasing first rank. Dense layers use sizes (TP, CP, EP=1, DP,
// PP); expert layers a second generator over (expert-TP, CP=1, EP, expert-DP, PP) with the same
// order, so a rank has the same coordinates here as in Megatron-Core.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "megacore/comm/communicator.hpp"

namespace megacore::parallel {

/// Parallel sizes of a run. DP is not given: it is whatever the world size leaves over.
struct ParallelConfig {
  int tensor = 1;         ///< TP: tensor-parallel size.
  int pipeline = 1;       ///< PP: pipeline stages.
  int context = 1;        ///< CP: context (sequence) parallel size.
  int expert = 1;         ///< EP: expert-parallel size of MoE layers.
  int expert_tensor = 0;  ///< Expert-TP: tensor-parallel size inside experts; 0 = same as tensor.
  /// Rank order, fastest-varying dimension first (Megatron-Core's `order`); dimensions of size 1
  /// may be left out.
  std::string order = "tp-cp-ep-dp-pp";
  int virtual_pipeline = 1;  ///< Model chunks per pipeline stage (interleaved 1F1B); 1 = none.
  /// The CP group's transfers by copy engines (comm::CommOptions::copy_engine, 32 MiB staging buffer for its
  /// collectives); no effect on the rank math.
  bool cp_copy_engine = false;
};

/// The kinds of group Megatron-Core builds (names as in its parallel_state / nccl config keys).
enum class GroupKind {
  Tp,                 ///< tensor parallel
  Cp,                 ///< context parallel
  Dp,                 ///< data parallel (without CP)
  DpCp,               ///< data × context parallel: the gradient-reduction group
  Pp,                 ///< pipeline parallel
  Mp,                 ///< model parallel: tensor × pipeline
  TpCp,               ///< tensor × context
  TpDp,               ///< tensor × data
  TpDpCp,             ///< tensor × data × context
  Ep,                 ///< expert parallel (expert generator)
  ExpertTp,           ///< tensor parallel inside experts
  ExpertDp,           ///< data parallel of expert weights
  TpEp,               ///< expert-tensor × expert parallel
  TpEpPp,             ///< expert-tensor × expert × pipeline
  Embedding,          ///< first and last stage of each pipeline group (first only when PP = 1)
  PositionEmbedding,  ///< first stage of each pipeline group
};

inline constexpr std::array<GroupKind, 16> kGroupKinds = {
    GroupKind::Tp,     GroupKind::Cp,     GroupKind::Dp,        GroupKind::DpCp,
    GroupKind::Pp,     GroupKind::Mp,     GroupKind::TpCp,      GroupKind::TpDp,
    GroupKind::TpDpCp, GroupKind::Ep,     GroupKind::ExpertTp,  GroupKind::ExpertDp,
    GroupKind::TpEp,   GroupKind::TpEpPp, GroupKind::Embedding, GroupKind::PositionEmbedding};

/// Short name of a kind: "tp", "dp_cp", "expert_tp", "position_embedding", ...
std::string_view group_kind_name(GroupKind kind);
/// Inverse of group_kind_name; throws ValueError listing the known names.
GroupKind group_kind_from_name(std::string_view name);

/// Every group of every kind for one (ParallelConfig, world_size), validated up front.
class GridLayout {
 public:
  /// Validates the config as a whole (see validate()), then computes all groups.
  GridLayout(const ParallelConfig& config, int world_size);

  /// Throws ConfigError, saying what to change, unless `config` can run on `world_size` ranks.
  static void validate(const ParallelConfig& config, int world_size);

  /// The config as given.
  const ParallelConfig& config() const { return config_; }
  /// The order with every dimension spelled out (left-out size-1 dimensions appended), lower case.
  const std::string& order() const { return order_; }

  int world_size() const { return world_; }
  int tp_size() const { return tp_; }
  int pp_size() const { return pp_; }
  int cp_size() const { return cp_; }
  /// DP = world / (TP·PP·CP).
  int dp_size() const { return dp_; }
  int ep_size() const { return ep_; }
  int expert_tp_size() const { return etp_; }
  /// Expert-DP = world / (expert-TP·EP·PP).
  int expert_dp_size() const { return edp_; }
  int virtual_pipeline_size() const { return vpp_; }

  /// All groups of a kind: each in increasing rank order, listed by increasing first rank.
  const std::vector<std::vector<int>>& groups(GroupKind kind) const;
  /// Number of ranks in each group of a kind (all groups of a kind have the same size).
  int group_size(GroupKind kind) const;
  /// The group of `kind` holding `rank`; empty when the rank is in none (middle pipeline stages
  /// have no embedding group).
  const std::vector<int>& group_of(GroupKind kind, int rank) const;
  /// Index of that group in groups(kind), usable as a split color; -1 when the rank is in none.
  int group_index(GroupKind kind, int rank) const;
  /// Position of `rank` inside its group (its rank in that communicator); -1 when in none.
  int rank_in_group(GroupKind kind, int rank) const;

  /// Coordinates of a global rank (the same as Megatron-Core's get_*_rank()).
  int tp_rank(int rank) const { return rank_in_group(GroupKind::Tp, rank); }
  int pp_rank(int rank) const { return rank_in_group(GroupKind::Pp, rank); }
  int cp_rank(int rank) const { return rank_in_group(GroupKind::Cp, rank); }
  int dp_rank(int rank) const { return rank_in_group(GroupKind::Dp, rank); }
  int ep_rank(int rank) const { return rank_in_group(GroupKind::Ep, rank); }
  int expert_tp_rank(int rank) const { return rank_in_group(GroupKind::ExpertTp, rank); }
  int expert_dp_rank(int rank) const { return rank_in_group(GroupKind::ExpertDp, rank); }
  /// The global rank with the given dense coordinates (inverse of tp/cp/dp/pp_rank).
  int rank_at(int tp, int cp, int dp, int pp) const;

  bool is_first_stage(int rank) const { return pp_rank(rank) == 0; }
  bool is_last_stage(int rank) const { return pp_rank(rank) == pp_ - 1; }

  /// Human-readable table: the sizes, then one line per rank with all its coordinates.
  std::string table() const;

 private:
  struct KindGroups {
    std::vector<std::vector<int>> groups;
    std::vector<int> index;     // per global rank: index into groups, -1 if none
    std::vector<int> position;  // per global rank: position inside its group, -1 if none
  };
  const KindGroups& kind_groups(GroupKind kind) const;
  void check_rank(int rank) const;

  ParallelConfig config_;
  std::string order_;
  int world_ = 1, tp_ = 1, pp_ = 1, cp_ = 1, dp_ = 1, ep_ = 1, etp_ = 1, edp_ = 1, vpp_ = 1;
  std::array<int, 4> dense_stride_{};  // of tp, cp, dp, pp in the dense mixed-radix rank
  std::array<KindGroups, kGroupKinds.size()> kinds_;
};

/// The communicators of every group this rank belongs to, split from a world communicator.
///
/// Construction is collective over `world`: it validates the config against world.size() first
/// (ConfigError, before any communicator is made), then splits one communicator per group kind, named
/// after the kind ("tp", "dp_cp", ...). Groups are values handed to layers; nothing is global.
class ProcessGrid {
 public:
  /// `kinds` limits which groups are built (all by default); asking later for one that was not built
  /// is a ValueError.
  ProcessGrid(comm::Communicator& world, const ParallelConfig& config,
              std::vector<GroupKind> kinds = std::vector<GroupKind>(kGroupKinds.begin(), kGroupKinds.end()));

  const GridLayout& layout() const { return layout_; }
  comm::Communicator& world() const { return world_; }
  int rank() const { return world_.rank(); }
  int world_size() const { return world_.size(); }

  /// The communicator of this rank's group of `kind`; throws ValueError if the rank is in no such group
  /// (e.g. a middle pipeline stage has no embedding group) or the kind was not built.
  comm::Communicator& group(GroupKind kind) const;
  /// True when this rank is in a group of `kind` (and it was built).
  bool has_group(GroupKind kind) const;

  comm::Communicator& tp() const { return group(GroupKind::Tp); }
  comm::Communicator& pp() const { return group(GroupKind::Pp); }
  comm::Communicator& cp() const { return group(GroupKind::Cp); }
  comm::Communicator& dp() const { return group(GroupKind::Dp); }
  comm::Communicator& dp_cp() const { return group(GroupKind::DpCp); }
  comm::Communicator& mp() const { return group(GroupKind::Mp); }
  comm::Communicator& ep() const { return group(GroupKind::Ep); }
  comm::Communicator& expert_tp() const { return group(GroupKind::ExpertTp); }
  comm::Communicator& expert_dp() const { return group(GroupKind::ExpertDp); }
  comm::Communicator& embedding() const { return group(GroupKind::Embedding); }

  int tp_rank() const { return layout_.tp_rank(rank()); }
  int pp_rank() const { return layout_.pp_rank(rank()); }
  int cp_rank() const { return layout_.cp_rank(rank()); }
  int dp_rank() const { return layout_.dp_rank(rank()); }
  int ep_rank() const { return layout_.ep_rank(rank()); }
  bool is_first_stage() const { return layout_.is_first_stage(rank()); }
  bool is_last_stage() const { return layout_.is_last_stage(rank()); }

 private:
  comm::Communicator& world_;
  GridLayout layout_;
  std::array<bool, kGroupKinds.size()> built_{};
  std::array<std::unique_ptr<comm::Communicator>, kGroupKinds.size()> groups_;
};

}  // namespace megacore::parallel
