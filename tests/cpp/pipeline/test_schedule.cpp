// Pipeline stage layouts and schedules, checked as data on one process.
//
// For every (PP, VP, m) setting each rank's op list is checked against the schedule's definition
// (forward/backward order, warm-up length, in-flight bound), and then all ranks are executed together
// by a small simulator: sends go into per-(src, dst, direction) FIFO channels, a receive blocks until
// the head of its channel is there and must be exactly the (micro-batch, stage) it expects, compute
// ops take one time unit and communication none. A schedule that cannot finish is a deadlock; one that
// finishes gives each rank's idle fraction, compared with the theoretical bubble.
#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include "megacore/model/transformer_config.hpp"
#include "megacore/pipeline/layout.hpp"
#include "megacore/pipeline/schedule.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::pipeline;

namespace {

template <class F>
std::string config_error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<no ConfigError>";
}

struct SimResult {
  bool deadlock = false;
  std::string error;                 // first mismatch found, empty when none
  int64_t makespan = 0;
  std::vector<int64_t> busy;         // compute time units per rank
};

// Executes all ranks' schedules together; see the file comment for the model.
SimResult simulate(const ScheduleConfig& cfg, const std::vector<std::vector<Op>>& ops) {
  const int pp = cfg.pipeline_parallel, num_stages = pp * cfg.virtual_stages;
  struct Msg {
    int64_t microbatch;
    int stage;
    int64_t ready;
  };
  std::map<std::tuple<int, int, bool>, std::vector<Msg>> channels;  // (src, dst, is_grad) -> FIFO
  std::map<std::tuple<int, int, bool>, size_t> heads;
  std::vector<size_t> pc(pp, 0);
  std::vector<int64_t> clock(pp, 0);
  SimResult r;
  r.busy.assign(pp, 0);
  auto fail = [&](int rank, const Op& op, const std::string& why) {
    if (r.error.empty()) r.error = fmt::format("rank {} at {}: {}", rank, to_string(op), why);
  };
  bool progress = true;
  while (progress && r.error.empty()) {
    progress = false;
    for (int rank = 0; rank < pp; ++rank) {
      while (pc[rank] < ops[rank].size() && r.error.empty()) {
        const Op& op = ops[rank][pc[rank]];
        const int stage = op.chunk * pp + rank;
        if (op.is_compute()) {
          clock[rank] += 1;
          r.busy[rank] += 1;
        } else {
          const bool fwd = op.kind == OpKind::SendForward || op.kind == OpKind::RecvForward;
          const bool send = op.kind == OpKind::SendForward || op.kind == OpKind::SendBackward;
          // Activations flow to stage + 1, gradients to stage - 1.
          const int other = send == fwd ? stage + 1 : stage - 1;
          if (other < 0 || other >= num_stages) {
            fail(rank, op, "communicates past the end of the pipeline");
            break;
          }
          if (op.peer != other % pp) {
            fail(rank, op, fmt::format("peer should be rank {}", other % pp));
            break;
          }
          if (send) {
            channels[{rank, op.peer, !fwd}].push_back({op.microbatch, stage, clock[rank]});
          } else {
            auto key = std::make_tuple(op.peer, rank, !fwd);
            auto& q = channels[key];
            size_t& h = heads[key];
            if (h == q.size()) break;  // blocked until the peer sends
            const Msg m = q[h++];
            if (m.microbatch != op.microbatch || m.stage != other) {
              fail(rank, op, fmt::format("received mb {} from stage {} instead (out of order)", m.microbatch, m.stage));
              break;
            }
            clock[rank] = std::max(clock[rank], m.ready);
          }
        }
        ++pc[rank];
        progress = true;
      }
    }
  }
  for (int rank = 0; rank < pp; ++rank) {
    if (pc[rank] < ops[rank].size()) r.deadlock = true;
    r.makespan = std::max(r.makespan, clock[rank]);
  }
  if (!r.deadlock && r.error.empty()) {
    for (auto& [key, q] : channels) {
      if (heads[key] != q.size()) r.error = "a message was sent but never received";
    }
  }
  return r;
}

// The definition, restated independently of the library: forward order over virtual micro-batches.
std::pair<int64_t, int> virtual_mb(const ScheduleConfig& c, int64_t k, bool forward) {
  const int64_t pp = c.pipeline_parallel, vp = c.virtual_stages;
  int chunk = static_cast<int>((k % (pp * vp)) / pp);
  if (!forward) chunk = static_cast<int>(vp) - 1 - chunk;
  return {k / (pp * vp) * pp + k % pp, chunk};
}

int64_t expected_warmup(const ScheduleConfig& c, int rank) {
  const int64_t pp = c.pipeline_parallel, vp = c.virtual_stages, m = c.num_microbatches;
  if (c.kind == ScheduleKind::NoPipelining) return 0;
  if (c.kind == ScheduleKind::OneFOneB) return std::min(pp - rank - 1, m);
  if (m == pp) return m * vp;
  return std::min((pp - rank - 1) * 2 + (vp - 1) * pp, m * vp);
}

}  // namespace

