// LoRA under mpirun: for every TP in {1, 2, 4} that divides the world, with and without sequence
// parallelism, on tiny Llama (GQA fused QKV with separate q/k/v adapters, SwiGLU gate/up adapters) and
// tiny GPT-2 (GELU fc1, biases), a model with adapters on every linear gives the same loss and the same
// adapter gradients (gathered along their partition_dim) as the TP = 1 model; so does the model split
// into two pipeline stages (PP = 2 layouts, run stage by stage on each rank). B is set to random
// values (drawn in full and sliced) so every gradient path is non-zero. Base weights get no gradient
// buffer. After merge_lora the model's logits equal the adapted model's. With dropout, full and
// selective recompute give bit-identical adapter gradients to none.
//
// Tolerances as mpi_test_gpt_model.cpp (f32, only the order of additions differs): loss 1e-6, logits
// and gradients 1e-5 relative. Merging rounds W + s·BA once in f32: logits 1e-5.
#include <cmath>
#include <cstdlib>
#include <functional>
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

constexpr double kLossTol = 1e-6, kTol = 1e-5;
constexpr int64_t kBatch = 2, kSeq = 8;

using model_test::Batch;

Batch make_batch(int64_t vocab) { return model_test::token_batch(kBatch, kSeq, vocab); }

mdl::LoRAConfig all_targets(double dropout = 0.0) {
  mdl::LoRAConfig l;
  l.dim = 4;
  l.alpha = 8;
  l.dropout = dropout;
  l.target_modules = {"linear_qkv", "o_proj", "linear_fc1", "down_proj"};
  return l;
}

// B of every adapter := 0.1 · randn of its full shape (seeded by its name, so a pipeline stage draws
// what the whole model draws), this rank's slice.
void randomise_b(mdl::GPTModel& m, int tpn, int rank) {
  for (ly::Parameter* p : m.parameters()) {
    const uint64_t k = std::hash<std::string>{}(p->name) % 1000003;
    if (p->name.find("lora_B") == std::string::npos) continue;
    Shape full = p->data.shape();
    if (p->partition_dim >= 0) full[size_t(p->partition_dim)] *= tpn;
    Tensor f = scaled(randn(full, 1000 + k), 0.1);
    p->data.copy_(p->partition_dim >= 0 ? chunk(f, p->partition_dim, tpn, rank) : f);
  }
}

Tensor full_grad(comm::Communicator& tp, const ly::Parameter& p) {
  return p.partition_dim < 0 ? p.main_grad : all_gather_along(tp, p.main_grad, p.partition_dim);
}

std::unique_ptr<mdl::GPTModel> lora_model(const mdl::TransformerConfig& cfg, comm::Communicator& tp,
                                          const mdl::LoRAConfig& l, mdl::GPTModelOptions o = {}) {
  auto m = std::make_unique<mdl::GPTModel>(cfg, tp, o);
  m->apply_lora(l);
  randomise_b(*m, tp.size(), tp.rank());
  return m;
}

void compare(comm::Communicator& tp1, comm::Communicator& tp, mdl::TransformerConfig cfg, bool sp) {
  const int tpn = tp.size();
  INFO("TP " << tpn << " SP " << sp << " norm " << mdl::norm_type_name(cfg.normalization));
  const Batch b = make_batch(cfg.vocab_size);
  ly::ForwardContext ctx;
  auto ref = lora_model(cfg, tp1, all_targets());
  const double ref_loss = ref->forward(ctx, b.tokens, b.labels, b.mask).item();
  ref->backward(ctx);

  cfg.sequence_parallel = sp;
  auto model = lora_model(cfg, tp, all_targets());
  const double loss = model->forward(ctx, b.tokens, b.labels, b.mask).item();
  CHECK(std::abs(loss - ref_loss) <= kLossTol * std::abs(ref_loss));
  model->backward(ctx);
  REQUIRE(model->parameters().size() == ref->parameters().size());
  for (size_t i = 0; i < ref->parameters().size(); ++i) {
    const ly::Parameter& pr = *ref->parameters()[i];
    const ly::Parameter& p = *model->parameters()[i];
    INFO("parameter " << p.name);
    REQUIRE(p.name == pr.name);
    REQUIRE(p.name.find("lora_") != std::string::npos);  // only adapters are trainable
    const Tensor want = full_grad(tp1, pr);
    REQUIRE(mctest::rel_err(want.to_double_vector(), std::vector<double>(size_t(want.numel()), 0.0)) > 0.5);
    require_close(full_grad(tp, p), want, kTol, p.name.c_str());
  }
  CHECK_FALSE(model->layer(0).self_attention().linear_qkv().weight().main_grad.defined());

  // Two pipeline stages (layer 0 | layer 1) on this TP group: the same adapter gradients.
  mdl::GPTModelOptions o0, o1;
  o0.layer_indices = std::vector<int64_t>{0}, o0.post_process = false;
  o1.layer_indices = std::vector<int64_t>{1}, o1.pre_process = false;
  auto s0 = lora_model(cfg, tp, all_targets(), o0);
  auto s1 = lora_model(cfg, tp, all_targets(), o1);
  Tensor h = s0->forward_stage(ctx, Tensor(), b.tokens);
  const double pp_loss = s1->forward_stage(ctx, h, b.tokens, b.labels, b.mask).item();
  CHECK(std::abs(pp_loss - ref_loss) <= kLossTol * std::abs(ref_loss));
  s0->backward_stage(ctx, s1->backward_stage(ctx, Tensor()));
  for (mdl::GPTModel* st : {s0.get(), s1.get()})
    for (ly::Parameter* p : st->parameters()) {
      INFO("PP stage parameter " << p->name);
      require_close(full_grad(tp, *p), full_grad(tp1, ref->parameter(p->name)), kTol, p->name.c_str());
    }

  // Merging: the plain model computes what base + adapters computed.
  ly::ForwardContext eval;
  eval.training = false;
  model->forward(eval, b.tokens, b.labels, b.mask);
  const Tensor adapted = model->logits().contiguous().clone();
  const size_t base_params = mdl::GPTModel(cfg, tp).parameters().size();
  model->merge_lora();
  REQUIRE(model->parameters().size() == base_params);
  model->forward(eval, b.tokens, b.labels, b.mask);
  require_close(model->logits().contiguous(), adapted, kTol, "merged logits");
}

