// SelfAttention under mpirun: for every TP in {1, 2, 4} dividing the world (split with a ProcessGrid),
// with and without sequence parallelism, with selective recompute off and on, and with and without
// biases, and with qk_layernorm (Qwen3's per-head q/k norms, whose replicated weights get TP-partial gradients),
// each rank's output, input gradient and gathered parameter gradients equal a TP = 1 layer run
// locally on the full tensors (same config, seed and init offsets, so the same full weights).
//
// Tolerances: the TP layer and the local one differ only in the order of f32 additions (TP partial
// products summed by the reductions, sequence chunks gathered), so they agree to a relative error
// (||a - b|| / ||b||) of 1e-5 in f32. The two recompute modes are required to be bit-identical.
#include <utility>

#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/layers/attention.hpp"
#include "megacore/model/transformer_layer.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::parallel;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

namespace {

constexpr double kTol = 1e-5;

std::vector<int> tp_sizes_for(int world) {
  std::vector<int> out;
  for (int tp : {1, 2, 4})
    if (world % tp == 0) out.push_back(tp);
  return out;
}

std::unique_ptr<comm::Communicator> world_comm() {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(60);
  return comm::make_mpi_world(o);
}

// The same values on every rank for the same offset.
Tensor randn(const Shape& shape, uint64_t offset, double std = 1.0) {
  Tensor t = Tensor::empty(shape);
  Generator g(91, offset);
  t.normal_(g, 0.0, std);
  return t;
}

Tensor chunk(const Tensor& t, int64_t dim, int parts, int r) {
  const int64_t n = t.size(dim) / parts;
  return t.narrow(dim, r * n, n).contiguous();
}

void require_close(const Tensor& got, const Tensor& want, double tol, const char* what) {
  INFO(what << ": got " << got.str() << " want " << want.str());
  REQUIRE(got.shape() == want.shape());
  const double err = mctest::rel_err(got.to_double_vector(), want.to_double_vector());
  INFO("relative error " << err);
  REQUIRE(err <= tol);
}

// h64, 8 query heads in 4 KV groups (head_dim 8): groups % TP == 0 for TP 1, 2 and 4.
mdl::TransformerConfig config(bool bias, bool sp, bool selective, bool qk = false) {
  mdl::TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 8;
  c.num_query_groups = 4;
  c.vocab_size = 64;
  c.max_position_embeddings = 64;
  c.rope_theta = 1000.0;
  c.rope_scaling = {.type = mdl::RopeScalingType::Llama3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                    .original_max_position_embeddings = 32};
  c.init_method_std = 0.1;
  c.add_bias_linear = bias;
  c.qk_layernorm = qk;
  c.sequence_parallel = sp;
  c.recompute_granularity = selective ? mdl::RecomputeGranularity::Selective : mdl::RecomputeGranularity::None;
  return c;
}

struct Outputs {
  Tensor y, dx, dw_qkv, db_qkv, dw_proj, db_proj;  // parameter gradients gathered to full shape
  Tensor dq_norm, dk_norm;                          // qk_layernorm: replicated, summed over TP
};

// Runs two micro-batches (so main_grad accumulation is covered) and returns the last output and input
// gradient with the accumulated gradients gathered over TP.
Outputs run(comm::Communicator& tp, const mdl::TransformerConfig& c, const Tensor& X, const Tensor& G,
            const Tensor& position_ids, const Tensor& bqkv, const Tensor& bproj) {
  const int tpn = tp.size(), r = tp.rank();
  ly::SelfAttention attn(tp, mdl::attention_config(c), {.qkv_init_offset = 40, .proj_init_offset = 41});
  if (c.add_bias_linear) {
    attn.linear_qkv().bias().data.copy_(chunk(bqkv, 0, tpn, r));
    attn.linear_proj().bias().data.copy_(bproj);
  }
  if (c.qk_layernorm) {
    attn.q_layernorm()->weight().data.copy_(randn({8}, 5, 0.5));
    attn.k_layernorm()->weight().data.copy_(randn({8}, 6, 0.5));
  }
  const Tensor x = c.sequence_parallel ? chunk(X, 0, tpn, r) : X;
  const Tensor g = c.sequence_parallel ? chunk(G, 0, tpn, r) : G;
  ly::ForwardContext ctx;
  Outputs o;
  for (int micro = 0; micro < 2; ++micro) {
    o.y = attn.forward(ctx, x, position_ids);
    o.dx = attn.backward(ctx, g);
  }
  ly::allreduce_sequence_parallel_grads(tp, attn.parameters());
  o.dw_qkv = all_gather_along(tp, attn.linear_qkv().weight().main_grad, 0);
  o.dw_proj = all_gather_along(tp, attn.linear_proj().weight().main_grad, -1);
  if (c.add_bias_linear) {
    o.db_qkv = all_gather_along(tp, attn.linear_qkv().bias().main_grad, 0);
    o.db_proj = attn.linear_proj().bias().main_grad;
  }
  if (c.qk_layernorm) {
    o.dq_norm = attn.q_layernorm()->weight().main_grad;
    o.dk_norm = attn.k_layernorm()->weight().main_grad;
  }
  return o;
}

void require_identical(const Tensor& a, const Tensor& b, const char* what) {
  INFO(what);
  REQUIRE(a.defined() == b.defined());
  if (a.defined()) REQUIRE(a.to_double_vector() == b.to_double_vector());
}

}  // namespace

