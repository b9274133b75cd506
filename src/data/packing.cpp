#include "megacore/data/packing.hpp"

#include <algorithm>
#include <numeric>

#include "megacore/core/error.hpp"

namespace megacore::data {

std::vector<std::vector<int64_t>> pack_first_fit_decreasing(std::span<const int64_t> lengths, int64_t capacity) {
  MC_CHECK(capacity >= 1, "packing capacity must be >= 1, got {}", capacity);
  const int64_t n = int64_t(lengths.size());
  for (int64_t i = 0; i < n; ++i)
    MC_CHECK(lengths[size_t(i)] >= 1 && lengths[size_t(i)] <= capacity,
             "sequence {} has length {}, outside [1, {}]; drop empty sequences and truncate long ones first", i,
             lengths[size_t(i)], capacity);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lengths[size_t(a)] > lengths[size_t(b)]; });

  // A max-segment-tree over the remaining room of at most n bins finds the first bin with room in
  // O(log n); unopened bins have full room, so the first fit among them is the next new bin.
  int64_t leaves = 1;
  while (leaves < std::max<int64_t>(n, 1)) leaves *= 2;
  std::vector<int64_t> tree(size_t(2 * leaves), capacity);
  std::vector<std::vector<int64_t>> bins;
  for (int64_t item : order) {
    int64_t len = lengths[size_t(item)];
    int64_t node = 1;
    while (node < leaves) node = tree[size_t(2 * node)] >= len ? 2 * node : 2 * node + 1;
    int64_t bin = node - leaves;
    if (bin >= int64_t(bins.size())) bins.resize(size_t(bin + 1));
    bins[size_t(bin)].push_back(item);
    tree[size_t(node)] -= len;
    for (node /= 2; node >= 1; node /= 2)
      tree[size_t(node)] = std::max(tree[size_t(2 * node)], tree[size_t(2 * node + 1)]);
  }
  return bins;
}

PackedSequenceDataset::PackedSequenceDataset(std::vector<int64_t> tokens, std::vector<uint8_t> answer_mask,
                                             std::vector<int64_t> offsets, PackingConfig cfg)
    : tokens_(std::move(tokens)), answer_(std::move(answer_mask)), offsets_(std::move(offsets)), cfg_(cfg) {
  MC_CHECK(cfg_.seq_length >= 2, "seq_length must be >= 2, got {}", cfg_.seq_length);
  MC_CHECK(answer_.size() == tokens_.size(), "answer mask has {} entries for {} tokens; give one flag per token",
           answer_.size(), tokens_.size());
  MC_CHECK(offsets_.size() >= 1 && offsets_.front() == 0 && offsets_.back() == int64_t(tokens_.size()),
           "offsets must start at 0 and end at the token count {} (one more entry than sequences)", tokens_.size());
  const int64_t n = num_sequences();
  std::vector<int64_t> lens(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    int64_t raw = offsets_[size_t(k + 1)] - offsets_[size_t(k)];
    MC_CHECK(raw >= 0, "offsets decrease at sequence {}", k);
    MC_CHECK(raw >= 2, "sequence {} has {} token(s); a training sequence needs at least 2 (drop empty examples)", k,
             raw);
    if (raw > cfg_.seq_length) {
      MC_CHECK(cfg_.truncate, "sequence {} has {} tokens, more than seq_length {}; raise seq_length or allow truncation",
               k, raw, cfg_.seq_length);
      ++num_truncated_;
    }
    lens[size_t(k)] = std::min(raw, cfg_.seq_length);
  }
  if (cfg_.pack) {
    rows_ = pack_first_fit_decreasing(lens, cfg_.seq_length);
  } else {
    rows_.resize(size_t(n));
    for (int64_t k = 0; k < n; ++k) rows_[size_t(k)] = {k};
  }
}

int64_t PackedSequenceDataset::length(int64_t k) const {
  return std::min(offsets_[size_t(k + 1)] - offsets_[size_t(k)], cfg_.seq_length);
}

double PackedSequenceDataset::fill_ratio() const {
  if (rows_.empty()) return 0.0;
  int64_t used = 0;
  for (int64_t k = 0; k < num_sequences(); ++k) used += length(k);
  return double(used) / double(int64_t(rows_.size()) * cfg_.seq_length);
}

void PackedSequenceDataset::get(int64_t i, const RowView& out) const {
  MC_CHECK(i >= 0 && i < size(), "row {} out of range [0, {})", i, size());
  out.seq_starts->clear();
  int64_t pos = 0;
  for (int64_t k : rows_[size_t(i)]) {
    const int64_t base = offsets_[size_t(k)], len = length(k);
    out.seq_starts->push_back(int32_t(pos));
    for (int64_t t = 0; t < len; ++t) {
      const bool last = t + 1 == len;
      out.tokens[pos + t] = tokens_[size_t(base + t)];
      out.labels[pos + t] = last ? cfg_.pad_id : tokens_[size_t(base + t + 1)];
      out.loss_mask[pos + t] = (!last && answer_[size_t(base + t + 1)]) ? 1.0f : 0.0f;
      out.position_ids[pos + t] = t;
    }
    pos += len;
  }
  if (pos < cfg_.seq_length) {
    out.seq_starts->push_back(int32_t(pos));
    for (int64_t t = pos; t < cfg_.seq_length; ++t) {
      out.tokens[t] = cfg_.pad_id;
      out.labels[t] = cfg_.pad_id;
      out.loss_mask[t] = 0.0f;
      out.position_ids[t] = t - pos;
    }
  }
}

}  // namespace megacore::data
