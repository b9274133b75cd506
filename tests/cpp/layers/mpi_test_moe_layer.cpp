// MoELayer under mpirun (4 ranks; layouts that do not fit the world are skipped): EP = 1, 2, 4, TP = 2 with
// and without sequence parallelism, expert-TP = 1 and 2 (also expert-TP ≠ TP), both dispatchers, a shared
// expert, capacity dropping, routing forced onto two experts (so most experts, and whole ranks, get no tokens)
// and forced load balancing (random routing) give the outputs, input gradients, aux/z-losses and every
// (gathered, reduced) parameter gradient of a single-rank layer (EP = 1, no TP) run on each data-parallel
// replica's full input.
//
// Every rank builds that reference itself. Replica d (the DP coordinate) feeds its own [s, b, h] input; the
// reference runs forward/backward once per replica, accumulating its gradients, so its expert gradients are
// the sum over all tokens, as expert-DP reduction makes them, and its router gradient the sum over replicas
// (the DP reduction of a replicated parameter). With LoRA on the experts (base frozen), the adapters' gradients
// are compared the same way (layers/moe_lora.hpp: fc1's A and fc2's B summed over expert-TP inside the layer).
// Tolerance: only the order of f32 additions differs, 1e-5 relative error.
#include <fmt/format.h>

#include "layers_test_util.hpp"
#include "megacore/layers/moe.hpp"
#include "megacore/parallel/process_grid.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;

