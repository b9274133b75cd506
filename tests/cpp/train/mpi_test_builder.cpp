// The trainer's parts (train/builder.hpp) composed by hand: a run built with build_training_parts and
// stepped by a loop written here gives the same per-step losses and gradient norms as train::Trainer,
// bit for bit, on CPU ranks (pipeline with tied embeddings, and ZeRO-1 with overlapped parameter gathers).
#include <catch2/catch.hpp>

#include <random>

#include "megacore/comm/collectives.hpp"
#include "megacore/data/corpus.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/train/builder.hpp"
#include "megacore/train/trainer.hpp"
#include "layers/layers_test_util.hpp"
#include "train/random_rows.hpp"

using namespace megacore;
namespace tr = megacore::train;

namespace {

using RandomTokens = train_test::RandomRows;

tr::RunConfig small_run(int world, int tp, int pp) {
  tr::RunConfig cfg;
  cfg.model = tr::ModelSection::preset("tiny_llama");
  cfg.model.vocab_size = data::ByteTokenizer::kVocabSize;  // the smallest the run validation accepts
  cfg.model.num_layers = 4;
  cfg.resources.num_gpus_per_node = world;
  cfg.parallel.tensor_model_parallel_size = tp;
  cfg.parallel.pipeline_model_parallel_size = pp;
  cfg.data.seq_length = 32;
  cfg.data.micro_batch_size = 2;
  cfg.data.global_batch_size = 4 * (world / (tp * pp));
  cfg.trainer.max_steps = 4;
  cfg.trainer.val_check_interval = 0;
  cfg.optim.lr = 3e-3;
  cfg.optim.min_lr = 3e-4;
  cfg.optim.lr_warmup_iters = 1;
  return cfg;
}

struct Losses {
  std::vector<double> loss, grad_norm;
};

// What Trainer::fit does per step, written against the parts.
Losses train_from_parts(tr::TrainingParts& p) {
  Losses out;
  layers::ForwardContext ctx;
  ctx.stream = p.placement.stream;
  tr::OptimizerParts& op = p.optimizer;
  REQUIRE(op.groups.size() == 1);
  tr::OptimizerGroup& g = op.groups.front();
  for (int64_t s = 0; s < p.cfg.trainer.max_steps; ++s) {
    op.zero_grad();
    std::vector<pipeline::MicroBatch> mbs = tr::next_micro_batches(*p.loader, *p.grid, ctx.stream);
    const pipeline::StepResult sr = p.engine->step(ctx, mbs, 1.0f);
    op.notify_tied_grads();
    op.finish_grad_sync();
    const optim::GradNormGroups groups = train_test::trainer_norm_groups(p);
    optim::CheckedStepOptions co;
    co.max_norm = p.cfg.optim.clip_grad;
    const double lr = op.sched->lr();
    const optim::StepResult st =
        g.zero ? optim::checked_step(*g.zero, lr, groups, co) : optim::checked_step(*g.opt, lr, groups, co);
    REQUIRE_FALSE(st.skipped);
    op.sched->step();
    out.loss.push_back(sr.loss);
    out.grad_norm.push_back(st.grad_norm);
  }
  op.finish_param_gather();
  return out;
}

void compare_with_trainer(comm::Communicator& world, const tr::RunConfig& cfg) {
  // Fresh data every run, the same on every rank.
  std::random_device rd;
  const int64_t seed = comm::all_reduce_value<int64_t>(world, world.rank() == 0 ? int64_t(rd() % 100000) : 0);
  INFO("data seed " << seed);
  auto src = std::make_shared<RandomTokens>(cfg.trainer.max_steps * cfg.data.global_batch_size, cfg.data.seq_length,
                                            cfg.model.vocab_size, uint64_t(seed));
  Losses built;
  {
    tr::TrainingParts p = tr::build_training_parts(cfg, world, src);
    REQUIRE(p.chunks.size() == size_t(cfg.parallel.virtual_pipeline_model_parallel_size));
    REQUIRE(p.optimizer.groups.front().group.name == "dense");
    REQUIRE(p.optimizer.groups.front().group.dp == &p.grid->dp_cp());
    built = train_from_parts(p);
  }
  tr::Trainer trainer(cfg, world, src);
  const tr::TrainResult r = trainer.fit();
  REQUIRE(r.history.size() == built.loss.size());
  for (size_t i = 0; i < built.loss.size(); ++i) {
    INFO("step " << i + 1);
    REQUIRE(std::isfinite(built.loss[i]));
    REQUIRE(built.loss[i] == r.history[i].loss);
    REQUIRE(built.grad_norm[i] == r.history[i].grad_norm);
  }
  // It trained: the random tokens' loss moves from about log(vocab).
  REQUIRE(built.loss.front() == Approx(std::log(double(cfg.model.vocab_size))).epsilon(0.1));
  REQUIRE(built.loss.back() != built.loss.front());
}

}  // namespace

