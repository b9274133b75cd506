// DataLoader: micro-batches of one data-parallel rank, prepared by a background thread.
//
// Sample order is global and independent of the DP size: step k consumes samples
// [k * global_batch, (k + 1) * global_batch) of the dataset, cut into chunks of micro_batch * dp_size
// samples; rank r takes samples [r * micro_batch, (r + 1) * micro_batch) of each chunk (Megatron's
// pretraining sampler). So the union of all ranks' rows at a step is exactly what DP = 1 sees, and each
// rank reads only its own samples. Resuming from consumed_samples continues the exact sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "megacore/core/device.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/data/sample_source.hpp"

namespace megacore::data {

/// One micro-batch of one rank. Tensor shapes are [micro_batch, seq_length] unless noted.
struct Batch {
  Tensor tokens;        ///< i64
  Tensor labels;        ///< i64
  Tensor loss_mask;     ///< f32
  Tensor position_ids;  ///< i64, restart at every packed-sequence start
  /// i32 [num_segments + 1]: cumulative segment boundaries over the flattened [micro_batch * seq_length]
  /// tokens (THD layout). Row ends are always boundaries; unpacked rows are one segment each.
  Tensor cu_seqlens;
  int64_t max_seqlen = 0;               ///< longest segment
  std::vector<int64_t> sample_indices;  ///< global (dataset) index of each row
  int64_t step = 0;                     ///< optimizer step this micro-batch belongs to
  int64_t micro_step = 0;               ///< index of the micro-batch within the step
  /// Loss tokens of the rows (label != -100, weighted by loss_mask), of this rank's context-parallel
  /// chunks when cp_size > 1: counted on the host, so the training step need not read them back.
  double loss_tokens = 0;
};

/// Options of a DataLoader.
struct LoaderConfig {
  int64_t micro_batch_size = 1;
  /// Samples per optimizer step over all ranks; 0 means micro_batch_size * dp_size (no accumulation).
  int64_t global_batch_size = 0;
  int dp_rank = 0;
  int dp_size = 1;
  /// Global samples already consumed (from a checkpoint); a multiple of micro_batch_size * dp_size.
  int64_t consumed_samples = 0;
  /// Micro-batches prepared ahead of the consumer.
  int prefetch = 4;
  /// Where batches are delivered. CUDA devices get an asynchronous copy from page-locked host buffers.
  Device device = Device::cpu();
  /// Use page-locked host buffers when CUDA is available (the default); ignored without CUDA.
  bool pin_memory = true;
  /// Apply a seeded permutation to the dataset order (for sources that are not shuffled, like packed SFT rows).
  bool shuffle = false;
  uint64_t seed = 1234;
  /// Passes over the dataset (SFT epochs). Each pass visits every sample of the dataset's steps once; with
  /// shuffle each pass has its own seeded order (the first pass's order does not depend on `epochs`).
  int64_t epochs = 1;
  /// When > 0: every token id, and every label at a position that counts towards the loss (other than the
  /// loss's ignore_index, -100), must lie in [0, vocab_size); a row that breaks this makes next() raise ValueError naming the sample, position and
  /// id. (On GPUs the embedding and cross-entropy kernels cannot stop on a bad id without a host sync;
  /// they would give NaN.) The Trainer sets it to model.vocab_size.
  int64_t vocab_size = 0;
  /// Context parallelism of the consumer: Batch::loss_tokens counts this CP rank's two sequence chunks
  /// (rank r holds chunks r and 2·cp_size−1−r of 2·cp_size).
  int cp_size = 1;
  int cp_rank = 0;
};

/// Counters of a DataLoader; wait time is how long next() blocked, i.e. the consumer's stall.
struct LoaderStats {
  int64_t batches = 0;
  double wait_seconds = 0;      ///< total time next() spent waiting for the producer
  double max_wait_seconds = 0;  ///< longest single wait
  double produce_seconds = 0;   ///< producer time spent filling batches
  bool pinned = false;          ///< host buffers are page-locked
};

/// Prefetching loader over a SampleSource. next() is for one consumer thread.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const SampleSource> source, LoaderConfig cfg);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// The next micro-batch of this rank, or nullopt after the last full step. For a CUDA device the copy
  /// is queued on stream s (the current work stream); the tensors are ready for work queued after it.
  std::optional<Batch> next(const Stream& s = {});

  /// Global samples consumed by all ranks up to and including the last batch returned (save it in checkpoints).
  int64_t consumed_samples() const;
  /// Micro-batches per rank per optimizer step.
  int64_t micro_batches_per_step() const;
  /// Optimizer steps the dataset provides over all epochs (incomplete last global batch of a pass dropped).
  int64_t num_steps() const;
  /// Optimizer steps of one pass over the dataset.
  int64_t steps_per_epoch() const;
  /// Global sample indices of rank r's micro-batch m of step k (no I/O; for tests and planning), before the
  /// shuffle permutation of that step's epoch.
  std::vector<int64_t> sample_indices(int64_t step, int64_t micro_step, int rank) const;
  LoaderStats stats() const;
  const LoaderConfig& config() const { return cfg_; }

  struct State;  // implementation detail (shared with the buffers handed out)

 private:
  std::shared_ptr<const SampleSource> source_;
  LoaderConfig cfg_;
  std::shared_ptr<State> state_;
};

}  // namespace megacore::data
