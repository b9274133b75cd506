// Checkpoints of MoE expert parameters reshard EP (and expert-TP), with ZeRO-1 optimizer state.
//
// The model of optim/expert_params_test_util.hpp takes one clipped ZeRO-1 step on a layout S and is saved;
// the checkpoint must hold the full tensors ([4 experts, ...]) of the single-process reference after the
// same step, and loading it into a layout D (fresh objects, zeroed parameters) must give every rank its
// slice of those full parameters and of the AdamW state (gathered_state). Layouts go round a cycle
// EP 1 → EP 2 → EP 4 → ... → EP 1 (with TP 2 and expert-TP 1 or 2 where the world allows), so every EP
// degree is saved and loaded at another. Values are copied, never recomputed: they must match exactly,
// except the reference update itself (1e-6 absolute, as in mpi_test_expert_optim.cpp).
#include <cmath>
#include <map>

#include "checkpoint/shared_tmp.hpp"
#include "megacore/checkpoint/dist_checkpoint.hpp"
#include "megacore/checkpoint/sharded_tensor.hpp"
#include "megacore/optim/loss_scaler.hpp"
#include "optim/expert_params_test_util.hpp"

using namespace megacore;
using namespace expert_test;
namespace op = megacore::optim;
namespace ck = megacore::checkpoint;
using layers_test::world_comm;

namespace {

// A model on a layout with its two DDPs and the ZeRO-1 optimizer over both.
struct Run {
  Model m;
  std::unique_ptr<op::DistributedDataParallel> dense, expert;
  std::unique_ptr<op::DistributedOptimizer> opt;
  std::vector<ck::ShardedTensor> describe_params() const {
    std::vector<ck::ShardedTensor> out;
    for (const auto& p : m.params) out.push_back(ck::shard_parameter(*p, ck::shard_layout(*m.grid)));
    return out;
  }
};

Run make_run(comm::Communicator& world, const parallel::ParallelConfig& pc) {
  Run r{make_model(world, pc), nullptr, nullptr, nullptr};
  const op::ExpertSplit split = op::split_expert_parameters(r.m.ptrs());
  op::DDPConfig dc;
  dc.use_distributed_optimizer = true;
  dc.overlap_grad_reduce = false;
  dc.bucket_size = 40;
  dc.param_align = 4;
  r.dense = std::make_unique<op::DistributedDataParallel>(split.dense, r.m.grid->dp_cp(), dc);
  dc.average_size = r.m.grid->dp_cp().size();
  r.expert = std::make_unique<op::DistributedDataParallel>(split.expert, r.m.grid->expert_dp(), dc);
  r.opt = std::make_unique<op::DistributedOptimizer>(
      std::vector<op::DistributedDataParallel*>{r.dense.get(), r.expert.get()}, op::AdamWConfig{});
  return r;
}

// The single-process reference of one clipped step with the gradients of layout `m`: full parameters and
// AdamW state by name.
std::map<std::string, Tensor> reference_after_step(const Model& m) {
  std::vector<ly::Parameter> full(specs().size());
  std::vector<ly::Parameter*> ptrs;
  double sq = 0;
  for (size_t i = 0; i < specs().size(); ++i) {
    full[i].name = specs()[i].name;
    full[i].data = m.full_init[i].clone();
    full[i].main_grad = mean_full_grad(m, i, 0);
    for (double g : full[i].main_grad.to_double_vector()) sq += g * g;
    ptrs.push_back(&full[i]);
  }
  op::AdamW ref(ptrs, op::AdamWConfig{});
  op::CheckedStepOptions co;
  co.max_norm = 0.5 * std::sqrt(sq);
  op::checked_step(ref, 1e-2, op::GradNormGroups{}, co);
  std::map<std::string, Tensor> out;
  for (const ly::Parameter& p : full) out[p.name] = p.data.clone();
  for (const op::NamedTensor& t : ref.state()) out["optimizer." + t.name] = t.tensor.clone();
  return out;
}

}  // namespace

