// Trainer: the training loop of a GPT/Llama model under any (TP, PP, VP, DP) layout, usable from C++ alone
// and driven from Python recipes (`python -m megacore.train`).
//
// What one run builds, on every rank, in this order:
//   ProcessGrid (validated)  →  this rank's model chunks (PipelineLayout: uniform or explicit counts;
//   GPTModel stages with global layer names)  →  [resume: parameters from a checkpoint, any layout]  →
//   DistributedDataParallel over all chunks' parameters (buckets, overlapped reduction on the last
//   micro-batch) and AdamW / SGD or the ZeRO-1 DistributedOptimizer  →  PipelineEngine (no pipelining,
//   1F1B or interleaved 1F1B, chosen from PP and VP)  →  DataLoader of this DP rank  →  checkpoint manager.
//
// One step: m = global_batch / (micro_batch × DP) micro-batches through the engine (token-weighted loss over
// all micro-batches and DP ranks), tied-embedding gradients summed over the embedding group and only then
// released to DDP, finish the DP reduction, global-norm clipping that counts every parameter once (tied
// copies skipped), optimizer step with the scheduled LR (skipped, and reported, when a gradient is NaN/Inf).
// Every log_interval steps rank 0 prints step, loss, grad norm, LR, tokens/s, TFLOP/s per GPU, MFU, memory
// and time per step, and appends the same to metrics.jsonl and TensorBoard event files.
//
// Checkpoints hold the model (global tensors, so they load into any layout), the optimizer state (per
// parameter, so ZeRO and plain AdamW checkpoints are interchangeable), the step, the LR scheduler and the
// data position (consumed samples), plus the recipe. Resuming continues bit for bit: the loader restarts at
// the saved sample and every reduction has a fixed order.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/data/sample_source.hpp"
#include "megacore/model/transformer_config.hpp"
#include "megacore/optim/lr_schedule.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "megacore/train/metrics.hpp"

namespace megacore::train {

/// Everything a run needs, as the Python Recipe describes it (same names, flattened).
struct TrainConfig {
  model::TransformerConfig model;
  parallel::ParallelConfig parallel;  ///< tensor, pipeline, context, virtual_pipeline
  std::vector<int64_t> pipeline_layout;  ///< explicit layers per virtual stage; empty = even
  /// With pipeline_layout empty and either cost > 0: PipelineLayout::balanced for these extras (in layers).
  double pipeline_embedding_cost = 0;
  double pipeline_head_cost = 0;
  bool use_distributed_optimizer = false;
  /// ZeRO-1 only: start the parameter all-gathers after the step and wait for each layer's just before
  /// the next forward reads it (DistributedOptimizer overlap_param_gather + the model's pre-forward hook).
  bool overlap_param_gather = false;
  bool overlap_grad_reduce = true;
  int64_t bucket_size = 0;
  bool grad_reduce_in_bf16 = false;

  int64_t seq_length = 128;
  int prefetch = 4;  ///< data.prefetch: micro-batches the training loader prepares ahead
  /// Seeded shuffle of the training rows in the loader (data.seed): on for SFT data (data.sft_path), whose
  /// packed rows come in bin order (longest examples first); pretraining samples are shuffled by their dataset.
  bool shuffle_rows = false;
  uint64_t data_seed = 1234;
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 1;

  std::string optimizer = "adamw";
  double weight_decay = 0.01, adam_beta1 = 0.9, adam_beta2 = 0.95, adam_eps = 1e-8, sgd_momentum = 0.9;
  double clip_grad = 1.0;
  bool skip_nonfinite_steps = true;
  double initial_loss_scale = 65536.0;  ///< f16 dynamic loss scaling
  optim::LRScheduleConfig lr;

  int64_t max_steps = 1;
  /// End this run after this many of its steps (0 = at max_steps), saving a checkpoint when save_last; the
  /// schedule and data order still follow max_steps, so a later run resumes exactly.
  int64_t stop_after_steps = 0;
  int64_t val_check_interval = 0;
  int64_t limit_val_batches = 1;
  int64_t log_interval = 1;
  std::string device = "auto";  ///< auto | cpu | cuda
  double peak_tflops = 0;       ///< 0: the card's known figure
  double comm_timeout_s = 300;

  std::string save_dir;
  int64_t save_interval = 0;
  int keep_last = 0;
  int keep_top_k = 0;
  std::string resume;  ///< "", "auto" or a checkpoint path
  bool async_save = false;
  bool save_last = true;

  std::string log_dir;
  bool jsonl = true;
  bool tensorboard = true;
  std::string progress_bar = "auto";

  /// The recipe as JSON, stored in every checkpoint (and compared on resume).
  std::string recipe_json;

  /// Parses a Recipe's to_json(); ConfigError naming a missing or mistyped field.
  static TrainConfig from_recipe_json(const std::string& json);
};

struct TrainResult {
  std::vector<StepMetrics> history;                       ///< every step of this run
  std::vector<std::pair<int64_t, double>> val_losses;     ///< (step, loss)
  int64_t start_step = 0;                                 ///< steps already done when the run started (resume)
  int64_t final_step = 0;
  std::string last_checkpoint;                            ///< "" when none was written
};

class Trainer {
 public:
  /// Builds everything (see the header comment); collective over `world`, which must outlive the trainer.
  /// `train` and `valid` are the sample sources (valid may be null: no validation). ConfigError for an
  /// invalid layout, before any model memory is allocated.
  Trainer(const TrainConfig& cfg, comm::Communicator& world, std::shared_ptr<const data::SampleSource> train,
          std::shared_ptr<const data::SampleSource> valid = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Trains from the current step to cfg.max_steps. Collective.
  TrainResult fit();
  /// Token-weighted mean loss over up to `max_batches` global validation batches (forward only). Collective.
  double evaluate(int64_t max_batches);
  /// Greedy generation: `n` new token ids after `prompt` (the whole model runs forward on the growing
  /// sequence; no KV cache). Collective; every rank returns the same ids.
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t n);
  /// Saves a checkpoint of the current state under cfg.save_dir (collective); returns its directory.
  std::string save();
  /// Loads model (and, when `optimizer`, optimizer, scheduler and data position) from a checkpoint
  /// directory or root (latest). Collective.
  void load(const std::string& path, bool optimizer = true);

  int64_t step() const;
  const parallel::ProcessGrid& grid() const;
  /// Invoked on every rank after each step with its metrics (Python progress hooks, tests).
  void set_step_callback(std::function<void(const StepMetrics&)> cb);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacore::train
