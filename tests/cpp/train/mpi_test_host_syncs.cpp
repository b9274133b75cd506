// Host synchronisations of the training step (docs/performance.md): counted by core/host_sync.hpp on CPU
// ranks (the same control flow as on GPUs), for DP, PP × DP and TP 2 + SP (with the overlapped SP forward) × DP
// layouts with gradient clipping on and a log interval > 1. In the steady state a step makes exactly two: the
// gradient norm's read (which also brings the loss and the token count) and the stop-signal agreement before
// the checkpoint decision.
// A second case checks the deferred token normalisation against the engine's per-step one on data whose
// loss mask drops tokens (the global token count then differs from the nominal one).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <random>

#include "megacore/comm/collectives.hpp"
#include "megacore/core/host_sync.hpp"
#include "megacore/data/corpus.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/train/builder.hpp"
#include "megacore/train/trainer.hpp"
#include "layers/layers_test_util.hpp"
#include "train/random_rows.hpp"

using namespace megacore;
namespace tr = megacore::train;

namespace {

using train_test::RandomRows;

tr::RunConfig small_run(int world, int pp, int64_t steps) {
  tr::RunConfig cfg;
  cfg.model = tr::ModelSection::preset("tiny_llama");
  cfg.model.vocab_size = data::ByteTokenizer::kVocabSize;
  cfg.model.num_layers = 2 * pp;
  cfg.resources.num_gpus_per_node = world;
  cfg.parallel.pipeline_model_parallel_size = pp;
  cfg.data.seq_length = 16;
  cfg.data.micro_batch_size = 2;
  cfg.data.global_batch_size = 4 * (world / pp);
  cfg.trainer.max_steps = steps;
  cfg.trainer.log_interval = 3;
  cfg.trainer.val_check_interval = 0;
  cfg.optim.clip_grad = 0.5;  // small: the clip is applied
  cfg.optim.lr = 3e-3;
  cfg.optim.lr_warmup_iters = 1;
  return cfg;
}

std::shared_ptr<data::SampleSource> fresh_rows(comm::Communicator& world, const tr::RunConfig& cfg, bool masked) {
  std::random_device rd;
  const int64_t seed = comm::all_reduce_value<int64_t>(world, world.rank() == 0 ? int64_t(rd() % 100000) : 0);
  INFO("data seed " << seed);
  return std::make_shared<RandomRows>(cfg.trainer.max_steps * cfg.data.global_batch_size, cfg.data.seq_length,
                                      cfg.model.vocab_size, uint64_t(seed), masked);
}

// The per-step host syncs of Trainer::fit, by reason: what happened between two step callbacks.
std::vector<std::map<std::string, int64_t>> syncs_per_step(comm::Communicator& world, const tr::RunConfig& cfg) {
  tr::Trainer trainer(cfg, world, fresh_rows(world, cfg, false));
  std::vector<std::map<std::string, int64_t>> out;
  std::map<std::string, int64_t> before;
  trainer.set_step_callback([&](const tr::StepMetrics&) {
    std::map<std::string, int64_t> now = host_sync_counts(), d;
    for (const auto& [k, v] : now)
      if (v != before[k]) d[k] = v - before[k];
    out.push_back(d);
    before = std::move(now);
  });
  reset_host_syncs();
  const tr::TrainResult r = trainer.fit();
  REQUIRE(r.history.size() == size_t(cfg.trainer.max_steps));
  for (const tr::StepMetrics& m : r.history) REQUIRE(std::isfinite(m.loss));
  return out;
}

std::string show(const std::map<std::string, int64_t>& m) {
  std::string s;
  for (const auto& [k, v] : m) s += k + "=" + std::to_string(v) + " ";
  return s;
}

}  // namespace

TEST_CASE("a training step makes the documented two host syncs (DP, ZeRO-1, PP x DP, TP+SP x DP; clipping, log interval 3)",
          "[train][mpi][host_sync]") {
  auto world = layers_test::world_comm();
  const int n = world->size();
  struct Layout {
    int pp;
    bool zero;
    int tp = 1;  // with TP 2: sequence parallelism and the overlapped SP forward (its rings wait on the stream)
  };
  std::vector<Layout> layouts{{1, false}, {1, true}};
  if (n % 2 == 0) layouts.push_back({2, false});
  if (n % 2 == 0) layouts.push_back({1, false, 2});
  for (const auto& [pp, zero, tp] : layouts) {
    INFO("world " << n << " PP " << pp << " ZeRO-1 " << zero << " TP " << tp);
    tr::RunConfig cfg = small_run(n, pp, 6);
    cfg.parallel.use_distributed_optimizer = zero;
    if (tp > 1) {
      cfg.parallel.tensor_model_parallel_size = tp;
      cfg.parallel.sequence_parallel = true;
      cfg.parallel.tp_comm_overlap_forward = true;
      cfg.data.global_batch_size = 4 * (n / tp);
    }
    const std::vector<std::map<std::string, int64_t>> steps = syncs_per_step(*world, cfg);
    // From the second step on (the first also agrees the pipeline's shapes and includes the set-up): the
    // previous iteration's stop agreement and this step's one read.
    const std::map<std::string, int64_t> want{{"grad_norm", 1}, {"stop_agreement", 1}};
    for (size_t i = 1; i < steps.size(); ++i) {
      INFO("step " << i + 1 << ": " << show(steps[i]));
      REQUIRE(steps[i] == want);
    }
  }
}

TEST_CASE("the deferred token normalisation equals the engine's per-step one (masked tokens)",
          "[train][mpi][host_sync]") {
  auto world = layers_test::world_comm();
  const int n = world->size();
  const int pp = n % 2 == 0 ? 2 : 1;
  const tr::RunConfig cfg = small_run(n, pp, 3);
  auto src = fresh_rows(*world, cfg, true);
  // Reference: the parts stepped by hand with the engine normalising by the global count before backward.
  std::vector<double> loss, norm;
  {
    tr::TrainingParts p = tr::build_training_parts(cfg, *world, src);
    layers::ForwardContext ctx;
    ctx.stream = p.placement.stream;
    tr::OptimizerGroup& g = p.optimizer.groups.front();
    for (int64_t s = 0; s < cfg.trainer.max_steps; ++s) {
      p.optimizer.zero_grad();
      const pipeline::StepResult sr = p.engine->step(ctx, tr::next_micro_batches(*p.loader, *p.grid, ctx.stream), 1.f);
      p.optimizer.notify_tied_grads();
      p.optimizer.finish_grad_sync();
      const optim::GradNormGroups groups = train_test::trainer_norm_groups(p);
      optim::CheckedStepOptions co;
      co.max_norm = cfg.optim.clip_grad;
      const double lr = p.optimizer.sched->lr();
      const optim::StepResult st =
          g.zero ? optim::checked_step(*g.zero, lr, groups, co) : optim::checked_step(*g.opt, lr, groups, co);
      p.optimizer.sched->step();
      loss.push_back(sr.loss);
      norm.push_back(st.grad_norm);
    }
  }
  tr::Trainer trainer(cfg, *world, src);
  const tr::TrainResult r = trainer.fit();
  REQUIRE(r.history.size() == loss.size());
  for (size_t i = 0; i < loss.size(); ++i) {
    INFO("step " << i + 1);
    REQUIRE(r.history[i].loss == Approx(loss[i]).epsilon(1e-5));
    REQUIRE(r.history[i].grad_norm == Approx(norm[i]).epsilon(1e-4));
  }
}
