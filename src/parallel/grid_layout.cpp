#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdint>

#include "megacore/core/error.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace megacore::parallel {
namespace {

// Dimensions of a rank generator; arrays of sizes are indexed by Dim, not by place in the order.
enum Dim : int { kTp = 0, kCp, kEp, kDp, kPp, kNumDims };
constexpr std::array<std::string_view, kNumDims> kDimNames = {"tp", "cp", "ep", "dp", "pp"};
// Megatron-Core appends left-out dimensions in this order. They all have size 1, so this only
// shapes the spelled-out order string, never a group.
constexpr std::array<Dim, kNumDims> kAppendOrder = {kTp, kPp, kDp, kEp, kCp};

using Sizes = std::array<int, kNumDims>;
constexpr unsigned bit(Dim d) { return 1u << d; }

struct ParsedOrder {
  std::vector<Dim> dims;  // fastest-varying first, all five
  size_t given = 0;       // how many of them the user named
};

ParsedOrder parse_order(const std::string& order) {
  std::string lower = order;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  ParsedOrder parsed;
  std::array<bool, kNumDims> seen{};
  for (size_t start = 0;;) {
    const size_t end = lower.find('-', start);
    const std::string_view token =
        std::string_view(lower).substr(start, end == std::string::npos ? end : end - start);
    const auto it = std::find(kDimNames.begin(), kDimNames.end(), token);
    MC_CHECK_AS(
        ConfigError, it != kDimNames.end(),
        "unknown dimension '{}' in order '{}'; an order is a dash-separated list of tp, cp, "
        "ep, dp, pp, fastest-varying first, e.g. 'tp-cp-ep-dp-pp'",
        token, order);
    const Dim d = static_cast<Dim>(it - kDimNames.begin());
    MC_CHECK_AS(ConfigError, !seen[d],
                "order '{}' names {} twice; name each of tp, cp, ep, dp, pp at most once", order,
                token);
    seen[d] = true;
    parsed.dims.push_back(d);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  parsed.given = parsed.dims.size();
  for (Dim d : kAppendOrder)
    if (!seen[d]) parsed.dims.push_back(d);
  return parsed;
}

// Generator sizes for dense layers (EP folded into DP) and for expert layers (CP folded into
// expert-DP), as Megatron-Core builds its two RankGenerators.
struct Resolved {
  ParsedOrder order;
  Sizes dense{};
  Sizes expert{};
};

// Stride of each dimension in the mixed-radix rank: the product of the sizes before it.
Sizes strides_of(const std::vector<Dim>& order, const Sizes& size) {
  Sizes stride{};
  int s = 1;
  for (Dim d : order) {
    stride[d] = s;
    s *= size[d];
  }
  return stride;
}

// The groups spanned by the dimensions in `mask`: group g's ranks share the coordinates of the
// other dimensions, which are g's digits; a rank's place inside the group is the digits of the
// masked dimensions. Both digit sequences run fastest-first, so groups and their members come out
// sorted.
std::vector<std::vector<int>> masked_groups(const std::vector<Dim>& order, const Sizes& size,
                                            unsigned mask) {
  const Sizes stride = strides_of(order, size);
  std::vector<int> in_size, in_stride, out_size, out_stride;
  int world = 1, group_size = 1;
  for (Dim d : order) {
    const bool in = mask & bit(d);
    (in ? in_size : out_size).push_back(size[d]);
    (in ? in_stride : out_stride).push_back(stride[d]);
    world *= size[d];
    if (in) group_size *= size[d];
  }
  auto place = [](int value, const std::vector<int>& sizes, const std::vector<int>& strides) {
    int rank = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      rank += value % sizes[i] * strides[i];
      value /= sizes[i];
    }
    return rank;
  };
  std::vector<std::vector<int>> groups(world / group_size, std::vector<int>(group_size));
  for (int g = 0; g < world / group_size; ++g) {
    const int base = place(g, out_size, out_stride);
    for (int k = 0; k < group_size; ++k) groups[g][k] = base + place(k, in_size, in_stride);
  }
  return groups;
}

std::string_view dim_label(Dim d, const Resolved& r) {
  switch (d) {
    case kTp:
      return r.dense[kTp] > 1 ? "TP" : "expert-TP";
    case kCp:
      return "CP";
    case kEp:
      return "EP";
    case kDp:
      return r.dense[kDp] > 1 ? "DP" : "expert-DP";
    case kPp:
      return "PP";
    default:
      return "?";
  }
}

Resolved resolve(const ParallelConfig& c, int world) {
  MC_CHECK_AS(ConfigError, world >= 1, "world_size {} must be >= 1", world);
  struct Field {
    const char* name;
    const char* label;
    int value;
  };
  for (const Field& f : {Field{"tensor", "TP", c.tensor}, Field{"pipeline", "PP", c.pipeline},
                         Field{"context", "CP", c.context}, Field{"expert", "EP", c.expert},
                         Field{"virtual_pipeline", "VPP", c.virtual_pipeline}}) {
    MC_CHECK_AS(ConfigError, f.value >= 1,
                "{}({}) must be >= 1; set ParallelConfig.{} to a positive size (1 turns it off)",
                f.label, f.value, f.name);
  }
  MC_CHECK_AS(ConfigError, c.expert_tensor >= 0,
              "expert-TP({}) must be >= 1; set ParallelConfig.expert_tensor to a positive size, or "
              "to 0 to use TP",
              c.expert_tensor);
  MC_CHECK_AS(ConfigError, c.virtual_pipeline == 1 || c.pipeline > 1,
              "VPP({}) > 1 needs PP > 1, since interleaving splits each pipeline stage into "
              "chunks; set pipeline >= 2 or virtual_pipeline = 1",
              c.virtual_pipeline);

  Resolved r;
  r.order = parse_order(c.order);

  // 64-bit products: sizes near INT_MAX must give a divisibility error, not an overflow.
  const int64_t model = int64_t{c.tensor} * c.pipeline * c.context;
  MC_CHECK_AS(ConfigError, world % model == 0,
              "world_size {} is not divisible by TP({})×PP({})×CP({})={}; choose sizes whose "
              "product divides the world size",
              world, c.tensor, c.pipeline, c.context, model);
  const int dp = static_cast<int>(world / model);
  const int etp = c.expert_tensor > 0 ? c.expert_tensor : c.tensor;
  const int64_t expert_model = int64_t{etp} * c.expert * c.pipeline;
  if (etp == c.tensor) {
    // Then world / (TP·PP) = DP·CP, and the condition reads as Megatron users know it.
    MC_CHECK_AS(ConfigError, world % expert_model == 0,
                "EP({}) must divide DP×CP({}); choose an expert-parallel size that divides {}",
                c.expert, dp * c.context, dp * c.context);
  } else {
    MC_CHECK_AS(ConfigError, world % expert_model == 0,
                "world_size {} is not divisible by expert-TP({})×EP({})×PP({})={}; choose expert "
                "sizes whose product divides the world size",
                world, etp, c.expert, c.pipeline, expert_model);
  }
  const int edp = static_cast<int>(world / expert_model);
  // Sizes in Dim order: tp, cp, ep, dp, pp.
  r.dense = {c.tensor, c.context, 1, dp, c.pipeline};
  r.expert = {etp, 1, c.expert, edp, c.pipeline};

  for (size_t i = r.order.given; i < r.order.dims.size(); ++i) {
    const Dim d = r.order.dims[i];
    const int n = std::max(r.dense[d], r.expert[d]);
    MC_CHECK_AS(ConfigError, n == 1, "order '{}' leaves out {} but {}({}) > 1; add {} to the order",
                c.order, kDimNames[d], dim_label(d, r), n, kDimNames[d]);
  }

  // Both generators must agree on the pipeline groups: P2P and the schedule use one PP group
  // per rank for dense and expert layers alike. With pp last this always holds.
  const bool pp_last = r.order.dims[r.order.given - 1] == kPp;
  MC_CHECK_AS(ConfigError, pp_last || c.pipeline == 1 || edp == dp,
              "with PP({}) > 1 and pp not last in order '{}', expert layers need the data-parallel "
              "size of dense layers, but expert-DP is {} and DP is {}; put pp last in the order or "
              "choose expert-TP×EP = TP×CP ({})",
              c.pipeline, c.order, edp, dp, c.tensor * c.context);
  if (!pp_last && c.pipeline > 1) {
    const int dense_stride = strides_of(r.order.dims, r.dense)[kPp];
    const int expert_stride = strides_of(r.order.dims, r.expert)[kPp];
    MC_CHECK_AS(ConfigError, dense_stride == expert_stride,
                "dense and expert layers would get different pipeline groups under order '{}' "
                "(pipeline stages {} ranks apart for dense layers, {} for expert layers); put pp "
                "last in the order",
                c.order, dense_stride, expert_stride);
  }
  return r;
}

// Which generator and which of its dimensions span each kind (embedding kinds derive from pp).
struct KindSpec {
  bool expert;
  unsigned mask;
};
KindSpec kind_spec(GroupKind kind) {
  switch (kind) {
    case GroupKind::Tp:
      return {false, bit(kTp)};
    case GroupKind::Cp:
      return {false, bit(kCp)};
    case GroupKind::Dp:
      return {false, bit(kDp)};
    case GroupKind::DpCp:
      return {false, bit(kDp) | bit(kCp)};
    case GroupKind::Pp:
      return {false, bit(kPp)};
    case GroupKind::Mp:
      return {false, bit(kTp) | bit(kPp)};
    case GroupKind::TpCp:
      return {false, bit(kTp) | bit(kCp)};
    case GroupKind::TpDp:
      return {false, bit(kTp) | bit(kDp)};
    case GroupKind::TpDpCp:
      return {false, bit(kTp) | bit(kDp) | bit(kCp)};
    case GroupKind::Ep:
      return {true, bit(kEp)};
    case GroupKind::ExpertTp:
      return {true, bit(kTp)};
    case GroupKind::ExpertDp:
      return {true, bit(kDp)};
    case GroupKind::TpEp:
      return {true, bit(kTp) | bit(kEp)};
    case GroupKind::TpEpPp:
      return {true, bit(kTp) | bit(kEp) | bit(kPp)};
    case GroupKind::Embedding:
    case GroupKind::PositionEmbedding:
      return {false, bit(kPp)};
  }
  return {false, 0};
}

}  // namespace

