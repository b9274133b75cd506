// Stage partitioning: which transformer layers each pipeline stage (and each virtual chunk) holds.
//
// A model with PP pipeline ranks and VP virtual chunks per rank is cut into PP × VP "virtual stages",
// numbered in model order s = chunk · PP + pp_rank (so with interleaving rank 0 holds stages 0, PP,
// 2·PP, ...). The word embedding lives on stage 0 (rank 0, chunk 0) and the output head on the last
// stage (rank PP − 1, chunk VP − 1), whatever the layer counts.
//
// Layers are split evenly by default, or by an explicit list of per-stage layer counts in model order,
// e.g. {5, 6, 6, 5} for PP = 4 so the stages carrying the embedding and the head get one layer fewer.
// Both are validated as a whole up front: a layout that does not cover the model exactly is refused
// (a run that silently trains 64 of 80 layers looks healthy and is wrong).
#pragma once

#include <cstdint>
#include <vector>

namespace megacore::pipeline {

/// A contiguous run of global layer indices [first, first + count).
struct LayerRange {
  int64_t first = 0;
  int64_t count = 0;
};

/// The assignment of layers to (pp_rank, virtual chunk). Immutable once built; always valid.
class PipelineLayout {
 public:
  /// num_layers / (PP × VP) layers per stage. ConfigError when the division is not exact, naming the fix.
  static PipelineLayout uniform(int64_t num_layers, int pipeline_parallel, int virtual_stages = 1);
  /// Explicit layer counts per virtual stage in model order (index s = chunk · PP + pp_rank).
  /// ConfigError unless there are exactly PP × VP counts, each >= 0, summing to num_layers.
  static PipelineLayout from_counts(int64_t num_layers, int pipeline_parallel, int virtual_stages,
                                    std::vector<int64_t> counts);

  int pipeline_parallel() const { return pp_; }
  int virtual_stages() const { return vp_; }
  int64_t num_layers() const { return num_layers_; }
  /// Per-virtual-stage counts in model order.
  const std::vector<int64_t>& counts() const { return counts_; }

  /// Layers held by (pp_rank, chunk); ValueError when either is out of range.
  LayerRange range(int pp_rank, int chunk) const;
  /// The global indices of those layers, ascending.
  std::vector<int64_t> layer_indices(int pp_rank, int chunk) const;
  /// Total layers on a pipeline rank over all its chunks.
  int64_t num_layers_on_rank(int pp_rank) const;
  /// Whether (pp_rank, chunk) is the first virtual stage, which owns the input embedding.
  bool has_embedding(int pp_rank, int chunk) const { return pp_rank == 0 && chunk == 0; }
  /// Whether (pp_rank, chunk) is the last virtual stage, which owns the output head and the loss.
  bool has_head(int pp_rank, int chunk) const { return pp_rank == pp_ - 1 && chunk == vp_ - 1; }

 private:
  PipelineLayout(int64_t num_layers, int pp, int vp, std::vector<int64_t> counts);
  void check_position(int pp_rank, int chunk) const;

  int64_t num_layers_;
  int pp_;
  int vp_;
  std::vector<int64_t> counts_;
  std::vector<int64_t> starts_;  // prefix sums of counts_, same indexing
};

}  // namespace megacore::pipeline