TEST_CASE("SelfAttention under TP/SP and selective recompute equals the TP = 1 layer", "[layers][mpi]") {
  auto world = world_comm();
  // A one-rank group for the local reference.
  ProcessGrid solo(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  REQUIRE(solo.tp().size() == 1);
  const int64_t s = 8, b = 2, h = 64;
  const Tensor X = randn({s, b, h}, 1), G = randn({s, b, h}, 2);
  const Tensor bqkv = randn({(8 + 2 * 4) * 8}, 3, 0.3), bproj = randn({h}, 4, 0.3);
  // Shifted ids given for the full sequence (also under SP, where each rank holds s/TP rows).
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < s; ++i) ids.push_back(5 + 3 * i);
  const Tensor position_ids = Tensor::from_vector(ids, {s});

  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    comm::Communicator& tp = grid.tp();
    const int r = tp.rank();
    for (auto [bias, qk] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}})
      for (bool sp : {false, true}) {
        if (sp && tpn == 1) continue;  // SP needs TP > 1 (the config check refuses it)
        for (bool given_ids : {false, true}) {
          INFO("TP " << tpn << " SP " << sp << " bias " << bias << " qk_layernorm " << qk << " position ids " << given_ids);
          const Tensor pos = given_ids ? position_ids : Tensor();
          const Outputs want = run(solo.tp(), config(bias, false, false, qk), X, G, pos, bqkv, bproj);
          Outputs got[2];
          for (int selective = 0; selective < 2; ++selective) {
            INFO("selective recompute " << selective);
            got[selective] = run(tp, config(bias, sp, selective == 1, qk), X, G, pos, bqkv, bproj);
            const Outputs& o = got[selective];
            require_close(o.y, sp ? chunk(want.y, 0, tpn, r) : want.y, kTol, "output");
            require_close(o.dx, sp ? chunk(want.dx, 0, tpn, r) : want.dx, kTol, "input gradient");
            require_close(o.dw_qkv, want.dw_qkv, kTol, "QKV weight gradient (gathered)");
            require_close(o.dw_proj, want.dw_proj, kTol, "output projection weight gradient (gathered)");
            if (qk) {
              require_close(o.dq_norm, want.dq_norm, kTol, "q norm weight gradient (summed over TP)");
              require_close(o.dk_norm, want.dk_norm, kTol, "k norm weight gradient (summed over TP)");
            }
            if (bias) {
              require_close(o.db_qkv, want.db_qkv, kTol, "QKV bias gradient (gathered)");
              require_close(o.db_proj, want.db_proj, kTol, "output projection bias gradient");
            }
          }
          require_identical(got[0].y, got[1].y, "recompute modes: output");
          require_identical(got[0].dx, got[1].dx, "recompute modes: input gradient");
          require_identical(got[0].dw_qkv, got[1].dw_qkv, "recompute modes: QKV weight gradient");
          require_identical(got[0].dw_proj, got[1].dw_proj, "recompute modes: proj weight gradient");
          require_identical(got[0].db_qkv, got[1].db_qkv, "recompute modes: QKV bias gradient");
          require_identical(got[0].db_proj, got[1].db_proj, "recompute modes: proj bias gradient");
          require_identical(got[0].dq_norm, got[1].dq_norm, "recompute modes: q norm gradient");
          require_identical(got[0].dk_norm, got[1].dk_norm, "recompute modes: k norm gradient");
        }
      }
  }
}

TEST_CASE("SelfAttention refuses groups not divisible by TP on every rank before communicating", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    mdl::TransformerConfig c = config(false, false, false);
    c.num_query_groups = 1;  // MQA: one KV head cannot be split over TP ranks
    REQUIRE_THROWS_AS(ly::SelfAttention(grid.tp(), mdl::attention_config(c)), ValueError);
    REQUIRE_THROWS_WITH(ly::SelfAttention(grid.tp(), mdl::attention_config(c)), Catch::Contains("1 KV groups do not split over TP"));
    // Nobody is stuck in a collective.
    Tensor t = Tensor::full({1}, 1.0);
    grid.tp().all_reduce(t)->wait();
    REQUIRE(t.item() == double(tpn));
  }
}
