// GridLayout against an independent reference of Megatron-Core's rank generator, hand-written
// tables from Megatron-Core's documentation, and its validation errors.
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::parallel;
using Groups = std::vector<std::vector<int>>;

namespace {

// ---- reference
// ----------------------------------------------------------------------------------- Megatron's
// documented rule, stated directly: a rank's coordinates are its digits in the mixed radix of the
// order (first dimension fastest); a group of some dimensions is the set of ranks that agree with
// it on all other coordinates. No strides, no decomposition of group indices.
constexpr std::array<const char*, 5> kDims = {"tp", "cp", "ep", "dp", "pp"};
enum { TP, CP, EP, DP, PP };

int dim_of(const std::string& name) {
  for (int d = 0; d < 5; ++d)
    if (name == kDims[d]) return d;
  FAIL("bad dim " << name);
  return -1;
}

struct RefGenerator {
  std::array<int, 5> size{};
  std::vector<std::array<int, 5>> coord;  // per rank

  RefGenerator(const std::string& order, std::array<int, 5> sizes) : size(sizes) {
    std::vector<int> dims;
    for (size_t s = 0, e; s <= order.size(); s = e + 1) {
      e = order.find('-', s);
      if (e == std::string::npos) e = order.size();
      dims.push_back(dim_of(order.substr(s, e - s)));
    }
    for (int d = 0; d < 5; ++d)  // left-out dimensions have size 1: their digit is always 0
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) REQUIRE(size[d] == 1);
    int world = 1;
    for (int d : dims) world *= size[d];
    coord.resize(world);
    for (int r = 0; r < world; ++r) {
      int rest = r;
      coord[r] = {};
      for (int d : dims) {
        coord[r][d] = rest % size[d];
        rest /= size[d];
      }
    }
  }
  int world() const { return static_cast<int>(coord.size()); }
  std::vector<int> group(int rank, std::vector<int> spanned) const {
    std::vector<int> out;
    for (int q = 0; q < world(); ++q) {
      bool same = true;
      for (int d = 0; d < 5; ++d)
        if (std::find(spanned.begin(), spanned.end(), d) == spanned.end() &&
            coord[q][d] != coord[rank][d])
          same = false;
      if (same) out.push_back(q);
    }
    return out;
  }
  Groups groups(const std::vector<int>& spanned) const {
    Groups out;
    for (int r = 0; r < world(); ++r) {
      auto g = group(r, spanned);
      if (g.front() == r) out.push_back(g);  // each group once, listed by its lowest rank
    }
    return out;
  }
};

struct RefKind {
  const char* name;
  bool expert;
  std::vector<int> spanned;
};
const std::vector<RefKind> kRefKinds = {
    {"tp", false, {TP}},
    {"cp", false, {CP}},
    {"dp", false, {DP}},
    {"dp_cp", false, {DP, CP}},
    {"pp", false, {PP}},
    {"mp", false, {TP, PP}},
    {"tp_cp", false, {TP, CP}},
    {"tp_dp", false, {TP, DP}},
    {"tp_dp_cp", false, {TP, DP, CP}},
    {"ep", true, {EP}},
    {"expert_tp", true, {TP}},
    {"expert_dp", true, {DP}},
    {"tp_ep", true, {TP, EP}},
    {"tp_ep_pp", true, {TP, EP, PP}},
};

std::string str(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}
std::string str(const Groups& g) {
  std::string s = "[";
  for (size_t i = 0; i < g.size(); ++i) s += (i ? "," : "") + str(g[i]);
  return s + "]";
}

std::string describe(const ParallelConfig& c, int world) {
  return fmt::format("world {} TP{} PP{} CP{} EP{} ETP{} VPP{} order {}", world, c.tensor,
                     c.pipeline, c.context, c.expert, c.expert_tensor, c.virtual_pipeline, c.order);
}

