// Stage partitioning: which transformer layers each pipeline stage (and each virtual chunk) holds.
//
// A model with PP pipeline ranks and VP virtual chunks per rank is cut into PP × VP "virtual stages",
// numbered in model order s = chunk · PP + pp_rank (so with interleaving rank 0 holds stages 0, PP,
// 2·PP, ...). The word embedding lives on stage 0 (rank 0, chunk 0) and the output head on the last
// stage (rank PP − 1, chunk VP − 1), whatever the layer counts.
//
// Layers are split evenly by default, or by an explicit list of per-stage layer counts in model order,
// e.g. {5, 6, 6, 5} for PP = 4 so the stages carrying the embedding and the head get one layer fewer.
// A third way balances the stages for the extra work of the first and last stage (the embedding, and
// the output layer + loss, which with a large vocabulary costs about as much as a layer or two):
// `balanced` takes those costs in units of one transformer layer, and `stage_costs_from_profile`
// measures them from one profiled step with any layout (per-rank compute times). Block recompute (only the
// first N layers of each virtual stage recomputed) makes those layers dearer than the rest, and StageCosts
// carries N so that the split counts it. The theoretical
// bubble (PP − 1)/(m + PP − 1) holds for equal stages; with the uniform split the last stage is the
// bottleneck and every other stage waits on it.
// Both are validated as a whole up front: a layout that does not cover the model exactly is refused
// (a run that silently trains 64 of 80 layers looks healthy and is wrong).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace megacore::model {
struct TransformerConfig;
}

namespace megacore::pipeline {

/// A contiguous run of global layer indices [first, first + count).
struct LayerRange {
  int64_t first = 0;
  int64_t count = 0;
};

/// The cost model of the virtual stages: the extra work of the first and last one, in units of one transformer
/// layer's compute, and which layers of each stage run their forward again (block recompute).
///
/// With `recompute_num_layers` N >= 0 (trainer.recompute_num_layers under full recompute) only the first N layers
/// of each virtual stage are recomputed, so a stage of n layers costs n + min(n, N)/3 units (the forward is a third
/// of a layer's forward + backward) and the unit is a layer that is not recomputed. With N < 0 every layer costs
/// one unit, whatever the recompute (stage_costs_from_model folds it into the unit).
struct StageCosts {
  double embedding = 0;               ///< the input embedding (first stage)
  double head = 0;                    ///< the final norm, output layer and loss (last stage)
  int64_t recompute_num_layers = -1;  ///< recomputed layers at the start of each virtual stage; < 0: no block recompute
};

/// The work of one virtual stage's `layers` layers, in StageCosts units: `layers`, plus a third of a layer for each
/// of the first `recompute_num_layers` (when >= 0) that block recompute runs forward again.
double layers_cost(int64_t layers, int64_t recompute_num_layers);

/// A StageCosts entry with this value (any negative one) asks for the cost derived from the model's shape.
inline constexpr double kAutoStageCost = -1.0;

/// The assignment of layers to (pp_rank, virtual chunk). Immutable once built; always valid.
class PipelineLayout {
 public:
  /// num_layers / (PP × VP) layers per stage. ConfigError when the division is not exact, naming the fix.
  static PipelineLayout uniform(int64_t num_layers, int pipeline_parallel, int virtual_stages = 1);
  /// Explicit layer counts per virtual stage in model order (index s = chunk · PP + pp_rank).
  /// ConfigError unless there are exactly PP × VP counts, each >= 0, summing to num_layers.
  static PipelineLayout from_counts(int64_t num_layers, int pipeline_parallel, int virtual_stages,
                                    std::vector<int64_t> counts);

