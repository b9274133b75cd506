// A small MoE GPTModel under mpirun: EP 2 and 4 (with TP 2, expert-TP 1 or 2 where the world allows) give the
// losses and gradients of one process.
//
// The model: tiny Llama with 2 layers, layer 0 a MoE layer (4 experts, top-2, aux loss and z-loss), layer 1
// dense. Every data-parallel replica d feeds its own batch. The reference, one process with the same
// initialisation (independent of TP and EP), runs forward/backward once per replica, so its gradients are the
// sums over replicas. Each rank's loss must equal the reference loss of its replica; after summing dense
// gradients over DP × CP and expert gradients over expert-DP (what DDP reduces, before its division), every
// rank's gradient must equal its slice of the reference sums (experts at expert_offset, split over expert-TP;
// dense weights split over TP). Tolerance: only the order of f32 additions differs, 1e-5 relative.
//
// Pipeline: the same kind of model with 4 layers (MoE layers 0 and 2, dense 1 and 3) at PP 2 and 4, with
// interleaving (VP 2) and EP 2/4 where the world allows, runs one step of 2·PP micro-batches per DP rank
// through the PipelineEngine (aux-loss gradients scaled by 1/micro-batches, as the trainer does); from 5
// micro-batches in the global batch on, one of them has no loss tokens (its LM gradient weight is 0). The
// reference is one process running every micro-batch of the global batch: LM gradients weighted by
// tokens / all tokens and aux/z-loss gradients by 1 / all micro-batches. Loss and every gradient (dense
// averaged over DP×CP, experts summed over expert-DP and divided by DP×CP, as DDP does) must match to 2e-5
// relative; the step's MoE metrics (model::moe_step_metrics) must equal the hand computation from the
// reference's per-micro-batch losses and token counts.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "megacore/model/gpt_model.hpp"
#include "megacore/pipeline/engine.hpp"
#include "model/model_test_util.hpp"
#include "optim/expert_params_test_util.hpp"

using namespace megacore;
namespace mdl = megacore::model;
using layers_test::world_comm;

namespace {

constexpr int64_t kB = 2, kS = 16;

mdl::TransformerConfig moe_config() {
  mdl::TransformerConfig c = mdl::presets::tiny_llama();
  c.num_moe_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 32;
  c.moe_layer_freq = 2;  // layer 0 MoE, layer 1 dense
  c.moe_aux_loss_coeff = 1e-2;
  c.moe_z_loss_coeff = 1e-3;
  return c;
}

struct Batch {
  Tensor tokens, labels;
};

Batch batch(int replica, int64_t vocab) {
  std::vector<int64_t> t, l;
  Generator g(4242, uint64_t(replica));
  Tensor u = Tensor::empty({2 * kB * kS});
  u.uniform_(g);
  const std::vector<double> v = u.to_double_vector();
  for (int64_t i = 0; i < kB * kS; ++i) {
    t.push_back(int64_t(v[size_t(i)] * double(vocab)) % vocab);
    l.push_back(int64_t(v[size_t(kB * kS + i)] * double(vocab)) % vocab);
  }
  return {Tensor::from_vector<int64_t>(t, {kB, kS}), Tensor::from_vector<int64_t>(l, {kB, kS})};
}

double rel(const Tensor& a, const Tensor& b) {
  return mctest::rel_err(a.to_double_vector(), b.to_double_vector());
}

}  // namespace

