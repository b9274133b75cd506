// Training metrics: the numbers a log line carries, and where they are written.
//
// TensorBoardWriter writes TensorBoard event files (events.out.tfevents.<time>.<host>) directly, without
// TensorFlow or protobuf: each record is TFRecord-framed (u64 length, masked CRC-32C of the length, the
// bytes, masked CRC-32C of the bytes) and holds an `Event` protobuf (wall_time = 1, step = 2,
// file_version = 3, summary = 5 { value = 1 { tag = 1, simple_value = 2 } }) encoded by hand. The first
// record is the file_version "brain.Event:2" event TensorBoard expects. JsonlWriter appends one JSON object
// per line. Both flush after every write, so a crash loses nothing already logged.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace megacore::train {

/// One optimizer step as logged.
struct StepMetrics {
  int64_t step = 0;            ///< 1-based: the number of optimizer steps taken after this one
  double loss = 0;             ///< token-weighted mean over the global batch
  double grad_norm = 0;        ///< global norm before clipping
  double lr = 0;
  double loss_scale = 1;       ///< f16 dynamic loss scale (1 otherwise)
  bool skipped = false;        ///< NaN/Inf gradients: no update
  bool nonfinite = false;      ///< the loss or (without f16 loss scaling) the gradient norm was NaN/Inf
  bool loss_spike = false;     ///< loss above trainer.loss_spike_factor x its moving average
  /// trainer.straggler_factor > 0: this rank's compute time (the step up to the data-parallel gradient
  /// reduction, which is where a fast rank waits for a slow one), every rank's, and the ranks slower than
  /// the factor times the median. Empty / 0 when off.
  double compute_seconds = 0;
  std::vector<double> rank_compute_seconds;
  std::vector<int> stragglers;
  double step_seconds = 0;
  double tokens_per_s = 0;     ///< global
  double tflops_per_gpu = 0;   ///< model FLOPs (6N + attention, non-causal) per second per rank
  double mfu = 0;              ///< tflops_per_gpu / peak (0 when the peak is unknown, e.g. CPU)
  double mem_allocated_gib = 0;
  double mem_peak_gib = 0;
  double consumed_samples = 0;
  /// MoE models (model::moe_step_metrics): the step's router aux loss + z-loss of a MoE layer (with their
  /// coefficients; mean over the MoE layers of every stage, the micro-batches and DP × CP) and its load
  /// imbalance (max/mean tokens per expert over every token routed in the step, the worst layer; 1 =
  /// balanced). 0 for dense models.
  double moe_aux_loss = 0;
  double moe_load_imbalance = 0;
  /// FP8 runs, at log steps: per FP8 linear of rank 0 ("layers.3.mlp.linear_fc1"), the elements its casts
  /// (input, weight, output gradient) saturated at the format's max and flushed to zero since the start.
  struct Fp8Counts {
    std::string name;
    int64_t saturated = 0, flushed = 0;
  };
  std::vector<Fp8Counts> fp8_counts;
};

/// Dense bf16 tensor-core peak in TFLOP/s of a card by name (H100/H200 SXM 989, H100 PCIe 756, A100 312);
/// 0 when unknown.
double known_peak_tflops(const std::string& device_name);

/// CRC-32C (Castagnoli), as TFRecord framing uses it.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

class TensorBoardWriter {
 public:
  /// Creates `dir` if needed and opens a new event file in it (IOError naming the path on failure).
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  /// One event holding scalar values (tag → value) at `step`.
  void add_scalars(int64_t step, const std::map<std::string, double>& values);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  std::FILE* f_ = nullptr;
};

/// Appends JSON lines to a file (created with its directory; IOError naming the path on failure).
class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const std::string& json_object);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

/// The JSON object of a StepMetrics ({"step": ..., "loss": ..., ...}).
std::string to_json(const StepMetrics& m);

}  // namespace megacore::train
