// Expert (MoE) parameters in DDP, ZeRO-1 and gradient clipping, under mpirun, against one process.
//
// The model of expert_params_test_util.hpp on grids with EP 2 and 4 (with TP 2 and expert-TP 1 or 2
// where the world allows): dense parameters go to a DDP over DP × CP, expert parameters to one over
// expert-DP, and both to one optimizer (ZeRO-1 over the two DDPs, or a replicated AdamW after
// all-reduce) or to one optimizer each, stepped together (checked_step over parts: ZeRO-1 or AdamW).
// Expert gradients are summed over expert-DP and divided by DP × CP (DDPConfig::average_size), as in
// Megatron-Core, so the reference's expert gradient is Σ of its expert-DP replicas / (DP × CP). Two clipped AdamW steps must give, on every rank, the slice of the single-process AdamW
// update of the full tensors with the gradients averaged over their replicas, and the reported norm must
// be the norm of those full gradients (clipping to half of it, so the clip coefficient is exercised).
//
// Tolerances: the layouts differ from the reference only in the order of the f32 additions of the
// gradient mean and of the norm (relative 1e-7); we hold norms to 1e-6 relative and parameters to 1e-6
// absolute (the update is lr = 1e-2 times a ratio of moments of order 1).
#include <cmath>

#include "optim/expert_params_test_util.hpp"
#include "megacore/optim/loss_scaler.hpp"

using namespace megacore;
using namespace expert_test;
namespace op = megacore::optim;
using layers_test::world_comm;

namespace {

constexpr double kLr = 1e-2;
constexpr int kSteps = 2;

op::AdamWConfig adam() {
  op::AdamWConfig a;
  a.weight_decay = 0.1f;
  return a;
}

enum class Mode { ZeroOne, ZeroParts, AdamWOne, AdamWParts };
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::ZeroOne: return "one ZeRO-1 optimizer over both DDPs";
    case Mode::ZeroParts: return "a ZeRO-1 optimizer per DDP";
    case Mode::AdamWOne: return "one AdamW";
    case Mode::AdamWParts: return "an AdamW per DDP";
  }
  return "";
}

