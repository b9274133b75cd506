#include "megacore/pipeline/layout.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "megacore/core/error.hpp"
#include "megacore/model/transformer_config.hpp"

namespace megacore::pipeline {

namespace {

void check_sizes(int64_t num_layers, int pp, int vp) {
  MC_CHECK_AS(ConfigError, num_layers >= 1, "num_layers is {}; a pipelined model needs at least one layer",
              num_layers);
  MC_CHECK_AS(ConfigError, pp >= 1, "pipeline_parallel is {}; it must be >= 1 (1 = no pipelining)", pp);
  MC_CHECK_AS(ConfigError, vp >= 1, "virtual_stages is {}; it must be >= 1 (1 = no interleaving)", vp);
}

// Block recompute is a property of full recompute; anything else would price (and train) a different model.
void check_block_recompute(const model::TransformerConfig& cfg, int64_t recompute_num_layers) {
  MC_CHECK_AS(ConfigError,
              recompute_num_layers < 0 || cfg.recompute_granularity == model::RecomputeGranularity::Full,
              "recompute_num_layers {} limits full recompute to the first layers of each model chunk, but the "
              "model's recompute granularity is {}; use full recompute, or recompute_num_layers -1",
              recompute_num_layers, model::recompute_granularity_name(cfg.recompute_granularity));
}

}  // namespace

double layers_cost(int64_t layers, int64_t recompute_num_layers) {
  if (recompute_num_layers < 0) return double(layers);
  // A recomputed layer runs its forward, a third of its forward + backward, once more.
  return double(layers) + double(std::min(layers, recompute_num_layers)) / 3.0;
}

PipelineLayout::PipelineLayout(int64_t num_layers, int pp, int vp, std::vector<int64_t> counts)
    : num_layers_(num_layers), pp_(pp), vp_(vp), counts_(std::move(counts)), starts_(counts_.size()) {
  std::exclusive_scan(counts_.begin(), counts_.end(), starts_.begin(), int64_t{0});
}

PipelineLayout PipelineLayout::uniform(int64_t num_layers, int pipeline_parallel, int virtual_stages) {
  check_sizes(num_layers, pipeline_parallel, virtual_stages);
  const int64_t stages = int64_t{pipeline_parallel} * virtual_stages;
  MC_CHECK_AS(ConfigError, num_layers % stages == 0,
              "num_layers {} is not divisible by pipeline_parallel × virtual_stages = {} × {} = {}; choose "
              "sizes whose product divides {}, or give an explicit per-stage layout (layer counts in model "
              "order summing to {})",
              num_layers, pipeline_parallel, virtual_stages, stages, num_layers, num_layers);
  return PipelineLayout(num_layers, pipeline_parallel, virtual_stages,
                        std::vector<int64_t>(static_cast<size_t>(stages), num_layers / stages));
}

PipelineLayout PipelineLayout::from_counts(int64_t num_layers, int pipeline_parallel, int virtual_stages,
                                           std::vector<int64_t> counts) {
  check_sizes(num_layers, pipeline_parallel, virtual_stages);
  const int64_t stages = int64_t{pipeline_parallel} * virtual_stages;
  MC_CHECK_AS(ConfigError, static_cast<int64_t>(counts.size()) == stages,
              "pipeline layout has {} entries but pipeline_parallel × virtual_stages = {} × {} = {} stages "
              "need one each; give {} layer counts in model order (entry chunk·PP + pp_rank)",
              counts.size(), pipeline_parallel, virtual_stages, stages, stages);
  for (size_t s = 0; s < counts.size(); ++s) {
    MC_CHECK_AS(ConfigError, counts[s] >= 0,
                "pipeline layout entry {} (pp_rank {}, virtual chunk {}) is {}; layer counts must be >= 0",
                s, s % pipeline_parallel, s / pipeline_parallel, counts[s]);
  }
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total != num_layers) {
    raise<ConfigError>(
        "pipeline layout assigns {} layers but the model has {}; make the per-stage counts sum to {} "
        "({} {} layer{}), or the run would train a different model than configured",
        total, num_layers, num_layers, total < num_layers ? "add" : "remove",
        total < num_layers ? num_layers - total : total - num_layers,
        (total < num_layers ? num_layers - total : total - num_layers) == 1 ? "" : "s");
  }
  return PipelineLayout(num_layers, pipeline_parallel, virtual_stages, std::move(counts));
}