namespace {

constexpr double kTol = 1e-5;
constexpr int64_t kS = 8, kB = 2, kH = 16, kF = 24, kE = 8, kShared = 8;

struct Case {
  int tp = 1;
  bool sp = false;
  int ep = 1;
  int etp = 0;  // 0 = TP
  ly::MoETokenDispatcher dispatcher = ly::MoETokenDispatcher::AllToAll;
  double capacity = 0;
  bool losses = false;
  bool shared = false;
  bool imbalanced = false;
  bool lora = false;  // LoRA on every expert's fc1 (gate, up) and fc2, base frozen: compare the adapters' gradients
  bool force = false;  // forced load balancing (random routing keyed by step, replica and token index)
};

std::string describe(const Case& c) {
  return fmt::format("TP {} SP {} EP {} ETP {} {} capacity {} losses {} shared {} imbalanced {} lora {} force {}", c.tp,
                     c.sp, c.ep, c.etp, enum_name(c.dispatcher), c.capacity, c.losses, c.shared, c.imbalanced, c.lora,
                     c.force);
}

ly::MoEOptions options(const Case& c) {
  ly::MoEOptions o;
  o.num_experts = kE;
  o.topk = 2;
  o.ffn_hidden_size = kF;
  o.shared_expert_size = c.shared ? kShared : 0;
  o.capacity_factor = c.capacity;
  o.aux_loss_coeff = c.losses ? 0.3f : 0.f;
  o.z_loss_coeff = c.losses ? 0.05f : 0.f;
  o.enable_expert_bias = c.imbalanced;
  o.dispatcher = c.dispatcher;
  o.force_load_balancing = c.force;
  o.sequence_parallel = c.sp;
  o.init_std = 0.3;
  return o;
}

// Every token to experts 0 and 1 (both on EP rank 0): the bias decides the selection.
void force_two_experts(ly::MoELayer& m) {
  std::vector<float> b(kE, 0.f);
  b[0] = 100.f, b[1] = 50.f;
  m.expert_bias().copy_(Tensor::from_vector(b, {kE}));
}

Tensor summed(comm::Communicator& c, const Tensor& t) {
  Tensor r = t.contiguous().clone();
  if (c.size() > 1) c.all_reduce(r)->wait();
  return r;
}

// Rows of expert-TP rank r in a [.., 2F, h] SwiGLU fc1: [gate rows r ; up rows r].
Tensor fc1_shard(const Tensor& full, int etp, int r) {
  const int64_t f = full.size(1) / 2, fl = f / etp;
  Tensor out = Tensor::empty({full.size(0), 2 * fl, full.size(2)});
  out.narrow(1, 0, fl).copy_(full.narrow(1, r * fl, fl));
  out.narrow(1, fl, fl).copy_(full.narrow(1, f + r * fl, fl));
  return out;
}

// LoRA on the experts (layers/moe_lora.hpp): B drawn in full [E, out, r] and sliced like the adapters (this
// rank's experts; fc1's B rows by expert-TP, fc2's B replicated), so every gradient path is non-zero.
void attach_lora(ly::MoELayer& m, int etpn, int er) {
  m.attach_lora({"gate_proj", "up_proj"}, false, true, ly::LoRAOptions{.rank = 3, .alpha = 6, .seed = 9});
  m.set_frozen(true);
  const int64_t off = m.expert_offset(), el = m.num_local_experts(), fl = kF / etpn;
  for (size_t j = 0; j < 2; ++j)
    m.fc1_lora()->lora_b(j).data.copy_(
        scaled(randn({kE, kF, 3}, 300 + j), 0.5).narrow(0, off, el).narrow(1, er * fl, fl).contiguous());
  m.fc2_lora()->lora_b(0).data.copy_(scaled(randn({kE, kH, 3}, 310), 0.5).narrow(0, off, el).contiguous());
}

// The expert adapters' gradients (reduced over expert-DP) = the single-rank layer's, sliced like the adapters.
void check_lora_grads(ProcessGrid& grid, ly::MoELayer& moe, ly::MoELayer& ref) {
  const int etpn = grid.expert_tp().size(), er = grid.expert_tp().rank();
  const int64_t off = moe.expert_offset(), el = moe.num_local_experts(), fl = kF / etpn;
  auto mine = [&](const Tensor& full) { return full.narrow(0, off, el).contiguous(); };
  REQUIRE_FALSE(moe.fc1_weight().main_grad.defined());
  ly::ExpertLoRAAdapter& a1 = *moe.fc1_lora();
  ly::ExpertLoRAAdapter& r1 = *ref.fc1_lora();
  for (size_t j = 0; j < 2; ++j) {
    REQUIRE(a1.lora_a(j).expert);
    require_close(summed(grid.expert_dp(), a1.lora_a(j).main_grad), mine(r1.lora_a(j).main_grad), kTol,
                  "fc1 lora_A gradient");
    require_close(summed(grid.expert_dp(), a1.lora_b(j).main_grad),
                  mine(r1.lora_b(j).main_grad).narrow(1, er * fl, fl).contiguous(), kTol, "fc1 lora_B gradient");
  }
  ly::ExpertLoRAAdapter& a2 = *moe.fc2_lora();
  ly::ExpertLoRAAdapter& r2 = *ref.fc2_lora();
  require_close(summed(grid.expert_dp(), a2.lora_a(0).main_grad),
                mine(r2.lora_a(0).main_grad).narrow(2, er * fl, fl).contiguous(), kTol, "fc2 lora_A gradient");
  require_close(summed(grid.expert_dp(), a2.lora_b(0).main_grad), mine(r2.lora_b(0).main_grad), kTol,
                "fc2 lora_B gradient");
}

void run_case(comm::Communicator& world, const Case& c) {
  INFO(describe(c));
  ProcessGrid grid(world, ParallelConfig{.tensor = c.tp, .expert = c.ep, .expert_tensor = c.etp},
                   {GroupKind::Tp, GroupKind::Dp, GroupKind::Ep, GroupKind::ExpertTp, GroupKind::ExpertDp,
                    GroupKind::TpEp});
  const int tpn = c.tp, tr = grid.tp_rank(), dpn = grid.layout().dp_size();
  const int etpn = grid.expert_tp().size(), er = grid.expert_tp().rank();
  const ly::MoEOptions o = options(c);
  ly::MoELayer moe({&grid.tp(), &grid.ep(), &grid.expert_tp(), &grid.group(GroupKind::TpEp)}, kH, o);
  NoCommCommunicator solo(0, 1);
  ly::MoELayer ref({&solo, &solo, &solo, &solo}, kH, o);
  if (c.imbalanced) force_two_experts(moe), force_two_experts(ref);
  if (c.lora) attach_lora(moe, etpn, er), attach_lora(ref, 1, 0);

  ly::ForwardContext ctx;
  Tensor ref_y, ref_dx;
  double ref_aux = 0, ref_z = 0;
  for (int d = 0; d < dpn; ++d) {
    const Tensor x = randn({kS, kB, kH}, 100 + d), dy = randn({kS, kB, kH}, 200 + d);
    ref.set_routing_step(7, uint64_t(d));  // forced routing: replica d's draws
    Tensor y = ref.forward(ctx, x);
    Tensor dx = ref.backward(ctx, dy);
    if (d == grid.dp_rank()) ref_y = y, ref_dx = dx, ref_aux = ref.aux_loss().item(), ref_z = ref.z_loss().item();
  }
  const int d = grid.dp_rank();
  Tensor x = randn({kS, kB, kH}, 100 + d), dy = randn({kS, kB, kH}, 200 + d);
  if (c.sp) x = chunk(x, 0, tpn, tr), dy = chunk(dy, 0, tpn, tr), ref_y = chunk(ref_y, 0, tpn, tr),
            ref_dx = chunk(ref_dx, 0, tpn, tr);
  moe.set_routing_step(7, uint64_t(d));
  require_close(moe.forward(ctx, x), ref_y, kTol, "output");
  require_close(moe.backward(ctx, dy), ref_dx, kTol, "input gradient");
  if (c.losses) {
    // Local losses summed over the TP group are the replica's losses.
    REQUIRE(std::abs(summed(grid.tp(), moe.aux_loss()).item() - ref_aux) <= 1e-5 * std::abs(ref_aux));
    REQUIRE(std::abs(summed(grid.tp(), moe.z_loss()).item() - ref_z) <= 1e-5 * std::abs(ref_z));
  }
  if (c.lora) return check_lora_grads(grid, moe, ref);
  require_close(summed(world, moe.router_weight().main_grad), ref.router_weight().main_grad, kTol, "router gradient");
  const int64_t off = moe.expert_offset(), el = moe.num_local_experts(), fl = kF / etpn;
  REQUIRE(el == kE / c.ep);
  REQUIRE(moe.fc1_weight().expert);
  REQUIRE(moe.fc1_weight().expert_offset == off);
  require_close(summed(grid.expert_dp(), moe.fc1_weight().main_grad),
                fc1_shard(ref.fc1_weight().main_grad.narrow(0, off, el).contiguous(), etpn, er), kTol, "fc1 gradient");
  require_close(summed(grid.expert_dp(), moe.fc2_weight().main_grad),
                ref.fc2_weight().main_grad.narrow(0, off, el).narrow(2, er * fl, fl).contiguous(), kTol, "fc2 gradient");
  // The weights themselves: the same model whatever EP and expert-TP.
  require_equal(moe.fc1_weight().data, fc1_shard(ref.fc1_weight().data.narrow(0, off, el).contiguous(), etpn, er),
                "fc1 weight");
  if (c.shared) {
    ly::MLP& s = *moe.shared_expert();
    ly::MLP& rs = *ref.shared_expert();
    const Tensor g1 = rs.fc1().weight().main_grad;
    require_close(summed(grid.dp(), s.fc1().weight().main_grad),
                  fc1_shard(g1.view({1, g1.size(0), g1.size(1)}), tpn, tr).view({-1, kH}), kTol, "shared fc1 gradient");
    require_close(summed(grid.dp(), s.fc2().weight().main_grad), chunk(rs.fc2().weight().main_grad, 1, tpn, tr), kTol,
                  "shared fc2 gradient");
  }
  if (c.force && !c.losses)  // no gradient reaches the router through forced routing
    REQUIRE(moe.router_weight().main_grad.to_double_vector() ==
            std::vector<double>(size_t(moe.router_weight().main_grad.numel()), 0.0));
  if (c.imbalanced && !c.force) {
    // Ranks whose experts got no tokens have zero expert gradients (and took part in every collective).
    REQUIRE(moe.tokens_per_expert()[0] == moe.tokens_per_expert()[1]);
    if (off >= 2) REQUIRE(moe.fc2_weight().main_grad.to_double_vector() == std::vector<double>(size_t(moe.fc2_weight().main_grad.numel()), 0.0));
  }
}

// Outside training (evaluation, generation) without SP: `tokens` tokens, which TP need not divide, against the
// single-rank layer on the same input (every replica feeds the same one). A count TP does not divide is routed whole
// on every TP rank; one it divides is split as in training. In training such a count is a ValueError naming the fix.
void run_inference_case(comm::Communicator& world, const Case& c, int64_t tokens) {
  INFO(describe(c) << ", " << tokens << " tokens outside training");
  ProcessGrid grid(world, ParallelConfig{.tensor = c.tp, .expert = c.ep, .expert_tensor = c.etp},
                   {GroupKind::Tp, GroupKind::Dp, GroupKind::Ep, GroupKind::ExpertTp, GroupKind::ExpertDp,
                    GroupKind::TpEp});
  const ly::MoEOptions o = options(c);
  ly::MoELayer moe({&grid.tp(), &grid.ep(), &grid.expert_tp(), &grid.group(GroupKind::TpEp)}, kH, o);
  NoCommCommunicator solo(0, 1);
  ly::MoELayer ref({&solo, &solo, &solo, &solo}, kH, o);
  ly::ForwardContext ctx;
  ctx.training = false;
  const Tensor x = randn({tokens, 1, kH}, 400 + tokens);
  moe.set_routing_step(3, 0), ref.set_routing_step(3, 0);
  require_close(moe.forward(ctx, x), ref.forward(ctx, x), kTol, "output");
  if (tokens % c.tp != 0) {
    ly::ForwardContext train;
    REQUIRE_THROWS_WITH(moe.forward(train, x), Catch::Contains("do not split evenly over TP") &&
                                                   Catch::Contains("use a sequence length"));
  }
}

bool fits(const Case& c, int world) {
  const int etp = c.etp > 0 ? c.etp : c.tp;
  return world % c.tp == 0 && (world / c.tp) % (c.etp > 0 && c.etp != c.tp ? 1 : c.ep) == 0 && world % (etp * c.ep) == 0;
}

void run_cases(const std::vector<Case>& cases) {
  auto world = world_comm();
  for (const Case& c : cases)
    if (fits(c, world->size())) run_case(*world, c);
}

using D = ly::MoETokenDispatcher;

}  // namespace

