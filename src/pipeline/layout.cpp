#include "megacore/pipeline/layout.hpp"

#include <fmt/format.h>

#include <numeric>
#include <utility>

#include "megacore/core/error.hpp"

namespace megacore::pipeline {

namespace {

void check_sizes(int64_t num_layers, int pp, int vp) {
  MC_CHECK_AS(ConfigError, num_layers >= 1, "num_layers is {}; a pipelined model needs at least one layer",
              num_layers);
  MC_CHECK_AS(ConfigError, pp >= 1, "pipeline_parallel is {}; it must be >= 1 (1 = no pipelining)", pp);
  MC_CHECK_AS(ConfigError, vp >= 1, "virtual_stages is {}; it must be >= 1 (1 = no interleaving)", vp);
}

}  // namespace

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