TEST_CASE("expert parameters and their ZeRO-1 state: a checkpoint saved at one EP loads at another",
          "[checkpoint][moe][mpi]") {
  auto world = world_comm();
  ckpt_test::SharedTmp tmp(*world);
  std::vector<parallel::ParallelConfig> cycle{parallel::ParallelConfig{}};
  for (const parallel::ParallelConfig& pc : layouts(world->size())) cycle.push_back(pc);
  REQUIRE(cycle.size() >= 2);
  static const char* kinds[3] = {"master", "exp_avg", "exp_avg_sq"};
  for (size_t c = 0; c < cycle.size(); ++c) {
    const parallel::ParallelConfig& src = cycle[c];
    const parallel::ParallelConfig& dst = cycle[(c + 1) % cycle.size()];
    INFO("save at " << describe(src) << ", load at " << describe(dst));
    const std::string root = tmp.path + "/c" + std::to_string(c);
    std::map<std::string, Tensor> ref;
    {
      Run s = make_run(*world, src);
      ref = reference_after_step(s.m);
      s.opt->zero_grad();
      set_grads(s.m, 0);
      s.dense->finish_grad_sync();
      s.expert->finish_grad_sync();
      op::CheckedStepOptions co;
      double sq = 0;
      for (size_t i = 0; i < specs().size(); ++i)
        for (double g : mean_full_grad(s.m, i, 0).to_double_vector()) sq += g * g;
      co.max_norm = 0.5 * std::sqrt(sq);
      op::checked_step(*s.opt, 1e-2, op::grad_norm_groups(*s.m.grid, true, true), co);
      ck::CheckpointState st;
      st.step = 1;
      const ck::ShardLayout sl = ck::shard_layout(*s.m.grid);
      st.tensors = s.describe_params();
      for (ck::ShardedTensor& t : ck::shard_zero_state(*s.opt, st.tensors, sl)) st.tensors.push_back(std::move(t));
      ck::save_checkpoint(*world, root, st);
    }
    // On disk: the full tensors of all experts, equal to the reference.
    ck::CheckpointReader reader(ck::checkpoint_dir(root, 1));
    for (size_t i = 0; i < specs().size(); ++i) {
      const std::string n = specs()[i].name;
      INFO(n);
      REQUIRE(reader.meta(n).global_shape == specs()[i].full);
      CHECK(max_abs_diff(reader.load_full(n), ref.at(n)) <= 1e-6);
      for (const char* k : kinds) {
        const std::string on = "optimizer." + n + "." + k;
        INFO(on);
        REQUIRE(reader.meta(on).global_shape == specs()[i].full);
        CHECK(max_abs_diff(reader.load_full(on), ref.at(on)) <= 1e-6);
      }
    }
    // Loaded at the next layout into zeroed parameters and fresh state.
    Run d = make_run(*world, dst);
    for (ly::Parameter* p : d.m.ptrs()) p->data.fill_(0.0);
    std::vector<ck::ShardedTensor> targets = d.describe_params();
    for (ck::ShardedTensor& t : ck::shard_zero_state(*d.opt, targets, ck::shard_layout(*d.m.grid)))
      targets.push_back(std::move(t));
    ck::load_checkpoint(world.get(), ck::checkpoint_dir(root, 1), targets);
    d.opt->finish_load(1);
    REQUIRE(d.opt->step_count() == 1);
    const std::vector<op::NamedTensor> gathered = d.opt->gathered_state();
    std::map<std::string, Tensor> got;
    for (const op::NamedTensor& t : gathered) got["optimizer." + t.name] = t.tensor;
    for (size_t i = 0; i < specs().size(); ++i) {
      const std::string n = specs()[i].name;
      INFO(n);
      CHECK(max_abs_diff(d.m.params[i]->data, d.m.local(i, ref.at(n))) <= 1e-6);
      for (const char* k : kinds) {
        const std::string on = "optimizer." + n + "." + k;
        INFO(on);
        CHECK(max_abs_diff(got.at(on), d.m.local(i, ref.at(on))) <= 1e-6);
      }
    }
  }
}

TEST_CASE("expert parameter descriptions: experts placed at expert_offset, bad ones refused", "[checkpoint][moe]") {
  ly::Parameter p;
  p.name = "experts.fc2.weight";
  p.data = Tensor::zeros({2, 3, 2});
  p.partition_dim = 2;
  p.expert = true;
  p.num_experts = 8;
  p.expert_offset = 4;
  ck::ShardLayout l;
  l.tp_rank = 1;  // the dense TP position must not matter for an expert
  l.tp_size = 4;
  l.expert_tp_rank = 1;
  l.expert_tp_size = 2;
  l.replica_writer = true;
  l.expert_replica_writer = false;
  const ck::ShardedTensor st = ck::shard_parameter(p, l);
  REQUIRE(st.global_shape == Shape{8, 3, 4});
  REQUIRE(st.pieces.size() == 1);
  REQUIRE(st.pieces[0].global_offsets == Shape{4, 0, 2});
  REQUIRE(st.pieces[0].shape == Shape{2, 3, 2});
  REQUIRE(!st.write);  // expert-DP rank 0 writes, not DP rank 0
  p.expert_offset = 7;  // experts 7, 8 of 8
  REQUIRE_THROWS_WITH(ck::shard_parameter(p, l), Catch::Contains("inside [0, num_experts)"));
  p.expert_offset = 0;
  p.partition_dim = 0;
  REQUIRE_THROWS_AS(ck::shard_parameter(p, l), ValueError);
}