TEST_CASE("schedules: every rank's ops follow the definition and the pipeline runs without deadlock",
          "[pipeline]") {
  for (int pp : {1, 2, 4}) {
    for (int vp : {1, 2}) {
      if (pp == 1 && vp == 2) continue;  // refused; see the refusal test
      std::set<int64_t> ms = {pp, 2 * pp, 8};
      for (int64_t m : ms) {
        const ScheduleConfig cfg = make_schedule_config(pp, vp, m);
        INFO(fmt::format("{} PP={} VP={} m={}", schedule_kind_name(cfg.kind), pp, vp, m));
        std::vector<std::vector<Op>> all;
        for (int rank = 0; rank < pp; ++rank) {
          INFO("rank " << rank);
          const auto ops = rank_schedule(cfg, rank);
          all.push_back(ops);
          std::vector<std::pair<int64_t, int>> fwd, bwd;
          int64_t in_flight = 0, max_in_flight = 0, warmup = -1;
          std::set<std::pair<int64_t, int>> done_fwd;
          for (const Op& op : ops) {
            if (op.kind == OpKind::Forward) {
              fwd.emplace_back(op.microbatch, op.chunk);
              REQUIRE(done_fwd.insert({op.microbatch, op.chunk}).second);
              max_in_flight = std::max(max_in_flight, ++in_flight);
            } else if (op.kind == OpKind::Backward) {
              if (warmup < 0) warmup = static_cast<int64_t>(fwd.size()) - 1;  // the steady F before it
              REQUIRE(done_fwd.count({op.microbatch, op.chunk}) == 1);        // backward after its forward
              bwd.emplace_back(op.microbatch, op.chunk);
              --in_flight;
            }
          }
          // Every (micro-batch, chunk) exactly once each way, in the defined order.
          REQUIRE(fwd.size() == static_cast<size_t>(m * vp));
          REQUIRE(bwd.size() == fwd.size());
          REQUIRE(std::set(bwd.begin(), bwd.end()).size() == bwd.size());
          for (int64_t k = 0; k < m * vp; ++k) {
            REQUIRE(fwd[k] == virtual_mb(cfg, k, true));
            REQUIRE(bwd[k] == virtual_mb(cfg, k, false));
          }
          // Warm-up: forwards before the first backward, less the steady-state forward (if any).
          const int64_t want = expected_warmup(cfg, rank);
          REQUIRE(num_warmup_forwards(cfg, rank) == want);
          if (want == m * vp) {
            REQUIRE(warmup == m * vp - 1);  // no steady state: the counting above saw the last F
          } else {
            REQUIRE(warmup == want);
          }
          // 1F1B's memory bound: at most PP − rank micro-batches' activations alive at once.
          if (cfg.kind != ScheduleKind::Interleaved1F1B) {
            REQUIRE(max_in_flight <= pp - rank);
            REQUIRE(max_in_flight == std::min<int64_t>(pp - rank, m));
          }
          // Steady state alternates one forward and one backward.
          std::vector<OpKind> compute;
          for (const Op& op : ops) {
            if (op.is_compute()) compute.push_back(op.kind);
          }
          for (int64_t i = 0; i < m * vp - want; ++i) {
            REQUIRE(compute[want + 2 * i] == OpKind::Forward);
            REQUIRE(compute[want + 2 * i + 1] == OpKind::Backward);
          }
        }
        const SimResult sim = simulate(cfg, all);
        INFO(sim.error);
        REQUIRE(sim.error.empty());
        REQUIRE_FALSE(sim.deadlock);
        // With unit-cost stages and free communication every rank idles for the same time; 1F1B and
        // no pipelining reach the theoretical bubble exactly, interleaving never beats its theory.
        const double theory = theoretical_bubble_fraction(cfg);
        for (int rank = 0; rank < pp; ++rank) {
          const double idle = 1.0 - static_cast<double>(sim.busy[rank]) / static_cast<double>(sim.makespan);
          INFO("rank " << rank << " simulated idle " << idle << " theory " << theory);
          if (cfg.kind == ScheduleKind::Interleaved1F1B) {
            REQUIRE(idle >= theory - 1e-12);
          } else {
            REQUIRE(idle == Approx(theory).margin(1e-12));
          }
        }
      }
    }
  }
}

TEST_CASE("schedules: the simulator catches a deadlock and an out-of-order receive", "[pipeline]") {
  const ScheduleConfig cfg = make_schedule_config(2, 1, 4);
  std::vector<std::vector<Op>> all = {rank_schedule(cfg, 0), rank_schedule(cfg, 1)};
  REQUIRE(simulate(cfg, all).error.empty());

  // Rank 0 waiting for a gradient before sending any activation: nobody can move.
  auto stuck = all;
  stuck[0].insert(stuck[0].begin(), Op{OpKind::RecvBackward, 0, 0, 1});
  REQUIRE(simulate(cfg, stuck).deadlock);

  // Rank 1 consuming micro-batches 0 and 1 in the wrong order.
  auto swapped = all;
  for (Op& op : swapped[1]) {
    if (op.kind == OpKind::RecvForward && op.microbatch <= 1) op.microbatch = 1 - op.microbatch;
  }
  REQUIRE_FALSE(simulate(cfg, swapped).error.empty());
}