// Returns "" when every group, index, position and coordinate matches the reference, else the first
// difference.
std::string mismatch(const GridLayout& g, const RefGenerator& dense, const RefGenerator& expert) {
  const int world = g.world_size();
  for (const RefKind& rk : kRefKinds) {
    const RefGenerator& ref = rk.expert ? expert : dense;
    const GroupKind kind = group_kind_from_name(rk.name);
    const Groups want = ref.groups(rk.spanned);
    if (g.groups(kind) != want)
      return fmt::format("{} groups {} != {}", rk.name, str(g.groups(kind)), str(want));
    if (g.group_size(kind) != static_cast<int>(want[0].size()))
      return fmt::format("{} size", rk.name);
    for (int r = 0; r < world; ++r) {
      const auto mine = ref.group(r, rk.spanned);
      const int index = static_cast<int>(std::find(want.begin(), want.end(), mine) - want.begin());
      const int pos = static_cast<int>(std::find(mine.begin(), mine.end(), r) - mine.begin());
      if (g.group_of(kind, r) != mine || g.group_index(kind, r) != index ||
          g.rank_in_group(kind, r) != pos)
        return fmt::format("{} of rank {}", rk.name, r);
    }
  }
  // Embedding groups: the first and last rank of each pipeline group (first only when PP = 1).
  const Groups pp = dense.groups({PP});
  Groups emb, pos_emb;
  for (const auto& p : pp) {
    emb.push_back(p.size() == 1 ? std::vector<int>{p[0]} : std::vector<int>{p.front(), p.back()});
    pos_emb.push_back({p[0]});
  }
  if (g.groups(GroupKind::Embedding) != emb)
    return "embedding groups " + str(g.groups(GroupKind::Embedding));
  if (g.groups(GroupKind::PositionEmbedding) != pos_emb) return "position_embedding groups";
  for (int r = 0; r < world; ++r) {
    const auto& c = dense.coord[r];
    const auto& e = expert.coord[r];
    if (g.tp_rank(r) != c[TP] || g.cp_rank(r) != c[CP] || g.dp_rank(r) != c[DP] ||
        g.pp_rank(r) != c[PP] || g.ep_rank(r) != e[EP] || g.expert_tp_rank(r) != e[TP] ||
        g.expert_dp_rank(r) != e[DP])
      return fmt::format("coordinates of rank {}", r);
    const bool first = c[PP] == 0, last = c[PP] == g.pp_size() - 1;
    if (g.is_first_stage(r) != first || g.is_last_stage(r) != last) return "stage flags";
    const int emb_index = g.group_index(GroupKind::Embedding, r);
    if ((emb_index >= 0) != (first || last) ||
        (emb_index < 0) != g.group_of(GroupKind::Embedding, r).empty())
      return fmt::format("embedding membership of rank {}", r);
    if ((g.group_index(GroupKind::PositionEmbedding, r) >= 0) != first)
      return fmt::format("position embedding membership of rank {}", r);
    if (g.rank_at(c[TP], c[CP], c[DP], c[PP]) != r) return fmt::format("rank_at of rank {}", r);
  }
  return "";
}

// Groups of every kind are disjoint and (except the embedding kinds) cover the world.
std::string partition_problem(const GridLayout& g) {
  for (GroupKind kind : kGroupKinds) {
    std::vector<int> seen(g.world_size(), 0);
    for (const auto& grp : g.groups(kind)) {
      if (static_cast<int>(grp.size()) != g.group_size(kind))
        return "uneven " + std::string(group_kind_name(kind));
      for (int r : grp) seen[r]++;
    }
    const bool partial = kind == GroupKind::Embedding || kind == GroupKind::PositionEmbedding;
    for (int n : seen)
      if (n > 1 || (!partial && n != 1))
        return "not a partition: " + std::string(group_kind_name(kind));
  }
  return "";
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The message of the ConfigError `config` raises, or "" if it is accepted.
std::string config_error(const ParallelConfig& config, int world) {
  try {
    GridLayout g(config, world);
  } catch (const ConfigError& e) {
    std::string constructed = e.what();
    try {
      GridLayout::validate(config, world);
    } catch (const ConfigError& v) {
      CHECK(std::string(v.what()) == constructed);  // validate() and the constructor agree
    }
    return constructed;
  }
  CHECK_NOTHROW(GridLayout::validate(config, world));
  return "";
}

GridLayout layout(int world, ParallelConfig c) { return GridLayout(c, world); }

}  // namespace

// ---- the exhaustive sweep
// --------------------------------------------------------------------------