  /// The counts that minimise the largest stage cost (layers_cost of its layers + the stage's extra from
  /// `costs`); among those, layers are taken off the costliest stages first (ties: the earlier stage, which
  /// under 1F1B holds the most micro-batches' activations). ConfigError for negative or non-finite costs.
  /// With VP > 1 it evens out the virtual stages (what each schedule slot costs), not per-rank totals.
  /// Example: 15 layers, PP 4, head ≈ 0.9 layer → {4, 4, 4, 3}.
  static PipelineLayout balanced(int64_t num_layers, int pipeline_parallel, int virtual_stages, StageCosts costs);

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

/// The embedding and head costs, in layers, from the model's shape: training matmul FLOPs per token of the
/// output layer (model::flops_per_token's `output_layer`, fwd + bwd, over the padded vocabulary of a TP rank,
/// tied or not) over those of the average transformer layer (weights + causal attention, plus the forward
/// that `cfg.recompute_granularity` repeats: all of it for full recompute, the attention for selective). The
/// embedding lookup, the cross-entropy and the norms do no matmul work, so the embedding cost is 0 and the
/// head is the output layer's GEMMs; where their memory traffic matters, measure with
/// `stage_costs_from_profile`. Llama 3.2 1B (vocab 128256, h2048, seq 2048, no recompute): head ≈ 4.0.
/// `recompute_num_layers` N >= 0 (full recompute only, else ConfigError) is block recompute: the unit is then a
/// layer without recompute, and the result carries N so that each stage's first N layers cost 4/3 of it.
StageCosts stage_costs_from_model(const model::TransformerConfig& cfg, int64_t seq_len, int tp,
                                  int64_t recompute_num_layers = -1);

/// `requested` with each negative cost (kAutoStageCost) replaced by stage_costs_from_model's for
/// `requested.recompute_num_layers`.
StageCosts resolve_stage_costs(StageCosts requested, const model::TransformerConfig& cfg, int64_t seq_len, int tp);

/// The layout a run uses: explicit `counts` when non-empty, else `balanced` for `costs` (resolved, >= 0) when
/// either is > 0, else `uniform` (so both costs 0 ask for the even split). With VP > 1, where evening out the
/// virtual stages leaves the ranks' totals (rank_work) uneven because the head outweighs a chunk, it balances
/// the ranks' totals instead (`balanced` at VP 1) and splits each rank's layers over its chunks with that
/// rank's own embedding/head counted (the interleaved schedule takes chunks of any size, empty ones too). Under
/// block recompute the ranks' totals are balanced as if each rank recomputed VP × N layers (exact when every chunk
/// holds at least N), and the two candidates are compared by their exact rank_work.
PipelineLayout choose_layout(int64_t num_layers, int pipeline_parallel, int virtual_stages,
                             std::vector<int64_t> counts, StageCosts costs);

/// Estimated work of each pipeline rank in layers: layers_cost of each of its virtual stages plus the
/// embedding and head costs of those it holds.
std::vector<double> rank_work(const PipelineLayout& layout, StageCosts costs);

/// One line for logs: "layers per stage: 10, 6 (head ≈ 4.0 layers; work per stage 10.0, 10.0)"; with VP > 1 the
/// per-chunk counts in model order and then the per-rank totals; with block recompute (costs.recompute_num_layers
/// >= 0) the work notes it: "(head ≈ 3.0 layers, first 1 layer per chunk recomputed: 4/3; work per stage ...)".
std::string describe_layout(const PipelineLayout& layout, StageCosts costs);

/// The embedding and head costs, in layers, from one step's measured compute time per pipeline rank
/// (busy_per_rank[r], any unit) under `layout`: one layer's cost is the median of busy/layers over the
/// ranks in between (with PP = 2, rank 0's, the embedding counted as free), and the first and last
/// rank's excess over their layers is their extra. Negative excesses (noise) count as 0. PP = 1 gives
/// {0, 0} (nothing to balance). ValueError when the sizes disagree or a time is not positive.
/// `recompute_num_layers` is the profiled run's block recompute (as in StageCosts): each rank's layers are then
/// counted by layers_cost, and the result carries it.
StageCosts stage_costs_from_profile(const PipelineLayout& layout, const std::vector<double>& busy_per_rank,
                                    int64_t recompute_num_layers = -1);

}  // namespace megacore::pipeline