TEST_CASE("schedules: exact op lists for small cases", "[pipeline]") {
  using K = OpKind;
  // No pipelining: gradient accumulation, no communication.
  REQUIRE(rank_schedule(make_schedule_config(1, 1, 2), 0) ==
          std::vector<Op>{{K::Forward, 0, 0, -1}, {K::Backward, 0, 0, -1}, {K::Forward, 1, 0, -1},
                          {K::Backward, 1, 0, -1}});
  // 1F1B, PP = 2, m = 2: rank 0 warms up with one forward.
  REQUIRE(rank_schedule(make_schedule_config(2, 1, 2), 0) ==
          std::vector<Op>{{K::Forward, 0, 0, -1},      {K::SendForward, 0, 0, 1},  {K::Forward, 1, 0, -1},
                          {K::SendForward, 1, 0, 1},   {K::RecvBackward, 0, 0, 1}, {K::Backward, 0, 0, -1},
                          {K::RecvBackward, 1, 0, 1},  {K::Backward, 1, 0, -1}});
  REQUIRE(rank_schedule(make_schedule_config(2, 1, 2), 1) ==
          std::vector<Op>{{K::RecvForward, 0, 0, 0}, {K::Forward, 0, 0, -1}, {K::Backward, 0, 0, -1},
                          {K::SendBackward, 0, 0, 0}, {K::RecvForward, 1, 0, 0}, {K::Forward, 1, 0, -1},
                          {K::Backward, 1, 0, -1},    {K::SendBackward, 1, 0, 0}});
  // Interleaved, PP = 2, VP = 2, m = 4: rank 1's chunk 0 feeds rank 0's chunk 1 (the wrap).
  const auto r1 = rank_schedule(make_schedule_config(2, 2, 4), 1);
  REQUIRE(r1[0] == Op{K::RecvForward, 0, 0, 0});
  REQUIRE(r1[2] == Op{K::SendForward, 0, 0, 0});
  REQUIRE(to_string(r1[2]) == "SendForward(mb 0, chunk 0 -> rank 0)");
  REQUIRE(num_warmup_forwards(make_schedule_config(2, 2, 4), 0) == 4);  // (2-0-1)·2 + (2-1)·2
  REQUIRE(num_warmup_forwards(make_schedule_config(2, 2, 4), 1) == 2);
  REQUIRE(num_warmup_forwards(make_schedule_config(4, 2, 4), 3) == 8);  // m = PP: all forwards first
}

TEST_CASE("schedules: micro-batch count and theoretical bubble", "[pipeline]") {
  REQUIRE(num_microbatches(256, 2, 4) == 32);
  REQUIRE(num_microbatches(8, 8, 1) == 1);
  REQUIRE(theoretical_bubble_fraction(make_schedule_config(1, 1, 8)) == 0.0);
  REQUIRE(theoretical_bubble_fraction(make_schedule_config(4, 1, 8)) == Approx(3.0 / 11.0));
  REQUIRE(theoretical_bubble_fraction(make_schedule_config(4, 2, 8)) == Approx(3.0 / 19.0));
  REQUIRE(make_schedule_config(1, 1, 4).kind == ScheduleKind::NoPipelining);
  REQUIRE(make_schedule_config(2, 1, 4).kind == ScheduleKind::OneFOneB);
  REQUIRE(make_schedule_config(2, 2, 4).kind == ScheduleKind::Interleaved1F1B);
}