std::string_view group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::Tp:
      return "tp";
    case GroupKind::Cp:
      return "cp";
    case GroupKind::Dp:
      return "dp";
    case GroupKind::DpCp:
      return "dp_cp";
    case GroupKind::Pp:
      return "pp";
    case GroupKind::Mp:
      return "mp";
    case GroupKind::TpCp:
      return "tp_cp";
    case GroupKind::TpDp:
      return "tp_dp";
    case GroupKind::TpDpCp:
      return "tp_dp_cp";
    case GroupKind::Ep:
      return "ep";
    case GroupKind::ExpertTp:
      return "expert_tp";
    case GroupKind::ExpertDp:
      return "expert_dp";
    case GroupKind::TpEp:
      return "tp_ep";
    case GroupKind::TpEpPp:
      return "tp_ep_pp";
    case GroupKind::Embedding:
      return "embedding";
    case GroupKind::PositionEmbedding:
      return "position_embedding";
  }
  return "?";
}

GroupKind group_kind_from_name(std::string_view name) {
  std::string known;
  for (GroupKind k : kGroupKinds) {
    if (group_kind_name(k) == name) return k;
    known += known.empty() ? "" : ", ";
    known += group_kind_name(k);
  }
  raise<ValueError>("unknown group kind '{}'; known kinds: {}", name, known);
}

