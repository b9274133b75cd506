// GPTModel under mpirun: for every TP in {1, 2, 4} that divides the world (split with a ProcessGrid),
// with and without sequence parallelism, tiny Llama (RMSNorm, RoPE, GQA, SwiGLU, untied and tied) and
// tiny GPT-2 (LayerNorm, learned positions, GELU, biases, tied) give the same loss, logits (gathered
// over the vocabulary) and every parameter gradient (gathered along its partition_dim) as a TP = 1
// model built on the same rank from the same seed. Two micro-batches are accumulated on the TP model
// (so the sequence-parallel gradient reduction is checked under accumulation) against twice the
// reference's single backward. Full and selective recompute give bit-identical gradients to none.
// With TP > 1 a third model with tp_comm_overlap (the column-parallel layers' backward collectives
// overlapped with their GEMMs) runs the same micro-batches and must give the SAME loss, logits and
// gradients as the model without it, bit-for-bit (it runs the same operations on the same operands).
//
// With SP, tp_comm_overlap_forward (the forward all-gathers and reduce-scatters as rings of send/recv steps
// overlapping row chunks of the GEMMs) gives the same loss, logits and gradients as the serial forward: exactly
// with only the column (all-gather) side on, and with both sides exactly at TP 2 (a two-term sum is the same
// in any order) and within f32 round-off at TP 4 (ring-order partial sums; measured logits ≤ 2e-7 and gradients
// ≤ 3e-7 relative, loss equal; held to 1e-6 on the loss and 1e-5 on logits and gradients), with TP 1 still
// the reference for all of them.
//
// Tolerances: the TP model runs the same f32 arithmetic as the reference except for the order of
// additions (TP partial GEMM products summed by all-reduce / reduce-scatter, vocab-parallel softmax
// statistics combined across shards, SP partial norm/bias gradients summed at the end). Measured at
// -np 4: loss identical to printing precision, logits ≤ 3e-7 and gradients ≤ 7e-7 relative error
// (||a − b|| / ||b|| per tensor). We hold the loss to 1e-6 and logits and gradients to 1e-5.
#include <cmath>
#include <memory>
#include <string>

#include "layers/layers_test_util.hpp"
#include "model/model_test_util.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/parallel/process_grid.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

