// Weighted blends of datasets, train/valid/test splits, and the one-call pretraining dataset builder.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megacore/data/gpt_dataset.hpp"
#include "megacore/data/sample_source.hpp"

namespace megacore::data {

/// Which dataset each blended sample comes from and its index there.
struct BlendingIndices {
  std::vector<int16_t> dataset_index;
  std::vector<int64_t> dataset_sample_index;
};

/// Assigns `size` samples to datasets so that after every prefix of n samples each dataset's count is as
/// close as possible to weight * n: sample n goes to the dataset furthest below its target (Megatron's
/// greedy error-minimising rule; ties go to the lowest index). Weights need not sum to one.
BlendingIndices build_blending_indices(const std::vector<double>& weights, int64_t size);

/// Samples drawn from several datasets in fixed proportions. Component i must hold at least the number of
/// samples the blend assigns to it (samples_needed()); the builder below sizes them that way.
class BlendedDataset : public SampleSource {
 public:
  BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets, std::vector<double> weights, int64_t size);

  int64_t size() const override { return size_; }
  int64_t seq_length() const override { return datasets_.front()->seq_length(); }
  void get(int64_t i, const RowView& out) const override;

  /// (dataset, sample within it) of blended sample i.
  std::pair<int, int64_t> locate(int64_t i) const;
  const std::vector<double>& weights() const { return weights_; }
  const BlendingIndices& indices() const { return idx_; }

 private:
  std::vector<std::shared_ptr<const SampleSource>> datasets_;
  std::vector<double> weights_;
  int64_t size_;
  BlendingIndices idx_;
};

/// Samples each component of a blend of `size` samples must provide (the exact greedy counts).
std::vector<int64_t> blend_samples_needed(const std::vector<double>& weights, int64_t size);

/// Parses a split such as "969,30,1" or "98/2/0" into three fractions summing to one.
std::array<double, 3> parse_split(const std::string& split);

/// Document ranges [begin, end) of the train, valid and test splits of num_documents documents
/// (contiguous, in order, sizes rounded as Megatron does so the three cover every document).
std::array<std::pair<int64_t, int64_t>, 3> split_document_ranges(int64_t num_documents,
                                                                 const std::array<double, 3>& fractions);

/// One weighted entry of a blend: weight and dataset prefix.
struct BlendEntry {
  double weight;
  std::string prefix;
};

/// Parameters of build_pretrain_datasets.
struct PretrainDatasetsConfig {
  std::vector<BlendEntry> blend;        ///< one entry means no blending
  std::string split = "969,30,1";       ///< train, valid, test proportions of each dataset's documents
  int64_t seq_length = 2048;
  std::array<int64_t, 3> num_samples{};  ///< samples wanted per split; 0 skips that split
  uint64_t seed = 1234;
  std::string cache_dir;                ///< see GPTDatasetConfig::cache_dir
  bool use_cache = true;
};

/// The train, valid and test datasets of a (possibly blended) pretraining corpus; nullptr for splits with
/// no samples requested. Each split draws from its own document range of every dataset.
std::array<std::shared_ptr<SampleSource>, 3> build_pretrain_datasets(const PretrainDatasetsConfig& cfg);

}  // namespace megacore::data
