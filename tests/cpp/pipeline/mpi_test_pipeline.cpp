// PipelineEngine under mpirun: pipeline parallelism (PP 2 and 4, with and without interleaving VP 2),
// combined with TP 2 (+ sequence parallelism) and DP 2 where the world size allows, against a PP = 1,
// TP = 1 model built on every rank from the same seed that runs the whole global batch (all DP ranks'
// micro-batches) itself.
//
// For each layout, over 3 optimizer steps (SGD with momentum for tiny Llama with 8 layers; AdamW for
// tiny GPT-2 with 4 layers and TIED embeddings across the first and last stage):
//   - the step's loss (global per-token mean over micro-batches of different token counts and over DP)
//     equals the reference's, on every rank;
//   - every parameter's gradient, after a plain DP average of main_grad (what a DDP does), gathered over
//     TP and mapped by name, equals the reference gradient of the global per-token mean loss, which the
//     test builds independently: per-micro-batch gradients of the reference model weighted on the host by
//     tokens_i / N;
//   - after the optimizer step every parameter equals the reference's (so the next step starts equal);
//   - the executed op sequence is rank_schedule() of the rank, and 1F1B keeps at most PP − rank
//     micro-batches in flight.
// Also: invalid layouts / chunk assignments / micro-batch counts are refused with ConfigError before
// anything is sent, and a stage that throws makes the other stages fail with CommError (2 s timeout)
// instead of hanging.
//
// Tolerance: the pipeline runs the same f32 operations as the reference except for summation order
// (TP partial products, the DP sum of token-weighted gradients vs. the reference's host-side weighting,
// the tied-embedding sum). Measured at -np 4/8: loss ≤ 2e-7, gradients and parameters ≤ 2e-6 relative.
// We hold loss to 1e-5 and gradients / parameters to 2e-5 (relative, per tensor).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "layers/layers_test_util.hpp"
#include "model/model_test_util.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "megacore/pipeline/engine.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;
namespace mdl = megacore::model;
namespace pl = megacore::pipeline;