TEST_CASE("schedules: refused configurations name the fix", "[pipeline]") {
  using Catch::Contains;
  auto cfg = [](ScheduleKind k, int pp, int vp, int64_t m) {
    ScheduleConfig c;
    c.kind = k;
    c.pipeline_parallel = pp;
    c.virtual_stages = vp;
    c.num_microbatches = m;
    return c;
  };
  const auto I = ScheduleKind::Interleaved1F1B;
  CHECK_THAT(config_error_of([&] { validate(cfg(I, 4, 2, 2)); }),
             Contains("needs at least pipeline_parallel = 4 micro-batches but has 2") &&
                 Contains("num_microbatches >= 4"));
  CHECK_THAT(config_error_of([&] { rank_schedule(cfg(I, 4, 2, 6), 0); }),
             Contains("num_microbatches (6) to be a multiple of pipeline_parallel (4)") && Contains("4 or 8"));
  CHECK_THAT(config_error_of([&] { validate(cfg(I, 1, 2, 4)); }), Contains("needs pipeline_parallel >= 2"));
  CHECK_THAT(config_error_of([&] { validate(cfg(ScheduleKind::NoPipelining, 2, 1, 4)); }),
             Contains("use the 1f1b"));
  CHECK_THAT(config_error_of([&] { validate(cfg(ScheduleKind::OneFOneB, 2, 2, 4)); }),
             Contains("use the interleaved_1f1b schedule or set virtual_stages = 1"));
  CHECK_THAT(config_error_of([&] { validate(cfg(ScheduleKind::OneFOneB, 2, 1, 0)); }),
             Contains("at least one micro-batch"));
  CHECK_THAT(config_error_of([&] { validate(cfg(ScheduleKind::OneFOneB, 0, 1, 4)); }),
             Contains("pipeline_parallel is 0"));
  CHECK_THAT(config_error_of([&] { num_microbatches(100, 4, 8); }),
             Contains("global_batch_size 100 is not divisible by micro_batch_size × data_parallel = 4 × 8 = 32") &&
                 Contains("nearest above is 128"));
  CHECK_THAT(config_error_of([&] { num_microbatches(8, 0, 1); }), Contains("micro_batch_size is 0"));
  CHECK_THROWS_AS(rank_schedule(make_schedule_config(2, 1, 4), 2), ValueError);
  // 1F1B itself accepts fewer micro-batches than stages (just a bigger bubble).
  CHECK_NOTHROW(validate(make_schedule_config(4, 1, 2)));
}

TEST_CASE("layout: even and explicit splits give the right global layers", "[pipeline]") {
  const auto even = PipelineLayout::uniform(80, 4);
  for (int r = 0; r < 4; ++r) {
    REQUIRE(even.range(r, 0).first == 20 * r);
    REQUIRE(even.range(r, 0).count == 20);
  }
  // Interleaved: stages in model order chunk·PP + rank, so rank 0 holds layers 0-1 and 4-5.
  const auto inter = PipelineLayout::uniform(8, 2, 2);
  REQUIRE(inter.layer_indices(0, 0) == std::vector<int64_t>{0, 1});
  REQUIRE(inter.layer_indices(1, 0) == std::vector<int64_t>{2, 3});
  REQUIRE(inter.layer_indices(0, 1) == std::vector<int64_t>{4, 5});
  REQUIRE(inter.layer_indices(1, 1) == std::vector<int64_t>{6, 7});
  REQUIRE(inter.num_layers_on_rank(1) == 4);
  REQUIRE(inter.has_embedding(0, 0));
  REQUIRE_FALSE(inter.has_embedding(0, 1));
  REQUIRE(inter.has_head(1, 1));
  REQUIRE_FALSE(inter.has_head(1, 0));

  // Embedding + 5 / 6 / 6 / 5 + head.
  const auto expl = PipelineLayout::from_counts(22, 4, 1, {5, 6, 6, 5});
  REQUIRE(expl.layer_indices(0, 0) == std::vector<int64_t>{0, 1, 2, 3, 4});
  REQUIRE(expl.range(1, 0).first == 5);
  REQUIRE(expl.range(2, 0).first == 11);
  REQUIRE(expl.layer_indices(3, 0) == std::vector<int64_t>{17, 18, 19, 20, 21});
  REQUIRE(expl.has_embedding(0, 0));
  REQUIRE(expl.has_head(3, 0));
  // Empty stages are allowed (e.g. a stage that only holds the head).
  const auto empty_last = PipelineLayout::from_counts(8, 2, 2, {3, 3, 2, 0});
  REQUIRE(empty_last.layer_indices(1, 1).empty());
  REQUIRE(empty_last.layer_indices(0, 1) == std::vector<int64_t>{6, 7});
  REQUIRE_THROWS_AS(empty_last.range(2, 0), ValueError);
  REQUIRE_THROWS_AS(empty_last.range(0, 2), ValueError);
}