std::vector<Tensor> lora_grads_with(comm::Communicator& tp, mdl::TransformerConfig cfg, mdl::RecomputeGranularity g,
                                    double dropout = 0.25, double* loss = nullptr, bool fused = true) {
  cfg.recompute_granularity = g;
  const Batch b = make_batch(cfg.vocab_size);
  ly::ForwardContext ctx;
  if (!fused) ::setenv("MEGACORE_LORA_FUSED", "0", 1);
  auto m = lora_model(cfg, tp, all_targets(dropout));
  ::unsetenv("MEGACORE_LORA_FUSED");
  const bool want_fused = fused && dropout == 0.0;
  auto& qkv = m->layer(0).self_attention().linear_qkv();
  auto& fc2 = m->layer(0).mlp().fc2();
  REQUIRE(qkv.lora()->fused_for(qkv.weight().data) == want_fused);
  REQUIRE(fc2.lora()->fused_for(fc2.weight().data) == want_fused);
  if (loss) *loss = m->forward(ctx, b.tokens, b.labels, b.mask).item();
  else m->forward(ctx, b.tokens, b.labels, b.mask);
  m->backward(ctx);
  for (int micro = 1; micro < 2; ++micro) {  // the dropout draw advances per forward
    m->forward(ctx, b.tokens, b.labels, b.mask);
    m->backward(ctx);
  }
  std::vector<Tensor> out;
  for (ly::Parameter* p : m->parameters()) out.push_back(p->main_grad.clone());
  return out;
}

}  // namespace

TEST_CASE("LoRA at TP 1/2/4 (SP on/off) and PP 2 stages gives the TP 1 adapter gradients; merge is exact",
          "[lora][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (const mdl::TransformerConfig& cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()})
      for (bool sp : {false, true})
        if (!sp || tpn > 1) compare(grid1.tp(), grid.tp(), cfg, sp);
  }
}

TEST_CASE("LoRA dropout: full and selective recompute give bit-identical adapter gradients", "[lora][mpi]") {
  auto world = world_comm();
  const int tpn = tp_sizes_for(world->size()).back();
  ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
  mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  cfg.sequence_parallel = tpn > 1;
  const std::vector<Tensor> none = lora_grads_with(grid.tp(), cfg, mdl::RecomputeGranularity::None);
  for (auto g : {mdl::RecomputeGranularity::Selective, mdl::RecomputeGranularity::Full}) {
    INFO("recompute " << mdl::recompute_granularity_name(g));
    const std::vector<Tensor> got = lora_grads_with(grid.tp(), cfg, g);
    REQUIRE(got.size() == none.size());
    for (size_t i = 0; i < got.size(); ++i) require_equal(got[i], none[i], "adapter gradient");
  }
}

TEST_CASE("LoRA fused and unfused paths give the same loss and adapter gradients at TP 2 with SP", "[lora][mpi]") {
  auto world = world_comm();
  const int tpn = world->size() % 2 == 0 ? 2 : 1;
  ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
  for (mdl::TransformerConfig cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()}) {
    cfg.sequence_parallel = tpn > 1;
    for (auto g : {mdl::RecomputeGranularity::None, mdl::RecomputeGranularity::Full}) {
      INFO("TP " << tpn << " norm " << mdl::norm_type_name(cfg.normalization) << " recompute "
                 << mdl::recompute_granularity_name(g));
      double fused_loss = 0, plain_loss = 0;
      const std::vector<Tensor> fused = lora_grads_with(grid.tp(), cfg, g, 0.0, &fused_loss, true);
      const std::vector<Tensor> plain = lora_grads_with(grid.tp(), cfg, g, 0.0, &plain_loss, false);
      CHECK(std::abs(fused_loss - plain_loss) <= kLossTol * std::abs(plain_loss));
      REQUIRE(fused.size() == plain.size());
      for (size_t i = 0; i < fused.size(); ++i) require_close(fused[i], plain[i], kTol, "adapter gradient");
    }
  }
}
