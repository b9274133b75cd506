// Global gradient norm under mpirun: for every TP in {1, 2, 4} dividing the world (ProcessGrid), tiny
// Llama (untied and tied embeddings, with and without sequence parallelism) and tiny GPT-2 (replicated
// biases and LayerNorms) run one forward/backward on a fixed batch; the global norm from
// global_grad_norm over this rank's shards, reduced over the model-parallel group, must equal the norm
// of a TP = 1 model built on the same rank — replicated norms and biases, the tied embedding and the
// vocabulary padding all counted once. The naive count (every rank counting everything) is shown to
// differ, so the test would catch that double count. Clipping then brings the global norm to max_norm.
// With each DP rank holding a disjoint piece of every gradient (as under ZeRO), reducing over dp_cp as
// well gives the same norm, and leaving that reduction out is caught.
//
// Tolerance: the TP gradients differ from TP = 1 by ≤ 7e-7 relative (see the GPTModel MPI test), and
// the norm sums squares in f32 per rank; we hold the norm to 1e-5 relative.
#include <cmath>

#include "layers/layers_test_util.hpp"
#include "model/model_test_util.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/parallel/process_grid.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

namespace {

constexpr int64_t kBatch = 2, kSeq = 8;

void forward_backward(mdl::GPTModel& m, int64_t vocab) {
  std::vector<int64_t> tok, lab;
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    tok.push_back((i * 37 + 5) % vocab);
    lab.push_back((i * 53 + 11) % vocab);
  }
  ly::ForwardContext ctx;
  m.forward(ctx, Tensor::from_vector<int64_t>(tok, {kBatch, kSeq}), Tensor::from_vector<int64_t>(lab, {kBatch, kSeq}));
  m.backward(ctx);
}

// Σ ||g||² in double straight from the TP = 1 model's gradients: the reference for the reference.
double direct_norm(const mdl::GPTModel& m) {
  double s = 0;
  for (const ly::Parameter* p : m.parameters())
    for (double g : p->main_grad.to_double_vector()) s += g * g;
  return std::sqrt(s);
}

void check(comm::Communicator& tp1, const ProcessGrid& grid, mdl::TransformerConfig cfg, bool sp) {
  const int tpn = grid.tp().size();
  INFO("TP " << tpn << " SP " << sp << " norm " << mdl::norm_type_name(cfg.normalization) << " tied "
             << cfg.tie_word_embeddings);
  mdl::GPTModel ref(cfg, tp1);
  forward_backward(ref, cfg.vocab_size);
  const double want = direct_norm(ref);
  REQUIRE(want > 0);
  CHECK(optim::global_grad_norm(ref.parameters(), optim::GradNormGroups{}).norm == Approx(want).epsilon(1e-6));

  cfg.sequence_parallel = sp;
  mdl::GPTModel model(cfg, grid.tp());
  forward_backward(model, cfg.vocab_size);
  const optim::GradNormGroups groups = optim::grad_norm_groups(grid);
  const optim::GradNormResult got = optim::global_grad_norm(model.parameters(), groups);
  CHECK(got.finite);
  CHECK(std::abs(got.norm - want) <= 1e-5 * want);

  // Every rank counting its replicated parameters too (norm gains are small next to the weights, so
  // the excess is small for Llama, ~8e-5 relative at TP 2) must fail the check the real count passes.
  optim::GradNormGroups naive = groups;
  naive.tp_rank = 0;
  const double naive_norm = optim::global_grad_norm(model.parameters(), naive).norm;
  if (tpn > 1) CHECK(naive_norm - want > 2e-5 * want);

  // Clip to half the norm: the new global norm is max_norm, on every rank.
  const optim::GradNormResult clipped = optim::clip_grad_norm(model.parameters(), want / 2, groups);
  CHECK(clipped.clip_coef == Approx(0.5).epsilon(1e-4));
  CHECK(optim::global_grad_norm(model.parameters(), groups).norm == Approx(want / 2).epsilon(1e-5));
}

using model_test::llama_tied;

}  // namespace

TEST_CASE("Global grad norm at TP 1/2/4 equals the TP 1 model's norm (tied and untied)", "[optim][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp, GroupKind::Mp});
    for (const mdl::TransformerConfig& cfg : {mdl::presets::tiny_llama(), llama_tied(), mdl::presets::tiny_gpt2()})
      for (bool sp : {false, true})
        if (!sp || tpn > 1) check(grid1.tp(), grid, cfg, sp);
  }
}

TEST_CASE("Gradient NaN on one TP rank is reported on every rank", "[optim][mpi]") {
  auto world = world_comm();
  const int tpn = tp_sizes_for(world->size()).back();
  ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp, GroupKind::Mp});
  mdl::GPTModel model(mdl::presets::tiny_llama(), grid.tp());
  forward_backward(model, mdl::presets::tiny_llama().vocab_size);
  // Poison a sharded gradient on the last TP rank only.
  if (grid.tp_rank() == tpn - 1) {
    ly::Parameter& p = model.parameter("layers.0.self_attention.linear_qkv.weight");
    REQUIRE(p.partition_dim >= 0);
    p.main_grad.data<float>()[3] = std::nanf("");
  }
  const optim::GradNormResult r = optim::clip_grad_norm(model.parameters(), 1.0, optim::grad_norm_groups(grid));
  CHECK_FALSE(r.finite);
}

TEST_CASE("Global grad norm with gradients sharded over DP (ZeRO) equals the TP 1 model's norm", "[optim][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp, GroupKind::Mp, GroupKind::DpCp});
    const int dpn = grid.dp_cp().size(), dpr = grid.dp_cp().rank();
    INFO("TP " << tpn << " DP " << dpn);
    const mdl::TransformerConfig cfg = llama_tied();
    mdl::GPTModel ref(cfg, grid1.tp());
    forward_backward(ref, cfg.vocab_size);
    const double want = direct_norm(ref);
    mdl::GPTModel model(cfg, grid.tp());  // the same batch on every DP rank: equal full gradients
    forward_backward(model, cfg.vocab_size);
    // Each DP rank keeps a disjoint contiguous piece of every flattened gradient, as ZeRO does.
    std::vector<ly::Parameter> shards;
    for (const ly::Parameter* p : model.parameters()) {
      const int64_t n = p->main_grad.numel(), per = (n + dpn - 1) / dpn, begin = std::min(n, dpr * per);
      const int64_t len = std::min(per, n - begin);
      if (len == 0) continue;
      ly::Parameter s = *p;
      s.main_grad = p->main_grad.view({n}).narrow(0, begin, len);
      shards.push_back(s);
    }
    std::vector<ly::Parameter*> list;
    for (ly::Parameter& s : shards) list.push_back(&s);
    const double got = optim::global_grad_norm(list, optim::grad_norm_groups(grid, true)).norm;
    CHECK(std::abs(got - want) <= 1e-5 * want);
    // Forgetting the DP reduction undercounts whenever DP > 1.
    if (dpn > 1) CHECK(optim::global_grad_norm(list, optim::grad_norm_groups(grid, false)).norm < want * 0.99);
  }
}