PipelineLayout PipelineLayout::balanced(int64_t num_layers, int pipeline_parallel, int virtual_stages,
                                       StageCosts costs) {
  check_sizes(num_layers, pipeline_parallel, virtual_stages);
  MC_CHECK_AS(ConfigError, std::isfinite(costs.embedding) && costs.embedding >= 0,
              "balanced pipeline layout: embedding cost is {}; give it in layers, >= 0", costs.embedding);
  MC_CHECK_AS(ConfigError, std::isfinite(costs.head) && costs.head >= 0,
              "balanced pipeline layout: head cost is {}; give it in layers, >= 0", costs.head);
  const size_t stages = size_t(pipeline_parallel) * size_t(virtual_stages);
  std::vector<double> extra(stages, 0.0);
  extra.front() += costs.embedding;
  extra.back() += costs.head;
  const int64_t recomputed = costs.recompute_num_layers;
  auto cost = [&](int64_t n) { return layers_cost(n, recomputed); };
  // Layers a stage can take under a cost bound t (a small slack absorbs rounding of t - extra).
  auto capacity = [&](double t, size_t s) {
    if (recomputed < 0) {
      const double c = std::floor(t - extra[s] + 1e-9);
      return c < 0 ? int64_t{0} : int64_t(c);
    }
    // The cost is not linear in the layers here; no stage needs more than all of them.
    int64_t n = 0;
    while (n < num_layers && cost(n + 1) <= t - extra[s] + 1e-9) ++n;
    return n;
  };
  auto fits = [&](double t) {
    int64_t n = 0;
    for (size_t s = 0; s < stages; ++s) n += capacity(t, s);
    return n >= num_layers;
  };
  // The optimum is cost(n) + extra[s] for some stage s and layer count n: the smallest feasible one.
  std::vector<double> candidates;
  for (size_t s = 0; s < stages; ++s)
    for (int64_t n = 0; n <= num_layers; ++n) candidates.push_back(cost(n) + extra[s]);
  std::sort(candidates.begin(), candidates.end());
  const auto best = std::partition_point(candidates.begin(), candidates.end(), [&](double t) { return !fits(t); });
  const double bound = best == candidates.end() ? cost(num_layers) + extra.back() : *best;
  std::vector<int64_t> counts(stages);
  int64_t total = 0;
  for (size_t s = 0; s < stages; ++s) total += counts[s] = capacity(bound, s);
  // Take the surplus off the costliest stages; among equals the earliest, which under 1F1B holds the most
  // micro-batches' activations.
  while (total > num_layers) {
    size_t pick = stages;
    for (size_t s = 0; s < stages; ++s) {
      if (counts[s] == 0) continue;
      if (pick == stages || cost(counts[s]) + extra[s] > cost(counts[pick]) + extra[pick]) pick = s;
    }
    --counts[pick];
    --total;
  }
  return from_counts(num_layers, pipeline_parallel, virtual_stages, std::move(counts));
}

StageCosts stage_costs_from_model(const model::TransformerConfig& cfg, int64_t seq_len, int tp,
                                  int64_t recompute_num_layers) {
  MC_CHECK_AS(ConfigError, cfg.num_layers >= 1 && tp >= 1,
              "stage_costs_from_model: needs num_layers >= 1 and TP >= 1 (got {}, {})", cfg.num_layers, tp);
  check_block_recompute(cfg, recompute_num_layers);
  const bool block = recompute_num_layers >= 0;
  const model::FlopsPerToken f = model::flops_per_token(cfg, seq_len, /*causal=*/true);
  // Forward FLOPs are a third of fwd + bwd; recompute runs (part of) the forward again in the backward. Under
  // block recompute the unit stays a plain layer and layers_cost adds the recomputed layers' third.
  double attention = f.attention, weights = f.dense - f.output_layer;
  if (cfg.recompute_granularity == model::RecomputeGranularity::Full && !block) {
    attention *= 4.0 / 3.0;
    weights *= 4.0 / 3.0;
  } else if (cfg.recompute_granularity == model::RecomputeGranularity::Selective) {
    attention *= 4.0 / 3.0;
  }
  const double per_layer = (weights + attention) / double(cfg.num_layers);
  // TP splits a layer's matmuls and the vocabulary alike; only the padding of the vocabulary is extra.
  const double head = f.output_layer * double(model::padded_vocab_size(cfg, tp)) / double(cfg.vocab_size);
  return {0.0, head / per_layer, block ? recompute_num_layers : -1};
}

