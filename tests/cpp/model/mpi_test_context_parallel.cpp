// Context parallelism under mpirun: for CP 2 and 4, alone and with TP 2 (+SP) where the world allows,
// a GPTModel on CP-local sequences (parallel::cp_slice_sequence, the ring attention of SelfAttention)
// gives the same loss (the CP ranks' shares summed) and every parameter gradient (summed over CP, gathered
// over TP) as a TP = CP = 1 model built on the same rank from the same seed, on full sequences of several
// lengths: tiny Llama with GQA (8 heads / 4 groups) and with MHA, tiny Llama with selective recompute (the
// ring reruns in backward), tiny GPT-2 with full recompute (the whole layer reruns), and tiny GPT-2 (learned positions at the embedding: global positions of the
// chunks). Both cp_comm_types: the p2p ring and all-gather; with TP 2 + SP, seq 16, also the p2p ring with
// tp_comm_overlap_forward. With PP 2 × CP 2 the pipeline engine (token weighting over DP×CP) gives the reference's loss
// and gradients.
//
// Tolerances: the CP model runs the same f32 arithmetic as the reference except for the order of additions
// (attention partials merged through their LSE, dK/dV summed over ring steps, gradients summed over CP, the
// TP reductions). We hold the loss to 1e-6 relative and gradients to 1e-5 (||a − b|| / ||b|| per tensor),
// as the TP tests do.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "layers/layers_test_util.hpp"
#include "model/model_test_util.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/parallel/context_parallel.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "megacore/pipeline/engine.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;
namespace mdl = megacore::model;
namespace pl = megacore::pipeline;

namespace {

constexpr double kLossTol = 1e-6, kGradTol = 1e-5;
constexpr int64_t kBatch = 2;

using model_test::Batch;
using model_test::full_tensor;

Batch make_batch(int64_t vocab, int64_t seq, int64_t salt = 0) {
  return model_test::token_batch(kBatch, seq, vocab, salt, /*ignored=*/3);
}

Batch local_part(const Batch& b, int rank, int size) {
  return {cp_slice_sequence(b.tokens, 1, rank, size), cp_slice_sequence(b.labels, 1, rank, size),
          cp_slice_sequence(b.mask, 1, rank, size)};
}

Tensor ref_view(const Tensor& want, const std::string& name, int tpn, bool swiglu) {
  if (swiglu && name.find("linear_fc1.weight") != std::string::npos) return swiglu_rank_layout(want, tpn);
  return want;
}

mdl::TransformerConfig llama_mha() {
  mdl::TransformerConfig c = mdl::presets::tiny_llama();
  c.num_query_groups = c.num_attention_heads;
  return c;
}

mdl::TransformerConfig llama_selective() {
  mdl::TransformerConfig c = mdl::presets::tiny_llama();
  c.recompute_granularity = mdl::RecomputeGranularity::Selective;
  return c;
}

mdl::TransformerConfig gpt2_full_recompute() {
  mdl::TransformerConfig c = mdl::presets::tiny_gpt2();
  c.recompute_granularity = mdl::RecomputeGranularity::Full;
  return c;
}

// Packed rows: segment boundaries over the full [kBatch, seq] rows (cu_seqlens) and positions restarting at each.
struct Packing {
  Tensor cu, positions;
  int64_t max_seqlen = 0;
};

void compare_model(comm::Communicator& tp1, ProcessGrid& grid, mdl::TransformerConfig cfg, bool sp, int64_t seq,
                   ly::CpCommType comm_type, const Packing& packing = {}) {
  const int tpn = grid.tp().size(), cpn = grid.cp().size(), cr = grid.cp().rank();
  const bool swiglu = cfg.activation == mdl::ActivationType::SwiGLU;
  INFO("CP " << cpn << (comm_type == ly::CpCommType::AllGather ? " all_gather" : " p2p") << " TP " << tpn << " SP " << sp << " forward overlap " << cfg.tp_comm_overlap_forward << " seq " << seq << " norm "
             << mdl::norm_type_name(cfg.normalization) << " groups " << cfg.query_groups() << " recompute "
             << mdl::recompute_granularity_name(cfg.recompute_granularity));
  const Batch batch = make_batch(cfg.vocab_size, seq);
  ly::ForwardContext ctx;
  ctx.cu_seqlens = packing.cu, ctx.max_seqlen = packing.max_seqlen, ctx.position_ids = packing.positions;

  mdl::TransformerConfig ref_cfg = cfg;
  ref_cfg.tp_comm_overlap_forward = false;  // an SP-only option
  mdl::GPTModel ref(ref_cfg, tp1);
  const double ref_loss = ref.forward(ctx, batch.tokens, batch.labels, batch.mask).item();
  ref.backward(ctx);
  REQUIRE(std::isfinite(ref_loss));

  cfg.sequence_parallel = sp;
  mdl::GPTModel model(cfg, grid.tp(), mdl::GPTModelOptions{.cp = &grid.cp(), .cp_comm_type = comm_type});
  const Batch mine = local_part(batch, cr, cpn);
  // Under CP the positions are this rank's part; cu_seqlens stays that of the full rows.
  if (packing.positions.defined()) ctx.position_ids = cp_slice_sequence(packing.positions, 1, cr, cpn);
  Tensor share = model.forward(ctx, mine.tokens, mine.labels, mine.mask).clone();
  grid.cp().all_reduce(share, comm::ReduceOp::Sum)->wait();
  CHECK(std::abs(share.item() - ref_loss) <= kLossTol * std::abs(ref_loss));
  model.backward(ctx);

  REQUIRE(model.parameters().size() == ref.parameters().size());
  for (size_t i = 0; i < ref.parameters().size(); ++i) {
    const ly::Parameter& pr = *ref.parameters()[i];
    ly::Parameter& p = *model.parameters()[i];
    INFO("parameter " << p.name);
    REQUIRE(p.name == pr.name);
    Tensor g = p.main_grad.clone();
    grid.cp().all_reduce(g, comm::ReduceOp::Sum)->wait();  // what DDP's reduction over DP×CP adds up
    require_close(full_tensor(grid.tp(), p, g, model.padded_vocab_size(), cfg.vocab_size),
                  ref_view(pr.main_grad, p.name, tpn, swiglu), kGradTol, p.name.c_str());
  }
}

}  // namespace