TEST_CASE("MoELayer over EP = 1, 2, 4 equals the single-rank layer (both dispatchers)", "[layers][mpi][moe]") {
  run_cases({{.ep = 1}, {.ep = 2}, {.ep = 4}, {.ep = 2, .dispatcher = D::AllGather}, {.ep = 4, .dispatcher = D::AllGather},
             {.ep = 4, .losses = true, .shared = true}});
}

TEST_CASE("MoELayer with TP = 2 (with and without SP) and expert-TP = 1 or 2 equals the single-rank layer",
          "[layers][mpi][moe]") {
  run_cases({{.tp = 2, .sp = true, .ep = 2, .losses = true},
             {.tp = 2, .sp = true, .ep = 2, .dispatcher = D::AllGather, .losses = true},
             {.tp = 2, .sp = false, .ep = 2, .shared = true},
             {.tp = 2, .sp = true, .ep = 4, .etp = 1, .shared = true},
             {.tp = 2, .sp = true, .ep = 1, .dispatcher = D::AllGather},
             {.tp = 1, .ep = 2, .etp = 2},
             {.tp = 1, .ep = 2, .etp = 2, .dispatcher = D::AllGather}});
}

TEST_CASE("MoELayer with capacity dropping and with every token on two experts equals the single-rank layer",
          "[layers][mpi][moe]") {
  run_cases({{.ep = 4, .capacity = 0.5, .losses = true},
             {.ep = 4, .dispatcher = D::AllGather, .capacity = 0.5},
             {.ep = 4, .imbalanced = true},
             {.ep = 4, .dispatcher = D::AllGather, .imbalanced = true},
             {.tp = 2, .sp = true, .ep = 2, .etp = 1, .imbalanced = true}});
}

