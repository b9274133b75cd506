#include "megacore/pipeline/schedule.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "megacore/core/error.hpp"

namespace megacore::pipeline {

std::string_view schedule_kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::NoPipelining: return "no_pipelining";
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::Interleaved1F1B: return "interleaved_1f1b";
  }
  return "?";
}

std::string_view op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::Forward: return "F";
    case OpKind::Backward: return "B";
    case OpKind::SendForward: return "SendForward";
    case OpKind::RecvForward: return "RecvForward";
    case OpKind::SendBackward: return "SendBackward";
    case OpKind::RecvBackward: return "RecvBackward";
  }
  return "?";
}

std::string to_string(const Op& op) {
  if (op.is_compute()) return fmt::format("{}(mb {}, chunk {})", op_kind_name(op.kind), op.microbatch, op.chunk);
  const bool send = op.kind == OpKind::SendForward || op.kind == OpKind::SendBackward;
  return fmt::format("{}(mb {}, chunk {} {} rank {})", op_kind_name(op.kind), op.microbatch, op.chunk,
                     send ? "->" : "<-", op.peer);
}

ScheduleConfig make_schedule_config(int pipeline_parallel, int virtual_stages, int64_t num_microbatches) {
  ScheduleConfig c;
  c.pipeline_parallel = pipeline_parallel;
  c.virtual_stages = virtual_stages;
  c.num_microbatches = num_microbatches;
  c.kind = pipeline_parallel == 1 && virtual_stages == 1 ? ScheduleKind::NoPipelining
           : virtual_stages == 1                         ? ScheduleKind::OneFOneB
                                                         : ScheduleKind::Interleaved1F1B;
  return c;
}

void validate(const ScheduleConfig& cfg) {
  const int pp = cfg.pipeline_parallel, vp = cfg.virtual_stages;
  const int64_t m = cfg.num_microbatches;
  const auto name = schedule_kind_name(cfg.kind);
  MC_CHECK_AS(ConfigError, pp >= 1, "pipeline_parallel is {}; it must be >= 1", pp);
  MC_CHECK_AS(ConfigError, vp >= 1, "virtual_stages is {}; it must be >= 1 (1 = no interleaving)", vp);
  MC_CHECK_AS(ConfigError, m >= 1,
              "num_microbatches is {}; a step needs at least one micro-batch (raise global_batch_size "
              "to at least micro_batch_size × data_parallel)",
              m);
  switch (cfg.kind) {
    case ScheduleKind::NoPipelining:
      MC_CHECK_AS(ConfigError, pp == 1 && vp == 1,
                  "the {} schedule runs the whole model on one stage but pipeline_parallel = {}, "
                  "virtual_stages = {}; use the 1f1b (or, with virtual_stages > 1, interleaved_1f1b) schedule",
                  name, pp, vp);
      break;
    case ScheduleKind::OneFOneB:
      MC_CHECK_AS(ConfigError, vp == 1,
                  "the {} schedule has one model chunk per rank but virtual_stages = {}; use the "
                  "interleaved_1f1b schedule or set virtual_stages = 1",
                  name, vp);
      break;
    case ScheduleKind::Interleaved1F1B:
      MC_CHECK_AS(ConfigError, pp >= 2,
                  "the {} schedule needs pipeline_parallel >= 2 (got {}); set virtual_stages = 1 or use "
                  "more pipeline stages",
                  name, pp);
      MC_CHECK_AS(ConfigError, m >= pp,
                  "the {} schedule needs at least pipeline_parallel = {} micro-batches but has {}; raise "
                  "global_batch_size (or lower micro_batch_size) so num_microbatches >= {}, or set "
                  "virtual_stages = 1",
                  name, pp, m, pp);
      // Micro-batches enter the chunks in groups of PP; a partial group would leave the ordering
      // (and the warm-up count that keeps it deadlock-free) undefined.
      MC_CHECK_AS(ConfigError, m % pp == 0,
                  "the {} schedule needs num_microbatches ({}) to be a multiple of pipeline_parallel ({}); "
                  "adjust global_batch_size so num_microbatches is {} or {}, or set virtual_stages = 1",
                  name, m, pp, m / pp * pp, (m / pp + 1) * pp);
      break;
  }
}

int64_t num_microbatches(int64_t global_batch, int64_t micro_batch, int64_t data_parallel) {
  MC_CHECK_AS(ConfigError, global_batch >= 1, "global_batch_size is {}; it must be >= 1", global_batch);
  MC_CHECK_AS(ConfigError, micro_batch >= 1, "micro_batch_size is {}; it must be >= 1", micro_batch);
  MC_CHECK_AS(ConfigError, data_parallel >= 1, "data_parallel is {}; it must be >= 1", data_parallel);
  const int64_t per_step = micro_batch * data_parallel;
  MC_CHECK_AS(ConfigError, global_batch % per_step == 0,
              "global_batch_size {} is not divisible by micro_batch_size × data_parallel = {} × {} = {}; "
              "use a global_batch_size that is a multiple of {} (the nearest above is {}), or change "
              "micro_batch_size",
              global_batch, micro_batch, data_parallel, per_step, per_step,
              (global_batch / per_step + 1) * per_step);
  return global_batch / per_step;
}