namespace {

constexpr double kLossTol = 1e-5, kTol = 2e-5;
constexpr int64_t kBatch = 2, kSeq = 8;

// Micro-batch g of the global batch; masks differ so token counts differ between micro-batches.
pl::MicroBatch make_mb(int64_t vocab, int64_t g, int step) {
  const int64_t salt = g * 13 + step * 101;
  const model_test::Batch b = model_test::token_batch(kBatch, kSeq, vocab, salt, salt % (kBatch * kSeq),
                                                      [&](int64_t i) { return (i * 3 + salt) % (3 + g % 4) == 0; });
  return {b.tokens, b.labels, b.mask};
}


Tensor ref_view(const mdl::GPTModel& ref, const std::string& name, const Tensor& t, int tpn, bool swiglu) {
  Tensor g = t;
  if (g.dim() == 2 && g.size(0) == ref.padded_vocab_size()) g = g.narrow(0, 0, ref.config().vocab_size).contiguous();
  if (swiglu && name.find("linear_fc1.weight") != std::string::npos) g = swiglu_rank_layout(g, tpn);
  return g;
}

struct Layout {
  int pp, vp, tp, dp;
};

void run_layout(comm::Communicator& world, comm::Communicator& tp1, const Layout& L, mdl::TransformerConfig cfg,
                bool adamw) {
  const bool swiglu = cfg.activation == mdl::ActivationType::SwiGLU;
  INFO("PP " << L.pp << " VP " << L.vp << " TP " << L.tp << " DP " << L.dp << " SP " << (L.tp > 1) << " tied "
             << cfg.tie_word_embeddings);
  ProcessGrid grid(world, ParallelConfig{.tensor = L.tp, .pipeline = L.pp, .virtual_pipeline = L.vp},
                   {GroupKind::Tp, GroupKind::Pp, GroupKind::Dp, GroupKind::Embedding});
  REQUIRE(grid.layout().dp_size() == L.dp);
  const int pp_rank = grid.pp_rank(), dp_rank = grid.dp_rank();
  const pl::PipelineLayout layout = pl::PipelineLayout::uniform(cfg.num_layers, L.pp, L.vp);

  mdl::TransformerConfig pcfg = cfg;
  pcfg.sequence_parallel = L.tp > 1;
  std::vector<std::unique_ptr<mdl::GPTModel>> chunks;
  std::vector<mdl::GPTModel*> chunk_ptrs;
  std::vector<ly::Parameter*> params;
  for (int c = 0; c < L.vp; ++c) {
    chunks.push_back(std::make_unique<mdl::GPTModel>(
        pcfg, grid.tp(),
        mdl::GPTModelOptions{.layer_indices = layout.layer_indices(pp_rank, c),
                             .pre_process = layout.has_embedding(pp_rank, c),
                             .post_process = layout.has_head(pp_rank, c)}));
    chunk_ptrs.push_back(chunks.back().get());
    for (ly::Parameter* p : chunks.back()->parameters()) params.push_back(p);
  }
  pl::PipelineEngine engine(grid.pp(), layout, chunk_ptrs,
                            {.dp = &grid.dp(),
                             .embedding = grid.has_group(GroupKind::Embedding) ? &grid.embedding() : nullptr,
                             .record_ops = true});
  mdl::GPTModel ref(cfg, tp1);

  std::unique_ptr<optim::Optimizer> opt, ref_opt;
  if (adamw) {
    // eps 1e-5 instead of 1e-8: the key bias has a mathematically zero gradient (softmax is shift
    // invariant), so both sides hold f32 noise (~1e-10) there that Adam would blow up to ±lr.
    const optim::AdamWConfig ac{.eps = 1e-5f};
    opt = std::make_unique<optim::AdamW>(params, ac);
    ref_opt = std::make_unique<optim::AdamW>(ref.parameters(), ac);
  } else {
    opt = std::make_unique<optim::SGD>(params, optim::SGDConfig{});
    ref_opt = std::make_unique<optim::SGD>(ref.parameters(), optim::SGDConfig{});
  }
  const float lr = adamw ? 1e-3f : 0.5f;
  const int64_t m = 2 * L.pp;
  ly::ForwardContext ctx;

  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    // Reference: every micro-batch of the global batch, weighted by its tokens on the host.
    std::vector<pl::MicroBatch> global;
    for (int64_t g = 0; g < m * L.dp; ++g) global.push_back(make_mb(cfg.vocab_size, g, step));
    double n_total = 0;
    for (auto& mb : global) n_total += mdl::count_loss_tokens(mb.labels, mb.loss_mask);
    std::map<std::string, Tensor> want;
    double want_loss = 0;
    for (ly::Parameter* p : ref.parameters()) want[p->name] = Tensor::zeros(p->main_grad.shape());
    for (auto& mb : global) {
      ref.zero_grad();
      const double tokens = mdl::count_loss_tokens(mb.labels, mb.loss_mask);
      want_loss += ref.forward(ctx, mb.tokens, mb.labels, mb.loss_mask).item() * tokens / n_total;
      ref.backward(ctx);
      for (ly::Parameter* p : ref.parameters()) {
        Tensor& w = want[p->name];
        for (int64_t i = 0; i < w.numel(); ++i)
          w.data<float>()[i] += float(p->main_grad.data<float>()[i] * tokens / n_total);
      }
    }

    // Pipeline: this DP rank's micro-batches.
    std::vector<pl::MicroBatch> mine(global.begin() + dp_rank * m, global.begin() + (dp_rank + 1) * m);
    opt->zero_grad();
    const pl::StepResult r = engine.step(ctx, mine);
    CHECK(std::abs(r.loss - want_loss) <= kLossTol * std::abs(want_loss));
    CHECK(r.tokens == n_total);
    const pl::ScheduleConfig sc = engine.schedule_config(m);
    CHECK(r.executed == pl::rank_schedule(sc, pp_rank));
    if (L.vp == 1) CHECK(r.max_in_flight == std::min<int64_t>(L.pp - pp_rank, m));
    CHECK(r.theoretical_bubble == pl::theoretical_bubble_fraction(sc));
    CHECK(r.idle_fraction >= 0.0);
    CHECK(r.idle_fraction <= 1.0);

    for (ly::Parameter* p : params) grid.dp().all_reduce(p->main_grad, comm::ReduceOp::Avg)->wait();
    for (ly::Parameter* p : params) {
      INFO("gradient of " << p->name);
      const mdl::GPTModel& any = *chunks[0];
      require_close(model_test::full_tensor(grid.tp(), *p, p->main_grad, any.padded_vocab_size(), cfg.vocab_size),
                    ref_view(ref, p->name, want.at(p->name), L.tp, swiglu), kTol, p->name.c_str());
    }
    // Same update on both sides.
    for (ly::Parameter* p : ref.parameters()) p->main_grad.copy_(want.at(p->name));
    opt->step(lr);
    ref_opt->step(lr);
    for (ly::Parameter* p : params) {
      INFO("parameter " << p->name);
      require_close(model_test::full_tensor(grid.tp(), *p, p->data, chunks[0]->padded_vocab_size(), cfg.vocab_size),
                    ref_view(ref, p->name, ref.parameter(p->name).data, L.tp, swiglu), kTol, p->name.c_str());
    }
  }