TEST_CASE("layout: balanced splits minimise the largest stage cost", "[pipeline]") {
  // Brute force over every split of L layers into S stages (small cases) gives the optimum to match. A stage of n
  // layers costs n, plus a third for each of its first N when block recompute (N >= 0) runs their forward again.
  auto stage_cost = [](int64_t n, int64_t N) { return double(n) + (N < 0 ? 0.0 : double(std::min(n, N)) / 3.0); };
  auto best_max = [&](int64_t L, size_t S, const std::vector<double>& extra, int64_t N) {
    double best = 1e300;
    std::vector<int64_t> c(S, 0);
    std::function<void(size_t, int64_t)> rec = [&](size_t s, int64_t left) {
      if (s + 1 == S) {
        c[s] = left;
        double m = 0;
        for (size_t i = 0; i < S; ++i) m = std::max(m, stage_cost(c[i], N) + extra[i]);
        best = std::min(best, m);
        return;
      }
      for (int64_t n = 0; n <= left; ++n) {
        c[s] = n;
        rec(s + 1, left - n);
      }
    };
    rec(0, L);
    return best;
  };
  std::mt19937_64 rng(20261126), rng_block(20270124);
  for (int trial = 0; trial < 400; ++trial) {
    // The first 200 trials without block recompute, the next 200 with N = 0..3 recomputed layers per stage.
    const int64_t N = trial < 200 ? -1 : int64_t(rng_block() % 4);
    const int pp = 1 + int(rng() % 4), vp = 1 + int(rng() % 2);
    const int64_t L = 1 + int64_t(rng() % 14);
    const StageCosts costs{double(rng() % 100) / 50.0, double(rng() % 300) / 50.0, N};
    const auto lay = PipelineLayout::balanced(L, pp, vp, costs);
    const size_t S = size_t(pp) * size_t(vp);
    std::vector<double> extra(S, 0.0);
    extra.front() += costs.embedding;
    extra.back() += costs.head;
    double got = 0;
    int64_t sum = 0;
    for (size_t s = 0; s < S; ++s) {
      got = std::max(got, stage_cost(lay.counts()[s], N) + extra[s]);
      sum += lay.counts()[s];
    }
    INFO("L " << L << " pp " << pp << " vp " << vp << " emb " << costs.embedding << " head " << costs.head << " N "
              << N);
    REQUIRE(sum == L);
    REQUIRE(got == Approx(best_max(L, S, extra, N)).margin(1e-12));
  }
  // Worked cases: the head of a 32k-vocabulary model costs ~0.9 layer.
  REQUIRE(PipelineLayout::balanced(15, 4, 1, {0.0, 0.86}).counts() == std::vector<int64_t>{4, 4, 4, 3});
  REQUIRE(PipelineLayout::balanced(16, 4, 1, {0.0, 0.86}).counts() == std::vector<int64_t>{4, 4, 4, 4});
  REQUIRE(PipelineLayout::balanced(16, 4, 1, {0.0, 0.0}).counts() == std::vector<int64_t>{4, 4, 4, 4});
  REQUIRE(PipelineLayout::balanced(22, 4, 1, {1.0, 1.0}).counts() == std::vector<int64_t>{5, 6, 6, 5});
  REQUIRE(PipelineLayout::balanced(4, 2, 1, {0.0, 10.0}).counts() == std::vector<int64_t>{4, 0});
  // Several optimal splits: layers come off the earliest costliest stage (it holds the most activations).
  REQUIRE(PipelineLayout::balanced(16, 4, 1, {0.0, 2.0}).counts() == std::vector<int64_t>{4, 4, 5, 3});
  CHECK_THAT(config_error_of([] { PipelineLayout::balanced(8, 2, 1, {-1.0, 0.0}); }),
             Catch::Contains("embedding cost is -1"));
  CHECK_THAT(config_error_of([] { PipelineLayout::balanced(8, 2, 1, {0.0, std::nan("")}); }),
             Catch::Contains("head cost is nan"));
}

