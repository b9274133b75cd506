// Hand-made dense and MoE expert parameters on a process grid, with the full (unsharded) tensors they
// come from, for the multi-rank optimizer and checkpoint tests of expert parallelism.
//
// Every layout holds the same model: two dense parameters (one replicated over TP, one split over TP
// along dim 0) and three expert parameters over 4 experts (dim 0), split over expert-TP like a SwiGLU
// fc1 (dim 1, two chunks), like fc2 (dim 2), and one replicated over expert-TP. Gradients come from
// "replicas": a dense parameter's gradient on a rank is its slice of the full gradient G_d of its DP×CP
// rank d, an expert parameter's the slice of G_e of its expert-DP rank e. Dense gradients are averaged
// over DP×CP: mean of the G_d. Expert gradients are summed over expert-DP and divided by DP×CP, as
// Megatron-Core scales them (an EP rank's expert gradient already sums the tokens of every EP rank; see
// DDPConfig::average_size): Σ G_e / (DP×CP). A single process computes both on full tensors.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "layers/layers_test_util.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace expert_test {

using namespace megacore;
namespace ly = megacore::layers;

constexpr int64_t kExperts = 4;

struct Spec {
  const char* name;
  Shape full;
  bool expert;
  int partition_dim;
  int chunks;
};

inline const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"dense.norm_weight", {6, 5}, false, -1, 1},
      {"dense.fc.weight", {8, 5}, false, 0, 1},
      {"experts.fc1.weight", {kExperts, 8, 3}, true, 1, 2},
      {"experts.fc2.weight", {kExperts, 3, 4}, true, 2, 1},
      {"experts.scale", {kExperts, 3}, true, -1, 1},
  };
  return s;
}

/// This rank's piece of a full tensor: experts [offset, offset + n) along dim 0 (expert parameters), then
/// rank r of `split` along partition_dim (in `chunks` blocks, each split evenly).
inline Tensor local_of(const Tensor& full, const Spec& s, int r, int split, int64_t expert_offset, int64_t n_local) {
  Tensor t = full;
  if (s.expert) t = t.narrow(0, expert_offset, n_local);
  if (s.partition_dim < 0 || split == 1) return t.contiguous().clone();
  const int64_t d = s.partition_dim, c = s.chunks, B = t.size(d) / c, b = B / split;
  Shape shape = t.shape();
  shape[size_t(d)] = b * c;
  Tensor out = Tensor::empty(shape, full.dtype());
  for (int64_t j = 0; j < c; ++j) out.narrow(d, j * b, b).copy_(t.narrow(d, j * B + r * b, b));
  return out;
}

/// A rank's parameters and the full tensors behind them.
struct Model {
  parallel::ParallelConfig pc;
  std::unique_ptr<parallel::ProcessGrid> grid;
  std::vector<std::unique_ptr<ly::Parameter>> params;  // specs() order
  std::vector<Tensor> full_init;

  int tp_rank() const { return grid->layout().tp_rank(grid->rank()); }
  int etp_rank() const { return grid->layout().expert_tp_rank(grid->rank()); }
  int ep_rank() const { return grid->layout().ep_rank(grid->rank()); }
  int64_t local_experts() const { return kExperts / pc.expert; }

  Tensor local(size_t i, const Tensor& full) const {
    const Spec& s = specs()[i];
    return s.expert ? local_of(full, s, etp_rank(), grid->layout().expert_tp_size(), ep_rank() * local_experts(),
                               local_experts())
                    : local_of(full, s, tp_rank(), grid->layout().tp_size(), 0, 0);
  }
  std::vector<ly::Parameter*> ptrs() const {
    std::vector<ly::Parameter*> v;
    for (const auto& p : params) v.push_back(p.get());
    return v;
  }
};

/// Full parameter i at initialisation (the same on every rank).
inline Tensor full_init(size_t i) { return layers_test::randn(specs()[i].full, 100 * (i + 1), 5); }