namespace {

constexpr double kLossTol = 1e-6, kLogitsTol = 1e-5, kGradTol = 1e-5;
constexpr int64_t kBatch = 2, kSeq = 8;

using model_test::Batch;
using model_test::llama_tied;

Batch make_batch(int64_t vocab) { return model_test::token_batch(kBatch, kSeq, vocab, 0, /*ignored=*/6); }

// A parameter's gradient as the full (TP = 1) tensor, real vocabulary rows only.
Tensor full_grad(comm::Communicator& tp, const mdl::GPTModel& m, const ly::Parameter& p) {
  return model_test::full_tensor(tp, p, p.main_grad, m.padded_vocab_size(), m.config().vocab_size);
}

Tensor full_logits(comm::Communicator& tp, const mdl::GPTModel& m) {
  Tensor l = all_gather_along(tp, m.logits().contiguous(), -1);
  return l.narrow(-1, 0, m.config().vocab_size).contiguous();
}

void compare(comm::Communicator& tp1, comm::Communicator& tp, mdl::TransformerConfig cfg, bool sp) {
  const int tpn = tp.size();
  INFO("TP " << tpn << " SP " << sp << " norm " << mdl::norm_type_name(cfg.normalization) << " tied "
             << cfg.tie_word_embeddings);
  const Batch batch = make_batch(cfg.vocab_size);
  ly::ForwardContext ctx;

  mdl::GPTModel ref(cfg, tp1);
  const double ref_loss = ref.forward(ctx, batch.tokens, batch.labels, batch.mask).item();
  const Tensor ref_logits = full_logits(tp1, ref);
  ref.backward(ctx);
  REQUIRE(std::isfinite(ref_loss));
  REQUIRE(ref_loss > 4.0);  // about ln(256) at init

  cfg.sequence_parallel = sp;
  mdl::GPTModel model(cfg, tp);
  REQUIRE(model.parameters().size() == ref.parameters().size());
  std::unique_ptr<mdl::GPTModel> overlapped;
  if (tpn > 1) {
    mdl::TransformerConfig ocfg = cfg;
    ocfg.tp_comm_overlap = true;
    overlapped = std::make_unique<mdl::GPTModel>(ocfg, tp);
    REQUIRE(overlapped->layer(0).mlp().fc1().options().overlap_grad_comm);
    REQUIRE(overlapped->output_layer().options().overlap_grad_comm);
  }
  for (int micro = 0; micro < 2; ++micro) {
    const double loss = model.forward(ctx, batch.tokens, batch.labels, batch.mask).item();
    CHECK(std::abs(loss - ref_loss) <= kLossTol * std::abs(ref_loss));
    require_close(full_logits(tp, model), ref_logits, kLogitsTol, "logits (gathered)");
    model.backward(ctx);
    if (overlapped) {
      CHECK(overlapped->forward(ctx, batch.tokens, batch.labels, batch.mask).item() == loss);
      require_equal(overlapped->logits().contiguous(), model.logits().contiguous(), "logits (tp_comm_overlap)");
      overlapped->backward(ctx);
    }
  }
  if (overlapped)
    for (size_t i = 0; i < model.parameters().size(); ++i)
      require_equal(overlapped->parameters()[i]->main_grad, model.parameters()[i]->main_grad,
                    ("tp_comm_overlap gradient of " + model.parameters()[i]->name).c_str());
  for (size_t i = 0; i < ref.parameters().size(); ++i) {
    const ly::Parameter& pr = *ref.parameters()[i];
    const ly::Parameter& p = *model.parameters()[i];
    INFO("parameter " << p.name);
    REQUIRE(p.name == pr.name);
    REQUIRE(p.sequence_parallel == (sp && p.partition_dim < 0));
    Tensor want = full_grad(tp1, ref, pr);
    if (p.name.find("linear_fc1.weight") != std::string::npos && cfg.activation == mdl::ActivationType::SwiGLU)
      want = swiglu_rank_layout(want, tpn);
    require_close(full_grad(tp, model, p), scaled(want, 2), kGradTol, p.name.c_str());
  }
}

// Gradients after one forward/backward with the given recompute granularity, in parameter order.
std::vector<Tensor> grads_with(comm::Communicator& tp, mdl::TransformerConfig cfg, mdl::RecomputeGranularity g) {
  cfg.recompute_granularity = g;
  const Batch batch = make_batch(cfg.vocab_size);
  ly::ForwardContext ctx;
  mdl::GPTModel model(cfg, tp);
  model.forward(ctx, batch.tokens, batch.labels, batch.mask);
  model.backward(ctx);
  std::vector<Tensor> out;
  for (ly::Parameter* p : model.parameters()) out.push_back(p->main_grad.clone());
  return out;
}

}  // namespace

TEST_CASE("GPTModel at TP 1/2/4, with and without SP, equals TP 1 (loss, logits, every gradient)", "[model][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (const mdl::TransformerConfig& cfg : {mdl::presets::tiny_llama(), llama_tied(), mdl::presets::tiny_gpt2()})
      for (bool sp : {false, true})
        if (!sp || tpn > 1) compare(grid1.tp(), grid.tp(), cfg, sp);
  }
}

TEST_CASE("GPTModel full and selective recompute give bit-identical gradients", "[model][mpi]") {
  auto world = world_comm();
  const int tpn = tp_sizes_for(world->size()).back();
  ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
  for (mdl::TransformerConfig cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()}) {
    cfg.sequence_parallel = tpn > 1;
    INFO("TP " << tpn << " norm " << mdl::norm_type_name(cfg.normalization));
    const std::vector<Tensor> none = grads_with(grid.tp(), cfg, mdl::RecomputeGranularity::None);
    for (auto g : {mdl::RecomputeGranularity::Selective, mdl::RecomputeGranularity::Full}) {
      INFO("recompute " << mdl::recompute_granularity_name(g));
      const std::vector<Tensor> got = grads_with(grid.tp(), cfg, g);
      REQUIRE(got.size() == none.size());
      for (size_t i = 0; i < got.size(); ++i) require_equal(got[i], none[i], "gradient");
    }
  }
}

