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
#include "megacore/model/gpt_model.hpp"
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