  // Forward-only (evaluation) through the same stages: the last stage's loss and token count equal the
  // reference model's on the same micro-batch; other stages return nothing.
  ly::ForwardContext ectx;
  ectx.training = false;
  const pl::MicroBatch eval_mb = make_mb(cfg.vocab_size, 7, 99);
  double n = -1;
  const Tensor loss = engine.forward_only(ectx, eval_mb, &n);
  const bool last = layout.has_head(pp_rank, L.vp - 1);
  REQUIRE(loss.defined() == last);
  if (last) {
    const double want = ref.forward(ectx, eval_mb.tokens, eval_mb.labels, eval_mb.loss_mask).item();
    CHECK(std::abs(loss.item() - want) <= kLossTol * std::abs(want));
    CHECK(n == mdl::count_loss_tokens(eval_mb.labels, eval_mb.loss_mask));
  }
  ly::ForwardContext train_ctx;
  REQUIRE_THROWS_WITH(engine.forward_only(train_ctx, eval_mb), Catch::Contains("training = false"));
}

std::vector<Layout> layouts_for(int world) {
  std::vector<Layout> out;
  for (int pp : {2, 4})
    for (int tp : {1, 2})
      for (int vp : {1, 2})
        if (world % (pp * tp) == 0 && world / (pp * tp) <= 2) out.push_back({pp, vp, tp, world / (pp * tp)});
  return out;
}

}  // namespace

TEST_CASE("Pipeline (PP 2/4, VP 1/2, with TP+SP and DP) equals PP 1: loss, every gradient, optimizer steps",
          "[pipeline][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  mdl::TransformerConfig llama = mdl::presets::tiny_llama();
  llama.num_layers = 8;
  mdl::TransformerConfig gpt2 = mdl::presets::tiny_gpt2();
  gpt2.num_layers = 4;
  const std::vector<Layout> layouts = layouts_for(world->size());
  if (layouts.empty()) WARN("no pipeline layout fits world size " << world->size());
  for (const Layout& L : layouts) {
    run_layout(*world, grid1.tp(), L, llama, /*adamw=*/false);
    if (L.vp == 1 || L.pp == 2) run_layout(*world, grid1.tp(), L, gpt2, /*adamw=*/true);
  }
}