TEST_CASE("MoE GPTModel at EP 2/4 (with TP 2 and expert-TP 1/2) gives the single-process losses and gradients",
          "[model][moe][mpi]") {
  auto world = world_comm();
  const mdl::TransformerConfig cfg = moe_config();
  const std::vector<parallel::ParallelConfig> ls = expert_test::layouts(world->size());
  REQUIRE(!ls.empty());
  comm::CommOptions so;
  so.name = "self";
  std::unique_ptr<comm::Communicator> self = world->split(world->rank(), 0, so);
  layers::ForwardContext ctx;
  for (const parallel::ParallelConfig& pc : ls) {
    INFO(expert_test::describe(pc));
    parallel::ProcessGrid grid(*world, pc);
    const int replicas = grid.layout().dp_size();
    // The reference: one process, every replica's batch, gradients summed.
    mdl::GPTModel ref(cfg, *self);
    std::vector<double> ref_loss;
    for (int d = 0; d < replicas; ++d) {
      const Batch b = batch(d, cfg.vocab_size);
      ref_loss.push_back(ref.forward(ctx, b.tokens, b.labels).item());
      ref.backward(ctx);
    }
    mdl::GPTModelOptions o;
    o.moe = mdl::moe_groups(grid);
    mdl::GPTModel model(cfg, grid.tp(), o);
    REQUIRE(model.moe_layers().size() == 1);
    const Batch b = batch(grid.dp_rank(), cfg.vocab_size);
    const double loss = model.forward(ctx, b.tokens, b.labels).item();
    CHECK(std::abs(loss - ref_loss[size_t(grid.dp_rank())]) <= 1e-5 * std::abs(ref_loss[size_t(grid.dp_rank())]));
    CHECK(model.moe_aux_loss() > 0);
    model.backward(ctx);
    const std::vector<layers::Parameter*> ps = model.parameters(), rps = ref.parameters();
    REQUIRE(ps.size() == rps.size());
    int experts = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
      const layers::Parameter& p = *ps[i];
      INFO(p.name);
      REQUIRE(p.name == rps[i]->name);
      Tensor g = p.main_grad.clone();
      (p.expert ? grid.expert_dp() : grid.dp_cp()).all_reduce(g, comm::ReduceOp::Sum)->wait();
      const expert_test::Spec s{p.name.c_str(), rps[i]->data.shape(), p.expert, p.partition_dim, p.partition_chunks};
      const Tensor want = p.expert ? expert_test::local_of(rps[i]->main_grad, s, grid.layout().expert_tp_rank(grid.rank()),
                                                           grid.layout().expert_tp_size(), p.expert_offset,
                                                           p.data.size(0))
                                   : expert_test::local_of(rps[i]->main_grad, s, grid.tp_rank(),
                                                           grid.layout().tp_size(), 0, 0);
      CHECK(rel(g, want) <= 1e-5);
      experts += p.expert;
    }
    CHECK(experts == 2);  // the MoE layer's fc1 and fc2
  }
}

namespace {

struct PpLayout {
  int pp, vp, ep;
};

std::vector<PpLayout> pp_layouts(int world) {
  std::vector<PpLayout> out;
  for (PpLayout l : {PpLayout{2, 1, 1}, PpLayout{2, 1, 2}, PpLayout{2, 2, 2}, PpLayout{4, 1, 1}, PpLayout{2, 1, 4}})
    if (world % l.pp == 0 && (world / l.pp) % l.ep == 0) out.push_back(l);
  return out;
}

// Micro-batch g: different masks, so different token counts.
pipeline::MicroBatch pp_micro_batch(int64_t vocab, int64_t g) {
  const int64_t salt = g * 13 + 5;
  const model_test::Batch b = model_test::token_batch(
      kB, kS, vocab, salt, salt % (kB * kS), [&](int64_t i) { return (i * 3 + salt) % (3 + g % 4) == 0; });
  return {b.tokens, b.labels, b.mask};
}

}  // namespace