TEST_CASE("MoELayer with forced load balancing at EP = 2, 4, TP = 2 (SP or not), expert-TP = 2 equals the "
          "single-rank layer", "[layers][mpi][moe]") {
  // The random scores are keyed by the token's index in its TP group's micro-batch, so every layout routes
  // each token as the single-rank layer does; the bias that sends learned routing to two experts is ignored.
  run_cases({{.ep = 2, .force = true},
             {.ep = 4, .losses = true, .force = true},
             {.ep = 4, .dispatcher = D::AllGather, .force = true},
             {.ep = 4, .imbalanced = true, .force = true},
             {.tp = 2, .sp = true, .ep = 2, .losses = true, .force = true},
             {.tp = 2, .sp = false, .ep = 2, .shared = true, .force = true},
             {.tp = 1, .ep = 2, .etp = 2, .force = true}});
}

TEST_CASE("LoRA on MoE experts over EP = 1, 2, 4 and expert-TP = 2 equals the single-rank layer",
          "[layers][mpi][moe][lora]") {
  run_cases({{.ep = 1, .lora = true},
             {.ep = 2, .lora = true},
             {.ep = 4, .losses = true, .lora = true},
             {.ep = 2, .dispatcher = D::AllGather, .lora = true},
             {.tp = 1, .ep = 2, .etp = 2, .lora = true},
             {.tp = 1, .ep = 2, .etp = 2, .dispatcher = D::AllGather, .lora = true},
             {.tp = 2, .sp = true, .ep = 2, .shared = true, .lora = true}});
}