TEST_CASE("layout: stage costs from the model's shape balance llama32_1b", "[pipeline]") {
  // Expected costs from the shapes, written out here: Llama 3.2 1B, h 2048, 32 heads × 64, 8 KV groups, SwiGLU
  // FFN 8192, vocab 128256 (a multiple of 128·TP for TP 1 and 2; padded to 128512 = 251·512 for TP 4), seq 2048.
  // Per token, fwd + bwd: a layer's weights 6·W, its causal attention 6·h·s (QK^T and AV over the lower
  // triangle), the output layer 6·V·h.
  const double h = 2048, s = 2048, V = 128256, kv = 8 * 64, f = 8192;
  const double W = h * (h + 2 * kv) + h * h + h * 2 * f + f * h;
  const double attn = 6 * h * s;
  const double expect_none = 6 * V * h / (6 * W + attn);
  const double expect_selective = 6 * V * h / (6 * W + attn * 4 / 3);
  const double expect_full = 6 * V * h / ((6 * W + attn) * 4 / 3);
  model::TransformerConfig cfg = model::presets::llama32_1b();
  for (int tp : {1, 2, 4}) {
    const StageCosts c = stage_costs_from_model(cfg, 2048, tp);
    CHECK(c.embedding == 0.0);
    CHECK(c.head == Approx(expect_none * (tp == 4 ? 128512.0 / V : 1.0)).epsilon(1e-12));
  }
  CHECK(expect_none == Approx(4.04).margin(0.01));
  cfg.recompute_granularity = model::RecomputeGranularity::Selective;
  CHECK(stage_costs_from_model(cfg, 2048, 2).head == Approx(expect_selective).epsilon(1e-12));
  cfg.recompute_granularity = model::RecomputeGranularity::Full;
  CHECK(stage_costs_from_model(cfg, 2048, 2).head == Approx(expect_full).epsilon(1e-12));
  cfg.recompute_granularity = model::RecomputeGranularity::None;
  // A padded vocabulary is extra work on every TP rank: 1000 padded to 1024 (make_vocab_size_divisible_by 128 × 8).
  model::TransformerConfig odd = cfg;
  odd.vocab_size = 1000;
  CHECK(stage_costs_from_model(odd, 2048, 8).head ==
        Approx(6 * 1024.0 * h / (6 * W + attn)).epsilon(1e-12));

  // The auto layouts are balanced()'s for those costs: 10 + 6 (+ head ≈ 4.0) at PP 2; by virtual stage 5, 5, 5, 1
  // at PP 2 VP 2 (rank 0: 10 layers, rank 1: 6 + head) and at PP 4.
  const StageCosts autoc = resolve_stage_costs({kAutoStageCost, kAutoStageCost}, cfg, 2048, 1);
  CHECK(autoc.embedding == 0.0);
  CHECK(autoc.head == Approx(expect_none).epsilon(1e-12));
  for (auto [pp, vp, want] : std::vector<std::tuple<int, int, std::vector<int64_t>>>{
           {2, 1, {10, 6}}, {2, 2, {5, 5, 5, 1}}, {4, 1, {5, 5, 5, 1}}}) {
    const PipelineLayout lay = choose_layout(16, pp, vp, {}, autoc);
    CHECK(lay.counts() == PipelineLayout::balanced(16, pp, vp, {0.0, expect_none}).counts());
    CHECK(lay.counts() == want);
  }
  // With VP > 1 where the head outweighs a chunk, the ranks' totals are balanced (balanced() at VP 1) and each
  // rank's layers split over its chunks: per-virtual-stage balancing would give 2, 2, 2, 2, 2, 3, 3, 0 (ranks 4, 5,
  // 5, 6 + head) at PP 4 × VP 2 and ranks 9, 7 + head at PP 2 × VP 4.
  CHECK(PipelineLayout::balanced(16, 4, 2, autoc).counts() == std::vector<int64_t>{2, 2, 2, 2, 2, 3, 3, 0});
  CHECK(choose_layout(16, 4, 2, {}, autoc).counts() == std::vector<int64_t>{2, 2, 2, 1, 3, 3, 3, 0});
  CHECK(rank_work(choose_layout(16, 4, 2, {}, autoc), autoc) == std::vector<double>{5, 5, 5, 1 + autoc.head});
  CHECK(choose_layout(16, 2, 4, {}, autoc).counts() == std::vector<int64_t>{2, 2, 2, 2, 3, 2, 3, 0});
  CHECK(rank_work(choose_layout(16, 2, 4, {}, autoc), autoc) == std::vector<double>{10, 6 + autoc.head});
  CHECK(rank_work(choose_layout(16, 2, 2, {}, autoc), autoc) ==
        std::vector<double>{10.0, 6.0 + autoc.head});
  CHECK(describe_layout(choose_layout(16, 2, 1, {}, autoc), autoc) ==
        "layers per stage: 10, 6 (head ≈ 4.0 layers; work per stage 10.0, 10.0)");
  CHECK(describe_layout(choose_layout(16, 2, 2, {}, autoc), autoc) ==
        "layers per virtual stage (model order): 5, 5, 5, 1; per stage: 10, 6 (head ≈ 4.0 layers; work per stage "
        "10.0, 10.0)");
  // Explicit costs and explicit counts win; both costs 0 is the even split.
  CHECK(resolve_stage_costs({0.5, 2.0}, cfg, 2048, 1).head == 2.0);
  CHECK(resolve_stage_costs({0.5, kAutoStageCost}, cfg, 2048, 1).embedding == 0.5);
  CHECK(choose_layout(16, 4, 1, {}, resolve_stage_costs({0.0, 2.0}, cfg, 2048, 1)).counts() ==
        std::vector<int64_t>{4, 4, 5, 3});
  CHECK(choose_layout(16, 2, 1, {7, 9}, autoc).counts() == std::vector<int64_t>{7, 9});
  CHECK(choose_layout(16, 4, 1, {}, {0.0, 0.0}).counts() == std::vector<int64_t>{4, 4, 4, 4});
  CHECK_THROWS_AS(choose_layout(15, 4, 1, {}, {0.0, 0.0}), ConfigError);
  CHECK(describe_layout(choose_layout(16, 4, 1, {}, {0.0, 0.0}), {}) == "layers per stage: 4, 4, 4, 4");
}