void GridLayout::validate(const ParallelConfig& config, int world_size) {
  resolve(config, world_size);
}

GridLayout::GridLayout(const ParallelConfig& config, int world_size) : config_(config) {
  static_assert(kGroupKinds.size() == static_cast<size_t>(GroupKind::PositionEmbedding) + 1);
  const Resolved r = resolve(config, world_size);
  world_ = world_size;
  tp_ = r.dense[kTp], cp_ = r.dense[kCp], dp_ = r.dense[kDp], pp_ = r.dense[kPp];
  ep_ = r.expert[kEp], etp_ = r.expert[kTp], edp_ = r.expert[kDp];
  vpp_ = config.virtual_pipeline;
  for (Dim d : r.order.dims) {
    if (!order_.empty()) order_ += '-';
    order_ += kDimNames[d];
  }
  const Sizes stride = strides_of(r.order.dims, r.dense);
  dense_stride_ = {stride[kTp], stride[kCp], stride[kDp], stride[kPp]};

  for (GroupKind kind : kGroupKinds) {
    KindGroups& kg = kinds_[static_cast<size_t>(kind)];
    const KindSpec spec = kind_spec(kind);
    kg.groups = masked_groups(r.order.dims, spec.expert ? r.expert : r.dense, spec.mask);
    if (kind == GroupKind::Embedding || kind == GroupKind::PositionEmbedding) {
      for (auto& g : kg.groups) {
        const bool both_ends = kind == GroupKind::Embedding && g.size() > 1;
        g = both_ends ? std::vector<int>{g.front(), g.back()} : std::vector<int>{g.front()};
      }
    }
    kg.index.assign(world_, -1);
    kg.position.assign(world_, -1);
    for (size_t i = 0; i < kg.groups.size(); ++i) {
      for (size_t j = 0; j < kg.groups[i].size(); ++j) {
        kg.index[kg.groups[i][j]] = static_cast<int>(i);
        kg.position[kg.groups[i][j]] = static_cast<int>(j);
      }
    }
  }
}

