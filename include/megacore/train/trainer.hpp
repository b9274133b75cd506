// Trainer: the training loop of a GPT/Llama model under any (TP, PP, VP, DP) layout, usable from C++ alone
// and driven from Python recipes (`python -m megacore.train`). Its configuration is a RunConfig
// (train/run_config.hpp), the same object a recipe JSON parses into.
//
// What one run builds, on every rank, in this order (each part a function of train/builder.hpp, composed by
// train::build_training_parts):
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
#include "megacore/train/run_config.hpp"

namespace megacore::train {

struct TrainResult {
  std::vector<StepMetrics> history;                       ///< every step of this run
  std::vector<std::pair<int64_t, double>> val_losses;     ///< (step, loss)
  int64_t start_step = 0;                                 ///< steps already done when the run started (resume)
  int64_t final_step = 0;
  std::string last_checkpoint;                            ///< "" when none was written
  /// The signal that stopped the run early (train/stop_signal.hpp), agreed by every rank; 0 when it ran to
  /// its end. The run then saved a checkpoint after its last step (when checkpoint.save_dir is set).
  int stopped_by_signal = 0;
};

class Trainer {
 public:
  /// Validates `cfg` as a whole for world.size() ranks (train::check, files excluded: the data arrives as
  /// sample sources), then builds everything (see the header comment); collective over `world`, which must
  /// outlive the trainer. `train` and `valid` are the sample sources (valid may be null: no validation).
  /// ConfigError listing every problem, before any model memory is allocated.
  Trainer(const RunConfig& cfg, comm::Communicator& world, std::shared_ptr<const data::SampleSource> train,
          std::shared_ptr<const data::SampleSource> valid = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Trains from the current step to cfg.max_steps. Collective. After every step the ranks agree on whether
  /// a stop was requested (a signal, see train/stop_signal.hpp); if so they all save a checkpoint and return.
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