namespace {

struct Work {
  int64_t microbatch;
  int chunk;
};

void check_rank(const ScheduleConfig& cfg, int pp_rank) {
  MC_CHECK(pp_rank >= 0 && pp_rank < cfg.pipeline_parallel, "pp_rank {} is out of range [0, {})", pp_rank,
           cfg.pipeline_parallel);
}

int64_t warmup_unchecked(const ScheduleConfig& cfg, int rank) {
  const int64_t pp = cfg.pipeline_parallel, vp = cfg.virtual_stages, m = cfg.num_microbatches;
  switch (cfg.kind) {
    case ScheduleKind::NoPipelining: return 0;
    case ScheduleKind::OneFOneB: return std::min(pp - rank - 1, m);
    case ScheduleKind::Interleaved1F1B:
      // With exactly PP micro-batches the steady state never reaches a full group, so every forward
      // runs first (as Megatron-Core does); otherwise 2 per downstream rank plus the extra chunks.
      if (m == pp) return m * vp;
      return std::min((pp - rank - 1) * 2 + (vp - 1) * pp, m * vp);
  }
  return 0;
}

// The order in which a rank runs its forwards / backwards (the same on every rank).
std::vector<Work> compute_order(const ScheduleConfig& cfg, bool forward) {
  const int64_t pp = cfg.pipeline_parallel, vp = cfg.virtual_stages, m = cfg.num_microbatches;
  std::vector<Work> order;
  order.reserve(static_cast<size_t>(m * vp));
  for (int64_t k = 0; k < m * vp; ++k) {
    const int64_t in_group = k % (pp * vp);
    int chunk = static_cast<int>(in_group / pp);
    if (!forward) chunk = static_cast<int>(vp) - 1 - chunk;
    order.push_back({k / (pp * vp) * pp + k % pp, chunk});
  }
  return order;
}

class Builder {
 public:
  Builder(const ScheduleConfig& cfg, int rank) : pp_(cfg.pipeline_parallel), rank_(rank),
      num_stages_(cfg.pipeline_parallel * cfg.virtual_stages) {}

  void forward(const Work& w) {
    const int s = stage(w.chunk);
    if (s > 0) ops_.push_back({OpKind::RecvForward, w.microbatch, w.chunk, rank_of(s - 1)});
    ops_.push_back({OpKind::Forward, w.microbatch, w.chunk, -1});
    if (s < num_stages_ - 1) ops_.push_back({OpKind::SendForward, w.microbatch, w.chunk, rank_of(s + 1)});
  }
  void backward(const Work& w) {
    const int s = stage(w.chunk);
    if (s < num_stages_ - 1) ops_.push_back({OpKind::RecvBackward, w.microbatch, w.chunk, rank_of(s + 1)});
    ops_.push_back({OpKind::Backward, w.microbatch, w.chunk, -1});
    if (s > 0) ops_.push_back({OpKind::SendBackward, w.microbatch, w.chunk, rank_of(s - 1)});
  }
  std::vector<Op> take() { return std::move(ops_); }

 private:
  int stage(int chunk) const { return chunk * pp_ + rank_; }
  int rank_of(int stage) const { return stage % pp_; }

  int pp_, rank_, num_stages_;
  std::vector<Op> ops_;
};

}  // namespace

int64_t num_warmup_forwards(const ScheduleConfig& cfg, int pp_rank) {
  validate(cfg);
  check_rank(cfg, pp_rank);
  return warmup_unchecked(cfg, pp_rank);
}

std::vector<Op> rank_schedule(const ScheduleConfig& cfg, int pp_rank) {
  const int64_t warmup = num_warmup_forwards(cfg, pp_rank);
  const auto fwd = compute_order(cfg, true);
  const auto bwd = compute_order(cfg, false);
  const int64_t total = static_cast<int64_t>(fwd.size());
  Builder b(cfg, pp_rank);
  for (int64_t i = 0; i < warmup; ++i) b.forward(fwd[i]);
  for (int64_t i = 0; i < total - warmup; ++i) {  // steady state: one forward, one backward
    b.forward(fwd[warmup + i]);
    b.backward(bwd[i]);
  }
  for (int64_t i = total - warmup; i < total; ++i) b.backward(bwd[i]);  // cool-down
  return b.take();
}

double theoretical_bubble_fraction(const ScheduleConfig& cfg) {
  validate(cfg);
  const double pp = cfg.pipeline_parallel, vp = cfg.virtual_stages, m = static_cast<double>(cfg.num_microbatches);
  switch (cfg.kind) {
    case ScheduleKind::NoPipelining: return 0.0;
    case ScheduleKind::OneFOneB: return (pp - 1) / (m + pp - 1);
    case ScheduleKind::Interleaved1F1B: return (pp - 1) / (vp * m + pp - 1);
  }
  return 0.0;
}

}  // namespace megacore::pipeline
