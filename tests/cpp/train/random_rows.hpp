// Helpers of the trainer's multi-rank tests: random training rows (the same on every rank for one seed)
// and the trainer's gradient-norm groups.
#pragma once

#include <random>
#include <vector>

#include "megacore/data/sample_source.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/train/builder.hpp"

namespace megacore::train_test {

/// Rows of random tokens, each one sequence; with `masked`, about a seventh of the labels are -100 and a
/// third of the positions have loss_mask 0 (the loss-token count then differs from the row length).
class RandomRows : public data::SampleSource {
 public:
  RandomRows(int64_t rows, int64_t seq, int64_t vocab, uint64_t seed, bool masked = false)
      : rows_(rows), seq_(seq), vocab_(vocab), seed_(seed), masked_(masked) {}
  int64_t size() const override { return rows_; }
  int64_t seq_length() const override { return seq_; }
  void get(int64_t i, const data::RowView& out) const override {
    std::mt19937_64 g(seed_ * 1000003u + uint64_t(i));
    std::vector<int64_t> t(size_t(seq_ + 1));
    for (int64_t& v : t) v = int64_t(g() % uint64_t(vocab_));
    for (int64_t j = 0; j < seq_; ++j) {
      out.tokens[j] = t[size_t(j)];
      out.labels[j] = masked_ && g() % 7 == 0 ? -100 : t[size_t(j + 1)];
      out.loss_mask[j] = masked_ && g() % 3 == 0 ? 0.0f : 1.0f;
      out.position_ids[j] = j;
    }
    *out.seq_starts = {0};
  }

 private:
  int64_t rows_, seq_, vocab_;
  uint64_t seed_;
  bool masked_;
};

/// The gradient-norm groups Trainer uses for the parts' first optimizer group: tied copies counted once.
inline optim::GradNormGroups trainer_norm_groups(const train::TrainingParts& p) {
  optim::GradNormGroups groups = optim::grad_norm_groups(*p.grid, p.optimizer.groups.front().zero != nullptr);
  groups.skip = [&p](const layers::Parameter& prm) {
    for (const auto& ch : p.chunks)
      if (ch->is_tied_copy(prm)) return true;
    return false;
  };
  return groups;
}

}  // namespace megacore::train_test