TEST_CASE("a run built from the trainer's parts trains like Trainer (pipeline, tied embeddings)", "[train][mpi]") {
  auto world = layers_test::world_comm();
  const int n = world->size();
  const int pp = n % 2 == 0 ? 2 : 1, tp = n % 4 == 0 ? 2 : 1;
  tr::RunConfig cfg = small_run(n, tp, pp);
  cfg.model.tie_word_embeddings = true;
  INFO("world " << n << " TP " << tp << " PP " << pp);
  compare_with_trainer(*world, cfg);
}

TEST_CASE("a run built from the trainer's parts trains like Trainer (ZeRO-1, overlapped gathers)", "[train][mpi]") {
  auto world = layers_test::world_comm();
  const int n = world->size();
  tr::RunConfig cfg = small_run(n, 1, 1);
  cfg.parallel.use_distributed_optimizer = true;
  cfg.parallel.overlap_param_gather = true;
  cfg.parallel.bucket_size = 4096;  // several buckets, gathered one by one ahead of the forward
  INFO("world " << n);
  compare_with_trainer(*world, cfg);
}

TEST_CASE("trainer.recompute_num_layers recomputes the first N layers of every chunk and trains like no recompute",
          "[train][mpi][recompute]") {
  auto world = layers_test::world_comm();
  const int n = world->size();
  const int pp = n % 2 == 0 ? 2 : 1, tp = n % 4 == 0 ? 2 : 1;
  std::random_device rd;
  const int64_t seed = comm::all_reduce_value<int64_t>(*world, world->rank() == 0 ? int64_t(rd() % 100000) : 0);
  for (int vp : {1, 2}) {
    if (pp == 1 && vp > 1) continue;
    tr::RunConfig cfg = small_run(n, tp, pp);
    cfg.model.num_layers = 8;
    cfg.parallel.virtual_pipeline_model_parallel_size = vp;
    const int64_t per_chunk = 8 / (pp * vp), recomputed = per_chunk / 2;
    INFO("world " << n << " TP " << tp << " PP " << pp << " VP " << vp << " data seed " << seed);
    auto src = std::make_shared<RandomTokens>(cfg.trainer.max_steps * cfg.data.global_batch_size, cfg.data.seq_length,
                                              cfg.model.vocab_size, uint64_t(seed));
    Losses ref;
    {
      tr::TrainingParts none = tr::build_training_parts(cfg, *world, src);
      ref = train_from_parts(none);
    }
    cfg.trainer.recompute = model::RecomputeGranularity::Full;
    cfg.trainer.recompute_num_layers = recomputed;
    tr::TrainingParts block = tr::build_training_parts(cfg, *world, src);
    REQUIRE(block.chunks.size() == size_t(vp));
    for (auto& ch : block.chunks) {
      REQUIRE(ch->block().num_layers() == size_t(per_chunk));
      for (size_t i = 0; i < ch->block().num_layers(); ++i)
        REQUIRE(ch->block().layer(i).recompute() ==
                (int64_t(i) < recomputed ? model::RecomputeGranularity::Full : model::RecomputeGranularity::None));
    }
    const Losses got = train_from_parts(block);
    REQUIRE(got.loss.size() == ref.loss.size());
    for (size_t i = 0; i < ref.loss.size(); ++i) {
      INFO("step " << i + 1);
      REQUIRE(std::isfinite(ref.loss[i]));
      REQUIRE(got.loss[i] == ref.loss[i]);  // recompute replays the same math: bit-identical
      REQUIRE(got.grad_norm[i] == ref.grad_norm[i]);
    }
  }
}

TEST_CASE("parameter groups must not share a parameter", "[train][mpi]") {
  auto world = layers_test::world_comm();
  tr::RunConfig cfg = small_run(world->size(), 1, 1);
  tr::Placement place = tr::pick_device(cfg, *world);
  REQUIRE_FALSE(place.device.is_cuda());
  auto grid = tr::build_grid(cfg, *world);
  auto layout = tr::build_pipeline_layout(cfg);
  const model::TransformerConfig m = cfg.transformer_config(false);
  tr::ModelChunks chunks = tr::build_model_chunks(cfg, m, *grid, *layout, place);
  std::vector<tr::ParameterGroup> groups = tr::parameter_groups(chunks, *grid);
  REQUIRE(groups.size() == 1);
  groups.push_back({"copy", {groups.front().params.front()}, &grid->dp_cp()});
  REQUIRE_THROWS_WITH(tr::build_optimizer(cfg, m, chunks, groups, place.stream),
                      Catch::Contains("parameter groups 'dense' and 'copy' share a parameter"));
}