TEST_CASE("layout: block recompute prices only the first N layers of each chunk at 4/3", "[pipeline]") {
  // Llama 3.2 1B's shape cut to 15 layers, seq 2048, TP 1. Per token, fwd + bwd: a layer's weights 6·W, its
  // causal attention 6·h·s; the output layer 6·V·h ≈ 4.04 layers without recompute (as in the test above).
  const double h = 2048, s = 2048, V = 128256, kv = 8 * 64, f = 8192;
  const double W = h * (h + 2 * kv) + h * h + h * 2 * f + f * h;
  const double plain_head = 6 * V * h / (6 * W + 6 * h * s);
  model::TransformerConfig cfg = model::presets::llama32_1b();
  cfg.num_layers = 15;
  cfg.recompute_granularity = model::RecomputeGranularity::Full;
  // Full recompute of every layer (N = -1): every layer costs 4/3, the unit, so the head is 4.04 · 3/4 ≈ 3.03
  // layers. Stage 0 with n layers against stage 1 with 15 − n + 3.03: n = 9 gives max(9, 9.03) = 9.03, n = 10
  // gives max(10, 8.03) = 10, so {9, 6}.
  const StageCosts every = stage_costs_from_model(cfg, 2048, 1);
  CHECK(every.recompute_num_layers == -1);
  CHECK(every.head == Approx(plain_head * 3 / 4).epsilon(1e-12));
  CHECK(choose_layout(15, 2, 1, {}, every).counts() == std::vector<int64_t>{9, 6});
  // N = -1 is today's pricing exactly: the same costs bit for bit, the same splits and work.
  const StageCosts every_explicit = stage_costs_from_model(cfg, 2048, 1, -1);
  CHECK(every_explicit.head == every.head);
  CHECK(every_explicit.embedding == every.embedding);
  for (auto [L, pp, vp] : std::vector<std::tuple<int64_t, int, int>>{{15, 2, 1}, {16, 4, 1}, {16, 4, 2}, {16, 2, 4}}) {
    const StageCosts legacy{every.embedding, every.head};  // the two-cost form every caller used
    CHECK(choose_layout(L, pp, vp, {}, every).counts() == choose_layout(L, pp, vp, {}, legacy).counts());
    CHECK(rank_work(choose_layout(L, pp, vp, {}, every), every) ==
          rank_work(choose_layout(L, pp, vp, {}, legacy), legacy));
  }
  CHECK(resolve_stage_costs({kAutoStageCost, kAutoStageCost, -1}, cfg, 2048, 1).head == every.head);

  // N = 1 (trainer.recompute_num_layers = 1): only each stage's first layer is recomputed, so the unit is a plain
  // layer, the head 4.04 of them, and a stage of n >= 1 layers costs n + 1/3. {9, 6} costs 9.33 and
  // 6.33 + 4.04 = 10.37; {10, 5} costs 10.33 and 5.33 + 4.04 = 9.37: the better balanced split is {10, 5}, which
  // the every-layer pricing above misses (its last stage would be the bottleneck at 10.37).
  const StageCosts block = stage_costs_from_model(cfg, 2048, 1, 1);
  CHECK(block.recompute_num_layers == 1);
  CHECK(block.embedding == 0.0);
  CHECK(block.head == Approx(plain_head).epsilon(1e-12));
  CHECK(resolve_stage_costs({kAutoStageCost, kAutoStageCost, 1}, cfg, 2048, 1).head == block.head);
  CHECK(PipelineLayout::balanced(15, 2, 1, block).counts() == std::vector<int64_t>{10, 5});
  const PipelineLayout chosen = choose_layout(15, 2, 1, {}, block);
  CHECK(chosen.counts() == std::vector<int64_t>{10, 5});
  const std::vector<double> work = rank_work(chosen, block);
  CHECK(work[0] == Approx(10 + 1.0 / 3).epsilon(1e-12));
  CHECK(work[1] == Approx(5 + 1.0 / 3 + plain_head).epsilon(1e-12));
  const std::vector<double> old_split = rank_work(PipelineLayout::from_counts(15, 2, 1, {9, 6}), block);
  CHECK(old_split[1] == Approx(6 + 1.0 / 3 + plain_head).epsilon(1e-12));
  CHECK(std::max(work[0], work[1]) < std::max(old_split[0], old_split[1]));
  CHECK(describe_layout(chosen, block) ==
        "layers per stage: 10, 5 (head ≈ 4.0 layers, first 1 layer per chunk recomputed: 4/3; work per stage 10.3, "
        "9.4)");
  // The cost of a chunk: n + min(n, N)/3 layers.
  CHECK(layers_cost(0, 2) == 0.0);
  CHECK(layers_cost(1, 2) == Approx(4.0 / 3).epsilon(1e-15));
  CHECK(layers_cost(5, 2) == Approx(5 + 2.0 / 3).epsilon(1e-15));
  CHECK(layers_cost(5, -1) == 5.0);
  // N counts per virtual stage: at PP 2 × VP 2 with N = 1 each of a rank's two chunks recomputes its first layer.
  const PipelineLayout vp2 = PipelineLayout::from_counts(15, 2, 2, {4, 4, 4, 3});
  const std::vector<double> vp2_work = rank_work(vp2, {0.0, 1.0, 1});
  CHECK(vp2_work[0] == Approx(8 + 2.0 / 3).epsilon(1e-12));
  CHECK(vp2_work[1] == Approx(7 + 2.0 / 3 + 1.0).epsilon(1e-12));
  // N at least every chunk's layers recomputes all of them: the split of N = -1 again (a scaled unit).
  CHECK(choose_layout(15, 2, 1, {}, stage_costs_from_model(cfg, 2048, 1, 15)).counts() ==
        choose_layout(15, 2, 1, {}, every).counts());
  // Block recompute is full recompute's: any other granularity is refused, naming the fix.
  cfg.recompute_granularity = model::RecomputeGranularity::Selective;
  CHECK_THAT(config_error_of([&] { stage_costs_from_model(cfg, 2048, 1, 1); }),
             Catch::Contains("recompute_num_layers 1 limits full recompute") && Catch::Contains("selective"));
  CHECK_THAT(config_error_of([&] { resolve_stage_costs({0.0, 1.0, 2}, cfg, 2048, 1); }),
             Catch::Contains("use full recompute, or recompute_num_layers -1"));
}

