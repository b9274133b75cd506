// Variable-length sequences (SFT examples) as fixed-length rows, optionally packed several to a row.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "megacore/data/sample_source.hpp"

namespace megacore::data {

/// First-fit-decreasing bin packing: items sorted by length (longest first, ties by index) each go to
/// the first bin with room. Returns the bins as lists of item indices, in bin-creation order. Every
/// length must be in [1, capacity] (ValueError otherwise). O(n log n).
std::vector<std::vector<int64_t>> pack_first_fit_decreasing(std::span<const int64_t> lengths, int64_t capacity);

/// Options of a PackedSequenceDataset.
struct PackingConfig {
  int64_t seq_length = 2048;  ///< positions per row
  bool pack = true;           ///< false: one sequence per row, padded
  int64_t pad_id = 0;         ///< token and label of padding positions (loss mask 0)
  /// Sequences longer than seq_length are cut to it (counted in num_truncated()); false makes them an error.
  bool truncate = true;
};

/// Rows built from tokenised sequences, each with a per-token flag saying whether the token belongs to
/// the answer. Within a row, sequence k occupies [start_k, start_k + len_k): its labels are its own next
/// tokens, the last position of every sequence has loss mask 0 (nothing in it to predict), position ids
/// restart at 0, and seq_starts lists every start so attention never crosses a boundary. Loss is taken
/// only where the *label* is an answer token (the answer mask shifted by one). Padding at the end of a
/// row forms one more segment with loss mask 0.
class PackedSequenceDataset : public SampleSource {
 public:
  /// tokens and answer_mask hold all sequences back to back; offsets has one more entry than sequences
  /// (offsets[0] = 0, offsets.back() = tokens.size()).
  PackedSequenceDataset(std::vector<int64_t> tokens, std::vector<uint8_t> answer_mask, std::vector<int64_t> offsets,
                        PackingConfig cfg);

  int64_t size() const override { return int64_t(rows_.size()); }
  int64_t seq_length() const override { return cfg_.seq_length; }
  void get(int64_t i, const RowView& out) const override;

  int64_t num_sequences() const { return int64_t(offsets_.size()) - 1; }
  int64_t num_truncated() const { return num_truncated_; }
  /// Sequence indices packed into row i, in placement order.
  const std::vector<int64_t>& row_sequences(int64_t i) const { return rows_.at(size_t(i)); }
  /// Fraction of row positions holding real tokens (1 - padding share).
  double fill_ratio() const;

 private:
  int64_t length(int64_t k) const;
  std::vector<int64_t> tokens_;
  std::vector<uint8_t> answer_;
  std::vector<int64_t> offsets_;
  PackingConfig cfg_;
  std::vector<std::vector<int64_t>> rows_;
  int64_t num_truncated_ = 0;
};

}  // namespace megacore::data