TEST_CASE("Pipeline refuses invalid layouts, chunk assignments and micro-batch counts before launching",
          "[pipeline][mpi]") {
  auto world = world_comm();
  const int pp = std::min(world->size(), 4);
  if (world->size() % pp != 0) return;
  ProcessGrid grid(*world, ParallelConfig{.pipeline = pp, .virtual_pipeline = 2},
                   {GroupKind::Tp, GroupKind::Pp, GroupKind::Dp, GroupKind::Embedding});
  mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  cfg.num_layers = 8;
  CHECK_THROWS_AS(pl::PipelineLayout::uniform(cfg.num_layers, 3, 1), ConfigError);
  CHECK_THROWS_AS(pl::PipelineLayout::from_counts(cfg.num_layers, pp, 2, std::vector<int64_t>(size_t(2 * pp), 3)),
                  ConfigError);
  const pl::PipelineLayout layout = pl::PipelineLayout::uniform(cfg.num_layers, pp, 2);
  const int r = grid.pp_rank();
  auto chunk = [&](int c, std::vector<int64_t> li) {
    return std::make_unique<mdl::GPTModel>(cfg, grid.tp(),
                                           mdl::GPTModelOptions{.layer_indices = std::move(li),
                                                                .pre_process = layout.has_embedding(r, c),
                                                                .post_process = layout.has_head(r, c)});
  };
  auto c0 = chunk(0, layout.layer_indices(r, 0)), c1 = chunk(1, layout.layer_indices(r, 1));
  // Wrong number of chunks, swapped chunks, a layout for another PP size.
  CHECK_THROWS_AS(pl::PipelineEngine(grid.pp(), layout, {c0.get()}), ConfigError);
  CHECK_THROWS_AS(pl::PipelineEngine(grid.pp(), layout, {c1.get(), c0.get()}), ConfigError);
  const pl::PipelineLayout other = pl::PipelineLayout::uniform(cfg.num_layers, pp == 2 ? 4 : 2, 2);
  CHECK_THROWS_AS(pl::PipelineEngine(grid.pp(), other, {c0.get(), c1.get()}), ConfigError);
  // Interleaving needs a multiple of PP micro-batches: refused on every rank before any transfer.
  pl::PipelineEngine engine(grid.pp(), layout, {c0.get(), c1.get()});
  std::vector<pl::MicroBatch> mbs;
  for (int i = 0; i < pp + 1; ++i) mbs.push_back(make_mb(cfg.vocab_size, i, 0));
  CHECK_THROWS_AS(engine.step({}, mbs), ConfigError);
  // Tied embeddings across stages need the embedding group.
  mdl::TransformerConfig tied = cfg;
  tied.tie_word_embeddings = true;
  const pl::PipelineLayout l1 = pl::PipelineLayout::uniform(cfg.num_layers, pp, 1);
  mdl::GPTModel t(tied, grid.tp(), {.layer_indices = l1.layer_indices(r, 0), .pre_process = r == 0,
                                    .post_process = r == pp - 1});
  if (r == 0 || r == pp - 1) CHECK_THROWS_AS(pl::PipelineEngine(grid.pp(), l1, {&t}), ConfigError);
  world->barrier();
}

TEST_CASE("A pipeline stage that throws makes the other stages fail with CommError, not hang", "[pipeline][mpi]") {
  auto world = world_comm();
  const int pp = world->size() >= 4 ? 4 : 2;
  if (world->size() % pp != 0) return;
  {
    // The grid is built under the world's generous timeout (its splits must not time out on a loaded machine);
    // only the pipeline's own group has the short one.
    ProcessGrid grid(*world, ParallelConfig{.pipeline = pp}, {GroupKind::Tp, GroupKind::Pp});
    mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
    cfg.num_layers = 4;
    const pl::PipelineLayout layout = pl::PipelineLayout::uniform(cfg.num_layers, pp, 1);
    const int r = grid.pp_rank();
    mdl::GPTModel chunk(cfg, grid.tp(), {.layer_indices = layout.layer_indices(r, 0), .pre_process = r == 0,
                                         .post_process = r == pp - 1});
    comm::CommOptions o = grid.pp().options();
    o.timeout = std::chrono::seconds(2);
    o.name = "short_pp";
    auto short_pp = grid.pp().split(0, grid.pp().rank(), o);
    pl::PipelineEngine engine(*short_pp, layout, {&chunk});
    std::vector<pl::MicroBatch> mbs;
    for (int i = 0; i < pp; ++i) mbs.push_back(make_mb(cfg.vocab_size, i, 0));
    // The last stage gets f32 tokens-as-labels of the right shape: its forward throws ValueError.
    if (r == pp - 1) mbs[0].labels = mbs[0].loss_mask;
    const auto t0 = std::chrono::steady_clock::now();
    if (r == pp - 1) {
      CHECK_THROWS_AS(engine.step({}, mbs), ValueError);
    } else {
      CHECK_THROWS_AS(engine.step({}, mbs), CommError);
      CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
    }
  }
  world->barrier();
}