namespace {

struct RunOut {
  double loss = 0;
  Tensor logits;
  std::vector<Tensor> grads;
};

// Two micro-batches forward and backward; the loss and logits of the last, the accumulated gradients.
RunOut run_micro_batches(mdl::GPTModel& m, const Batch& batch) {
  ly::ForwardContext ctx;
  RunOut out;
  for (int micro = 0; micro < 2; ++micro) {
    out.loss = m.forward(ctx, batch.tokens, batch.labels, batch.mask).item();
    out.logits = m.logits().contiguous().clone();
    m.backward(ctx);
  }
  for (ly::Parameter* p : m.parameters()) out.grads.push_back(p->main_grad.clone());
  return out;
}

}  // namespace

TEST_CASE("GPTModel with tp_comm_overlap_forward equals the serial sequence-parallel forward", "[model][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    // With world 4 and TP 2 the two TP groups (TP 2 × DP 2) run their rings at the same time.
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    comm::Communicator& tp = grid.tp();
    for (mdl::TransformerConfig cfg : {mdl::presets::tiny_llama(), llama_tied(), mdl::presets::tiny_gpt2()}) {
      INFO("TP " << tpn << " norm " << mdl::norm_type_name(cfg.normalization) << " tied " << cfg.tie_word_embeddings);
      const Batch batch = make_batch(cfg.vocab_size);
      mdl::GPTModel ref(cfg, grid1.tp());
      const RunOut want = run_micro_batches(ref, batch);
      cfg.sequence_parallel = true;
      mdl::GPTModel serial(cfg, tp);
      const RunOut off = run_micro_batches(serial, batch);
      cfg.tp_comm_overlap_forward = true;
      mdl::GPTModel both(cfg, tp), column_only(cfg, tp);
      REQUIRE(both.layer(0).mlp().fc1().options().overlap_sp_forward);
      REQUIRE(both.layer(0).mlp().fc2().options().overlap_sp_forward);
      REQUIRE(both.layer(0).self_attention().linear_qkv().options().overlap_sp_forward);
      REQUIRE(both.layer(0).self_attention().linear_proj().options().overlap_sp_forward);
      REQUIRE(both.output_layer().options().overlap_sp_forward);
      for (int l = 0; l < cfg.num_layers; ++l) {
        column_only.layer(l).self_attention().linear_proj().set_overlap_sp_forward(false);
        column_only.layer(l).mlp().fc2().set_overlap_sp_forward(false);
      }
      const RunOut col = run_micro_batches(column_only, batch), on = run_micro_batches(both, batch);
      CHECK(col.loss == off.loss);
      require_equal(col.logits, off.logits, "logits (all-gather side overlapped)");
      for (size_t i = 0; i < off.grads.size(); ++i)
        require_equal(col.grads[i], off.grads[i], ("gradient (all-gather side) of " + serial.parameters()[i]->name).c_str());
      if (tpn == 2) {
        CHECK(on.loss == off.loss);
        require_equal(on.logits, off.logits, "logits (both sides, TP 2)");
      } else {
        CHECK(std::abs(on.loss - off.loss) <= kLossTol * std::abs(off.loss));
        require_close(on.logits, off.logits, kLogitsTol, "logits (both sides)");
      }
      CHECK(std::abs(on.loss - want.loss) <= kLossTol * std::abs(want.loss));
      for (size_t i = 0; i < off.grads.size(); ++i) {
        const ly::Parameter& p = *both.parameters()[i];
        INFO("parameter " << p.name);
        if (tpn == 2) require_equal(on.grads[i], off.grads[i], "gradient (both sides, TP 2)");
        else require_close(on.grads[i], off.grads[i], kGradTol, "gradient (both sides)");
        Tensor wantg = model_test::full_tensor(grid1.tp(), *ref.parameters()[i], want.grads[i], ref.padded_vocab_size(),
                                               cfg.vocab_size);
        if (p.name.find("linear_fc1.weight") != std::string::npos && cfg.activation == mdl::ActivationType::SwiGLU)
          wantg = swiglu_rank_layout(wantg, tpn);
        require_close(model_test::full_tensor(tp, p, on.grads[i], both.padded_vocab_size(), cfg.vocab_size), wantg, kGradTol,
                      "gradient vs TP 1");
      }
    }
  }
}
