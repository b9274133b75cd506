// GPT pretraining samples over an indexed dataset, in Megatron's three-index scheme.
//
// document index: the documents of the split, each epoch in its own seeded shuffle, epochs concatenated;
// sample index:   for each sample, where it starts in the document index (entry, token offset); sample i
//                 spans seq_length + 1 tokens that may cross document boundaries (consecutive samples
//                 share one token, the last label of one is the first input of the next);
// shuffle index:  a seeded permutation of the samples.
// All three depend only on (data, document range, seq_length, num_samples, seed), so sample i is the same
// tokens on every rank, at every DP size and after any restart. They are cached next to the data (or in
// cache_dir) under a name holding a hash of those parameters.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megacore/data/indexed_dataset.hpp"
#include "megacore/data/sample_source.hpp"

namespace megacore::data {

/// Parameters of a GPTDataset.
struct GPTDatasetConfig {
  int64_t seq_length = 2048;
  /// Samples wanted; epochs repeat as needed. 0 means one pass over the documents (no repeats).
  int64_t num_samples = 0;
  uint64_t seed = 1234;
  /// Documents [doc_begin, doc_end) of the indexed dataset; doc_end < 0 means all documents.
  int64_t doc_begin = 0;
  int64_t doc_end = -1;
  /// Where the index cache goes; empty means next to the data. Cache files are written to a temporary
  /// name and renamed, so ranks building the same cache at once cannot corrupt it.
  std::string cache_dir;
  /// Set false to build the indices in memory only (read-only data directories, tests).
  bool use_cache = true;
};

/// GPT pretraining rows: tokens, next-token labels, loss mask of ones, position ids 0..seq_length-1.
class GPTDataset : public SampleSource {
 public:
  GPTDataset(std::shared_ptr<const IndexedDataset> data, GPTDatasetConfig cfg);

  int64_t size() const override { return num_samples_; }
  int64_t seq_length() const override { return cfg_.seq_length; }
  void get(int64_t i, const RowView& out) const override;

  /// The seq_length + 1 tokens of sample i (after shuffling), into out.
  void sample_tokens(int64_t i, int64_t* out) const;
  /// Sample i's seq_length + 1 tokens as a vector.
  std::vector<int64_t> sample_tokens(int64_t i) const;

  const GPTDatasetConfig& config() const { return cfg_; }
  const IndexedDataset& data() const { return *data_; }
  int64_t num_epochs() const { return num_epochs_; }
  /// The cache file used ("" without cache), and whether the indices came from it.
  const std::string& cache_path() const { return cache_path_; }
  bool loaded_from_cache() const { return from_cache_; }
  /// Hex hash of everything the indices depend on (part of the cache name).
  const std::string& index_hash() const { return hash_; }

  // The raw indices, for tests and inspection.
  const std::vector<int32_t>& document_index() const { return doc_idx_; }
  const std::vector<int64_t>& sample_index() const { return sample_idx_; }  ///< 2 * (size + 1) entries
  const std::vector<int64_t>& shuffle_index() const { return shuffle_idx_; }

 private:
  void build_indices();
  bool load_cache();
  void save_cache() const;

  std::shared_ptr<const IndexedDataset> data_;
  GPTDatasetConfig cfg_;
  int64_t num_samples_ = 0, num_epochs_ = 0;
  std::vector<int64_t> doc_len_, doc_start_;  // per document of the split, in tokens
  std::vector<int32_t> doc_idx_;
  std::vector<int64_t> sample_idx_;
  std::vector<int64_t> shuffle_idx_;
  std::string hash_, cache_path_;
  bool from_cache_ = false;
};

/// A deterministic permutation of [0, n) from (seed, stream); identical on every platform.
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, uint64_t stream);

}  // namespace megacore::data