const GridLayout::KindGroups& GridLayout::kind_groups(GroupKind kind) const {
  const auto i = static_cast<size_t>(kind);
  MC_CHECK(i < kinds_.size(), "invalid GroupKind {}", i);
  return kinds_[i];
}

void GridLayout::check_rank(int rank) const {
  MC_CHECK(rank >= 0 && rank < world_, "rank {} is out of range for world_size {}", rank, world_);
}

const std::vector<std::vector<int>>& GridLayout::groups(GroupKind kind) const {
  return kind_groups(kind).groups;
}

int GridLayout::group_size(GroupKind kind) const {
  return static_cast<int>(kind_groups(kind).groups.front().size());
}

const std::vector<int>& GridLayout::group_of(GroupKind kind, int rank) const {
  static const std::vector<int> kNone;
  const int i = group_index(kind, rank);
  return i < 0 ? kNone : kind_groups(kind).groups[i];
}

int GridLayout::group_index(GroupKind kind, int rank) const {
  check_rank(rank);
  return kind_groups(kind).index[rank];
}

int GridLayout::rank_in_group(GroupKind kind, int rank) const {
  check_rank(rank);
  return kind_groups(kind).position[rank];
}

int GridLayout::rank_at(int tp, int cp, int dp, int pp) const {
  MC_CHECK(tp >= 0 && tp < tp_ && cp >= 0 && cp < cp_ && dp >= 0 && dp < dp_ && pp >= 0 && pp < pp_,
           "coordinates (tp {}, cp {}, dp {}, pp {}) are outside TP({})×CP({})×DP({})×PP({})", tp,
           cp, dp, pp, tp_, cp_, dp_, pp_);
  return tp * dense_stride_[0] + cp * dense_stride_[1] + dp * dense_stride_[2] +
         pp * dense_stride_[3];
}

std::string GridLayout::table() const {
  std::string out = fmt::format(
      "world {}: TP {} × CP {} × DP {} × PP {} (order {}, VPP {})\n"
      "experts: expert-TP {} × EP {} × expert-DP {} × PP {}\n",
      world_, tp_, cp_, dp_, pp_, order_, vpp_, etp_, ep_, edp_, pp_);
  const int w = std::max(5, static_cast<int>(fmt::formatted_size("{}", world_)) + 1);
  for (const char* h : {"rank", "tp", "cp", "dp", "pp", "ep", "etp", "edp"})
    out += fmt::format("{:>{}}", h, w);
  out += "  stage\n";
  for (int r = 0; r < world_; ++r) {
    for (int v : {r, tp_rank(r), cp_rank(r), dp_rank(r), pp_rank(r), ep_rank(r), expert_tp_rank(r),
                  expert_dp_rank(r)})
      out += fmt::format("{:>{}}", v, w);
    const char* stage = pp_ == 1            ? "first/last"
                        : is_first_stage(r) ? "first"
                        : is_last_stage(r)  ? "last"
                                            : "-";
    out += fmt::format("  {}\n", stage);
  }
  return out;
}

}  // namespace megacore::parallel