void run_layout(comm::Communicator& world, const parallel::ParallelConfig& pc, Mode mode) {
  INFO(describe(pc) << ", " << mode_name(mode));
  const bool zero = mode == Mode::ZeroOne || mode == Mode::ZeroParts;
  Model m = make_model(world, pc);
  const op::ExpertSplit split = op::split_expert_parameters(m.ptrs());
  REQUIRE(split.dense.size() == 2);
  REQUIRE(split.expert.size() == 3);
  op::DDPConfig dc;
  dc.use_distributed_optimizer = zero;
  dc.overlap_grad_reduce = false;
  dc.bucket_size = 40;  // several buckets, parameters cut by shard boundaries
  dc.param_align = 4;
  op::DistributedDataParallel dense(split.dense, m.grid->dp_cp(), dc);
  dc.average_size = m.grid->dp_cp().size();  // Megatron-Core's scaling of expert gradients
  op::DistributedDataParallel expert(split.expert, m.grid->expert_dp(), dc);
  std::vector<std::unique_ptr<op::DistributedOptimizer>> zeros;
  std::vector<std::unique_ptr<op::AdamW>> adams;
  std::vector<op::OptimizerPart> parts;
  switch (mode) {
    case Mode::ZeroOne:
      zeros.push_back(std::make_unique<op::DistributedOptimizer>(std::vector<op::DistributedDataParallel*>{&dense, &expert}, adam()));
      break;
    case Mode::ZeroParts:
      zeros.push_back(std::make_unique<op::DistributedOptimizer>(dense, adam()));
      zeros.push_back(std::make_unique<op::DistributedOptimizer>(expert, adam()));
      break;
    case Mode::AdamWOne: adams.push_back(std::make_unique<op::AdamW>(m.ptrs(), adam())); break;
    case Mode::AdamWParts:
      adams.push_back(std::make_unique<op::AdamW>(split.dense, adam()));
      adams.push_back(std::make_unique<op::AdamW>(split.expert, adam()));
      break;
  }
  for (auto& z : zeros) parts.push_back({nullptr, z.get()});
  for (auto& a : adams) parts.push_back({a.get(), nullptr});
  const op::GradNormGroups groups = op::grad_norm_groups(*m.grid, zero, /*experts=*/true);

  // The single-process reference over the full tensors.
  std::vector<ly::Parameter> full(specs().size());
  std::vector<ly::Parameter*> full_ptrs;
  for (size_t i = 0; i < specs().size(); ++i) {
    full[i].name = specs()[i].name;
    full[i].data = m.full_init[i].clone();
    full[i].main_grad = Tensor::zeros(specs()[i].full);
    full_ptrs.push_back(&full[i]);
  }
  op::AdamW ref(full_ptrs, adam());

  for (int step = 0; step < kSteps; ++step) {
    INFO("step " << step);
    double sq = 0;
    for (size_t i = 0; i < specs().size(); ++i) {
      full[i].main_grad.copy_(mean_full_grad(m, i, step));
      for (double g : full[i].main_grad.to_double_vector()) sq += g * g;
    }
    const double norm = std::sqrt(sq);
    op::CheckedStepOptions co;
    co.max_norm = 0.5 * norm;
    const op::StepResult want = op::checked_step(ref, kLr, op::GradNormGroups{}, co);
    REQUIRE(std::abs(want.grad_norm - norm) <= 1e-6 * norm);

    dense.zero_grad();
    expert.zero_grad();
    set_grads(m, step);
    dense.finish_grad_sync();
    expert.finish_grad_sync();
    const op::StepResult got = parts.size() > 1 ? op::checked_step(parts, kLr, groups, co)
                               : zero           ? op::checked_step(*zeros[0], kLr, groups, co)
                                                : op::checked_step(*adams[0], kLr, groups, co);
    CHECK(!got.skipped);
    CHECK(std::abs(got.grad_norm - norm) <= 1e-6 * norm);
    CHECK(std::abs(got.clip_coef - want.clip_coef) <= 1e-6);
    REQUIRE(got.clip_coef < 0.6);
    for (size_t i = 0; i < specs().size(); ++i) {
      INFO(specs()[i].name);
      CHECK(max_abs_diff(m.params[i]->data, m.local(i, full[i].data)) <= 1e-6);
    }
  }
  // Both DDPs' groups agree: every expert-DP replica of an expert shard holds the same values.
  for (size_t i = 0; i < specs().size(); ++i) {
    Tensor sum = m.params[i]->data.clone();
    comm::Communicator& g = specs()[i].expert ? m.grid->expert_dp() : m.grid->dp_cp();
    g.all_reduce(sum, comm::ReduceOp::Sum)->wait();
    CHECK(max_abs_diff(sum, layers_test::scaled(m.params[i]->data, g.size())) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("expert parameters: ZeRO-1 and AdamW (one optimizer, or one per DDP) at EP 2/4 equal the single-process "
          "update; clip norm of the full gradient",
          "[optim][moe][mpi]") {
  auto world = world_comm();
  const std::vector<parallel::ParallelConfig> ls = layouts(world->size());
  REQUIRE(!ls.empty());
  for (const parallel::ParallelConfig& pc : ls)
    for (Mode mode : {Mode::ZeroOne, Mode::ZeroParts, Mode::AdamWOne, Mode::AdamWParts}) run_layout(*world, pc, mode);
}

TEST_CASE("expert parameters: bad groups and mixed DDPs are refused", "[optim][moe][mpi]") {
  auto world = world_comm();
  parallel::ParallelConfig pc;
  pc.expert = 2;
  Model m = make_model(*world, pc);
  const op::ExpertSplit split = op::split_expert_parameters(m.ptrs());
  op::DDPConfig dc;
  dc.use_distributed_optimizer = true;
  dc.overlap_grad_reduce = false;
  // One DDP holding dense and expert parameters.
  {
    op::DistributedDataParallel mixed(m.ptrs(), m.grid->dp_cp(), dc);
    REQUIRE_THROWS_WITH(op::DistributedOptimizer(mixed, adam()), Catch::Contains("split_expert_parameters"));
  }
  op::DistributedDataParallel dense(split.dense, m.grid->dp_cp(), dc);
  op::DistributedDataParallel expert(split.expert, m.grid->expert_dp(), dc);
  op::DistributedOptimizer opt(std::vector<op::DistributedDataParallel*>{&dense, &expert}, adam());
  REQUIRE(opt.parameters().size() == 5);
  // Norm groups without the expert part: refused (before any collective), naming the fix.
  REQUIRE_THROWS_AS(opt.grad_norm(op::grad_norm_groups(*m.grid, true, /*experts=*/false)), ValueError);
  REQUIRE_THROWS_WITH(opt.grad_norm(op::grad_norm_groups(*m.grid, true, false)), Catch::Contains("experts=*/true"));
  REQUIRE_THROWS_WITH(op::global_grad_norm(m.ptrs(), op::grad_norm_groups(*m.grid, false, false)),
                      Catch::Contains("experts=*/true"));
  // The routing hook hands each parameter to its own DDP; an unknown one is a ValueError.
  auto hook = op::grad_ready_hook({&dense, &expert});
  hook(m.ptrs());
  ly::Parameter stray;
  stray.name = "stray";
  REQUIRE_THROWS_AS(hook({&stray}), ValueError);
  dense.finish_grad_sync();
  expert.finish_grad_sync();
}
