// The interface between datasets and the loader: a fixed number of fixed-length training rows.
#pragma once

#include <cstdint>
#include <vector>

namespace megacore::data {

/// Where a dataset writes one training row of seq_length positions. All arrays have seq_length entries.
struct RowView {
  int64_t* tokens;        ///< input ids
  int64_t* labels;        ///< next-token targets (tokens shifted by one within each sequence)
  float* loss_mask;       ///< 1 where the label counts towards the loss
  int64_t* position_ids;  ///< restart at 0 at each sequence start
  /// Offsets within the row where a sequence starts; the first is always 0. Attention and RoPE must
  /// not cross these boundaries. A row that is one sequence has just {0}.
  std::vector<int32_t>* seq_starts;
};

/// A dataset of training rows, random access by sample index. Implementations are immutable after
/// construction and get() is safe to call from several threads.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  /// Number of rows.
  virtual int64_t size() const = 0;
  /// Positions per row.
  virtual int64_t seq_length() const = 0;
  /// Fills row i (0 <= i < size()).
  virtual void get(int64_t i, const RowView& out) const = 0;
};

}  // namespace megacore::data