StageCosts resolve_stage_costs(StageCosts requested, const model::TransformerConfig& cfg, int64_t seq_len, int tp) {
  check_block_recompute(cfg, requested.recompute_num_layers);
  if (requested.embedding >= 0 && requested.head >= 0) return requested;
  const StageCosts derived = stage_costs_from_model(cfg, seq_len, tp, requested.recompute_num_layers);
  if (requested.embedding < 0) requested.embedding = derived.embedding;
  if (requested.head < 0) requested.head = derived.head;
  return requested;
}

PipelineLayout choose_layout(int64_t num_layers, int pipeline_parallel, int virtual_stages,
                             std::vector<int64_t> counts, StageCosts costs) {
  if (!counts.empty()) return PipelineLayout::from_counts(num_layers, pipeline_parallel, virtual_stages, std::move(counts));
  if (costs.embedding == 0 && costs.head == 0) return PipelineLayout::uniform(num_layers, pipeline_parallel, virtual_stages);
  PipelineLayout by_stage = PipelineLayout::balanced(num_layers, pipeline_parallel, virtual_stages, costs);
  if (virtual_stages == 1) return by_stage;
  // A rank runs all its chunks for every micro-batch, so its total sets the steady-state pace. When the head
  // outweighs a virtual stage (Llama 3.2 1B at PP 4 × VP 2: 4 layers of head against 2-layer chunks) evening
  // out the virtual stages leaves the ranks uneven (4, 5, 5, 6); then balance the ranks' totals instead and
  // split each rank's layers over its chunks, its own embedding/head counted (5, 5, 5, 5 + head).
  // Under block recompute a rank recomputes the first N layers of each of its VP chunks.
  StageCosts rank_costs = costs;
  if (costs.recompute_num_layers >= 0) rank_costs.recompute_num_layers = costs.recompute_num_layers * virtual_stages;
  const PipelineLayout by_rank = PipelineLayout::balanced(num_layers, pipeline_parallel, 1, rank_costs);
  std::vector<int64_t> split(size_t(pipeline_parallel) * size_t(virtual_stages), 0);
  for (int r = 0; r < pipeline_parallel; ++r) {
    const int64_t n = by_rank.counts()[size_t(r)];
    if (n == 0) continue;
    const StageCosts own{r == 0 ? costs.embedding : 0.0, r == pipeline_parallel - 1 ? costs.head : 0.0,
                         costs.recompute_num_layers};
    const PipelineLayout chunks = PipelineLayout::balanced(n, 1, virtual_stages, own);
    for (int c = 0; c < virtual_stages; ++c) split[size_t(c) * size_t(pipeline_parallel) + size_t(r)] = chunks.counts()[size_t(c)];
  }
  PipelineLayout ranks = PipelineLayout::from_counts(num_layers, pipeline_parallel, virtual_stages, std::move(split));
  auto worst = [&](const PipelineLayout& l) {
    const std::vector<double> w = rank_work(l, costs);
    return *std::max_element(w.begin(), w.end());
  };
  return worst(ranks) < worst(by_stage) - 1e-9 ? ranks : by_stage;
}

std::vector<double> rank_work(const PipelineLayout& layout, StageCosts costs) {
  const int pp = layout.pipeline_parallel(), vp = layout.virtual_stages();
  std::vector<double> work(static_cast<size_t>(pp));
  const int64_t recomputed = costs.recompute_num_layers;
  for (int r = 0; r < pp; ++r) {
    if (recomputed < 0) work[size_t(r)] = double(layout.num_layers_on_rank(r));
    for (int c = 0; c < vp; ++c) {
      if (recomputed >= 0) work[size_t(r)] += layers_cost(layout.range(r, c).count, recomputed);
      if (layout.has_embedding(r, c)) work[size_t(r)] += costs.embedding;
      if (layout.has_head(r, c)) work[size_t(r)] += costs.head;
    }
  }
  return work;
}