TEST_CASE("MoELayer at TP = 2 without SP, outside training, takes token counts TP does not divide (generation)",
          "[layers][mpi][moe]") {
  auto world = world_comm();
  for (const Case& c : std::vector<Case>{{.tp = 2, .ep = 1},
                                         {.tp = 2, .ep = 2, .shared = true},
                                         {.tp = 2, .ep = 2, .etp = 1},
                                         {.tp = 2, .ep = 2, .dispatcher = D::AllGather},
                                         {.tp = 2, .ep = 2, .capacity = 0.5},
                                         {.tp = 2, .ep = 2, .force = true}})
    if (fits(c, world->size()))
      for (int64_t tokens : {int64_t(13), int64_t(1), int64_t(14)})
        if (c.capacity == 0 || tokens % 2 != 0)  // split, each TP rank's capacity counts its share only
          run_inference_case(*world, c, tokens);
}

TEST_CASE("moe_exchange_counts and moe_exchange_rows: the dispatcher's exchange, uneven and with empty peers",
          "[layers][mpi][moe]") {
  // Every rank draws every rank's per-expert counts from one seed, so each knows what it must receive; a row's
  // values name its source rank, expert and index, so the received rows are checked one by one, and the
  // reverse exchange must return each rank's rows unchanged (the combine direction of the benchmark and layer).
  auto world = world_comm();
  const int p = world->size(), me = world->rank();
  const int64_t el = 2, e = el * p, h = 3;
  for (uint64_t seed : {5u, 6u}) {
    Generator g(seed, 0);
    Tensor u = Tensor::empty({int64_t(p), e}, DType::F32, Device::cpu());
    u.uniform_(g, 0.0, 1.0);
    std::vector<std::vector<int64_t>> counts(static_cast<size_t>(p), std::vector<int64_t>(static_cast<size_t>(e)));
    for (int r = 0; r < p; ++r)
      for (int64_t i = 0; i < e; ++i)  // 0..6 rows; seed 6 sends nothing to the last rank's experts
        counts[size_t(r)][size_t(i)] = seed == 6 && i >= e - el ? 0 : int64_t(u.data<float>()[r * e + i] * 7.f);
    const ly::MoEExchangePlan plan = ly::moe_exchange_counts(*world, counts[size_t(me)], el);
    std::vector<float> rows;
    for (int64_t i = 0; i < e; ++i)
      for (int64_t j = 0; j < counts[size_t(me)][size_t(i)]; ++j)
        for (int64_t c = 0; c < h; ++c) rows.push_back(float(me * 10000 + i * 100 + j) + 0.25f * float(c));
    const int64_t sent = int64_t(rows.size()) / h;
    Tensor x = Tensor::from_vector(rows, {sent, h});
    Tensor y = ly::moe_exchange_rows(*world, x, plan.send_rows, plan.recv_rows);
    int64_t row = 0;
    for (int q = 0; q < p; ++q) {
      int64_t from_q = 0;
      for (int64_t j = 0; j < el; ++j) {
        const int64_t i = int64_t(me) * el + j;
        CHECK(plan.recv_counts[size_t(q * el + j)] == counts[size_t(q)][size_t(i)]);
        from_q += counts[size_t(q)][size_t(i)];
        for (int64_t k = 0; k < counts[size_t(q)][size_t(i)]; ++k, ++row)
          CHECK(y.data<float>()[row * h + 1] == float(q * 10000 + i * 100 + k) + 0.25f);
      }
      CHECK(plan.recv_rows[size_t(q)] == from_q);
    }
    CHECK(y.size(0) == row);
    Tensor back = ly::moe_exchange_rows(*world, y, plan.recv_rows, plan.send_rows);
    REQUIRE(back.size(0) == sent);
    CHECK(std::equal(rows.begin(), rows.end(), back.data<float>()));
  }
  CHECK_THROWS_AS(ly::moe_exchange_counts(*world, std::vector<int64_t>(size_t(3 * p + 1), 1), 3), ValueError);
}