TEST_CASE("grid: every valid TP/PP/CP/EP/expert-TP on world sizes 1..16 matches the reference",
          "[grid]") {
  int valid = 0, invalid = 0;
  for (int world = 1; world <= 16; ++world) {
    for (const char* order : {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"}) {
      for (int tp : divisors(world))
        for (int pp : divisors(world / tp))
          for (int cp : divisors(world / tp / pp))
            for (int ep : divisors(world))
              for (int etp_field : [&] {
                     auto d = divisors(world);
                     d.insert(d.begin(), 0);
                     return d;
                   }()) {
                const ParallelConfig c{.tensor = tp,
                                       .pipeline = pp,
                                       .context = cp,
                                       .expert = ep,
                                       .expert_tensor = etp_field,
                                       .order = order};
                const int etp = etp_field ? etp_field : tp;
                const int dp = world / (tp * pp * cp);
                INFO(describe(c, world));
                if (world % (etp * ep * pp) != 0) {
                  CHECK(config_error(c, world) != "");
                  ++invalid;
                  continue;
                }
                const int edp = world / (etp * ep * pp);
                const RefGenerator dense(order, {tp, cp, 1, dp, pp});
                const RefGenerator expert(order, {etp, 1, ep, edp, pp});
                // Megatron-Core: with pp not last, PP > 1 needs equal DP for dense and expert
                // layers, and both generators must give the same pipeline groups.
                const bool pp_last = std::string(order).ends_with("pp");
                if (!pp_last && pp > 1 &&
                    (edp != dp || dense.groups({PP}) != expert.groups({PP}))) {
                  CHECK(config_error(c, world) != "");
                  ++invalid;
                  continue;
                }
                const GridLayout g(c, world);
                CHECK(g.dp_size() == dp);
                CHECK(g.expert_dp_size() == edp);
                CHECK(mismatch(g, dense, expert) == "");
                CHECK(partition_problem(g) == "");
                ++valid;
              }
    }
  }
  // Sanity of the sweep itself: it covered many layouts and rejected some.
  CHECK(valid > 3000);
  CHECK(invalid > 5000);
}

TEST_CASE("grid: coordinates round-trip and sizes multiply to the world", "[grid]") {
  for (int world : {1, 6, 12, 16}) {
    for (int tp : divisors(world))
      for (int pp : divisors(world / tp))
        for (int cp : divisors(world / tp / pp)) {
          const GridLayout g = layout(world, {.tensor = tp, .pipeline = pp, .context = cp});
          INFO("world " << world << " TP" << tp << " PP" << pp << " CP" << cp);
          REQUIRE(g.tp_size() * g.cp_size() * g.dp_size() * g.pp_size() == world);
          REQUIRE(g.expert_tp_size() * g.ep_size() * g.expert_dp_size() * g.pp_size() == world);
          std::vector<int> hit(world, 0);
          for (int t = 0; t < tp; ++t)
            for (int c = 0; c < cp; ++c)
              for (int d = 0; d < g.dp_size(); ++d)
                for (int p = 0; p < pp; ++p) {
                  const int r = g.rank_at(t, c, d, p);
                  REQUIRE(r >= 0);
                  REQUIRE(r < world);
                  hit[r]++;
                  REQUIRE(g.tp_rank(r) == t);
                  REQUIRE(g.cp_rank(r) == c);
                  REQUIRE(g.dp_rank(r) == d);
                  REQUIRE(g.pp_rank(r) == p);
                  // Default order: rank = tp + cp·TP + dp·TP·CP + pp·TP·CP·DP.
                  REQUIRE(r == t + c * tp + d * tp * cp + p * tp * cp * g.dp_size());
                }
          REQUIRE(std::count(hit.begin(), hit.end(), 1) == world);
        }
  }
  const GridLayout g = layout(8, {.tensor = 2});
  REQUIRE_THROWS_AS(g.rank_at(2, 0, 0, 0), ValueError);
  REQUIRE_THROWS_AS(g.tp_rank(8), ValueError);
  REQUIRE_THROWS_AS(g.group_of(GroupKind::Dp, -1), ValueError);
}

// ---- hand-written tables
// ---------------------------------------------------------------------------

TEST_CASE("grid: world 8, TP2 PP2", "[grid]") {
  const GridLayout g = layout(8, {.tensor = 2, .pipeline = 2});
  CHECK(g.dp_size() == 2);
  CHECK(g.groups(GroupKind::Tp) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(g.groups(GroupKind::Pp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(g.groups(GroupKind::Dp) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(g.groups(GroupKind::DpCp) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(g.groups(GroupKind::Cp) == Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  CHECK(g.groups(GroupKind::Mp) == Groups{{0, 1, 4, 5}, {2, 3, 6, 7}});
  CHECK(g.groups(GroupKind::TpDpCp) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(g.groups(GroupKind::Embedding) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(g.groups(GroupKind::PositionEmbedding) == Groups{{0}, {1}, {2}, {3}});
  // Expert-TP defaults to TP and EP = 1, so expert groups mirror the dense ones.
  CHECK(g.groups(GroupKind::ExpertTp) == g.groups(GroupKind::Tp));
  CHECK(g.groups(GroupKind::ExpertDp) == g.groups(GroupKind::Dp));
  CHECK(g.group_of(GroupKind::Dp, 5) == std::vector<int>{5, 7});
  CHECK(g.group_index(GroupKind::Dp, 5) == 3);
  CHECK(g.rank_in_group(GroupKind::Dp, 7) == 1);
  CHECK(g.group_index(GroupKind::PositionEmbedding, 5) == -1);
  CHECK(g.group_of(GroupKind::PositionEmbedding, 5).empty());
  CHECK(g.order() == "tp-cp-ep-dp-pp");
}

TEST_CASE("grid: Megatron-Core's documented examples", "[grid]") {
  SECTION("16 GPUs, TP2 PP4 (initialize_model_parallel docstring)") {
    const GridLayout g = layout(16, {.tensor = 2, .pipeline = 4});
    CHECK(g.groups(GroupKind::Dp) ==
          Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
    CHECK(g.groups(GroupKind::Tp) ==
          Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
    CHECK(g.groups(GroupKind::Pp) ==
          Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
    CHECK(g.groups(GroupKind::Embedding) == Groups{{0, 12}, {1, 13}, {2, 14}, {3, 15}});
    // Middle stages hold no embedding.
    CHECK(g.group_index(GroupKind::Embedding, 4) == -1);
    CHECK(g.group_of(GroupKind::Embedding, 9).empty());
    CHECK(g.group_of(GroupKind::Embedding, 13) == std::vector<int>{1, 13});
    CHECK(g.rank_in_group(GroupKind::Embedding, 13) == 1);
    CHECK(g.is_first_stage(3));
    CHECK(g.is_last_stage(14));
    CHECK_FALSE(g.is_last_stage(8));
  }
  SECTION("8 GPUs, TP4 CP2 (context_parallel_size docstring)") {
    const GridLayout g = layout(8, {.tensor = 4, .context = 2});
    CHECK(g.groups(GroupKind::Cp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
    CHECK(g.groups(GroupKind::Tp) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}});
    CHECK(g.dp_size() == 1);
    CHECK(g.groups(GroupKind::DpCp) == g.groups(GroupKind::Cp));
    CHECK(g.groups(GroupKind::TpCp) == Groups{{0, 1, 2, 3, 4, 5, 6, 7}});
  }
  SECTION("24 ranks, sizes [2, 3, 4] (generate_masked_orthogonal_rank_groups docstring)") {
    const GridLayout g = layout(24, {.tensor = 2, .pipeline = 4});
    const auto& dp = g.groups(GroupKind::Dp);
    REQUIRE(dp.size() == 8);
    CHECK(dp[0] == std::vector<int>{0, 2, 4});
    CHECK(dp[1] == std::vector<int>{1, 3, 5});
    CHECK(dp[7] == std::vector<int>{19, 21, 23});
  }
}

TEST_CASE("grid: expert groups", "[grid]") {
  SECTION("world 8, TP2 EP2: expert-TP = TP") {
    const GridLayout g = layout(8, {.tensor = 2, .expert = 2});
    CHECK(g.expert_dp_size() == 2);
    CHECK(g.groups(GroupKind::Ep) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
    CHECK(g.groups(GroupKind::ExpertTp) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
    CHECK(g.groups(GroupKind::ExpertDp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
    CHECK(g.groups(GroupKind::TpEp) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}});
    CHECK(g.ep_rank(6) == 1);
    CHECK(g.expert_dp_rank(6) == 1);
  }
  SECTION("world 8, TP2, expert-TP1 EP4") {
    const GridLayout g = layout(8, {.tensor = 2, .expert = 4, .expert_tensor = 1});
    CHECK(g.groups(GroupKind::Ep) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}});
    CHECK(g.groups(GroupKind::ExpertDp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
    CHECK(g.groups(GroupKind::ExpertTp).size() == 8);
    CHECK(g.groups(GroupKind::Tp) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  }
  SECTION("world 8, TP2 CP2 EP2: expert parallelism folds CP in") {
    const GridLayout g = layout(8, {.tensor = 2, .context = 2, .expert = 2});
    CHECK(g.groups(GroupKind::Ep) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
    CHECK(g.groups(GroupKind::Cp) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
    CHECK(g.groups(GroupKind::ExpertDp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  }
  SECTION("world 16, TP2 PP2 EP2: expert groups stay inside a stage") {
    const GridLayout g = layout(16, {.tensor = 2, .pipeline = 2, .expert = 2});
    CHECK(g.groups(GroupKind::Ep) ==
          Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
    CHECK(g.groups(GroupKind::TpEpPp) ==
          Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}});
  }
}

TEST_CASE("grid: order tp-cp-ep-pp-dp and left-out dimensions", "[grid]") {
  const GridLayout g = layout(8, {.tensor = 2, .pipeline = 2, .order = "tp-cp-ep-pp-dp"});
  CHECK(g.groups(GroupKind::Pp) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(g.groups(GroupKind::Dp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(g.groups(GroupKind::Embedding) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  // Size-1 dimensions may be left out, and case does not matter; the spelled-out order appends
  // them.
  const GridLayout h = layout(8, {.tensor = 2, .pipeline = 2, .order = "TP-DP-PP"});
  CHECK(h.order() == "tp-dp-pp-ep-cp");
  for (GroupKind k : kGroupKinds)
    CHECK(h.groups(k) == layout(8, {.tensor = 2, .pipeline = 2}).groups(k));
}

TEST_CASE("grid: world 1 and PP1 embedding", "[grid]") {
  const GridLayout one = layout(1, {});
  for (GroupKind k : kGroupKinds) CHECK(one.groups(k) == Groups{{0}});
  const GridLayout g = layout(4, {.tensor = 2});
  CHECK(g.groups(GroupKind::Embedding) == Groups{{0}, {1}, {2}, {3}});
  CHECK(g.is_first_stage(3));
  CHECK(g.is_last_stage(3));
}

// ---- validation
// ------------------------------------------------------------------------------------

TEST_CASE("grid: invalid configs raise ConfigError that names the fix", "[grid]") {
  using Catch::Matchers::Contains;
  struct Case {
    ParallelConfig config;
    int world;
    std::vector<const char*> expect;
  };
  const std::vector<Case> cases = {
      {{.tensor = 4},
       6,
       {"world_size 6 is not divisible by TP(4)×PP(1)×CP(1)=4",
        "choose sizes whose product divides the world size"}},
      {{.tensor = 2, .pipeline = 2, .context = 2},
       12,
       {"world_size 12 is not divisible by TP(2)×PP(2)×CP(2)=8"}},
      {{.expert = 3},
       4,
       {"EP(3) must divide DP×CP(4)", "choose an expert-parallel size that divides 4"}},
      {{.tensor = 2, .expert = 2, .expert_tensor = 4},
       4,
       {"world_size 4 is not divisible by expert-TP(4)×EP(2)×PP(1)=8", "choose expert sizes"}},
      {{.tensor = 0}, 8, {"TP(0) must be >= 1", "ParallelConfig.tensor"}},
      {{.pipeline = -1}, 8, {"PP(-1) must be >= 1", "ParallelConfig.pipeline"}},
      {{.context = 0}, 8, {"CP(0) must be >= 1"}},
      {{.expert = 0}, 8, {"EP(0) must be >= 1"}},
      {{.virtual_pipeline = 0}, 8, {"VPP(0) must be >= 1"}},
      {{.expert_tensor = -2}, 8, {"expert-TP(-2) must be >= 1", "or to 0 to use TP"}},
      {{.virtual_pipeline = 2},
       8,
       {"VPP(2) > 1 needs PP > 1", "set pipeline >= 2 or virtual_pipeline = 1"}},
      {{.order = "tp-xx-dp-pp"},
       8,
       {"unknown dimension 'xx' in order 'tp-xx-dp-pp'", "tp, cp, ep, dp, pp"}},
      {{.order = ""}, 8, {"unknown dimension '' in order ''"}},
      {{.order = "tp-cp--dp-pp"}, 8, {"unknown dimension ''"}},
      {{.order = "tp-dp-tp-pp"}, 8, {"order 'tp-dp-tp-pp' names tp twice"}},
      {{.pipeline = 2, .order = "tp-dp"},
       8,
       {"order 'tp-dp' leaves out pp but PP(2) > 1", "add pp to the order"}},
      {{.expert = 2, .order = "tp-cp-dp-pp"}, 8, {"leaves out ep but EP(2) > 1"}},
      {{.order = "tp-cp-ep-pp"}, 8, {"leaves out dp but DP(8) > 1"}},
      {{.tensor = 1, .expert = 2, .expert_tensor = 2, .order = "cp-ep-dp-pp"},
       8,
       {"leaves out tp but expert-TP(2) > 1"}},
      {{.pipeline = 2, .expert = 2, .order = "tp-cp-ep-pp-dp"},
       8,
       {"pp not last in order 'tp-cp-ep-pp-dp'", "expert-DP is 2 and DP is 4", "put pp last"}},
      {{.pipeline = 2, .context = 2, .expert = 2, .order = "tp-ep-pp-dp-cp"},
       8,
       {"different pipeline groups under order 'tp-ep-pp-dp-cp'", "put pp last in the order"}},
      {{}, 0, {"world_size 0 must be >= 1"}},
  };
  for (const Case& c : cases) {
    INFO(describe(c.config, c.world));
    const std::string msg = config_error(c.config, c.world);
    REQUIRE_FALSE(msg.empty());
    for (const char* part : c.expect) CHECK_THAT(msg, Contains(part));
  }
  // EP may span CP: EP(4) divides DP×CP = 1×4 even though it does not divide DP.
  CHECK(config_error({.tensor = 2, .context = 2, .expert = 4}, 8).empty());
  // ConfigError is a ValueError, so callers that catch ValueError see it too.
  REQUIRE_THROWS_AS(layout(6, {.tensor = 4}), ConfigError);
  REQUIRE_THROWS_AS(layout(6, {.tensor = 4}), ValueError);
}

// ---- names and table
// -------------------------------------------------------------------------------

TEST_CASE("grid: group kind names round-trip", "[grid]") {
  for (GroupKind k : kGroupKinds) CHECK(group_kind_from_name(group_kind_name(k)) == k);
  CHECK(group_kind_name(GroupKind::DpCp) == "dp_cp");
  CHECK(group_kind_name(GroupKind::Mp) == "mp");
  CHECK(group_kind_name(GroupKind::PositionEmbedding) == "position_embedding");
  try {
    group_kind_from_name("data");
    FAIL("no error");
  } catch (const ValueError& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("unknown group kind 'data'") &&
                             Catch::Matchers::Contains("expert_dp"));
  }
}

TEST_CASE("grid: table lists every rank with its coordinates", "[grid]") {
  const GridLayout g = layout(8, {.tensor = 2, .pipeline = 2, .expert = 2});
  const std::string t = g.table();
  CHECK_THAT(t,
             Catch::Matchers::Contains("world 8: TP 2 × CP 1 × DP 2 × PP 2 (order tp-cp-ep-dp-pp"));
  CHECK_THAT(t, Catch::Matchers::Contains("expert-TP 2 × EP 2 × expert-DP 1 × PP 2"));
  // Header + column line + one line per rank.
  CHECK(std::count(t.begin(), t.end(), '\n') == 3 + 8);
  // rank 7: tp 1, cp 0, dp 1, pp 1, ep 1, etp 1, edp 0, last stage
  CHECK_THAT(t, Catch::Matchers::Contains("    7    1    0    1    1    1    1    0  last\n"));
  CHECK_THAT(t, Catch::Matchers::Contains("    0    0    0    0    0    0    0    0  first\n"));
}