/// Full gradient of parameter i from replica `rep` at `step`.
inline Tensor full_grad(size_t i, int rep, int step) {
  return layers_test::randn(specs()[i].full, 100000 + 10000 * uint64_t(step) + 1000 * uint64_t(rep) + i, 9);
}

inline Model make_model(comm::Communicator& world, const parallel::ParallelConfig& pc) {
  Model m;
  m.pc = pc;
  m.grid = std::make_unique<parallel::ProcessGrid>(world, pc);
  for (size_t i = 0; i < specs().size(); ++i) {
    const Spec& s = specs()[i];
    m.full_init.push_back(full_init(i));
    auto p = std::make_unique<ly::Parameter>();
    p->name = s.name;
    p->partition_dim = s.partition_dim;
    p->partition_chunks = s.chunks;
    p->expert = s.expert;
    if (s.expert) {
      p->num_experts = kExperts;
      p->expert_offset = m.ep_rank() * m.local_experts();
    }
    m.params.push_back(std::move(p));
  }
  for (size_t i = 0; i < specs().size(); ++i) {
    m.params[i]->data = m.local(i, m.full_init[i]);
    m.params[i]->main_grad = Tensor::zeros(m.params[i]->data.shape());
  }
  return m;
}

/// Writes this rank's gradients of `step` into the main_grads (through the parameters' current views).
inline void set_grads(const Model& m, int step) {
  const int d = m.grid->layout().rank_in_group(parallel::GroupKind::DpCp, m.grid->rank());
  const int e = m.grid->layout().expert_dp_rank(m.grid->rank());
  for (size_t i = 0; i < specs().size(); ++i)
    m.params[i]->main_grad.copy_(m.local(i, full_grad(i, specs()[i].expert ? e : d, step)));
}

/// The reduced full gradient of parameter i at `step`: Σ over the replicas of its kind / (DP×CP).
inline Tensor mean_full_grad(const Model& m, size_t i, int step) {
  const int n = specs()[i].expert ? m.grid->layout().expert_dp_size()
                                  : m.grid->layout().dp_size() * m.grid->layout().cp_size();
  const int divisor = m.grid->layout().dp_size() * m.grid->layout().cp_size();
  Tensor acc = Tensor::zeros(specs()[i].full);
  std::vector<double> sum(size_t(acc.numel()), 0.0);
  for (int r = 0; r < n; ++r) {
    const std::vector<double> g = full_grad(i, r, step).to_double_vector();
    for (size_t k = 0; k < g.size(); ++k) sum[k] += g[k];
  }
  std::vector<float> mean(sum.size());
  for (size_t k = 0; k < sum.size(); ++k) mean[k] = float(sum[k] / divisor);
  return Tensor::from_vector<float>(mean, specs()[i].full);
}

/// The layouts of `world` ranks to test: (TP, expert-TP, EP) with EP 2 and 4, those the grid accepts.
inline std::vector<parallel::ParallelConfig> layouts(int world) {
  std::vector<parallel::ParallelConfig> out;
  const int cand[][3] = {{1, 1, 2}, {1, 1, 4}, {2, 1, 2}, {2, 2, 2}, {1, 2, 2}};
  for (const auto& c : cand) {
    parallel::ParallelConfig pc;
    pc.tensor = c[0];
    pc.expert_tensor = c[1];
    pc.expert = c[2];
    try {
      parallel::GridLayout::validate(pc, world);
    } catch (const ConfigError&) {
      continue;
    }
    out.push_back(pc);
  }
  return out;
}

/// max |a − b| over two tensors of equal size (any dtype and device).
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_double_vector(), y = b.to_double_vector();
  REQUIRE(x.size() == y.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

inline std::string describe(const parallel::ParallelConfig& pc) {
  return "TP " + std::to_string(pc.tensor) + " expert-TP " + std::to_string(pc.expert_tensor) + " EP " +
         std::to_string(pc.expert);
}

}  // namespace expert_test