TEST_CASE("layout: stage costs from a profile recover the embedding and head costs", "[pipeline]") {
  // busy = unit · layers + extras, unit 3.9 ms: the costs come back in layers, for any layout.
  for (auto [pp, vp] : std::vector<std::pair<int, int>>{{2, 1}, {3, 1}, {4, 1}, {4, 2}}) {
    const auto lay = PipelineLayout::uniform(8 * pp * vp, pp, vp);
    std::vector<double> busy(static_cast<size_t>(pp), 0.0);
    for (int r = 0; r < pp; ++r) busy[size_t(r)] = 3.9 * double(lay.num_layers_on_rank(r));
    busy.back() += 3.9 * 0.86;
    if (pp > 2) busy.front() += 3.9 * 0.05;
    const StageCosts c = stage_costs_from_profile(lay, busy);
    REQUIRE(c.head == Approx(0.86));
    REQUIRE(c.embedding == Approx(pp > 2 ? 0.05 : 0.0).margin(1e-12));
  }
  // A profile of a block-recompute run: each rank's first N layers of every chunk took 4/3 of the others.
  for (auto [pp, vp, N] : std::vector<std::tuple<int, int, int64_t>>{{2, 1, 1}, {4, 1, 2}, {4, 2, 1}}) {
    const auto lay = PipelineLayout::from_counts(5 * pp * vp, pp, vp, std::vector<int64_t>(size_t(pp * vp), 5));
    std::vector<double> busy(static_cast<size_t>(pp), 0.0);
    for (int r = 0; r < pp; ++r) busy[size_t(r)] = 3.9 * double(vp) * (5 + double(N) / 3);
    busy.back() += 3.9 * 0.86;
    const StageCosts c = stage_costs_from_profile(lay, busy, N);
    REQUIRE(c.head == Approx(0.86));
    REQUIRE(c.recompute_num_layers == N);
    // Read without N, the recomputed layers would inflate the unit and shrink the head.
    REQUIRE(stage_costs_from_profile(lay, busy).head < 0.86);
  }
  // Noise that makes a stage look cheaper than its layers counts as no extra.
  const auto lay = PipelineLayout::uniform(16, 4);
  REQUIRE(stage_costs_from_profile(lay, {15.6, 15.7, 15.8, 15.65}).head == 0.0);
  REQUIRE(stage_costs_from_profile(PipelineLayout::uniform(4, 1), {1.0}).head == 0.0);
  REQUIRE_THROWS_AS(stage_costs_from_profile(lay, {1.0, 2.0}), ValueError);
  REQUIRE_THROWS_AS(stage_costs_from_profile(lay, {1.0, 0.0, 1.0, 1.0}), ValueError);
}

TEST_CASE("layout: refused layouts name the fix", "[pipeline]") {
  using Catch::Contains;
  CHECK_THAT(config_error_of([] { PipelineLayout::from_counts(80, 4, 1, {16, 16, 16, 16}); }),
             Contains("pipeline layout assigns 64 layers but the model has 80") && Contains("add 16 layers"));
  CHECK_THAT(config_error_of([] { PipelineLayout::from_counts(20, 4, 1, {5, 6, 6, 5}); }),
             Contains("assigns 22 layers but the model has 20") && Contains("remove 2 layers"));
  CHECK_THAT(config_error_of([] { PipelineLayout::from_counts(8, 2, 1, {9, -1}); }),
             Contains("entry 1 (pp_rank 1, virtual chunk 0) is -1"));
  CHECK_THAT(config_error_of([] { PipelineLayout::from_counts(8, 2, 2, {4, 4}); }),
             Contains("has 2 entries but pipeline_parallel × virtual_stages = 2 × 2 = 4"));
  CHECK_THAT(config_error_of([] { PipelineLayout::uniform(80, 3); }),
             Contains("num_layers 80 is not divisible by pipeline_parallel × virtual_stages = 3 × 1 = 3") &&
                 Contains("explicit per-stage layout"));
  CHECK_THAT(config_error_of([] { PipelineLayout::uniform(8, 2, 3); }), Contains("2 × 3 = 6"));
  CHECK_THAT(config_error_of([] { PipelineLayout::uniform(8, 0); }), Contains("pipeline_parallel is 0"));
  CHECK_THAT(config_error_of([] { PipelineLayout::uniform(0, 2); }), Contains("num_layers is 0"));
}