TEST_CASE("cp_slice_sequence holds chunks r and 2CP-1-r; cp_unslice_sequence inverts it", "[cp][mpi]") {
  std::vector<int64_t> v(2 * 16);
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(i);
  const Tensor t = Tensor::from_vector<int64_t>(v, {2, 16});
  for (int n : {1, 2, 4}) {
    std::vector<Tensor> parts;
    for (int r = 0; r < n; ++r) {
      parts.push_back(cp_slice_sequence(t, 1, r, n));
      const std::vector<double> got = parts.back().to_double_vector();
      const int64_t l = 16 / n;
      for (int64_t i = 0; i < l; ++i) CHECK(int64_t(got[size_t(i)]) == cp_global_position(i, l, r, n));
      if (n == 4 && r == 1) CHECK(got == std::vector<double>({2, 3, 12, 13, 18, 19, 28, 29}));
    }
    require_equal(cp_unslice_sequence(parts, 1), t, "unsliced");
  }
  CHECK_THROWS_AS(cp_slice_sequence(t, 1, 0, 3), ValueError);  // 16 is not a multiple of 6
}

TEST_CASE("GPTModel with CP 2/4 (p2p ring and all-gather, alone and with TP 2 + SP) equals CP 1: loss and every "
          "gradient", "[cp][model][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (int cpn : {2, 4})
    for (int tpn : {1, 2}) {
      if (world->size() % (cpn * tpn)) continue;
      ProcessGrid grid(*world, ParallelConfig{.tensor = tpn, .context = cpn}, {GroupKind::Tp, GroupKind::Cp});
      for (const mdl::TransformerConfig& cfg :
           {mdl::presets::tiny_llama(), llama_mha(), llama_selective(), mdl::presets::tiny_gpt2(),
            gpt2_full_recompute()})
        for (bool sp : {false, true}) {
          if (sp && tpn == 1) continue;
          for (int64_t seq : {8, 16, 24, 48}) {
            if (seq % (2 * cpn * (sp ? tpn : 1))) continue;
            for (ly::CpCommType ct : {ly::CpCommType::P2P, ly::CpCommType::AllGather})
              compare_model(grid1.tp(), grid, cfg, sp, seq, ct);
            if (sp && seq == 16) {  // the SP forward collectives as TP rings inside each CP rank's part
              mdl::TransformerConfig fwd = cfg;
              fwd.tp_comm_overlap_forward = true;
              compare_model(grid1.tp(), grid, fwd, sp, seq, ly::CpCommType::P2P);
            }
          }
        }
    }
}