// Every layout of pp_layouts the rank count allows (DP = the rest): PP 2 on 2 ranks; PP 2 × DP 2, PP 2 × EP 2
// (also VP 2) and PP 4 on 4; those and PP 2 × EP 4 on 8.
// (Catch2 2.x's console reporter loops forever wrapping some long test names: keep this one short.)
TEST_CASE("MoE GPTModel under pipeline parallelism equals PP 1",
          "[model][moe][pipeline][mpi]") {
  auto world = world_comm();
  mdl::TransformerConfig cfg = moe_config();
  cfg.num_layers = 4;  // layers 0 and 2 MoE, 1 and 3 dense
  const std::vector<PpLayout> ls = pp_layouts(world->size());
  REQUIRE(!ls.empty());
  comm::CommOptions so;
  so.name = "self";
  std::unique_ptr<comm::Communicator> self = world->split(world->rank(), 0, so);
  layers::ForwardContext ctx;
  for (const PpLayout& L : ls) {
    INFO("PP " << L.pp << " VP " << L.vp << " EP " << L.ep << " on " << world->size() << " ranks");
    parallel::ProcessGrid grid(*world, parallel::ParallelConfig{.pipeline = L.pp, .expert = L.ep,
                                                                .virtual_pipeline = L.vp});
    const int dp = grid.layout().dp_size(), pp_rank = grid.pp_rank();
    const int64_t m = 2 * L.pp, all = m * dp;
    const pipeline::PipelineLayout layout = pipeline::PipelineLayout::uniform(cfg.num_layers, L.pp, L.vp);

    // Reference: every micro-batch of the global batch on one process.
    std::vector<pipeline::MicroBatch> global;
    for (int64_t g = 0; g < all; ++g) global.push_back(pp_micro_batch(cfg.vocab_size, g));
    double n_total = 0;
    int empty = 0;
    for (const auto& mb : global) {
      const double n = mdl::count_loss_tokens(mb.labels, mb.loss_mask);
      n_total += n;
      empty += n == 0;
    }
    CHECK(empty == (all > 4 ? 1 : 0));  // micro-batch 4 masks every token: a step may hold one with no loss tokens
    mdl::GPTModel ref(cfg, *self);
    std::vector<layers::MoELayer*> ref_moe = ref.moe_layers();
    REQUIRE(ref_moe.size() == 2);
    // Gradients accumulate in the main grads: the LM loss weighted by w (0 for the micro-batch with no loss
    // tokens), the aux/z-losses by 1 / all.
    ref.zero_grad();
    ref.set_moe_aux_loss_grad_scale(float(1.0 / double(all)));
    double want_loss = 0, want_aux = 0;
    std::vector<std::vector<double>> want_tokens(ref_moe.size(), std::vector<double>(size_t(cfg.num_moe_experts), 0));
    for (const auto& mb : global) {
      const double w = mdl::count_loss_tokens(mb.labels, mb.loss_mask) / n_total;
      want_loss += ref.forward_stage(ctx, {}, mb.tokens, mb.labels, mb.loss_mask).item() * w;
      for (size_t l = 0; l < ref_moe.size(); ++l) {
        want_aux += (ref_moe[l]->aux_loss().item() + ref_moe[l]->z_loss().item()) / double(all * ref_moe.size());
        for (size_t e = 0; e < want_tokens[l].size(); ++e)
          want_tokens[l][e] += double(ref_moe[l]->tokens_per_expert()[e]);
      }
      ref.backward_stage(ctx, {}, float(w));
    }
    std::map<std::string, Tensor> want;
    for (layers::Parameter* p : ref.parameters()) want[p->name] = p->main_grad;
    double want_imbalance = 0;
    for (const auto& t : want_tokens) {
      const double total = std::accumulate(t.begin(), t.end(), 0.0);
      want_imbalance = std::max(want_imbalance, *std::max_element(t.begin(), t.end()) / (total / double(t.size())));
    }

    // Pipeline: this rank's stage chunks, this DP rank's micro-batches.
    std::vector<std::unique_ptr<mdl::GPTModel>> chunks;
    std::vector<mdl::GPTModel*> chunk_ptrs;
    for (int c = 0; c < L.vp; ++c) {
      mdl::GPTModelOptions o;
      o.layer_indices = layout.layer_indices(pp_rank, c);
      o.pre_process = layout.has_embedding(pp_rank, c);
      o.post_process = layout.has_head(pp_rank, c);
      o.moe = mdl::moe_groups(grid);
      chunks.push_back(std::make_unique<mdl::GPTModel>(cfg, grid.tp(), o));
      chunk_ptrs.push_back(chunks.back().get());
      chunks.back()->zero_grad();  // main gradients accumulate: start from zero, as the trainer's DDP does
      chunks.back()->set_moe_aux_loss_grad_scale(float(1.0 / double(m)));
      chunks.back()->reset_moe_step_stats();
    }
    pipeline::PipelineEngine engine(grid.pp(), layout, chunk_ptrs, {.dp = &grid.dp()});
    const std::vector<pipeline::MicroBatch> mine(global.begin() + grid.dp_rank() * m,
                                                 global.begin() + (grid.dp_rank() + 1) * m);
    const pipeline::StepResult r = engine.step(ctx, mine);
    CHECK(std::abs(r.loss - want_loss) <= 1e-5 * std::abs(want_loss));
    CHECK(r.tokens == n_total);

    const mdl::MoEStepMetrics mm = mdl::moe_step_metrics(chunk_ptrs, grid, m);
    CHECK(want_aux > 0);
    CHECK(std::abs(mm.aux_loss - want_aux) <= 1e-5 * want_aux);
    CHECK(std::abs(mm.load_imbalance - want_imbalance) <= 1e-9 * want_imbalance);

    int experts = 0, moe_layers = 0;
    for (auto& ch : chunks) {
      moe_layers += int(ch->moe_layers().size());
      for (layers::Parameter* q : ch->parameters()) {
        const layers::Parameter& p = *q;
        INFO(p.name);
        REQUIRE(want.count(p.name) == 1);
        Tensor g = p.main_grad.clone();
        (p.expert ? grid.expert_dp() : grid.dp_cp()).all_reduce(g, comm::ReduceOp::Sum)->wait();
        std::vector<double> got = g.to_double_vector();
        for (double& x : got) x /= double(grid.dp_cp().size());
        const Tensor& full = want.at(p.name);
        const expert_test::Spec sp{p.name.c_str(), full.shape(), p.expert, p.partition_dim, p.partition_chunks};
        const Tensor expect = p.expert ? expert_test::local_of(full, sp, 0, 1, p.expert_offset, p.data.size(0)) : full;
        CHECK(mctest::rel_err(got, expect.to_double_vector()) <= 2e-5);
        experts += p.expert;
      }
    }
    // Every stage holds its share of the MoE layers, numbered by their global index.
    Tensor tm = Tensor::from_vector<float>({float(moe_layers)}, {1});
    grid.pp().all_reduce(tm, comm::ReduceOp::Sum)->wait();
    CHECK(tm.item() == 2);
    CHECK(experts == 2 * moe_layers);
  }
}