std::string describe_layout(const PipelineLayout& layout, StageCosts costs) {
  auto join = [](const auto& v, const char* f) {
    std::string out;
    for (const auto& x : v) out += (out.empty() ? "" : ", ") + fmt::format(fmt::runtime(f), x);
    return out;
  };
  std::string s = layout.virtual_stages() > 1
                      ? fmt::format("layers per virtual stage (model order): {}; per stage: ", join(layout.counts(), "{}"))
                      : std::string("layers per stage: ");
  std::vector<int64_t> per_rank;
  for (int r = 0; r < layout.pipeline_parallel(); ++r) per_rank.push_back(layout.num_layers_on_rank(r));
  s += join(per_rank, "{}");
  std::string extra;
  if (costs.embedding > 0) extra = fmt::format("embedding ≈ {:.1f}", costs.embedding);
  if (costs.head > 0) extra += fmt::format("{}head ≈ {:.1f}", extra.empty() ? "" : ", ", costs.head);
  if (!extra.empty()) {
    const int64_t n = costs.recompute_num_layers;
    const std::string block =
        n < 0 ? "" : fmt::format(", first {} layer{} per chunk recomputed: 4/3", n, n == 1 ? "" : "s");
    s += fmt::format(" ({} layers{}; work per stage {})", extra, block, join(rank_work(layout, costs), "{:.1f}"));
  }
  return s;
}

StageCosts stage_costs_from_profile(const PipelineLayout& layout, const std::vector<double>& busy_per_rank,
                                    int64_t recompute_num_layers) {
  const int pp = layout.pipeline_parallel();
  MC_CHECK(int64_t(busy_per_rank.size()) == pp,
           "stage_costs_from_profile: {} busy times for a layout of {} pipeline ranks; give one per rank",
           busy_per_rank.size(), pp);
  for (double b : busy_per_rank)
    MC_CHECK(std::isfinite(b) && b > 0, "stage_costs_from_profile: busy time {} is not a positive time", b);
  if (pp == 1) return {0.0, 0.0, recompute_num_layers < 0 ? -1 : recompute_num_layers};
  // Each rank's layers in StageCosts units (its block-recomputed layers dearer).
  const std::vector<double> units = rank_work(layout, {0.0, 0.0, recompute_num_layers});
  std::vector<double> per_layer;
  for (int r = (pp == 2 ? 0 : 1); r < (pp == 2 ? 1 : pp - 1); ++r) {
    if (units[size_t(r)] > 0) per_layer.push_back(busy_per_rank[size_t(r)] / units[size_t(r)]);
  }
  MC_CHECK(!per_layer.empty(),
           "stage_costs_from_profile: the profiled layout has no layers on the ranks that measure one layer's "
           "cost (the middle ranks, or rank 0 with PP 2); profile with an even layout");
  std::sort(per_layer.begin(), per_layer.end());
  const size_t k = per_layer.size();
  const double unit = k % 2 ? per_layer[k / 2] : 0.5 * (per_layer[k / 2 - 1] + per_layer[k / 2]);
  auto excess = [&](int r) {
    return std::max(0.0, busy_per_rank[size_t(r)] / unit - units[size_t(r)]);
  };
  StageCosts c;
  c.recompute_num_layers = recompute_num_layers < 0 ? -1 : recompute_num_layers;
  c.embedding = pp == 2 ? 0.0 : excess(0);
  c.head = excess(pp - 1);
  return c;
}

void PipelineLayout::check_position(int pp_rank, int chunk) const {
  MC_CHECK(pp_rank >= 0 && pp_rank < pp_, "pp_rank {} is out of range [0, {})", pp_rank, pp_);
  MC_CHECK(chunk >= 0 && chunk < vp_, "virtual chunk {} is out of range [0, {})", chunk, vp_);
}

LayerRange PipelineLayout::range(int pp_rank, int chunk) const {
  check_position(pp_rank, chunk);
  const size_t s = static_cast<size_t>(chunk) * pp_ + pp_rank;
  return {starts_[s], counts_[s]};
}

std::vector<int64_t> PipelineLayout::layer_indices(int pp_rank, int chunk) const {
  const LayerRange r = range(pp_rank, chunk);
  std::vector<int64_t> out(static_cast<size_t>(r.count));
  std::iota(out.begin(), out.end(), r.first);
  return out;
}

int64_t PipelineLayout::num_layers_on_rank(int pp_rank) const {
  int64_t n = 0;
  for (int c = 0; c < vp_; ++c) n += range(pp_rank, c).count;
  return n;
}

}  // namespace megacore::pipeline