TEST_CASE("Pipeline engine with PP 2 x CP 2 equals the CP 1 model (loss and gradients)", "[cp][pipeline][mpi]") {
  auto world = world_comm();
  if (world->size() % 4) return;  // needs PP 2 × CP 2
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  const int pp = 2, cpn = 2;
  ProcessGrid grid(*world, ParallelConfig{.pipeline = pp, .context = cpn},
                   {GroupKind::Tp, GroupKind::Pp, GroupKind::Cp, GroupKind::DpCp, GroupKind::Embedding});
  const int dpn = grid.layout().dp_size(), dp_rank = grid.dp_rank();
  for (mdl::TransformerConfig cfg : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()}) {
    INFO("norm " << mdl::norm_type_name(cfg.normalization) << " tied " << cfg.tie_word_embeddings);
    const bool swiglu = cfg.activation == mdl::ActivationType::SwiGLU;
    const pl::PipelineLayout layout = pl::PipelineLayout::uniform(cfg.num_layers, pp, 1);
    const int pp_rank = grid.pp_rank();
    mdl::GPTModel chunk(cfg, grid.tp(),
                        mdl::GPTModelOptions{.layer_indices = layout.layer_indices(pp_rank, 0),
                                             .pre_process = layout.has_embedding(pp_rank, 0),
                                             .post_process = layout.has_head(pp_rank, 0),
                                             .cp = &grid.cp()});
    pl::PipelineEngine engine(grid.pp(), layout, {&chunk},
                              {.dp = &grid.dp_cp(),
                               .embedding = grid.has_group(GroupKind::Embedding) ? &grid.embedding() : nullptr});
    // Reference: every micro-batch of the global batch on the full sequence, weighted by its tokens.
    const int64_t m = 4, seq = 16;
    std::vector<Batch> global;
    for (int64_t g = 0; g < m * dpn; ++g) global.push_back(make_batch(cfg.vocab_size, seq, g));
    double n_total = 0;
    for (auto& b : global) n_total += mdl::count_loss_tokens(b.labels, b.mask);
    mdl::GPTModel ref(cfg, grid1.tp());
    ly::ForwardContext ctx;
    double want_loss = 0;
    for (auto& b : global) {
      ly::ForwardContext rctx;
      rctx.loss_tokens = n_total;  // Σ loss / N over everything: its gradient accumulates over micro-batches
      want_loss += ref.forward(rctx, b.tokens, b.labels, b.mask).item();
      ref.backward(rctx);
    }
    std::vector<pl::MicroBatch> mine;
    for (int64_t i = 0; i < m; ++i) {
      const Batch l = local_part(global[size_t(dp_rank * m + i)], grid.cp_rank(), cpn);
      mine.push_back(pl::MicroBatch{l.tokens, l.labels, l.mask});
    }
    chunk.zero_grad();
    const pl::StepResult r = engine.step(ctx, mine);
    CHECK(std::abs(r.loss - want_loss) <= kLossTol * std::abs(want_loss));
    CHECK(r.tokens == n_total);
    for (ly::Parameter* p : chunk.parameters()) {
      INFO("gradient of " << p->name);
      if (chunk.is_tied_copy(*p)) continue;
      Tensor g = p->main_grad.clone();
      grid.dp_cp().all_reduce(g, comm::ReduceOp::Avg)->wait();  // as DDP does
      require_close(full_tensor(grid.tp(), *p, g, chunk.padded_vocab_size(), cfg.vocab_size),
                    ref_view(ref.parameter(p->name).main_grad, p->name, 1, swiglu), kGradTol, p->name.c_str());
    }
  }
}

// Segments crossing chunk borders; loss and every gradient.
TEST_CASE("GPTModel with CP 2/4 on packed rows equals CP 1", "[cp][model][mpi]") {
  auto world = world_comm();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  const int64_t seq = 48;
  // Row 0: segments of 5, 13, 7, 20 and 3 tokens; row 1: 30, 11 and 7. With CP 2 (chunks of 12) and CP 4
  // (chunks of 6) most segments cross chunk borders, and the 20- and 30-token ones span several chunks.
  const std::vector<std::vector<int64_t>> rows = {{5, 13, 7, 20, 3}, {30, 11, 7}};
  std::vector<int32_t> cu{0};
  std::vector<int64_t> pos;
  int64_t longest = 0;
  for (const auto& row : rows)
    for (int64_t len : row) {
      cu.push_back(int32_t(cu.back() + len));
      for (int64_t i = 0; i < len; ++i) pos.push_back(i);
      longest = std::max(longest, len);
    }
  REQUIRE(cu.back() == kBatch * seq);
  const Packing packing{Tensor::from_vector<int32_t>(cu, {int64_t(cu.size())}),
                        Tensor::from_vector<int64_t>(pos, {kBatch, seq}), longest};
  for (int cpn : {2, 4}) {
    if (world->size() % cpn) continue;
    ProcessGrid grid(*world, ParallelConfig{.context = cpn}, {GroupKind::Tp, GroupKind::Cp});
    for (const mdl::TransformerConfig& cfg : {mdl::presets::tiny_llama(), llama_selective(), mdl::presets::tiny_gpt2()})
      compare_model(grid1.tp(), grid, cfg, false, seq, ly::CpCommType::P2P, packing);
  }
}
